"""The front door's request streams (pure): token events in, the client's Delta/Final out.

Fed with the tiny model's real tokenizer; no sockets, no runtime, the clock is passed in."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import AutoTokenizer

from messages.tokenizer import TokenEvent
from tokenizer_svc.stops import StopMatcher
from tokenizer_svc.streams import Stream, completed

TEXT = "the model token cache block prefix request queue batch step"


@pytest.fixture(scope="module")
def tok(tiny_model):
    return AutoTokenizer.from_pretrained(tiny_model)


def events(ids: list[int], finish: str | None = "length") -> list[TokenEvent]:
    evs = [TokenEvent("r@c1.x", t) for t in ids]
    if evs and finish:
        evs[-1].finish_reason = finish
    return evs


def run(stream: Stream, evs: list[TokenEvent]):
    """Feed the events (one second apart); the deltas and the ending, stopping where it ends."""
    deltas, ending = [], None
    for i, ev in enumerate(evs):
        delta, ending = stream.token(ev, now=float(i + 1))
        deltas.append(delta)
        if ending is not None:
            break
    return deltas, ending


def test_deltas_carry_each_token_and_concatenate_to_the_text(tok):
    ids = tok(TEXT + " 你好 😀")["input_ids"]
    s = Stream("r", tok, prompt_tokens=5, stops=[], arrival=0.0)
    deltas, ending = run(s, events(ids))
    assert [d.token_ids for d in deltas] == [[t] for t in ids]
    assert all(d.request_id == "r" for d in deltas)  # the client's own id
    assert "".join(d.text for d in deltas) == tok.decode(ids)
    assert ending is not None and ending.finish_reason == "length" and not ending.abort_upstream
    assert all(d.logprobs is None for d in deltas)  # not asked for


def ends(tok, ids: list[int]) -> list[int]:
    """``ends[n]``: length of the text of the first ``n`` tokens (ASCII text: no partial chars)."""
    return [len(tok.decode(ids[:n])) for n in range(len(ids) + 1)]


def tokens_until(end: list[int], offset: int) -> int:
    """How many tokens it takes for the text to reach ``offset`` characters."""
    return next(n for n, e in enumerate(end) if e >= offset)


def split_after(full: str, end: list[int]) -> int:
    """A token k (of 2+ characters) whose last 2 characters and the 2 after them occur nowhere
    earlier in the text."""
    return next(
        k
        for k in range(2, len(end) - 2)
        if end[k] - end[k - 1] >= 2 and full.find(full[end[k] - 2 : end[k] + 2]) == end[k] - 2
    )


def test_stop_string_split_across_tokens_is_held_back_and_ends_the_stream(tok):
    ids = tok(TEXT)["input_ids"]
    full, end = tok.decode(ids), ends(tok, ids)
    k = split_after(full, end)
    stop = full[end[k] - 2 : end[k] + 2]  # the last 2 characters of token k and the 2 after
    last = tokens_until(end, end[k] + 2)  # the token that completes it
    s = Stream("r", tok, 5, [stop], 0.0)
    deltas, ending = run(s, events(ids))
    assert len(deltas) == last  # ended by the stop string, not by the executor
    assert "".join(d.text for d in deltas[:k]) == full[: end[k] - 2]  # its first half held back
    assert "".join(d.text for d in deltas) == full[: end[k] - 2]  # ... and never sent
    assert ending is not None
    assert (ending.finish_reason, ending.stop_reason, ending.abort_upstream) == ("stop", stop, True)
    final = s.final(ending.finish_reason, ending.stop_reason, now=10.0)
    assert final.finish_reason == "stop" and final.stop_reason == stop
    assert final.usage.completion_tokens == last


def test_held_back_text_is_flushed_with_the_last_token(tok):
    ids = tok(TEXT)["input_ids"]
    full = tok.decode(ids)
    stop = full[-3:] + "!"  # the text ends with the start of the stop string, which never comes
    s = Stream("r", tok, 5, [stop], 0.0)
    deltas, ending = run(s, events(ids, finish="stop"))
    assert ending is not None and ending.finish_reason == "stop" and ending.stop_reason is None
    assert "".join(d.text for d in deltas[:-1]) == full[:-3]  # held back until the end
    assert deltas[-1].text.endswith(full[-3:])  # released by the final flush
    assert "".join(d.text for d in deltas) == full


def test_stop_strings_do_not_end_the_stream_before_min_tokens(tok):
    ids = tok(TEXT + " model again")["input_ids"]
    full, end = tok.decode(ids), ends(tok, ids)
    first, second = full.index(" model"), full.rindex(" model")
    n1 = tokens_until(end, first + len(" model"))  # tokens until the first " model" is complete
    n2 = tokens_until(end, second + len(" model"))
    assert n1 < n2
    # without min_tokens the first one ends the stream
    deltas, ending = run(Stream("r", tok, 5, [" model"], 0.0), events(ids))
    assert len(deltas) == n1 and "".join(d.text for d in deltas) == full[:first]
    # with min_tokens past it, the first one is ordinary text and the second one ends it
    s = Stream("r", tok, 5, [" model"], 0.0, min_tokens=n1 + 1)
    deltas, ending = run(s, events(ids))
    assert len(deltas) == n2 and "".join(d.text for d in deltas) == full[:second]
    assert ending is not None and ending.stop_reason == " model"
    # min_tokens beyond the stream: no stop string ends it, the executor's last token does
    s = Stream("r", tok, 5, [" model"], 0.0, min_tokens=len(ids) + 1)
    deltas, ending = run(s, events(ids))
    assert "".join(d.text for d in deltas) == full
    assert ending is not None and (ending.finish_reason, ending.stop_reason) == ("length", None)


def test_a_stop_string_that_completes_once_min_tokens_is_reached_counts(tok):
    ids = tok(TEXT)["input_ids"]
    full, end = tok.decode(ids), ends(tok, ids)
    k = split_after(full, end)
    stop = full[end[k] - 2 : end[k] + 2]  # begins in token k, complete at token n = min_tokens
    n = tokens_until(end, end[k] + 2)
    s = Stream("r", tok, 5, [stop], 0.0, min_tokens=n)
    deltas, ending = run(s, events(ids))
    assert len(deltas) == n and ending is not None and ending.stop_reason == stop
    assert "".join(d.text for d in deltas) == full[: end[k] - 2]


def test_logprobs_timings_usage_and_the_metrics_record(tok):
    ids = tok(TEXT)["input_ids"][:4]
    s = Stream("mine", tok, prompt_tokens=7, stops=[], arrival=0.5, want_logprobs=True)
    s.admitted(cached_tokens=2, queue_s=0.25)
    s.admitted(cached_tokens=3, queue_s=0.3)  # re-admitted after a preemption
    evs = events(ids)
    evs[0].logprob, evs[0].top_logprobs = -0.5, [(ids[0], -0.5), (9, -1.5)]
    evs[1].logprob = -0.25
    deltas, ending = run(s, evs)
    assert deltas[0].logprobs == [-0.5]
    assert [(t.token_id, t.logprob) for t in deltas[0].top_logprobs[0]] == [
        (ids[0], -0.5),
        (9, -1.5),
    ]
    assert deltas[1].logprobs == [-0.25] and deltas[1].top_logprobs is None
    assert deltas[2].logprobs is None  # the executor sent none for this token
    final = s.final(ending.finish_reason, None, now=4.5)
    assert final.request_id == "mine" and final.preemptions == 1
    assert (
        final.usage.prompt_tokens,
        final.usage.completion_tokens,
        final.usage.cached_tokens,
    ) == (
        7,
        4,
        3,
    )
    # tokens at t = 1, 2, 3, 4; arrival 0.5; final at 4.5
    t = final.timings
    assert (t.queue_s, t.ttft_s, t.tpot_s, t.total_s) == (0.3, 0.5, 1.0, 4.0)
    record = completed("mine@c1.x", final)
    assert record.request_id == "mine@c1.x"  # the scheduler knows the runtime-wide id
    assert (record.completion_tokens, record.e2e_s, record.finish_reason) == (4, 4.0, "length")


@settings(max_examples=300, deadline=None)
@given(
    text=st.text(alphabet="abc xy", max_size=40),
    cuts=st.lists(st.integers(0, 40), max_size=8),
    stops=st.lists(st.text(alphabet="abcxy", min_size=1, max_size=4), min_size=1, max_size=3),
    armed_from=st.integers(0, 9),
)
def test_stop_matcher_ignores_stops_that_end_before_it_is_armed(text, cuts, stops, armed_from):
    """Pieces before ``armed_from`` are unarmed: the text stops right before the first stop
    string that ends in an armed piece."""
    pieces, prev = [], 0
    for c in sorted(set(min(c, len(text)) for c in cuts)):
        pieces.append(text[prev:c])
        prev = c
    pieces.append(text[prev:])
    armed_at = len("".join(pieces[:armed_from]))  # text offset where armed text begins
    bounds = [len("".join(pieces[: i + 1])) for i in range(len(pieces))]
    m = StopMatcher(stops)
    out, matched, j = "", None, -1
    for j, p in enumerate(pieces):
        emit, matched = m.feed(p, armed=j >= armed_from)
        out += emit
        if matched:
            break
    if matched is None:
        out += m.flush()
    # where each stop string occurrence that ends in armed text ends
    ends = [
        i + len(s)
        for s in stops
        for i in range(len(text))
        if text.startswith(s, i) and i + len(s) > armed_at
    ]
    if not ends:
        assert matched is None and out == text
        return
    assert matched is not None and text.startswith(out + matched)
    end = len(out) + len(matched)
    assert end > armed_at  # it ends in armed text
    # it is found in the piece where the first such occurrence completes
    assert (bounds[j - 1] if j else 0) < min(ends) <= bounds[j] and end <= bounds[j]
