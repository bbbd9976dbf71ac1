"""The pure parts of resuming after a crash: the front door's bookkeeping (``tokenizer_svc.resume``),
a resumed stream's text (``Stream.prime``), the scheduler admitting a resumed request like a
preempted one, and the client endpoint's new ids for a resumed request."""

from __future__ import annotations

import pytest
from structlog.testing import capture_logs
from transformers import AutoTokenizer

from messages import executor as xm
from messages import tokenizer as tm
from messages.common import SamplingParams
from messages.scheduler import Submit
from tests.scheduler.test_scheduler_core import admit_ok, make, sent
from tests.tokenizer_svc.test_streams import TEXT, events, run
from tokenizer_svc.clients import ClientEndpoint
from tokenizer_svc.resume import (
    MAX_RESUMES,
    RESUME_TIMEOUT_S,
    Resume,
    already_ended,
    check_resume_ids,
)
from tokenizer_svc.streams import Stream


def test_only_lost_attempts_that_progressed_count_and_the_count_is_bounded():
    r = Resume([1, 2, 3], SamplingParams(max_tokens=8), arrival=0.0)
    assert r.lost("executor died", now=1.0) == "" and r.pending and r.resumes == 0
    sub = r.submit("a@x.2", [7, 8])
    assert not r.pending
    assert (sub.prompt_ids, sub.output_ids, sub.resume_reason) == (
        [1, 2, 3],
        [7, 8],
        "executor died",
    )
    # refused while the runtime settles: pending again, not counted, the first cause kept
    assert r.lost("executor: not admitting yet", now=2.0) == "" and r.resumes == 0
    assert r.reason == "executor died"
    for n in range(1, MAX_RESUMES + 1):
        r.submit("a@x.3", [7, 8])
        r.progressed = True  # admitted, then lost again
        assert r.lost("scheduler died", now=3.0) == "" and r.resumes == n
    r.submit("a@x.4", [7, 8])
    r.progressed = True
    why = r.lost("kv_manager died", now=4.0)
    assert "kv_manager died" in why and f"resumed {MAX_RESUMES} times" in why


def test_a_pending_request_expires_with_a_reason_instead_of_hanging():
    r = Resume([1], SamplingParams(), arrival=0.0)
    r.lost("executor died", now=10.0)
    assert r.expired(now=10.0 + RESUME_TIMEOUT_S) == ""
    assert "could not resume" in r.expired(now=10.1 + RESUME_TIMEOUT_S)


def test_resume_ids_are_checked_and_a_complete_request_is_recognised():
    p = SamplingParams(max_tokens=4, stop_token_ids=[9])
    assert check_resume_ids([1, 2], p, vocab_size=10) == ""
    assert "in [0, 10)" in check_resume_ids([1, 10], p, vocab_size=10)
    assert "max_tokens" in check_resume_ids([1] * 5, p, vocab_size=10)
    assert already_ended([1, 2], p, {3}) is None
    assert already_ended([1, 2, 3, 4], p, {3}) == "length"
    assert already_ended([1, 3], p, {3}) == "stop"
    assert already_ended([1, 9], p, {3}) == "stop"
    assert already_ended([1, 3], SamplingParams(max_tokens=4, ignore_eos=True), {3}) is None


@pytest.fixture(scope="module")
def tok(tiny_model):
    return AutoTokenizer.from_pretrained(tiny_model)


@pytest.mark.parametrize("cut", [1, 3, 6, 9])
def test_a_primed_stream_continues_the_text_exactly(tok, cut):
    ids = tok(TEXT + " 你好 😀")["input_ids"]
    full = tok.decode(ids)
    stop = full[-3:] + "!"  # its start is held back at the end, it never completes
    whole, _ = run(Stream("r", tok, 5, [stop], 0.0), events(ids))
    before = "".join(d.text for d in whole[:cut])  # what the client received before the crash
    s = Stream("r", tok, 5, [stop], 0.0)
    s.prime(ids[:cut])
    after, ending = run(s, events(ids)[cut:])
    assert [d.token_ids[0] for d in after] == ids[cut:]
    assert before + "".join(d.text for d in after) == full  # nothing twice, nothing missing
    assert ending is not None and s.final("length", None, 9.0).usage.completion_tokens == len(ids)


