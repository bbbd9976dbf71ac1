"""`minirt bench serve` end to end on the tiny model: a report directory with numbers and plots."""

from __future__ import annotations

import json

from minirt.bench import serve
from minirt.bench.serve import main


def test_bench_serve_writes_report_with_variants(tiny_model, tmp_path):
    out = tmp_path / "report"
    argv = [
        "--start",
        "--model",
        str(tiny_model),
        "--workload",
        "mix",
        "--out",
        str(out),
        "--variant",
        "fcfs=--policy fcfs --num-blocks 512",
        "--variant",
        "sjf=--policy sjf --num-blocks 512",
    ]
    assert main(argv) == 0
    # the report beside its plots, the raw data (report.json, each run's events) in results/
    data = json.loads((out / "results" / "report.json").read_text())
    assert set(data["runs"]) == {"fcfs", "sjf"}
    assert (out / "results" / "runs" / "fcfs" / "events").is_dir()
    assert sorted(p.name for p in out.iterdir()) == [
        "README.md",
        "results",
        "throughput_kv.png",
        "ttft_cdf.png",
    ]
    for run in data["runs"].values():
        s = run["summary"]
        assert s["requests"] == 64 and s["errors"] == 0 and s["output_tokens"] == 64 * 32
        assert run["summary_short"]["requests"] == 60 and run["summary_long"]["requests"] == 4
        assert run["kv_timeline"] and run["control"]["steps"] > 0
        # the CPU each process spent in the run: the executor most, the others a small share
        cpu = run["cpu_s"]
        assert set(cpu) == {*serve.CPU_COLS[1:]}
        assert cpu["executor"] > max(cpu["tokenizer"], cpu["scheduler"], cpu["kv_manager"]) > 0
        assert 0 < cpu["others_pct"] < 100
    md = (out / "README.md").read_text()
    assert "minirt bench serve" in md and "| fcfs (short) |" in md
    assert "Sampling: temperature 1, EOS ignored." in md  # sampled by default, as users run
    assert "## CPU seconds during the run, per process" in md
    assert (out / "ttft_cdf.png").stat().st_size > 1000
    assert (out / "throughput_kv.png").stat().st_size > 1000


def test_compare_rounds_interleave_the_systems_and_report_medians(
    tiny_model, tmp_path, monkeypatch
):
    """``--compare --rounds 2``: the pipeline runs twice (a runtime each time), the executor
    alone after each, and the report's rows are the rounds' medians beside each round's ratios
    (vLLM is left out here: it has its own venv and tests)."""
    from benchmarks import compare

    monkeypatch.setattr(compare, "vllm_tok_s", lambda *a: (0.0, "not in this test", ""))
    out = tmp_path / "report"
    argv = ["--start", "--model", str(tiny_model), "--workload", "w1", "--requests", "8"]
    assert main([*argv, "--compare", "--rounds", "2", "--out", str(out)]) == 0
    data = json.loads((out / "results" / "report.json").read_text())
    per = data["compare_rounds"]
    assert [r["round"] for r in per] == [1, 2]
    for r in per:
        assert r["pipeline_tok_s"] > 0 and r["executor_alone_tok_s"] > 0
        assert (
            abs(r["pipeline_over_executor"] * r["executor_alone_tok_s"] - r["pipeline_tok_s"])
            < 1e-6
        )
    rows = {r["run"]: r for r in data["compare"]}
    pipe = rows["minirt pipeline (minirt)"]["throughput_tok_s"]
    assert abs(pipe - sum(r["pipeline_tok_s"] for r in per) / 2) < 1e-6  # the median of two
    assert data["runs"]["minirt"]["summary"]["throughput_tok_s"] == per[0]["pipeline_tok_s"]
    assert "vLLM skipped: not in this test" in rows
    md = (out / "README.md").read_text()
    assert "medians of 2 interleaved rounds" in md and "### Each round" in md
    # the rounds' table ends with each column's median, the ratios' medians the paired ones
    ratio = sorted(r["pipeline_over_executor"] for r in per)
    assert f"| median | {pipe:,.1f} |" in md and f"| {sum(ratio) / 2:.2f} |" in md


def test_compare_names_how_vllm_ran(monkeypatch, tmp_path):
    """The vLLM row says whether tcmalloc was preloaded, as vLLM's CPU docs advise."""
    from benchmarks import compare, vllm_row

    for preload, want in [
        ("/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4", "tcmalloc, OpenMP threads bound"),
        ("", "glibc malloc: no tcmalloc, OpenMP threads bound"),
    ]:
        row = {"vllm_tok_s": 100.0, "vllm_ld_preload": preload}
        monkeypatch.setattr(vllm_row, "bench_row", lambda *a, r=row, **k: r)
        monkeypatch.setattr(
            "gpu.model.loader.load_spec", lambda m: type("S", (), {"max_model_len": 9})
        )
        assert compare.vllm_tok_s(tmp_path, [[1]], 1, [[2]], 1.0) == (100.0, "", want)


def test_every_bench_mode_runs_from_a_checkout_and_serve_ships_in_the_package(tmp_path):
    """`minirt bench MODE --help` works for every mode (the developer benchmarks from the
    checkout's benchmarks/ folder, found from any working directory); only `serve` is in the
    installed package."""
    import subprocess
    import sys
    import tomllib
    from pathlib import Path

    from minirt.cli import _BENCH_MODES

    root = Path(__file__).resolve().parents[2]
    for mode in _BENCH_MODES:
        got = subprocess.run(
            [sys.executable, "-m", "minirt.cli", "bench", mode, "--help"],
            cwd=tmp_path,  # not the checkout: the CLI finds benchmarks/ itself
            capture_output=True,
            text=True,
        )
        assert got.returncode == 0 and "usage" in got.stdout, (mode, got.stderr[-2000:])
    found = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]
    assert not any(p.startswith("benchmarks") for p in found["packages"]["find"]["include"])
