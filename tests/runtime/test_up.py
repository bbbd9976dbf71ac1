"""`minirt up` as a user runs it: ready line, where it serves, generate from another process, Ctrl-C cleans up."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import urllib.request

from minirt.launch.launch import actor_pids
from tests.support.http_server import free_port
from tests.support.runtime import start_runtime


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a zombie still answers kill(0); read its state
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] != "Z"
    except FileNotFoundError:
        return False


def test_generate_events_and_ctrl_c_leaves_no_process(tiny_model, tmp_path):
    run_dir = tmp_path / "rt"
    with start_runtime(tiny_model, run_dir) as rt:
        cli = [sys.executable, "-m", "minirt.cli"]
        out = subprocess.run(
            [
                *cli,
                "generate",
                "--run-dir",
                str(run_dir),
                "--json",
                "--max-tokens",
                "5",
                "hello world",
            ],
            capture_output=True,
            text=True,
            timeout=60,
            check=True,
        )
        result = json.loads(out.stdout)
        assert result["usage"]["completion_tokens"] == len(result["token_ids"]) >= 1
        streamed = subprocess.run(
            [*cli, "generate", "--run-dir", str(run_dir), "--max-tokens", "5", "hello"],
            capture_output=True,
            text=True,
            timeout=60,
            check=True,
        )
        assert "[" in streamed.stderr  # finish reason and usage line
        trace = subprocess.run(
            [*cli, "trace", result["request_id"], "--run-dir", str(run_dir)],
            capture_output=True,
            text=True,
            timeout=60,
            check=True,
        ).stdout
        for event in (
            "client.received",
            "request.queued",
            "request.admitted",
            "kv.allocated",
            "executor.prefill_done",
            "request.finished",
            "client.completed",
        ):
            assert event in trace, event
        pids = [rt.pid_of(a) for a in ("tokenizer", "scheduler", "kv_manager", "executor")]
        assert all(_alive(p) for p in pids)
        os.killpg(rt.proc.pid, signal.SIGINT)  # what Ctrl-C in a terminal does
        assert rt.proc.wait(timeout=20) == 0
        assert not any(_alive(p) for p in pids), "an actor outlived minirt up"


def test_up_prints_where_the_http_api_and_the_dashboard_are(tiny_model, tmp_path):
    port = free_port()
    with start_runtime(tiny_model, tmp_path / "rt", "--http-port", str(port)) as rt:
        assert rt.proc.stdout is not None
        line = rt.proc.stdout.readline().strip()
        base = f"http://127.0.0.1:{port}"
        assert line == f"minirt: OpenAI API {base}/v1, dashboard {base}/dashboard"
        for url in (f"{base}/v1/models", f"{base}/dashboard"):  # both answer where it says
            with urllib.request.urlopen(url, timeout=30) as r:
                assert r.status == 200
    with start_runtime(tiny_model, tmp_path / "off") as rt:  # --http-port 0
        assert rt.proc.stdout is not None
        assert "HTTP off" in rt.proc.stdout.readline()
        pids = list(actor_pids(rt.run_dir).values())
    # SIGTERM came right after the ready lines: minirt up stopped its actors before it exited
    assert pids and not any(_alive(p) for p in pids), "an actor outlived minirt up"


def test_every_actor_starts_from_the_resolved_config_whatever_the_environment_says(
    tiny_model, tmp_path, monkeypatch
):
    """A ``MINIRT_MODEL`` left in the shell (here a .gguf-like file, another model) is overridden
    by ``--model`` for ``minirt up``; its children must then read the config ``minirt up``
    resolved and wrote, not the variable again (issue 58: the HTTP actor read the unresolved
    .gguf path). Twice on the same run dir, as a user restarting it."""
    stray = tmp_path / "SmolLM2-135M-Instruct.Q4_1.gguf"
    stray.write_bytes(b"GGUF")
    monkeypatch.setenv("MINIRT_MODEL", str(stray))
    run_dir = tmp_path / "rt"
    for _ in range(2):
        port = free_port()
        with start_runtime(tiny_model, run_dir, "--http-port", str(port)) as rt:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=30) as r:
                served = json.loads(r.read())["data"][0]["id"]
            assert served == str(tiny_model)
            assert json.loads((run_dir / "config.json").read_text())["model"] == str(tiny_model)
            assert rt.proc.poll() is None


def test_an_actor_that_cannot_start_names_what_it_read_and_from_where(tiny_model, tmp_path):
    from actors.runtime.config import RuntimeConfig

    cfg = RuntimeConfig(model=str(tiny_model), run_dir=str(tmp_path / "rt"), max_model_len=64)
    path = tmp_path / "config.json"
    cfg.save(path)
    stray = tmp_path / "x.gguf"
    stray.write_bytes(b"GGUF")
    env = dict(os.environ, MINIRT_MODEL=str(stray))
    out = subprocess.run(
        [sys.executable, "-m", "minirt.cli", "actor", "http", "--config", str(path)],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
    )
    assert out.returncode == 2
    said = out.stderr.strip().splitlines()[-1]
    assert said.startswith("minirt actor http: ")
    assert f"model '{stray}', from the config {path} and the environment's MINIRT_MODEL" in said