def resumed_submit() -> Submit:
    """A request whose attempt died with the executor after it streamed 2 tokens."""
    params = SamplingParams(max_tokens=8, seed=5, temperature=1.0)
    return Submit(
        request_id="old",
        prompt_ids=[1, 2, 3],
        params=params,
        arrival=0.0,
        output_ids=[7, 8],
        resumes=1,
        resume_reason="executor died",
    )


def test_a_resumed_submit_runs_like_a_preempted_request():
    core, _ = make(max_waiting=1)
    params = SamplingParams(max_tokens=8, seed=5, temperature=1.0)
    core.submit(Submit(request_id="new", prompt_ids=[1, 2], params=params, arrival=0.0))
    sent(core)
    with capture_logs() as logs:
        core.submit(resumed_submit())
    # the queue was full (max_waiting 1), but a resumed request is never refused as overloaded
    assert not [m for m in sent(core, "tokenizer") if isinstance(m, tm.RequestFailed)]
    ev = [e for e in logs if e["event"] == "request.resumed"]
    assert ev and ev[0]["output_tokens"] == 2 and ev[0]["recomputed_tokens"] == 5
    assert ev[0]["reason"] == "executor died"
    assert "old" in core.queue


def test_resumed_request_is_admitted_with_its_tokens_and_output_offset():
    core, _ = make()
    core.submit(resumed_submit())
    asks = sent(core, "kv_manager")
    assert asks[-1].token_ids == [1, 2, 3, 7, 8]
    admit_ok(core, "old")
    run_msg = next(m for m in sent(core, "executor") if isinstance(m, xm.Run))
    assert run_msg.prompt_ids == [1, 2, 3, 7, 8] and run_msg.output_offset == 2
    assert run_msg.params.max_tokens == 8  # the executor counts output_offset against it


def test_nothing_left_to_resume_is_refused_naming_the_field():
    core, _ = make()
    core.submit(
        Submit(
            request_id="x",
            prompt_ids=[1],
            params=SamplingParams(max_tokens=2),
            arrival=0.0,
            output_ids=[4, 5],
            resume_reason="executor died",
        )
    )
    failed = [m for m in sent(core, "tokenizer") if isinstance(m, tm.RequestFailed)]
    assert failed and failed[0].field == "output_ids" and "x" not in core.requests


def test_a_resumed_request_gets_a_new_id_and_only_its_client_sees_it():
    import structlog

    ep = ClientEndpoint(
        lambda ident, data: True, lambda ids: None, "abcdef123456", structlog.get_logger()
    )
    first = ep.open(b"c1", "1")
    assert first is not None
    again = ep.rekey(b"c1", "1")
    assert again is not None and again != first and again.startswith("1@")
    assert ep.lookup(b"c1", "1") == again  # cancel reaches the resumed request
    assert ep.rekey(b"c2", "1") is None and ep.rekey(b"c1", "2") is None


def test_a_starting_scheduler_is_ready_only_once_its_peers_answered() -> None:
    """The front door (and ``minirt ready``) waits for the scheduler's readiness before it takes
    requests: a scheduler still gathering its peers' reconcile answers is not ready, so no client
    request can reach it and be taken for one it inherited from a predecessor."""
    from actors.runtime.config import RuntimeConfig
    from actors.scheduler.actor import SchedulerActor
    from messages.scheduler import ExecutorHeld, KVHeld, LiveRequests

    actor = SchedulerActor(RuntimeConfig())  # no sockets until open()
    actor.settle_until = 0.0  # past the settling time a restart waits
    answers = [
        ("tokenizer", LiveRequests(requests=[])),
        ("executor", ExecutorHeld(running=[], ended=[])),
        ("kv_manager", KVHeld(allocations=[])),
    ]
    ready = [actor.is_ready()]
    for peer, msg in answers:
        actor.on_peer_reply(peer, msg)
        ready.append(actor.is_ready())
    assert ready == [False, False, False, True]
