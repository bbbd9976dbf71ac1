"""Across hosts, the other path: one instance's actors split over two network namespaces (made
by the test, standing in for two hosts), every socket tcp:// with CURVE. Needs root and iproute2;
skipped with the reason when missing, except in CI."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import pytest

from actors.runtime.security import make_keys
from tests.support.netns import two_hosts, unavailable
from tests.support.runtime import hf_greedy, poll_until

_why = unavailable()
if _why:
    if os.environ.get("CI") == "true":
        raise RuntimeError(f"the network-namespace test cannot run in CI: {_why}")
    pytest.skip(_why, allow_module_level=True)

CLI = [sys.executable, "-m", "minirt.cli"]


def in_ns(ns: str, code: str) -> str:
    out = subprocess.run(
        ["ip", "netns", "exec", ns, sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    return out.stdout


SPLIT_PORTS = {
    "client": 5560,
    "tokenizer": 5561,
    "scheduler": 5562,
    "kv_manager": 5563,
    "executor": 5564,
}


def test_one_instance_split_across_two_hosts_over_curve(tiny_model, tmp_path):
    """The other path across hosts: tokenizer, scheduler and KV manager on host A, the executor
    on host B, every socket tcp:// with CURVE. Exact answers; a peer without the keys gets no
    answer from the executor's inbox."""
    with two_hosts() as h:
        _split_run(h, tiny_model, tmp_path)


def _split_run(h, tiny_model, tmp_path) -> None:
    keys = tmp_path / "keys"
    make_keys(keys)
    eps = {n: f"tcp://{h.link_a}:{p}" for n, p in SPLIT_PORTS.items()}
    eps["client"] = f"tcp://{h.a_addr}:{SPLIT_PORTS['client']}"  # reachable from the root side
    eps["executor"] = f"tcp://{h.link_b}:{SPLIT_PORTS['executor']}"
    conf = tmp_path / "split.toml"
    conf.write_text(
        f'model = "{tiny_model}"\n[kv]\nnum_blocks = 256\n[security]\n'
        f'curve_dir = "{keys}"\nallow_remote = true\n[endpoints]\n'
        + "".join(f'{n} = "{e}"\n' for n, e in eps.items())
    )
    where = {"tokenizer": h.a, "scheduler": h.a, "kv_manager": h.a, "executor": h.b}
    procs = []
    try:
        for name, ns in where.items():
            run = tmp_path / ("host-a" if ns == h.a else "host-b")
            cmd = h.cmd(ns, [*CLI, "actor", name, "--config", str(conf), "--run-dir", str(run)])
            with (tmp_path / f"{name}.log").open("w") as log:
                procs.append(
                    subprocess.Popen(
                        cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
                    )
                )
        prompt = [5, 6, 7, 8, 9, 10]
        gen = [*CLI, "generate", "--endpoint", eps["client"], "--curve-dir", str(keys), "--json"]
        gen += ["--prompt-ids", ",".join(map(str, prompt)), "--max-tokens", "6", "--timeout", "10"]
        tries: list[subprocess.CompletedProcess] = []

        def generated() -> subprocess.CompletedProcess | None:
            tries.append(subprocess.run(gen, capture_output=True, text=True, timeout=60))
            assert all(p.poll() is None for p in procs), "an actor exited; see its log"
            return tries[-1] if tries[-1].returncode == 0 else None

        try:
            out = poll_until(generated, 150, "a generate over CURVE", interval=1)
        except TimeoutError:
            raise AssertionError(tries[-1].stderr) from None
        assert json.loads(out.stdout)["token_ids"] == hf_greedy(tiny_model, [prompt], 6)[0]
        ping = f"""
import trio
from actors.runtime.ping import ping
from actors.runtime.security import CurveKeys
keyed = trio.run(ping, "{eps["executor"]}", 3.0, 1, CurveKeys.load("{keys}"))
bare = trio.run(ping, "{eps["executor"]}", 3.0, 2, None)
print(keyed is not None, bare is None)
"""
        assert in_ns(h.a, ping).split() == ["True", "True"]
    finally:
        for p in procs:
            p.send_signal(signal.SIGTERM)
        for p in procs:
            try:
                p.wait(timeout=15)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
