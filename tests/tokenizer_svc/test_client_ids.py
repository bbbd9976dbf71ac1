"""The front door over a real runtime: request ids are scoped to the client's connection (two
clients may use the same id; a client sees and cancels only its own requests; ``minirt trace``
finds a request by the client's id), and ``welcome`` tells a client whether the runtime serves."""

from __future__ import annotations

import os
import signal

import pytest
import trio

from messages import client as cm
from messages.codec import Decoder, encode
from messages.common import PROTOCOL_VERSION, Hello, Ping, Pong
from messages.tokenizer import Cancel
from minirt.client import connect, open_client
from minirt.eventlog import trace_lines
from tests.support.runtime import hf_greedy, start_runtime, wait_until
from tests.support.steps import Stopper

LONG = 600  # tokens: long enough that a request is still running while another client acts


@pytest.fixture(scope="module")
def rt(tiny_model, tmp_path_factory):
    with start_runtime(tiny_model, tmp_path_factory.mktemp("front"), "--num-blocks", "512") as r:
        yield r


class Raw:
    """A client on a bare DEALER, as protocol.md describes it."""

    def __init__(self, endpoint: str) -> None:
        self.sock = connect(endpoint)
        self.decoder: Decoder = Decoder(cm.ClientInbound)

    async def send(self, msg) -> None:
        await self.sock.send([encode(msg)])

    async def recv(self, timeout: float = 10.0):
        with trio.fail_after(timeout):
            return self.decoder.decode((await self.sock.recv())[-1])

    async def hello(self) -> cm.Welcome:
        await self.send(Hello(actor="client", version=PROTOCOL_VERSION))
        msg = await self.recv()
        assert isinstance(msg, cm.Welcome), msg
        return msg

    async def ping(self, nonce: int) -> None:
        """Round trip: everything sent before it has been handled by the front door."""
        await self.send(Ping(nonce=nonce))
        while True:
            msg = await self.recv()
            if isinstance(msg, Pong) and msg.nonce == nonce:
                return
            assert isinstance(msg, Pong), f"unexpected {msg}"  # only probes are allowed

    def pending(self) -> list:
        """What arrived and was not read, skipping the front door's idle probes (pong nonce 0)."""
        out = []
        while (frames := self.sock.recv_nowait()) is not None:
            msg = self.decoder.decode(frames[-1])
            if not (isinstance(msg, Pong) and msg.nonce == 0):
                out.append(msg)
        return out

    def close(self) -> None:
        self.sock.close()


async def test_two_clients_may_use_the_same_request_id(rt, tiny_model):
    prompts = [[5, 6, 7, 8, 9], [40, 41, 42]]
    # A's "1" runs a few steps, then the executor is stopped: B's "1" arrives and A cancels its
    # own while A's is surely in flight
    stopper = await Stopper.start(rt, 8)

    def admitted_as_1() -> int:
        return len([e for e in rt.events("request.admitted") if e["request_id"].startswith("1@")])

    try:
        async with open_client(rt.endpoint) as a, open_client(rt.endpoint) as b:
            a_ids: list[int] = []
            a_final = b_res = None
            before = admitted_as_1()
            async with trio.open_nursery() as nursery:

                async def run_b() -> None:
                    nonlocal b_res
                    b_res = await b.generate(prompt_ids=prompts[1], max_tokens=8, request_id="1")

                async def b_then_cancel_a() -> None:
                    await stopper.stopped()
                    nursery.start_soon(run_b)  # B uses "1" too, to the end
                    await wait_until(lambda: admitted_as_1() == before + 2, timeout=30)
                    await a.cancel("1")  # then A ends its own "1"
                    stopper.resume()

                nursery.start_soon(b_then_cancel_a)
                async for msg in a.stream(
                    prompt_ids=prompts[0], max_tokens=LONG, ignore_eos=True, request_id="1"
                ):
                    if isinstance(msg, cm.Delta):
                        a_ids += msg.token_ids
                    elif isinstance(msg, cm.Final):
                        a_final = msg
            assert a_ids, "A's request made no token before it was cancelled"
            alone = await a.generate(prompt_ids=prompts[0], max_tokens=len(a_ids), ignore_eos=True)
    finally:
        stopper.close()
    # each got its own request's tokens, and nothing of the other's
    assert a_final is not None and a_final.finish_reason == "abort"  # A ran until it cancelled
    assert a_ids == alone.token_ids
    assert b_res is not None and b_res.request_id == "1" and b_res.finish_reason == "length"
    assert b_res.token_ids == hf_greedy(tiny_model, prompts[1:], 8)[0]
    received = [e for e in rt.events("client.received") if e["client_request_id"] == "1"]
    assert len({e["request_id"] for e in received}) == 2  # two runtime-wide ids
    a_done = [
        e for e in rt.events("client.completed") if e["request_id"] == received[0]["request_id"]
    ]
    assert received[1]["ts"] < a_done[0]["ts"]  # B's "1" arrived while A's "1" was in flight
    # `minirt trace 1` shows both requests, each with the other actors' events for it
    lines = trace_lines(rt.events(), "1")
    headers = [line for line in lines if line.startswith("request ")]
    assert headers == [f"request {e['request_id']}:" for e in received]
    assert sum("request.admitted" in line for line in lines) == 2
    assert sum("request.finished" in line for line in lines) == 1  # B's; A's was aborted
    assert sum("request.aborted" in line for line in lines) == 1


