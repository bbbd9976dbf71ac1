"""Across hosts, for real on one machine: two network namespaces made by this test stand in for
two hosts. Replica A runs in one, replica B in the other, the router in the root namespace; the
router reaches them over HTTP with an API key. Both serve through the router; a host without the
key (or CURVE keys) gets nothing into a replica; a replica killed and started again with the same
command and run dir rejoins. Needs root, iproute2 and the router (scripts/install-router);
skipped with the reason when one is missing, except in CI.
"""

from __future__ import annotations

import json
import os
import secrets
import signal
import subprocess
import sys
from contextlib import ExitStack, contextmanager
from pathlib import Path

import httpx
import pytest
import trio
import zmq.auth

from actors.runtime.security import make_keys
from benchmarks.http_load import reference_texts, run_jobs, text_w2
from benchmarks.scale_out import free_port, served_by
from minirt.eventlog import is_request, read_events
from minirt.launch.launch import read_ready
from minirt.launch.router import (
    RouterMissing,
    RouterSpec,
    find_router,
    router_workers,
    running_router,
)
from tests.support.netns import Hosts, two_hosts, unavailable
from tests.support.runtime import poll_until

try:
    find_router()
    _why = unavailable()
except RouterMissing as e:
    _why = str(e)
if _why:
    if os.environ.get("CI") == "true":
        raise RuntimeError(f"the network-namespace test cannot run in CI: {_why}")
    pytest.skip(_why, allow_module_level=True)

PORT, ZMQ_PORT, MAX_TOKENS = 8001, 5550, 6
CLI = [sys.executable, "-m", "minirt.cli"]


@contextmanager
def replica(cmd: list[str], log: Path, timeout: float = 180.0):
    """A `minirt up` (inside a namespace) until it printed `minirt ready`; SIGKILLed after."""
    proc = subprocess.Popen(
        cmd,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
        env=dict(os.environ, PYTHONUNBUFFERED="1"),
    )
    try:
        ready, lines = read_ready(proc, timeout)
        if ready is None:
            raise RuntimeError("replica did not start:\n" + "".join(lines[-20:]))
        log.write_text("".join(lines))
        yield proc
    finally:
        try:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(timeout=15)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            pass
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait()


def up_cmd(
    h: Hosts, ns: str, addr: str, model: Path, run: Path, key: str, curve: Path
) -> list[str]:
    return h.cmd(
        ns,
        [
            *CLI,
            "up",
            "--model",
            str(model),
            "--run-dir",
            str(run),
            "--threads",
            "1",
            "--http-host",
            addr,
            "--http-port",
            str(PORT),
            "--allow-remote",
            "--api-key",
            key,
            "--client-endpoint",
            f"tcp://{addr}:{ZMQ_PORT}",
            "--curve-dir",
            str(curve),
        ],
    )


