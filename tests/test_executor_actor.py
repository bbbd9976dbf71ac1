"""The executor actor in this process, its peers played by bare ROUTER sockets: it tells the
scheduler which prompts a step completes while that step's forward is still running, so the
requests held back for their prefix can be admitted in time for the next step."""

from __future__ import annotations

import os

import trio
import zmq

from actors.runtime.config import RuntimeConfig
from actors.runtime.transport import open_socket
from gpu.actor import ExecutorActor
from gpu.executor import Executor
from messages import executor as xm
from messages.codec import Decoder, encode
from messages.common import PROTOCOL_VERSION, Hello, HelloAck, Ping, Pong, SamplingParams
from messages.scheduler import PrefillDone, RequestDone
from messages.tokenizer import TokenBatch

PEER_SAYS = Hello | Ping | PrefillDone | RequestDone | TokenBatch


async def next_of(sock, kind, decoder):
    """The next message of type ``kind`` on a peer's ROUTER (handshakes and pings skipped)."""
    while True:
        msg = decoder.decode((await sock.recv())[-1])
        if isinstance(msg, kind):
            return msg


async def test_prefill_done_leaves_before_the_step_that_completes_the_prompt_returns(
    tiny_model, tmp_path
):
    cfg = RuntimeConfig(run_dir=str(tmp_path), model=str(tiny_model), heartbeat_s=30.0).resolve()
    actor = ExecutorActor(cfg, executor=Executor(tiny_model, num_blocks=64))
    ctx = zmq.Context.instance()
    (tmp_path / "sock").mkdir(exist_ok=True)
    peers = {
        name: open_socket(ctx, zmq.ROUTER, bind=cfg.endpoints.of(name))
        for name in ("scheduler", "kv_manager", "tokenizer")
    }
    me = open_socket(ctx, zmq.DEALER, connect=(cfg.endpoints.of("executor"),))
    acks = Decoder(HelloAck | Pong)
    says = Decoder(PEER_SAYS)
    finished = (
        trio.Event()
    )  # the test lets each step return only once it has seen what it waits for
    steps_back: list[int] = []

    async def gated_step(fn):
        result = await trio.to_thread.run_sync(fn)
        await finished.wait()
        steps_back.append(len(result.outputs))
        return result

    actor.run_step = gated_step
    try:
        with trio.fail_after(30):
            async with trio.open_nursery() as nursery:
                await nursery.start(actor.serve)
                await me.send(
                    [encode(Hello(actor="scheduler", version=PROTOCOL_VERSION, pid=os.getpid()))]
                )
                assert isinstance(acks.decode((await me.recv())[-1]), HelloAck)
                run = xm.Run(
                    request_id="a",
                    attempt=3,
                    prompt_ids=list(range(5, 45)),
                    params=SamplingParams(max_tokens=2, ignore_eos=True),
                    block_table=[0, 1, 2],
                )
                await me.send([encode(run)])
                done = await next_of(peers["scheduler"], PrefillDone, says)
                assert (done.request_id, done.attempt) == ("a", 3)
                assert not steps_back  # the step that completes the prompt has not returned
                early = []  # what reached the front door so far: no tokens yet
                while (frames := peers["tokenizer"].recv_nowait()) is not None:
                    early.append(says.decode(frames[-1]))
                assert not [m for m in early if isinstance(m, TokenBatch)]
                finished.set()
                tokens = await next_of(peers["tokenizer"], TokenBatch, says)
                assert [e.request_id for e in tokens.events] == ["a"]
                end = await next_of(peers["scheduler"], RequestDone, says)
                assert (end.request_id, end.status, len(end.output_ids)) == ("a", "finished", 2)
                assert steps_back == [1, 1]
                nursery.cancel_scope.cancel()
    finally:
        me.close()
        for sock in peers.values():
            sock.close()
