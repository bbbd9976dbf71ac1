"""Transport stress and latency: two processes push N messages each way at once, then ping-pong.

``minirt bench transport [--n 100000] [--rtt 2000]`` prints messages/s each way and round-trip
latency percentiles. The pytest stress test runs the same code. Each side binds a ROUTER inbox and
connects a DEALER to the other's inbox (the actors' own pattern) over ipc://.
"""

from __future__ import annotations

import argparse
import json
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import trio
import zmq

from actors.runtime.transport import ZSocket, open_socket

_SEQ = struct.Struct("<Iq")  # kind (0 data, 1 ping), sequence


async def _exchange(inbox: ZSocket, out: ZSocket, n: int, rtt: int, leader: bool) -> dict[str, Any]:
    """Send ``n`` numbered messages while receiving ``n``; check order; then ``rtt`` ping-pongs."""
    got = 0
    errors = 0
    t0 = time.perf_counter()
    sent_done = 0.0

    async def sender() -> None:
        nonlocal sent_done
        payload = b"x" * 32
        for i in range(n):
            await out.send([_SEQ.pack(0, i) + payload])
            if i % 1000 == 999:
                await trio.sleep(0)
        sent_done = time.perf_counter() - t0

    async with trio.open_nursery() as nursery:
        nursery.start_soon(sender)
        while got < n:
            frames = await inbox.recv()
            kind, seq = _SEQ.unpack_from(frames[-1])
            if kind != 0 or seq != got:
                errors += 1
            got += 1
    recv_s = time.perf_counter() - t0
    lat: list[float] = []
    for i in range(rtt):
        if leader:
            t = time.perf_counter()
            await out.send([_SEQ.pack(1, i)])
            await inbox.recv()
            lat.append(time.perf_counter() - t)
        else:
            frames = await inbox.recv()
            await out.send([frames[-1]])
    lat.sort()
    return {
        "n": n,
        "received": got,
        "out_of_order": errors,
        "send_s": sent_done,
        "recv_s": recv_s,
        "recv_msgs_per_s": n / recv_s if recv_s else 0.0,
        "rtt_p50_us": lat[len(lat) // 2] * 1e6 if lat else None,
        "rtt_p99_us": lat[int(len(lat) * 0.99)] * 1e6 if lat else None,
    }


async def run_side(inbox_ep: str, peer_ep: str, n: int, rtt: int, leader: bool) -> dict[str, Any]:
    ctx: zmq.Context[Any] = zmq.Context.instance()
    inbox = open_socket(ctx, zmq.ROUTER, bind=inbox_ep, hwm=0)
    out = open_socket(ctx, zmq.DEALER, connect=[peer_ep], hwm=0)
    try:
        # readiness: both sides exchange one hello frame before the blast
        await out.send([_SEQ.pack(2, -1)])
        await inbox.recv()
        return await _exchange(inbox, out, n, rtt, leader)
    finally:
        out.close()
        inbox.close()


def run_pair(n: int, rtt: int, timeout: float = 120.0) -> dict[str, Any]:
    """Start the peer process, run both sides, return both reports."""
    with tempfile.TemporaryDirectory() as d:
        a, b = f"ipc://{Path(d) / 'a'}", f"ipc://{Path(d) / 'b'}"
        cmd = [
            sys.executable,
            "-m",
            "benchmarks.transport",
            "--peer",
            b,
            a,
            "--n",
            str(n),
            "--rtt",
            str(rtt),
        ]
        # the checkout's root: benchmarks/ is not an installed package
        root = str(Path(__file__).resolve().parents[1])
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, cwd=root)
        try:
            mine = trio.run(_with_deadline, a, b, n, rtt, timeout)
            out, _ = proc.communicate(timeout=timeout)
            theirs = json.loads(out.strip().splitlines()[-1])
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    return {"leader": mine, "peer": theirs}


async def _with_deadline(a: str, b: str, n: int, rtt: int, timeout: float) -> dict[str, Any]:
    with trio.fail_after(timeout):
        return await run_side(a, b, n, rtt, leader=True)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="minirt bench transport")
    p.add_argument("--n", type=int, default=100_000)
    p.add_argument("--rtt", type=int, default=2000)
    p.add_argument("--peer", nargs=2, metavar=("INBOX", "PEER"), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.peer:
        report = trio.run(run_side, args.peer[0], args.peer[1], args.n, args.rtt, False)
        print(json.dumps(report))
        return 0
    r = run_pair(args.n, args.rtt)
    lead, peer = r["leader"], r["peer"]
    print(f"{args.n} messages each way, concurrently, over ipc:// between two processes")
    print(
        f"  leader received {lead['received']} ({lead['out_of_order']} out of order) "
        f"at {lead['recv_msgs_per_s']:,.0f} msg/s"
    )
    print(
        f"  peer   received {peer['received']} ({peer['out_of_order']} out of order) "
        f"at {peer['recv_msgs_per_s']:,.0f} msg/s"
    )
    print(
        f"  round trip over {args.rtt} ping-pongs: p50 {lead['rtt_p50_us']:.0f} us, "
        f"p99 {lead['rtt_p99_us']:.0f} us"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
