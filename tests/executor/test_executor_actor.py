"""The executor actor in this process, its peers played by bare ROUTER sockets: it tells the
scheduler which prompts a step completes while that step's forward is still running (so the
requests held back for their prefix are admitted in time for the next step), and with nothing
running it waits for a burst being admitted before its first step."""

from __future__ import annotations

import contextlib
import os

import trio
import trio.testing
import zmq

from actors.runtime.config import RuntimeConfig
from actors.runtime.transport import open_socket
from gpu.actor import ExecutorActor
from gpu.model_runner import ModelRunner
from messages import executor as xm
from messages.codec import Decoder, encode
from messages.common import PROTOCOL_VERSION, Hello, HelloAck, Ping, Pong, SamplingParams
from messages.scheduler import PrefillDone, RequestDone
from messages.tokenizer import TokenBatch

PEER_SAYS = Decoder(Hello | Ping | PrefillDone | RequestDone | TokenBatch)


async def next_of(sock, kind):
    """The next message of type ``kind`` on a peer's ROUTER (handshakes and pings skipped)."""
    while True:
        msg = PEER_SAYS.decode((await sock.recv())[-1])
        if isinstance(msg, kind):
            return msg


def run(rid: str, first_block: int, more: bool = False) -> xm.Run:
    return xm.Run(
        request_id=rid,
        attempt=3,
        prompt_ids=list(range(5, 45)),
        params=SamplingParams(max_tokens=2, ignore_eos=True),
        block_table=[first_block, first_block + 1, first_block + 2],
        more=more,
    )


class Harness:
    """The actor, a connection to its inbox, and its three peers' inboxes."""

    def __init__(self, tiny_model, tmp_path, burst_wait_ms: float = 50.0) -> None:
        cfg = RuntimeConfig(run_dir=str(tmp_path), model=str(tiny_model), heartbeat_s=30.0)
        cfg.executor.burst_wait_ms = burst_wait_ms
        cfg = cfg.resolve()
        (tmp_path / "sock").mkdir(exist_ok=True)
        self.actor = ExecutorActor(cfg, executor=ModelRunner(tiny_model, num_blocks=64))
        ctx = zmq.Context.instance()
        self.peers = {
            name: open_socket(ctx, zmq.ROUTER, bind=cfg.endpoints.of(name))
            for name in ("scheduler", "kv_manager", "tokenizer")
        }
        self.me = open_socket(ctx, zmq.DEALER, connect=(cfg.endpoints.of("executor"),))
        self.release = trio.Event()  # each step returns only once the test allows it
        self.started: list[int] = []  # requests in each step, as it starts
        self.returned = 0
        self.actor.run_step = self._gated

    async def _gated(self, fn):
        self.started.append(self.actor.ex.num_requests())
        result = await trio.to_thread.run_sync(fn)
        await self.release.wait()
        self.returned += 1
        return result

    @contextlib.asynccontextmanager
    async def serving(self):
        try:
            with trio.fail_after(30):
                async with trio.open_nursery() as nursery:
                    await nursery.start(self.actor.serve)
                    hello = Hello(actor="scheduler", version=PROTOCOL_VERSION, pid=os.getpid())
                    await self.me.send([encode(hello)])
                    reply = Decoder(HelloAck | Pong).decode((await self.me.recv())[-1])
                    assert isinstance(reply, HelloAck)
                    yield self
                    nursery.cancel_scope.cancel()
        finally:
            self.me.close()
            for sock in self.peers.values():
                sock.close()


async def test_prefill_done_leaves_before_the_step_that_completes_the_prompt_returns(
    tiny_model, tmp_path
):
    async with Harness(tiny_model, tmp_path).serving() as h:
        await h.me.send([encode(run("a", 0))])
        done = await next_of(h.peers["scheduler"], PrefillDone)
        assert (done.request_id, done.attempt) == ("a", 3)
        assert h.started == [1] and h.returned == 0  # its step has not returned yet
        early = []  # what reached the front door so far: no tokens
        while (frames := h.peers["tokenizer"].recv_nowait()) is not None:
            early.append(PEER_SAYS.decode(frames[-1]))
        assert not [m for m in early if isinstance(m, TokenBatch)]
        h.release.set()
        tokens = await next_of(h.peers["tokenizer"], TokenBatch)
        assert [e.request_id for e in tokens.events] == ["a"]
        end = await next_of(h.peers["scheduler"], RequestDone)
        assert (end.request_id, end.status, len(end.output_ids)) == ("a", "finished", 2)
        assert h.returned == 2


async def test_an_idle_executor_waits_for_the_burst_behind_a_run_marked_more(tiny_model, tmp_path):
    async with Harness(tiny_model, tmp_path, burst_wait_ms=20_000).serving() as h:
        h.release.set()
        await h.me.send([encode(run("a", 0, more=True))])
        while "a" not in h.actor.flight:  # until the actor has taken it in
            await trio.testing.wait_all_tasks_blocked()
        await trio.testing.wait_all_tasks_blocked()
        assert h.started == []  # it waits for the rest of the burst, not stepping with "a" alone
        await h.me.send([encode(run("b", 8))])  # the last of the burst: more=False
        ends = {(await next_of(h.peers["scheduler"], RequestDone)).request_id for _ in "ab"}
        assert ends == {"a", "b"}
        assert h.started[0] == 2  # the first step took both


async def test_a_burst_that_does_not_come_is_waited_for_at_most_burst_wait_ms(tiny_model, tmp_path):
    async with Harness(tiny_model, tmp_path, burst_wait_ms=1.0).serving() as h:
        h.release.set()
        await h.me.send([encode(run("a", 0, more=True))])  # says more, and nothing follows
        end = await next_of(h.peers["scheduler"], RequestDone)
        assert (end.request_id, end.status) == ("a", "finished") and h.started == [1, 1]