async def test_a_client_cannot_see_or_cancel_another_clients_request(rt):
    other = Raw(rt.endpoint)
    try:
        await other.hello()
        stopper = await Stopper.start(
            rt, 8
        )  # "x" in flight while the other client tries to cancel it
        async with open_client(rt.endpoint) as owner, trio.open_nursery() as nursery:
            n = 0
            final = None

            async def other_cancels() -> None:
                await stopper.stopped()
                await other.send(Cancel(request_id="x"))
                await other.ping(1)  # the front door has read the cancel
                stopper.resume()

            nursery.start_soon(other_cancels)
            try:
                async for msg in owner.stream(
                    prompt_ids=[11, 12, 13, 14], max_tokens=LONG, ignore_eos=True, request_id="x"
                ):
                    if isinstance(msg, cm.Delta):
                        n += len(msg.token_ids)
                    elif isinstance(msg, cm.Final):
                        final = msg
            finally:
                stopper.close()
        # it ran to its end, untouched
        assert final is not None and final.finish_reason == "length" and n == LONG
        assert final.usage.completion_tokens == LONG
        assert other.pending() == []  # no Final(abort), no delta: it saw nothing of "x"
    finally:
        other.close()
    [ignored] = [e for e in rt.events("client.cancel_ignored") if e["client_request_id"] == "x"]
    [done] = [e for e in rt.events("client.completed") if e["client_request_id"] == "x"]
    assert ignored["ts"] < done["ts"]  # the cancel came while "x" ran, and was ignored
    assert not [e for e in rt.events("client.aborted") if e["client_request_id"] == "x"]
    assert not [e for e in rt.events("request.aborted") if e["request_id"] == done["request_id"]]


async def test_own_cancel_still_works_and_frees_the_id(rt):
    stopper = await Stopper.start(rt, 4)  # "z" in flight when its client cancels it
    async with open_client(rt.endpoint) as c:
        final = None
        async with trio.open_nursery() as nursery:

            async def cancel() -> None:
                await stopper.stopped()
                await c.cancel("z")
                stopper.resume()

            nursery.start_soon(cancel)
            try:
                async for msg in c.stream(
                    prompt_ids=[7, 8, 9], max_tokens=LONG, ignore_eos=True, request_id="z"
                ):
                    if isinstance(msg, cm.Final):
                        final = msg
            finally:
                stopper.close()
        assert final is not None and final.finish_reason == "abort"
        again = await c.generate(prompt_ids=[7, 8, 9], max_tokens=3, request_id="z")
    assert again.finish_reason == "length" and len(again.token_ids) == 3
    assert [e["reason"] for e in rt.events("client.aborted") if e["client_request_id"] == "z"] == [
        "cancel"
    ]


@pytest.mark.deadline(90)
async def test_welcome_says_when_the_runtime_does_not_serve_and_clients_wait(rt):
    raw = Raw(rt.endpoint)
    try:
        assert (await raw.hello()).ready
        scheduler = rt.pid_of("scheduler")
        os.kill(scheduler, signal.SIGKILL)  # the supervisor restarts it; it settles, then admits

        async def not_ready():
            w = await raw.hello()
            return w if not w.ready else None

        welcome = await wait_until(not_ready, timeout=15)
        assert welcome.ok and "scheduler" in welcome.reason, welcome
        # a client that connects now is not refused: its handshake waits until the runtime serves
        async with open_client(rt.endpoint) as c:
            assert c.welcome is not None and c.welcome.ready
            res = await c.generate(prompt_ids=[3, 4, 5], max_tokens=4)
        assert len(res.token_ids) == 4 and res.finish_reason == "length"
        assert rt.pid_of("scheduler") != scheduler  # it did go away and come back
        assert (await raw.hello()).ready
    finally:
        raw.close()
