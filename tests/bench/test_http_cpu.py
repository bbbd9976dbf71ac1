"""The HTTP-CPU benchmark's reading of py-spy's collapsed stacks (benchmarks/http_cpu.py)."""

from benchmarks.http_cpu import top_functions


def test_top_functions_share_per_function_without_the_outer_frames(tmp_path):
    raw = tmp_path / "http.raw"
    outer = "main (minirt/cli.py:10);run (trio/_core/_run.py:2400)"
    raw.write_text(
        f"{outer};send_all (trio/_highlevel_socket.py:80);send (trio/_socket.py:9) 6\n"
        f"{outer};send_all (trio/_highlevel_socket.py:81) 2\n"
        f"{outer};feed (minirt/http/openai/sse.py:70) 2\n"
    )
    got = dict((fn, share) for share, fn in top_functions(raw))
    # every line of a function counts once per sample, whatever line it was on
    assert got["send_all (trio/_highlevel_socket.py)"] == 80.0
    assert got["send (trio/_socket.py)"] == 60.0
    assert got["feed (minirt/http/openai/sse.py)"] == 20.0
    assert not [fn for fn in got if "cli.py" in fn or "_run.py" in fn]
