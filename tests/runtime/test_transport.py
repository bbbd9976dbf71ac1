"""The trio/pyzmq adapter under load, and a reader parked while another task sends."""

from __future__ import annotations

import trio
import zmq

from actors.runtime.transport import open_socket
from benchmarks.transport import run_pair


def test_100k_messages_each_way_between_two_processes_no_loss():
    report = run_pair(n=100_000, rtt=500, timeout=120)
    for side in ("leader", "peer"):
        r = report[side]
        assert r["received"] == 100_000 and r["out_of_order"] == 0, (side, r)
    lead = report["leader"]
    print(f"\ntransport: {lead['recv_msgs_per_s']:,.0f} msg/s, rtt p50 {lead['rtt_p50_us']:.0f} us")


async def test_parked_reader_wakes_when_another_task_sends_on_its_socket(tmp_path):
    """The FD is edge-triggered and a send can consume the edge: the parked reader must still wake."""
    ctx = zmq.Context.instance()
    ep = f"ipc://{tmp_path / 'r'}"
    router = open_socket(ctx, zmq.ROUTER, bind=ep)
    dealer = open_socket(ctx, zmq.DEALER, connect=[ep])
    got: list[bytes] = []
    try:
        async with trio.open_nursery() as nursery:

            async def reader() -> None:
                for _ in range(200):
                    got.append((await dealer.recv())[-1])

            nursery.start_soon(reader)
            await dealer.send([b"hello"])
            ident = (await router.recv())[0]
            for i in range(200):
                await router.send([ident, str(i).encode()])
                # the reader's socket also sends, consuming FD edges while input is pending
                await dealer.send([b"x"])
                if i % 7 == 0:
                    await trio.lowlevel.checkpoint()  # let the reader run
    finally:
        router.close()
        dealer.close()
    assert got == [str(i).encode() for i in range(200)]
