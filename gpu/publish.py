"""What one executor step tells its peers: the tokens for the tokenizer, the ends for the
scheduler, the growth ahead of need for the KV manager. A function of the step's result and the
flight ledger (which it updates); the executor core (``gpu/core.py``) sends what it returns."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import msgspec

from actors.shared.reservation import grow_to
from gpu.requests import StepResult
from gpu.state import Flight, finished
from messages.kv import Grow
from messages.scheduler import RequestDone
from messages.tokenizer import TokenBatch, TokenEvent

if TYPE_CHECKING:
    from gpu.request_table import RequestTable


def step_messages(
    result: StepResult,
    flight: dict[str, Flight],
    requests: RequestTable,
    lookahead: int,
    kv_down: bool,
    log: Any,
    clock: Callable[[], float],
    draft_tokens: int = 0,
) -> list[tuple[str, msgspec.Struct]]:
    """``(peer, message)`` pairs for ``result``, in sending order. Ended requests leave
    ``flight``; each running one records its tokens and the growth it asked for. With
    ``kv_down`` growth is not asked (the successor is asked when it holds)."""
    out_msgs: list[tuple[str, msgspec.Struct]] = []
    # (before ends leave flight)
    scored = [p for p in result.prompt if p.request_id in flight]
    pooled = [p for p in result.pooled if p.request_id in flight]
    for rid, field, reason in result.failed:
        fl = flight.pop(rid, None)
        if fl is None:
            continue
        log.warning("executor.failed", request_id=rid, field=field, reason=reason)
        done = RequestDone(
            request_id=rid,
            attempt=fl.attempt,
            status="error",
            message=reason,
            field=field,
            output_ids=fl.outputs,
        )
        out_msgs.append(("scheduler", done))
    if result.spec is not None:  # each request's drafts, for the counters its done carries
        for rid, drafts, accepted in result.spec.per_request:
            sfl = flight.get(rid)
            if sfl is not None:
                sfl.spec[0] += 1
                sfl.spec[1] += drafts
                sfl.spec[2] += accepted
    events: list[TokenEvent] = []
    # a request may emit several tokens in a step (speculative decoding): growth from its last
    last = {o.request_id: i for i, o in enumerate(result.outputs) if o.token_id is not None}
    for i, out in enumerate(result.outputs):
        if out.token_id is None:
            continue
        rid = out.request_id
        fl = flight.get(rid)
        if fl is None:
            continue
        fl.outputs.append(out.token_id)
        events.append(
            TokenEvent(rid, out.token_id, out.logprob, out.top_logprobs, out.finish_reason)
        )
        if out.prefill_done:
            log.info(
                "executor.prefill_done",
                request_id=rid,
                ttft_s=round(clock() - fl.started, 6),
            )  # (its PrefillDone went out when the step was planned)
        if out.finish_reason is not None:
            flight.pop(rid)
            out_msgs.append(("scheduler", finished(rid, fl, out.finish_reason)))
            continue
        if last[rid] != i:
            continue
        # Grow ahead of need: the next step writes KV for prompt + outputs tokens; never past
        # what the request can still write (a full reservation holds that from the start).
        # With speculation, room for the drafts too (``draft_tokens`` + 1 rows), granted only
        # where blocks are free: ``needed_tokens`` is what the request must have.
        need = out.num_prompt_tokens + out.num_output_tokens
        at_most = requests.kv_tokens_at_most(rid)
        must = grow_to(need, lookahead, at_most)
        want = max(must, grow_to(need, draft_tokens + 1, at_most))
        if requests.capacity(rid) < want and fl.grow_asked < want:
            fl.grow_asked = want
            if not kv_down:
                grow = Grow(
                    request_id=rid,
                    attempt=fl.attempt,
                    total_tokens=want,
                    needed_tokens=must if must < want else 0,
                )
                out_msgs.append(("kv_manager", grow))
    if events or scored or pooled:
        out_msgs.append(("tokenizer", TokenBatch(events=events, prompt=scored, pooled=pooled)))
    return out_msgs
