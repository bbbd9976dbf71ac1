"""Speculative decoding in the executor (gpu/spec/): n-gram drafts verified in the step's forward,
lossless. Greedy outputs are token-identical with and without speculation (and to
transformers); seeded sampling emits the same tokens too and keeps the model's distribution;
ends (stop ids, max_tokens, length) land inside accepted runs exactly; aborts and resumes keep
the KV pool whole.

Two kinds of drafts: the real proposer (``NgramTokens``), and an oracle that proposes the
reference continuation with chosen positions corrupted, so that long accepted runs and
rejections land where a test wants them, on a model whose attention matters."""

from __future__ import annotations

import math
import random
import shutil
import warnings
from collections import Counter, defaultdict
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from gpu.model_runner import ModelRunner
from messages.common import SamplingParams, StructuredOutput
from tests.support.runtime import hf_greedy

SPEC = (
    '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, '
    '"prompt_lookup_min": 1}'
)
NEAR_TIE = 1e-5


# ---------------------------------------------------------------------------------- helpers
class Oracle:
    """Drafts from the reference sequence (prompt + expected outputs): the true next tokens,
    except at the absolute positions in ``wrong`` (there the next token id instead)."""

    def __init__(self, ref: list[int], n: int, wrong: set[int] = frozenset(), vocab: int = 512):
        self.ref, self.n, self.wrong, self.vocab = ref, n, wrong, vocab

    accept = best = 0.9  # drafts kept often enough to run wherever a step has room for them
    since = 0  # verified lately: never due to explore

    def settle(self, drafted: int, accepted: int) -> None:
        pass

    def extend(self, tokens) -> None:
        self.n += len(tuple(tokens))

    def propose(self, k: int, lo: int, hi: int) -> list[int]:
        out = []
        for p in range(self.n, min(self.n + k, len(self.ref))):
            out.append((self.ref[p] + 1) % self.vocab if p in self.wrong else self.ref[p])
        return out