def in_ns(h: Hosts, ns: str, code: str) -> str:
    """Run Python ``code`` inside namespace ``ns``; its stdout."""
    out = subprocess.run(
        h.cmd(ns, [sys.executable, "-c", code]), capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr
    return out.stdout


def test_two_hosts_behind_the_router_and_keyless_hosts_get_nothing_in(tiny_model, tmp_path):
    with two_hosts() as h:
        _http_run(h, tiny_model, tmp_path)


def _http_run(h: Hosts, tiny_model: Path, tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    key = secrets.token_hex(16)
    curve = tmp_path / "keys"
    make_keys(curve)
    tok = AutoTokenizer.from_pretrained(tiny_model)
    with ExitStack() as stack:
        runs = {"a": tmp_path / "replica-a", "b": tmp_path / "replica-b"}
        cmds = {
            "a": up_cmd(h, h.a, h.a_addr, tiny_model, runs["a"], key, curve),
            "b": up_cmd(h, h.b, h.b_addr, tiny_model, runs["b"], key, curve),
        }
        procs = {n: stack.enter_context(replica(cmds[n], tmp_path / f"{n}.log")) for n in "ab"}
        urls = [f"http://{h.a_addr}:{PORT}", f"http://{h.b_addr}:{PORT}"]
        spec = RouterSpec(
            urls, port=free_port(), metrics_port=free_port(), api_key=key, policy="round_robin"
        )
        stack.enter_context(running_router(spec, tmp_path / "router.log"))

        # Both hosts serve through the router, every answer exact.
        jobs = text_w2(tok, 5, groups=2, per_group=2, system=32, tag="ns")
        records, _ = trio.run(
            lambda: run_jobs(
                spec.url, jobs, model=str(tiny_model), max_tokens=MAX_TOKENS, api_key=key
            )
        )
        assert all(r.status == 200 and not r.error for r in records), [
            (r.status, r.error) for r in records
        ]
        ref = reference_texts(tiny_model, jobs, MAX_TOKENS)
        assert [r.text for r in records] == [ref[j.rid] for j in jobs]
        where = served_by(runs, [j.rid for j in jobs])
        assert set(where.values()) == {"a", "b"}, where
        # The router wants the key too.
        body = {"model": "m", "prompt": "hello", "max_tokens": 2}
        assert (
            httpx.post(f"{spec.url}/v1/completions", json=body, trust_env=False).status_code == 401
        )

        # From host B, replica A without the key, or with a wrong one: 401, nothing admitted.
        probe = f"""
import json, httpx
url = "http://{h.a_addr}:{PORT}"
body = {{"model": "{tiny_model}", "prompt": "hello there", "max_tokens": 2}}
out = {{}}
for name, hdrs in (("none", {{}}), ("wrong", {{"Authorization": "Bearer nope"}}), ("right", {{"Authorization": "Bearer {key}"}})):
    out[name] = [
        httpx.post(url + "/v1/completions", json=body, headers={{**hdrs, "X-Request-Id": "intruder-" + name}}, trust_env=False, timeout=30).status_code,
        httpx.get(url + "/v1/models", headers=hdrs, trust_env=False, timeout=30).status_code,
        httpx.get(url + "/metrics", headers=hdrs, trust_env=False, timeout=30).status_code,
    ]
out["health"] = httpx.get(url + "/health", trust_env=False, timeout=30).status_code
print(json.dumps(out))
"""
        seen = json.loads(in_ns(h, h.b, probe))
        assert seen["none"] == [401, 401, 401] and seen["wrong"] == [401, 401, 401], seen
        assert seen["right"][:2] == [200, 200] and seen["health"] == 200, seen
        assert served_by(runs, ["intruder-right"]) == {"intruder-right": "a"}
        for rid in ("intruder-none", "intruder-wrong"):  # refused at the HTTP gate, no further
            evs = [e for e in read_events(runs["a"]) if is_request(e.get("request_id"), rid)]
            assert {e["actor"] for e in evs} == {"http"}, evs
            assert {e.get("status") for e in evs if e["event"] == "http.response"} == {401}

        # CURVE: replica A's ZeroMQ client endpoint answers host B with the keys, and nothing to
        # a key pair it has not authorized (even knowing the server's public key).
        intruder = tmp_path / "intruder"
        intruder.mkdir()
        (intruder / "server.key").write_bytes((curve / "server.key").read_bytes())
        zmq.auth.create_certificates(intruder, "client")
        gen = [
            *CLI,
            "generate",
            "--endpoint",
            f"tcp://{h.a_addr}:{ZMQ_PORT}",
            "--json",
            "--max-tokens",
            "3",
            "--timeout",
            "5",
        ]
        ok = subprocess.run(
            h.cmd(h.b, [*gen, "--curve-dir", str(curve), "hello"]),
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert ok.returncode == 0 and json.loads(ok.stdout)["usage"]["completion_tokens"] >= 1, (
            ok.stderr
        )
        bad = subprocess.run(
            h.cmd(h.b, [*gen, "--curve-dir", str(intruder), "hello"]),
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert bad.returncode != 0 and not bad.stdout.strip(), (bad.stdout, bad.stderr)

        # Replica B killed (the whole instance) and started again with the same command and run
        # dir: the router stops sending to it, then takes it back by itself.
        os.killpg(procs["b"].pid, signal.SIGKILL)
        poll_until(lambda: router_workers(spec).get(urls[1]) is False, 30, "router to drop B", 0.3)
        records, _ = trio.run(
            lambda: run_jobs(
                spec.url,
                text_w2(tok, 6, groups=1, per_group=3, system=16, tag="down"),
                model=str(tiny_model),
                max_tokens=MAX_TOKENS,
                api_key=key,
            )
        )
        assert all(r.status == 200 and not r.error for r in records)
        assert set(served_by(runs, [r.rid for r in records]).values()) == {"a"}
        stack.enter_context(replica(cmds["b"], tmp_path / "b2.log"))
        poll_until(
            lambda: router_workers(spec).get(urls[1]) is True, 60, "replica B to rejoin", 0.3
        )
        jobs = text_w2(tok, 7, groups=1, per_group=4, system=16, tag="back")
        records, _ = trio.run(
            lambda: run_jobs(
                spec.url, jobs, model=str(tiny_model), max_tokens=MAX_TOKENS, api_key=key
            )
        )
        assert all(r.status == 200 and not r.error for r in records)
        assert set(served_by(runs, [j.rid for j in jobs]).values()) == {"a", "b"}
