"""Logit processors (penalties, logit_bias, min_tokens): each exact against a reference."""

from __future__ import annotations

import random
from collections import Counter

import torch
from transformers.generation.logits_process import (
    MinNewTokensLengthLogitsProcessor,
    RepetitionPenaltyLogitsProcessor,
)

from gpu.logits_processors import LogitsProcessors, apply_processors
from messages.common import SamplingParams

VOCAB = 64
CPU = torch.device("cpu")
STOP = {0, 2, 9}


def _logits(rows: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rows, VOCAB, generator=g) * 3  # positive and negative logits


def _history(seed: int, prompt_len: int, out_len: int) -> tuple[list[int], list[int]]:
    """A prompt and an output with repeats, the output overlapping the prompt."""
    rng = random.Random(seed)
    prompt = [rng.randrange(3, 30) for _ in range(prompt_len)]
    out = [rng.randrange(20, 40) for _ in range(out_len)]
    return prompt, out


def _built(params: SamplingParams, prompt: list[int], out: list[int], prior: int = 0):
    """Processors of a request whose first ``prior`` outputs came with its (resumed) prompt and
    whose other outputs were observed one by one."""
    procs = LogitsProcessors.build(params, prompt + out[:prior], prior, STOP, VOCAB, CPU)
    assert procs is not None
    for t in out[prior:]:
        procs.observe(t)
    return procs


def _ref_penalties(row: torch.Tensor, out: list[int], freq: float, pres: float) -> torch.Tensor:
    """OpenAI's definition, token by token: ``logit -= f * count + p * (count > 0)``."""
    ref = row.clone()
    for t, c in Counter(out).items():
        ref[t] -= freq * c + pres
    return ref


def _ref_bias(row: torch.Tensor, bias: dict[int, float]) -> torch.Tensor:
    ref = row.clone()
    for t, b in bias.items():
        ref[t] += b
    return ref


def test_defaults_build_nothing():
    assert LogitsProcessors.build(SamplingParams(), [1, 2, 3], 0, STOP, VOCAB, CPU) is None
    # min_tokens already met by the prior outputs, or no stop ids to hold back: nothing to do
    done = SamplingParams(min_tokens=2)
    assert LogitsProcessors.build(done, [1, 2, 3], 2, STOP, VOCAB, CPU) is None
    assert LogitsProcessors.build(done, [1, 2, 3], 0, set(), VOCAB, CPU) is None


def test_repetition_penalty_matches_transformers():
    logits = _logits(4, seed=1)
    cases = {0: 1.3, 2: 0.7, 3: 2.0}  # row 1 has no processors
    rows, hist = [], {}
    for i, pen in cases.items():
        prompt, out = _history(i, 12, 9)
        hist[i] = prompt + out
        rows.append((i, _built(SamplingParams(repetition_penalty=pen), prompt, out, prior=i), 9))
    got = apply_processors(logits, rows)
    for i, pen in cases.items():
        ref = RepetitionPenaltyLogitsProcessor(pen)(torch.tensor([hist[i]]), logits[i : i + 1])
        assert torch.equal(got[i], ref[0]), i
    assert torch.equal(got[1], logits[1])
    assert not torch.equal(got[0], logits[0])


def test_frequency_and_presence_penalties_match_the_reference():
    logits = _logits(3, seed=2)
    cases = {0: (0.5, 0.0), 1: (0.0, -1.5), 2: (1.7, 0.3)}
    rows, outs = [], {}
    for i, (freq, pres) in cases.items():
        prompt, out = _history(10 + i, 15, 12)
        outs[i] = out
        params = SamplingParams(frequency_penalty=freq, presence_penalty=pres)
        rows.append((i, _built(params, prompt, out, prior=4 * i), 12))
    got = apply_processors(logits, rows)
    for i, (freq, pres) in cases.items():
        # prompt tokens do not count, generated ones (before and after a preemption) do
        assert torch.equal(got[i], _ref_penalties(logits[i], outs[i], freq, pres)), i


def test_logit_bias_matches_the_reference():
    logits = _logits(2, seed=3)
    bias = {5: 100.0, 6: -100.0, 63: 0.25, 0: -3.5}
    procs = _built(SamplingParams(logit_bias=bias), [1, 2], [])
    got = apply_processors(logits, [(1, procs, 0)])
    assert torch.equal(got[1], _ref_bias(logits[1], bias))
    assert torch.equal(got[0], logits[0])
    assert int(got[1].argmax()) == 5