class Run:
    """Drives an executor as the KV manager would: a table per request (whole, or grown a block
    at a time when ``lazy``), blocks back when a request ends or is aborted."""

    def __init__(self, ex: ModelRunner, lazy: bool = False) -> None:
        self.ex, self.lazy = ex, lazy
        self.free = list(range(ex.num_blocks - 1, -1, -1))
        self.tables: dict[str, list[int]] = {}
        self.outs: dict[str, list[int]] = {}
        self.finish: dict[str, str] = {}
        self.lps: dict[str, list] = defaultdict(list)
        self.steps: list = []

    def add(self, rid, prompt, params, prior: int = 0, oracle: Oracle | None = None) -> None:
        bs = self.ex.block_size
        tokens = len(prompt) if self.lazy else len(prompt) + params.max_tokens - prior
        table = [self.free.pop() for _ in range(-(-tokens // bs))]
        self.ex.add_request(rid, prompt, params, list(table), prior_output_tokens=prior)
        self.tables[rid] = table
        self.outs.setdefault(rid, [])
        if oracle is not None:
            self.ex.requests.get(rid).ngram = oracle

    def abort(self, rid: str) -> None:
        assert self.ex.abort(rid)
        self.free.extend(self.tables.pop(rid))

    def step(self):
        res = self.ex.step()
        self.steps.append(res)
        for rid in res.skipped:
            self.grow(rid)
        for o in res.outputs:
            if o.token_id is None:
                continue
            self.outs[o.request_id].append(o.token_id)
            self.lps[o.request_id].append((o.logprob, o.top_logprobs))
            if o.finish_reason is not None:
                self.finish[o.request_id] = o.finish_reason
                self.free.extend(self.tables.pop(o.request_id))
        for rid in {o.request_id for o in res.outputs} & set(self.tables) if self.lazy else ():
            tokens = self.ex.requests.get(rid).computed + 1  # what the next step writes
            if tokens + 2 >= len(self.tables[rid]) * self.ex.block_size:
                self.grow(rid)  # a block when two slots are left: drafts often lack room
        return res

    def grow(self, rid: str) -> None:
        new = [self.free.pop()]
        self.tables[rid].extend(new)
        self.ex.extend(rid, new)

    def run(self) -> Run:
        for _ in range(10_000):
            if not self.ex.has_work():
                assert len(self.free) == self.ex.num_blocks  # every block came back
                return self
            self.step()
        raise AssertionError("executor did not finish")

    def spec_steps(self) -> list:
        return [s.spec for s in self.steps if s.num_requests]

    def accepted(self) -> int:
        return sum(s.num_accepted_tokens for s in self.spec_steps())

    def drafted(self) -> int:
        return sum(s.num_draft_tokens for s in self.spec_steps())


def executor(model_dir, speculative=SPEC, **kw) -> ModelRunner:
    kw = {"dtype": "float32", "num_blocks": 800, "spec_rows": 64, **kw}
    if not speculative:
        kw.pop("spec_rows")
    return ModelRunner(model_dir, speculative=speculative or None, **kw)


def near_tie_or_same(hf, prompt: list[int], ours: list[int], ref: list[int]) -> int:
    """0 if equal; 1 if they first differ where the model's top two logits are within
    NEAR_TIE (float rounding of another batch shape may pick either); else fail."""
    if ours == ref:
        return 0
    j = next((i for i, (a, b) in enumerate(zip(ours, ref, strict=False)) if a != b), None)
    assert j is not None, f"one is a prefix of the other: {ours} vs {ref}"
    with torch.inference_mode():
        logits = hf(torch.tensor([prompt + ref[:j]])).logits[0, -1].double()
    gap = float(logits.topk(2).values.diff().abs()[0])
    assert gap < NEAR_TIE, f"diverged at output {j} (gap {gap:.3g}): {ours} vs {ref}"
    warnings.warn(f"near-tie divergence at output {j}", stacklevel=2)
    return 1


def repeating(rng: random.Random, n: int) -> list[list[int]]:
    """Prompts that repeat themselves (a short pattern, several times), so drafts are found."""
    out = []
    for _ in range(n):
        pat = [rng.randrange(512) for _ in range(rng.randint(2, 9))]
        out.append((pat * 12)[: rng.randint(12, 80)])
    return out


@pytest.fixture(scope="module")
def bigram_model(tiny_model, tmp_path_factory) -> Path:
    """The tiny model with its attention output zeroed: each next-token distribution depends on
    the current token only (a Markov chain), so outputs cycle and drafts are often accepted,
    and the distribution after a token is known exactly."""
    out = tmp_path_factory.mktemp("bigram") / "model"
    shutil.copytree(tiny_model, out)
    w = load_file(str(tiny_model / "model.safetensors"))
    for k in w:
        if k.endswith("o_proj.weight"):
            w[k] = torch.zeros_like(w[k])
    save_file(w, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


# ---------------------------------------------------------------------------------- greedy
def test_greedy_with_ngram_drafts_is_token_identical(tiny_model):
    rng = random.Random(3)
    prompts = repeating(rng, 8) + [[rng.randrange(512) for _ in range(40)] for _ in range(4)]
    params = [
        SamplingParams(max_tokens=rng.randint(20, 60), stop_token_ids=[rng.randrange(512)])
        for _ in prompts
    ]
    runs = []
    for spec in ("", SPEC):
        r = Run(executor(tiny_model, spec), lazy=True)
        for i, (p, sp) in enumerate(zip(prompts, params, strict=True)):
            r.add(f"r{i}", p, sp)
        runs.append(r.run())
    plain, spec = runs
    assert spec.accepted() > 0 and spec.drafted() > spec.accepted()  # some accepted, some not
    hf = AutoModelForCausalLM.from_pretrained(str(tiny_model), dtype=torch.float32)
    ties = 0
    for i, p in enumerate(prompts):
        rid = f"r{i}"
        tie = near_tie_or_same(hf, p, spec.outs[rid], plain.outs[rid])
        assert tie or spec.finish[rid] == plain.finish[rid]
        ties += tie
    assert ties <= 1
    # and transformers' greedy generate, for a few (its stops: the model's EOS ids)
    eos_only = Run(executor(tiny_model))
    for i, p in enumerate(prompts[:4]):
        eos_only.add(f"r{i}", p, SamplingParams(max_tokens=30))
    eos_only.run()
    for i, ref in enumerate(hf_greedy(tiny_model, prompts[:4], 30)):
        near_tie_or_same(hf, prompts[i], eos_only.outs[f"r{i}"], ref)


def reference(model_dir, prompts, params) -> Run:
    r = Run(executor(model_dir, ""))
    for i, p in enumerate(prompts):
        r.add(f"r{i}", p, params[i] if isinstance(params, list) else params)
    return r.run()


def test_oracle_drafts_accepted_runs_and_rejections(tiny_model):
    rng = random.Random(5)
    prompts = [[rng.randrange(512) for _ in range(rng.randint(3, 30))] for _ in range(6)]
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    ref = reference(tiny_model, prompts, params)
    r = Run(executor(tiny_model))
    for i, p in enumerate(prompts):
        full = p + ref.outs[f"r{i}"]
        wrong = {len(p) + j for j in range(40) if rng.random() < 0.15}
        r.add(f"r{i}", p, params, oracle=Oracle(full, len(p), wrong))
    r.run()
    assert r.outs == ref.outs
    assert all(f == "length" for f in r.finish.values())
    assert r.accepted() > 100 and r.drafted() > r.accepted()
    assert max(s.k for s in r.spec_steps()) == 4
    assert len(r.steps) < len(ref.steps) / 2
    # every step: its decode rows, drafts and prompt tokens within the step budget and the
    # cost model's rows
    for s in r.steps:
        rows = s.num_decode_tokens + s.num_prefill_tokens + s.spec.num_draft_tokens
        assert rows <= r.ex.budget.step_budget
        assert not s.spec.num_draft_tokens or rows <= r.ex.spec_cost.limit


def test_ends_inside_an_accepted_run(tiny_model):
    """max_tokens and a stop id that fall inside a run of accepted drafts end the request there,
    with the right reason and count; nothing after them is emitted."""
    rng = random.Random(7)
    prompt = [rng.randrange(512) for _ in range(12)]
    long = reference(tiny_model, [prompt], SamplingParams(max_tokens=30, ignore_eos=True))
    outs = long.outs["r0"]
    full = prompt + outs
    stop = next(t for t in outs[5:] if t not in outs[:5])  # a token first emitted past the 5th
    cut = outs.index(stop) + 1
    cases = [  # max_tokens caps the drafts: 1 at prefill, then 1 + 4 drafts
        (SamplingParams(max_tokens=6, ignore_eos=True), outs[:6], "length"),
        (SamplingParams(max_tokens=30, ignore_eos=True, stop_token_ids=[stop]), outs[:cut], "stop"),
    ]
    for params, want, reason in cases:
        r = Run(executor(tiny_model))
        r.add("r0", prompt, params, oracle=Oracle(full, len(prompt)))
        r.run()
        assert r.outs["r0"] == want and r.finish["r0"] == reason
        last = r.steps[-1].outputs
        assert last[-1].finish_reason == reason and len(last) > 1  # ended mid-run
        assert last[-1].num_output_tokens == len(want)


def test_length_limit_caps_drafts(tiny_model):
    """max_model_len: a request near it verifies fewer drafts and ends with "length" there."""
    rng = random.Random(8)
    prompt = [rng.randrange(512) for _ in range(20)]
    ref = Run(executor(tiny_model, "", max_model_len=32))
    ref.add("r0", prompt, SamplingParams(max_tokens=100, ignore_eos=True))
    ref.run()
    assert len(ref.outs["r0"]) == 12 and ref.finish["r0"] == "length"
    r = Run(executor(tiny_model, max_model_len=32))
    oracle = Oracle(prompt + ref.outs["r0"] + [1] * 50, len(prompt))  # would propose past it
    r.add("r0", prompt, SamplingParams(max_tokens=100, ignore_eos=True), oracle=oracle)
    r.run()
    assert r.outs == ref.outs and r.finish == ref.finish
    assert r.accepted() > 0


def test_mixed_batch_of_speculating_decodes_and_prefill_chunks(tiny_model):
    rng = random.Random(11)
    prompts = [[rng.randrange(512) for _ in range(rng.randint(5, 60))] for _ in range(8)]
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    ref = reference(tiny_model, prompts, params)
    r = Run(executor(tiny_model, chunk_cap=7, step_budget=24), lazy=True)
    pending = list(enumerate(prompts))
    while pending or r.ex.has_work():
        if pending and len(r.steps) % 3 == 0:  # a new prompt every third step
            i, p = pending.pop(0)
            r.add(f"r{i}", p, params, oracle=Oracle(p + ref.outs[f"r{i}"], len(p), {len(p) + 9}))
        r.step()
    assert r.outs == ref.outs
    steps = [s for s in r.steps if s.num_requests]
    mixed = [s for s in steps if s.spec.num_draft_tokens and s.num_prefill_tokens]
    assert len(mixed) >= 3
    for s in steps:
        rows = s.num_decode_tokens + s.num_prefill_tokens + s.spec.num_draft_tokens
        assert rows <= 24
    assert len(r.free) == r.ex.num_blocks


def test_abort_and_resume_mid_run(tiny_model):
    """An abort (the executor's preemption) between speculating steps, then the request resumed
    with its outputs as prior: the same tokens as never interrupted; the KV pool whole."""
    rng = random.Random(13)
    prompts = repeating(rng, 3)
    params = SamplingParams(max_tokens=30, ignore_eos=True)
    ref = reference(tiny_model, prompts, params)
    r = Run(executor(tiny_model))
    for i, p in enumerate(prompts):
        r.add(f"r{i}", p, params, oracle=Oracle(p + ref.outs[f"r{i}"], len(p), {len(p) + 6}))
    while len(r.outs["r1"]) < 8:
        r.step()
    assert r.accepted() > 0
    done = r.outs["r1"]
    r.abort("r1")
    assert "r1" not in r.ex.requests and r.ex.num_requests() == 2
    r.step()  # the others go on
    resumed = prompts[1] + done
    oracle = Oracle(prompts[1] + ref.outs["r1"], len(resumed))
    r.add("r1", resumed, params, prior=len(done), oracle=oracle)
    r.run()  # asserts every block came back
    assert r.outs == ref.outs
    assert r.ex.num_requests() == 0 and not r.ex.has_work()


def test_processors_penalties_and_logprobs_speculate_exactly(tiny_model):
    """logit_bias, min_tokens, logprobs and the penalties under verification: every request
    speculates and emits what it emits without, greedy or seeded; a penalised draft row counts
    the drafts before it (without them it would sample another token where a draft repeats)."""
    rng = random.Random(17)
    prompts = [[rng.randrange(512) for _ in range(10)] for _ in range(7)]
    bias = {int(t): 2.0 for t in rng.sample(range(512), 40)}
    seeded = {"temperature": 0.9, "seed": 11}
    params = [
        SamplingParams(max_tokens=20, logit_bias=bias, logprobs=2),
        SamplingParams(max_tokens=20, min_tokens=15, stop_token_ids=[3, 4, 5], logprobs=0),
        SamplingParams(max_tokens=30, ignore_eos=True, repetition_penalty=1.3),
        SamplingParams(max_tokens=30, ignore_eos=True, frequency_penalty=1.5, logprobs=1),
        SamplingParams(max_tokens=30, ignore_eos=True, presence_penalty=2.0),
        SamplingParams(max_tokens=30, ignore_eos=True, frequency_penalty=0.8, **seeded),
        SamplingParams(max_tokens=30, ignore_eos=True, repetition_penalty=1.5, **seeded),
    ]
    ref = reference(tiny_model, prompts, params)
    r = Run(executor(tiny_model))
    for i, p in enumerate(prompts):
        r.add(f"r{i}", p, params[i])
        r.ex.requests.get(f"r{i}").ngram = Oracle(p + ref.outs[f"r{i}"], len(p), {len(p) + 4})
    r.run()
    assert r.outs == ref.outs and r.finish == ref.finish
    sped = {rid for s in r.spec_steps() for rid, _, _ in s.per_request}
    assert sped == {f"r{i}" for i in range(7)}
    assert r.accepted() > 100
    for rid in ("r0", "r1", "r3"):
        for (lp, top), (lp0, top0) in zip(r.lps[rid], ref.lps[rid], strict=True):
            assert lp == pytest.approx(lp0, abs=1e-5)
            assert [t for t, _ in top] == [t for t, _ in top0]


def test_structured_output_speculates_within_its_grammar(tiny_model):
    """A constrained request drafts only what its grammar accepts, each draft row masked as the
    grammar stands after the drafts before it: greedy and seeded, it emits what it emits without
    speculation; a proposal the grammar refuses at once is not verified ("grammar")."""
    rng = random.Random(29)
    schema = {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 12},
            "n": {"type": "integer", "minimum": 0, "maximum": 999},
            "tags": {"type": "array", "items": {"enum": ["ab", "cd"]}, "maxItems": 4},
        },
        "required": ["name", "n", "tags"],
        "additionalProperties": False,
    }
    shapes = [
        StructuredOutput(json_schema=schema),
        StructuredOutput(regex=r"([a-z]{2,5}-[0-9]{2} ){3,6}end"),
    ]
    samplings = [{}, {"temperature": 1.0, "seed": 7}, {"temperature": 0.8, "top_p": 0.9, "seed": 8}]
    prompts, params = [], []
    for i in range(7):
        prompts.append([rng.randrange(3, 500) for _ in range(rng.randint(4, 20))])
        params.append(SamplingParams(max_tokens=90, structured=shapes[i % 2], **samplings[i % 3]))
    ref = reference(tiny_model, prompts, params)
    assert set(ref.finish.values()) == {"stop"}  # every answer completed its grammar
    r = Run(executor(tiny_model))
    for i, p in enumerate(prompts):
        wrong = {len(p) + 3, len(p) + 10, len(p) + 17}  # some drafts the model (or grammar) refuses
        r.add(f"r{i}", p, params[i], oracle=Oracle(p + ref.outs[f"r{i}"], len(p), wrong))
    r.ex.requests.get("r6").ngram = None  # one constrained request beside them never drafts
    r.run()
    assert r.outs == ref.outs and r.finish == ref.finish
    per = Counter()
    for s in r.spec_steps():
        for rid, _, acc in s.per_request:
            per[rid] += acc
    assert set(per) == {f"r{i}" for i in range(6)} and all(per.values())  # each sped up
    assert r.accepted() < r.drafted()  # and some drafts were refused
    # a first draft the grammar refuses is never verified
    alone = Run(executor(tiny_model))
    alone.add("r0", prompts[0], params[0])
    matcher = alone.ex.requests.get("r0").grammar.matcher
    refused = next(t for t in range(512) if matcher.validate_tokens([t]) == 0)
    alone.ex.requests.get("r0").ngram = Oracle(prompts[0] + [refused] * 200, len(prompts[0]))
    alone.run()
    assert alone.outs["r0"] == ref.outs["r0"] and alone.drafted() == 0
    assert "grammar" in {s.off for s in alone.spec_steps()}


def test_batch_past_its_drafting_rows_turns_speculation_off(tiny_model):
    rng = random.Random(19)
    prompts = repeating(rng, 6)
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    r = Run(executor(tiny_model, spec_rows=4))
    for i, p in enumerate(prompts):
        r.add(f"r{i}", p, params)
    r.run()
    offs = [s.spec.off for s in r.steps if s.num_decode_tokens >= 4]
    assert offs and all(o == "cost" for o in offs)
    assert all(s.num_decode_tokens + s.spec.num_draft_tokens <= 4 for s in r.steps if s.spec.k)


# ---------------------------------------------------------------------------------- sampling
def test_seeded_sampling_same_tokens_with_and_without_speculation(bigram_model):
    """Verification draws from the same (seed, output index) noise as plain sampling: a seeded
    request emits the same tokens with or without drafts, alone or in a batch."""
    rng = random.Random(23)
    prompts = [[rng.randrange(512) for _ in range(8)] for _ in range(6)]
    params = [
        SamplingParams(max_tokens=60, ignore_eos=True, temperature=0.2, seed=100 + i, top_p=0.95)
        for i in range(6)
    ]
    ref = reference(bigram_model, prompts, params)
    batched = Run(executor(bigram_model))
    for i, p in enumerate(prompts):
        batched.add(f"r{i}", p, params[i])
    batched.run()
    assert batched.outs == ref.outs
    assert batched.accepted() > 20
    alone = Run(executor(bigram_model))
    alone.add("r3", prompts[3], params[3])
    alone.run()
    assert alone.outs["r3"] == ref.outs["r3"]


def _chi2_critical(df: int, z: float = 5.0) -> float:
    """The chi-square quantile at the normal quantile ``z`` (Wilson-Hilferty); z=5: p ~ 3e-7."""
    a = 2 / (9 * df)
    return df * (1 - a + z * math.sqrt(a)) ** 3


def test_speculative_sampling_keeps_the_distribution(bigram_model):
    """Tokens emitted by speculating steps, grouped by the token before them, against the
    model's softmax after that token (the bigram model's next-token law does not depend on
    anything else): a pooled chi-square test, fixed seeds (deterministic), generous bound.
    A verifier that accepts every draft fails it by far (checked below)."""
    temp = 0.3
    hf = AutoModelForCausalLM.from_pretrained(str(bigram_model), dtype=torch.float32)

    def pairs(ex: ModelRunner) -> dict[int, Counter]:
        rng = random.Random(29)
        r = Run(ex)
        seq = {}
        for i in range(200):
            p = [rng.randrange(512) for _ in range(8)]
            params = SamplingParams(max_tokens=80, ignore_eos=True, temperature=temp, seed=i)
            r.add(f"r{i}", p, params)
            seq[f"r{i}"] = list(p)
        got: dict[int, Counter] = defaultdict(Counter)
        while ex.has_work():
            res = r.step()
            sped = {rid for rid, _, _ in res.spec.per_request}
            for o in res.outputs:
                if o.request_id in sped:
                    got[seq[o.request_id][-1]][o.token_id] += 1
                seq[o.request_id].append(o.token_id)
        return got

    def chi2(got: dict[int, Counter]) -> tuple[float, int, int]:
        stat, df, n_all = 0.0, 0, 0
        for x, c in got.items():
            n = sum(c.values())
            if n < 20:
                continue
            with torch.inference_mode():
                p = torch.softmax(hf(torch.tensor([[x]])).logits[0, -1].double() / temp, -1)
            cats = [t for t in p.argsort(descending=True).tolist() if n * float(p[t]) >= 5]
            exp = [n * float(p[t]) for t in cats]
            obs = [c[t] for t in cats]
            if n - sum(exp) >= 5:  # the rest as one more category, else into the last one
                exp.append(n - sum(exp))
                obs.append(n - sum(obs))
            else:
                exp[-1] += n - sum(exp)
                obs[-1] += n - sum(obs)
            stat += sum((o - e) ** 2 / e for o, e in zip(obs, exp, strict=True))
            df += len(cats) - 1
            n_all += n
        return stat, df, n_all

    ex = executor(bigram_model, step_budget=4096, spec_rows=256, num_blocks=2000)
    stat, df, n = chi2(pairs(ex))
    assert n > 400 and df >= 10
    assert stat < _chi2_critical(df), (stat, df)

    biased = executor(bigram_model, step_budget=4096, spec_rows=256, num_blocks=2000)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr("gpu.model_runner.accepted", lambda targets, drafts: len(drafts))
        bad, bad_df, _ = chi2(pairs(biased))
    assert bad > 3 * _chi2_critical(bad_df)
