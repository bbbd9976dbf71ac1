"""Structured output below the executor: the constraint's canonical form, the bounded compile
cache, whitespace styles and the bitmask's application to the constrained rows only."""

from __future__ import annotations

import json
import re

import msgspec
import pytest
import torch
from transformers import AutoTokenizer

from actors.shared.grammar import GrammarCache, GrammarError, constraint_of, hf_llg_tokenizer
from gpu.structured.masks import GrammarState, Masker
from messages.common import SamplingParams, StructuredOutput, validate_params

SCHEMA = {
    "type": "object",
    "properties": {
        "a": {"type": "integer", "minimum": 0, "maximum": 9},
        "b": {"type": "array", "items": {"enum": ["x", "y"]}, "maxItems": 3},
    },
    "required": ["a", "b"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def hf(tiny_model):
    return AutoTokenizer.from_pretrained(tiny_model)


@pytest.fixture(scope="module")
def llg_tok(hf):
    return hf_llg_tokenizer(hf, 512, [hf.eos_token_id])


def test_the_wire_struct_round_trips_and_is_validated():
    p = SamplingParams(structured=StructuredOutput(json_schema=SCHEMA, whitespace="spaces"))
    back = msgspec.msgpack.decode(msgspec.msgpack.encode(p), type=SamplingParams)
    assert back == p and validate_params(back) is None
    bad = msgspec.msgpack.encode({"structured": {"regex": "a", "whitespace": "lots"}})
    with pytest.raises(msgspec.ValidationError, match="whitespace"):
        msgspec.msgpack.decode(bad, type=SamplingParams)
    cases = [
        (StructuredOutput(), "structured"),
        (StructuredOutput(regex="a", json_object=True), "structured"),
        (StructuredOutput(regex=""), "structured.regex"),
        (StructuredOutput(choice=[]), "structured.choice"),
        (StructuredOutput(json_schema={"a": b"bytes"}), "structured.json_schema"),
        (StructuredOutput(grammar="x" * (300 * 1024)), "structured.grammar"),
        (StructuredOutput(choice=["a"], whitespace="flexible"), "structured.whitespace"),
    ]
    for s, field in cases:
        got = validate_params(SamplingParams(structured=s))
        assert got is not None and got[0] == field, (s, got)


def test_canonical_form_keeps_property_order():
    a = constraint_of(StructuredOutput(json_schema={"type": "object", "x": 1}))
    b = constraint_of(StructuredOutput(json_schema={"type": "object", "x": 1}))
    c = constraint_of(StructuredOutput(json_schema={"x": 1, "type": "object"}))
    assert a.key == b.key and a.digest == b.digest
    assert a.key != c.key  # property order is the output's order: not the same constraint
    spaced = constraint_of(
        StructuredOutput(json_schema={"type": "object", "x": 1}, whitespace="spaces")
    )
    assert spaced.key != a.key


def test_cache_counts_hits_and_misses_and_stays_bounded(llg_tok):
    made = []

    def tokenizer():
        made.append(1)
        return llg_tok

    cache = GrammarCache(tokenizer, capacity=2)
    s1, s2, s3 = (StructuredOutput(regex=r) for r in ("a+", "b+", "c+"))
    first, hit = cache.compile(s1)
    assert not hit and (cache.hits, cache.misses) == (0, 1)
    again, hit = cache.compile(StructuredOutput(regex="a+"))
    assert hit and again is first and (cache.hits, cache.misses) == (1, 1)
    cache.compile(s2)
    cache.compile(s3)  # evicts s1, the least recently used
    assert len(cache) == 2 and cache.misses == 3
    assert not cache.compile(s1)[1]
    # failures are cached too: a bad schema sent again is not compiled again
    bad = StructuredOutput(json_schema={"type": "string", "uniqueItems": True})
    for expect_hit in (False, True):
        before = cache.hits
        with pytest.raises(GrammarError) as info:
            cache.compile(bad)
        assert info.value.field == "structured.json_schema" and "uniqueItems" in info.value.reason
        assert (cache.hits > before) == expect_hit
    assert made == [1]  # the tokenizer is built once, on first use


def _generate(compiled, tok, n: int = 200, seed: int = 0) -> str:
    """Greedy decode from random logits under the grammar (no model)."""
    masker = Masker(512, [tok.eos_token_id], torch.device("cpu"), threads=1)
    state = GrammarState(compiled, [])
    gen = torch.Generator().manual_seed(seed)
    out: list[int] = []
    for _ in range(n):
        logits = masker.apply(
            torch.randn(1, 512, generator=gen), [0], masker.fill([state], [False])
        )
        t = int(logits.argmax())
        assert state.advance(t)
        out.append(t)
        if state.stopped:
            break
    assert state.stopped
    return tok.decode(out, skip_special_tokens=True)


def test_whitespace_styles(llg_tok, hf):
    cache = GrammarCache(lambda: llg_tok)
    outside = re.compile(r'"(?:[^"\\]|\\.)*"')  # strings removed: what lies between tokens
    for seed in range(5):
        compact = _generate(cache.compile(StructuredOutput(json_schema=SCHEMA))[0], hf, seed=seed)
        assert json.loads(compact) and not re.search(r"\s", outside.sub("", compact))
        spaced = _generate(
            cache.compile(StructuredOutput(json_schema=SCHEMA, whitespace="spaces"))[0],
            hf,
            seed=seed,
        )
        assert json.dumps(json.loads(spaced)) == spaced  # Python's default ", " and ": "
        flex = _generate(
            cache.compile(StructuredOutput(json_schema=SCHEMA, whitespace="flexible"))[0],
            hf,
            seed=seed,
        )
        json.loads(flex)
        assert max((len(m) for m in re.findall(r"\s+", outside.sub("S", flex))), default=0) <= 4


def test_mask_touches_constrained_rows_only(llg_tok, hf):
    cache = GrammarCache(lambda: llg_tok)
    state = GrammarState(cache.compile(StructuredOutput(choice=["hello"]))[0], [])
    masker = Masker(512, [hf.eos_token_id], torch.device("cpu"), threads=1)
    logits = torch.randn(3, 512)
    out = masker.apply(logits, [1], masker.fill([state], [False]))
    assert torch.equal(out[0], logits[0]) and torch.equal(out[2], logits[2])
    allowed = torch.isfinite(out[1]).nonzero().flatten().tolist()
    assert allowed and all("hello".startswith(hf.decode([t])) for t in allowed)
    assert torch.equal(out[1][allowed], logits[1][allowed])
    wide = masker.apply(torch.randn(1, 520), [0], masker.fill([state], [False]))
    assert torch.isinf(wide[0, 512:]).all()  # padded logits beyond the vocabulary: never allowed


def test_ban_of_eos_clears_high_bits_and_keeps_a_lone_eos():
    masker = Masker(64, [31, 63], torch.device("cpu"), threads=1)
    row = torch.full((2,), -1, dtype=torch.int32)  # every token allowed
    masker._drop_eos(row)
    assert row.tolist() == [0x7FFFFFFF, 0x7FFFFFFF]
    lone = torch.tensor([-(1 << 31), 0], dtype=torch.int32)  # only token 31 (an EOS)
    masker._drop_eos(lone)
    assert lone.tolist() == [-(1 << 31), 0]