def test_min_tokens_matches_transformers():
    logits = _logits(1, seed=4)
    prompt = [7, 8, 9, 10]
    params = SamplingParams(min_tokens=3, max_tokens=8)
    ref_proc = MinNewTokensLengthLogitsProcessor(len(prompt), 3, sorted(STOP))
    for prior in (0, 1):
        out = [11, 12, 13, 14]
        procs = LogitsProcessors.build(params, prompt + out[:prior], prior, STOP, VOCAB, CPU)
        assert procs is not None
        for n in range(prior, len(out) + 1):
            got = apply_processors(logits, [(0, procs, n)])
            ref = ref_proc(torch.tensor([prompt + out[:n]]), logits)
            assert torch.equal(got, ref), (prior, n)
            banned = torch.isinf(got[0]).nonzero().flatten().tolist()
            assert banned == (sorted(STOP) if n < 3 else []), (prior, n)
            if n < len(out):
                procs.observe(out[n])


def test_processors_compose_in_vllm_order():
    """bias, then the min_tokens mask, then repetition, then frequency/presence."""
    logits = _logits(3, seed=5)
    prompt, out = _history(7, 20, 6)
    bias = {21: 2.5, 30: -4.0, 2: 50.0}
    params = SamplingParams(
        logit_bias=bias,
        min_tokens=10,
        max_tokens=16,
        repetition_penalty=1.4,
        frequency_penalty=0.6,
        presence_penalty=0.2,
    )
    got = apply_processors(logits, [(2, _built(params, prompt, out, prior=2), len(out))])
    ref = _ref_bias(logits[2], bias)[None]
    ref = MinNewTokensLengthLogitsProcessor(len(prompt), 10, sorted(STOP))(
        torch.tensor([prompt + out]), ref
    )
    ref = RepetitionPenaltyLogitsProcessor(1.4)(torch.tensor([prompt + out]), ref)
    ref = _ref_penalties(ref[0], out, 0.6, 0.2)
    assert torch.equal(got[2], ref)
    assert torch.equal(got[:2], logits[:2])


def test_allowed_token_ids_match_transformers_prefix_constraint():
    from transformers.generation.logits_process import PrefixConstrainedLogitsProcessor

    logits = _logits(2, seed=11)
    prompt, out = _history(3, 10, 4)
    allowed = [5, 17, 40, 63]
    got = apply_processors(
        logits, [(1, _built(SamplingParams(allowed_token_ids=allowed), prompt, out), 4)]
    )
    ref = PrefixConstrainedLogitsProcessor(lambda _b, _ids: allowed, 1)(
        torch.tensor([prompt + out]), logits[1:2].clone()
    )
    assert torch.equal(got[1], ref[0]) and torch.equal(got[0], logits[0])
    assert torch.isinf(got[1]).sum() == VOCAB - len(allowed)


def test_bad_words_match_transformers_on_the_output():
    """A one-token word is banned always; a longer word's last token only where the output ends
    with its other tokens (matched on the output, as vLLM does, not the prompt)."""
    from transformers.generation.logits_process import NoBadWordsLogitsProcessor

    logits = _logits(1, seed=13)
    prompt, out = _history(5, 10, 6)
    words = [[7], [out[-2], out[-1], 44], [out[-1], 45], [12, 46], [prompt[-1], out[0], 47]]
    params = SamplingParams(bad_words_ids=words)
    for prior in (0, 3):  # resumed after a preemption: its earlier outputs came with the prompt
        got = apply_processors(logits, [(0, _built(params, prompt, out, prior), len(out))])
        ref = NoBadWordsLogitsProcessor(words, eos_token_id=None)(
            torch.tensor([out]), logits.clone()
        )
        assert torch.equal(got, ref)
        assert {t for t in range(VOCAB) if torch.isinf(got[0, t])} == {7, 44, 45}
    # a draft row: the drafts before it count as output
    procs = _built(params, prompt, out)
    got = apply_processors(logits, [(0, procs, len(out))], pending=[[12]])
    assert torch.isinf(got[0, 46]) and not torch.isinf(got[0, 45])
