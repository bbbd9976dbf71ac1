"""Incremental detokenization and stop strings (pure, on the tiny model's tokenizer)."""

from __future__ import annotations

import random

from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import AutoTokenizer

from tokenizer_svc.detok import IncrementalDetokenizer
from tokenizer_svc.stops import StopMatcher


def test_deltas_concatenate_to_decode_and_never_split_characters(tiny_model):
    tok = AutoTokenizer.from_pretrained(tiny_model)
    text = "hello 你好 world 😀 café naïve 東京 🚀 the end"
    ids = tok(text)["input_ids"]
    d = IncrementalDetokenizer(tok)
    deltas = [d.push(t) for t in ids]
    deltas.append(d.flush())
    assert "".join(deltas) == text
    assert all("\ufffd" not in x for x in deltas)


def test_random_token_streams_round_trip(tiny_model):
    tok = AutoTokenizer.from_pretrained(tiny_model)
    assert IncrementalDetokenizer(tok)._backend is not None  # the fast path is the one checked
    rng = random.Random(0)
    for _ in range(50):
        ids = [rng.randrange(3, len(tok)) for _ in range(rng.randint(1, 40))]
        d = IncrementalDetokenizer(tok)
        out = "".join(d.push(t) for t in ids) + d.flush()
        assert out == tok.decode(ids, skip_special_tokens=True)


@settings(max_examples=300, deadline=None)
@given(
    text=st.text(alphabet="abc xy", max_size=40),
    cuts=st.lists(st.integers(0, 40), max_size=8),
    stops=st.lists(st.text(alphabet="abcxy", min_size=1, max_size=4), min_size=1, max_size=3),
)
def test_stop_matcher_emits_text_up_to_first_stop(text, cuts, stops):
    pieces, prev = [], 0
    for c in sorted(set(min(c, len(text)) for c in cuts)):
        pieces.append(text[prev:c])
        prev = c
    pieces.append(text[prev:])
    m = StopMatcher(stops)
    out, matched = "", None
    for p in pieces:
        emit, matched = m.feed(p)
        out += emit
        if matched:
            break
    if matched is None:
        out += m.flush()
    if any(s in text for s in stops):
        # streaming semantics: the text stops right before the first stop string that completes
        assert matched in stops and text.startswith(out + matched)
        assert not any(s in out for s in stops)
    else:
        assert matched is None and out == text
