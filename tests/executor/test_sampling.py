"""Sampling: filters, seeded determinism, batch independence, preemption safety, and the
penalties, logit_bias and min_tokens end to end through the executor."""

from __future__ import annotations

import pytest
import torch

from gpu.logits_processors import LogitsProcessors, apply_processors
from gpu.model_runner import ModelRunner
from gpu.sampling import cut_floors, sample
from messages.common import SamplingParams, validate_params

LOGITS = torch.tensor([2.0, 1.5, 1.0, 0.5, 0.0, -0.5, -1.0, -3.0])
# Chi-square critical values at p = 0.001 by degrees of freedom.
CHI2_001 = {
    1: 10.83,
    2: 13.82,
    3: 16.27,
    4: 18.47,
    5: 20.52,
    6: 22.46,
    7: 24.32,
    8: 26.12,
    9: 27.88,
}


def _expected(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0) -> torch.Tensor:
    """The target distribution, computed independently of the sampler (sorted, explicit sets)."""
    p = torch.softmax(LOGITS.double() / temperature, -1)
    order = p.argsort(descending=True).tolist()
    if top_k:
        p[order[top_k:]] = 0.0
        p = p / p.sum()
    keep = torch.zeros_like(p, dtype=torch.bool)
    mass = 0.0
    for i in order:
        if mass >= top_p or p[i] == 0:
            break
        keep[i] = True
        mass += float(p[i])
    q = torch.where(keep, p, 0.0)
    q = q / q.sum()
    q = torch.where(q >= min_p * q.max(), q, 0.0)
    return q / q.sum()


def _draw(params: SamplingParams, n: int = 20000) -> torch.Tensor:
    logits = LOGITS.repeat(n, 1)
    toks = sample(logits, [params] * n, list(range(n)), [7] * n)
    return torch.bincount(toks, minlength=LOGITS.numel()).double()


@pytest.mark.parametrize(
    "kw",
    [
        dict(temperature=1.0),
        dict(temperature=0.6),
        dict(temperature=1.5, top_p=0.8),
        dict(temperature=1.0, min_p=0.2),
        dict(temperature=1.0, top_k=3),
        dict(temperature=0.8, top_k=5, top_p=0.9, min_p=0.1),
    ],
)
def test_sampled_frequencies_fit_the_distribution(kw):
    _chi2_fits(_draw(SamplingParams(**kw)), _expected(**kw))


def _chi2_fits(counts: torch.Tensor, expected: torch.Tensor) -> None:
    """Chi-square at p = 0.001 of the draws' counts against the expected probabilities; a token
    of probability 0 never drawn."""
    n = counts.sum()
    kept = expected > 0
    assert counts[~kept].sum() == 0, "a filtered-out token was sampled"
    exp = expected[kept] * n
    chi2 = float(((counts[kept] - exp) ** 2 / exp).sum())
    df = int(kept.sum()) - 1
    if df:
        assert chi2 < CHI2_001[df], (chi2, counts.tolist(), exp.tolist())


def test_penalized_frequencies_fit_the_distribution():
    # prompt [0, 3], then outputs [5, 5] (prior 2): 0, 3 and 5 seen; 5 generated twice
    params = SamplingParams(
        temperature=0.8, repetition_penalty=1.3, frequency_penalty=0.5, presence_penalty=0.5
    )
    procs = LogitsProcessors.build(params, [0, 3, 5, 5], 2, set(), 8, torch.device("cpu"))
    assert procs is not None
    n = 20000
    x = apply_processors(LOGITS.repeat(n, 1), [(i, procs, 2) for i in range(n)])
    toks = sample(x, [params] * n, list(range(n)), [7] * n)
    ref = LOGITS.double().clone()
    for t in (0, 3, 5):  # repetition penalty, as transformers defines it
        ref[t] = ref[t] / 1.3 if ref[t] > 0 else ref[t] * 1.3
    ref[5] -= 0.5 * 2 + 0.5  # frequency and presence, as OpenAI defines them
    _chi2_fits(torch.bincount(toks, minlength=8).double(), torch.softmax(ref / 0.8, -1))


def test_wide_vocabulary_frequencies_fit_the_distribution():
    # 3,000 tokens in 10 bands of 300: the draw walks blocks of 256 across bands; each band's
    # mass is known, and a top-p cut falls inside the fourth band
    band = torch.tensor([3.0, 2.0, 1.5, 1.0, 0.5, 0.0, -0.5, -1.0, -2.0, -4.0]).double()
    logits = band.repeat_interleave(300) + torch.linspace(0, 0.01, 3000).double()
    n = 20000
    for kw in (
        dict(temperature=1.0),
        dict(temperature=0.7, top_p=0.8),
        dict(temperature=1.0, min_p=0.3),
    ):
        params = SamplingParams(**kw)
        toks = sample(logits.float().repeat(n, 1), [params] * n, list(range(n)), [3] * n)
        x = logits / params.temperature
        keep = torch.ones(3000, dtype=torch.bool)
        if params.top_p < 1:
            p = torch.softmax(x, -1)
            order = p.argsort(descending=True)
            before = p[order].cumsum(0) - p[order]
            keep[order[before >= params.top_p]] = False
        keep &= torch.softmax(x, -1) >= params.min_p * torch.softmax(x, -1).max()
        expected = torch.softmax(x.masked_fill(~keep, float("-inf")), -1)
        counts = torch.bincount(toks // 300, minlength=10).double()
        per_band = expected.view(10, 300).sum(-1)
        # the band the top-p cut falls in is part kept: compare the bands either side of it
        whole = (expected.view(10, 300) > 0).all(-1) | (per_band == 0)
        assert counts[per_band == 0].sum() == 0, (kw, "a filtered-out token was sampled")
        got = torch.cat([counts[whole], counts[~whole].sum()[None]])
        want = torch.cat([per_band[whole], per_band[~whole].sum()[None]])
        _chi2_fits(got, want / want.sum())


def test_cuts_directly():
    """top-k and top-p as logit cuts: the tokens at or above the cut are the ones kept."""
    x, row, one = LOGITS[None], torch.zeros(1, dtype=torch.long), torch.ones(1)
    cut = cut_floors(x, row, one, torch.tensor([2]), one)
    assert (cut <= LOGITS).tolist() == [True, True] + [False] * 6
    p = torch.softmax(LOGITS, -1)
    cut = cut_floors(x, row, one, torch.tensor([0]), torch.tensor([0.5]))
    assert int((cut <= LOGITS).sum()) == int((p.cumsum(0) - p < 0.5).sum())
    cut = cut_floors(x, row, torch.tensor([2.0]), torch.tensor([0]), torch.tensor([0.5]))
    hot = torch.softmax(LOGITS / 2.0, -1)  # top-p reads the probabilities at the temperature
    assert int((cut <= LOGITS).sum()) == int((hot.cumsum(0) - hot < 0.5).sum())
    assert cut_floors(x, row, one, torch.tensor([0]), one).item() == float("-inf")


def test_sampler_is_a_pure_function_of_seed_and_index():
    logits = torch.randn(6, 50)
    logits[3] = logits[0]
    ps = [SamplingParams(temperature=1.0)] * 6
    a = sample(logits, ps, [1, 2, 3, 1, 1, 9], [0, 0, 0, 0, 1, 4])
    b = sample(logits.flip(0), ps, [9, 1, 1, 3, 2, 1], [4, 1, 0, 0, 0, 0])
    assert a.tolist() == b.flip(0).tolist()
    assert a[0] == a[3]  # same seed, same index, same logits
    many = sample(logits[:1].repeat(64, 1), [ps[0]] * 64, list(range(64)), [0] * 64)
    assert len(set(many.tolist())) > 5  # different seeds do differ


def test_greedy_rows_are_argmax():
    logits = torch.randn(5, 40)
    params = [
        SamplingParams(),
        SamplingParams(temperature=0.0, seed=3, top_p=0.5),
        SamplingParams(temperature=2.0, top_k=1),
        SamplingParams(temperature=0.0, min_p=0.9),
        SamplingParams(temperature=5.0, top_k=1, seed=11),
    ]
    assert sample(logits, params, [0] * 5, [0] * 5).tolist() == logits.argmax(-1).tolist()


def test_validate_names_the_field():
    for field, kw in [
        ("temperature", dict(temperature=-0.1)),
        ("temperature", dict(temperature=float("nan"))),
        ("top_k", dict(top_k=-1)),
        ("top_p", dict(top_p=1.5)),
        ("min_p", dict(min_p=-0.1)),
        ("max_tokens", dict(max_tokens=0)),
        ("stop_token_ids", dict(stop_token_ids=[-1])),
        ("stop_token_ids", dict(stop_token_ids=[100])),
        ("logprobs", dict(logprobs=21)),
        ("presence_penalty", dict(presence_penalty=2.1)),
        ("presence_penalty", dict(presence_penalty=float("nan"))),
        ("frequency_penalty", dict(frequency_penalty=-2.5)),
        ("repetition_penalty", dict(repetition_penalty=0.0)),
        ("repetition_penalty", dict(repetition_penalty=float("inf"))),
        ("logit_bias", dict(logit_bias={100: 1.0})),
        ("logit_bias", dict(logit_bias={-1: 1.0})),
        ("logit_bias", dict(logit_bias={3: -100.5})),
        ("logit_bias", dict(logit_bias={3: float("nan")})),
        ("min_tokens", dict(min_tokens=-1)),
        ("min_tokens", dict(max_tokens=8, min_tokens=9)),
    ]:
        bad = validate_params(SamplingParams(**kw), vocab_size=100)
        assert bad is not None and bad[0] == field, (kw, bad)
    good = SamplingParams(
        temperature=0.7,
        top_k=40,
        top_p=0.9,
        min_p=0.05,
        logprobs=20,
        stop_token_ids=[99],
        presence_penalty=-2.0,
        frequency_penalty=2.0,
        repetition_penalty=0.5,
        logit_bias={0: -100.0, 99: 100.0},
        max_tokens=8,
        min_tokens=8,
    )
    assert validate_params(good, vocab_size=100) is None
    assert validate_params(SamplingParams(logit_bias={10**6: 1.0})) is None  # no vocab: ids >= 0


def _run(
    ex: ModelRunner, reqs: dict[str, tuple[list[int], SamplingParams]]
) -> dict[str, list[int]]:
    nxt = 0
    outs: dict[str, list[int]] = {}
    for rid, (prompt, params) in reqs.items():
        n = -(-(len(prompt) + params.max_tokens) // ex.block_size)
        ex.add_request(rid, prompt, params, list(range(nxt, nxt + n)))
        nxt += n
        outs[rid] = []
    while ex.has_work():
        for o in ex.step().outputs:
            if o.token_id is not None:
                outs[o.request_id].append(o.token_id)
    return outs


def test_seeded_request_same_alone_and_in_batch(tiny_model):
    ex = ModelRunner(tiny_model, num_blocks=512, chunk_cap=9, step_budget=50)
    target = (
        [30, 31, 32, 33, 34] * 9,
        SamplingParams(temperature=1.0, top_p=0.95, seed=1234, max_tokens=20, ignore_eos=True),
    )
    plain = ([50, 51, 52], SamplingParams(temperature=1.0, seed=77, max_tokens=20, ignore_eos=True))
    alone = _run(ex, {"t": target})["t"]
    plain_alone = _run(ex, {"u": plain})["u"]
    others = {
        f"o{i}": (
            [40 + i] * (3 + 17 * i),
            SamplingParams(
                temperature=0.5 + i / 10, top_k=i, seed=i if i % 2 else None, max_tokens=12
            ),
        )
        for i in range(16)
    }
    batch = _run(
        ex,
        {
            **dict(list(others.items())[:7]),
            "t": target,
            **dict(list(others.items())[7:]),
            "u": plain,
        },
    )
    assert batch["t"] == alone and batch["u"] == plain_alone
    assert len(set(alone)) > 3
    greedy = _run(ex, {"g": (target[0], SamplingParams(max_tokens=20, ignore_eos=True))})["g"]
    assert greedy != alone  # the seeded request really sampled
    top1 = SamplingParams(temperature=1.3, top_k=1, seed=5, max_tokens=20, ignore_eos=True)
    assert _run(ex, {"k": (target[0], top1)})["k"] == greedy


def test_seeded_request_survives_preemption(tiny_model):
    ex = ModelRunner(tiny_model, num_blocks=64)
    prompt = [7, 8, 9, 10, 11, 12]
    params = SamplingParams(temperature=1.0, seed=99, max_tokens=12, ignore_eos=True)
    full = _run(ex, {"a": (prompt, params)})["a"]
    ex.add_request("a", prompt, params, [0, 1])
    got: list[int] = []
    while len(got) < 5:
        got += [o.token_id for o in ex.step().outputs if o.token_id is not None]
    assert ex.abort("a")
    ex.add_request("a", prompt + got, params, [2, 3], prior_output_tokens=len(got))
    while ex.has_work():
        for o in ex.step().outputs:
            got.append(o.token_id)
            last = o
    assert got == full and last.num_output_tokens == 12 and last.finish_reason == "length"


# ---- penalties, logit_bias and min_tokens through the executor ---------------------------------

PENALIZED = dict(
    repetition_penalty=1.3,
    frequency_penalty=0.5,
    presence_penalty=0.5,
    logit_bias={17: 1.0, 18: -2.0},
    min_tokens=4,
)


def test_plain_batches_skip_the_processors(tiny_model, monkeypatch):
    import gpu.sampling

    calls: list[list[int]] = []  # per call: outputs so far of each processed row
    real = gpu.sampling.apply_processors

    def spy(logits, rows, pending=None, inplace=False):
        calls.append([n for _, _, n in rows])
        return real(logits, rows, pending, inplace)

    monkeypatch.setattr(gpu.sampling, "apply_processors", spy)
    ex = ModelRunner(tiny_model, num_blocks=128)
    plain = {
        "g": ([5, 6, 7], SamplingParams(max_tokens=6)),
        "s": ([5, 6, 7], SamplingParams(temperature=1.0, top_p=0.9, seed=3, max_tokens=6)),
    }
    _run(ex, plain)
    assert calls == []
    pen = SamplingParams(max_tokens=6, ignore_eos=True, **PENALIZED)
    _run(ex, {**plain, "p": ([5, 6, 7], pen)})
    assert calls == [[n] for n in range(6)]  # p's row alone, once per token it sampled


def test_logit_bias_forces_the_greedy_token(tiny_model):
    ex = ModelRunner(tiny_model, num_blocks=128)
    prompt = [40, 41, 42, 43]
    alone = _run(ex, {"g": (prompt, SamplingParams(max_tokens=8))})["g"]
    outs = _run(
        ex,
        {
            "g": (prompt, SamplingParams(max_tokens=8)),
            "b": (prompt, SamplingParams(max_tokens=8, logit_bias={77: 100.0})),
        },
    )
    assert outs["b"] == [77] * 8
    assert outs["g"] == alone and 77 not in alone  # the plain neighbour is untouched


def test_min_tokens_holds_back_eos(tiny_model):
    ex = ModelRunner(tiny_model, num_blocks=128)
    eos = min(ex.eos_token_ids)
    pushed = dict(max_tokens=10, logit_bias={eos: 100.0})
    assert _run(ex, {"a": ([9, 10, 11], SamplingParams(**pushed))})["a"] == [eos]
    out = _run(ex, {"a": ([9, 10, 11], SamplingParams(min_tokens=3, **pushed))})["a"]
    assert len(out) == 4 and out[3] == eos and not set(out[:3]) & set(ex.eos_token_ids)
    stop = SamplingParams(max_tokens=10, min_tokens=2, stop_token_ids=[77], logit_bias={77: 100.0})
    out = _run(ex, {"s": ([9, 10, 11], stop)})["s"]
    assert len(out) == 3 and out[2] == 77 and 77 not in out[:2]


def test_repetition_penalty_matches_transformers_generate(tiny_model):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(tiny_model), dtype=torch.float32)
    ex = ModelRunner(tiny_model, num_blocks=256, chunk_cap=7, step_budget=40)
    prompts = [[30, 31, 30, 31, 30, 31, 32], [100 + i % 5 for i in range(40)], [7] * 19]
    reqs: dict[str, tuple[list[int], SamplingParams]] = {}
    for i, p in enumerate(prompts):
        reqs[f"d{i}"] = (p, SamplingParams(max_tokens=16))  # defaults: plain greedy
        reqs[f"r{i}"] = (p, SamplingParams(max_tokens=16, repetition_penalty=1.8, min_tokens=16))
    outs = _run(ex, reqs)
    changed = 0
    for i, p in enumerate(prompts):
        ids = torch.tensor([p])
        with torch.inference_mode():
            plain = hf.generate(ids, max_new_tokens=16, do_sample=False)[0, len(p) :].tolist()
            ref = hf.generate(
                ids, max_new_tokens=16, do_sample=False, repetition_penalty=1.8, min_new_tokens=16
            )[0, len(p) :].tolist()
        assert outs[f"d{i}"] == plain, i
        assert outs[f"r{i}"] == ref, i
        changed += ref != plain
    assert changed >= 2  # the penalty did change the text


@pytest.mark.parametrize("temperature,penalty", [(0.0, -1.0), (1.0, -2.0)])
def test_penalized_request_survives_preemption(tiny_model, temperature, penalty):
    """Negative penalties favour generated tokens: the counts of the outputs before the
    preemption decide the tokens after it."""
    ex = ModelRunner(tiny_model, num_blocks=64)
    prompt = [7, 8, 9, 10, 11, 12, 7, 8]
    plain = dict(max_tokens=14, ignore_eos=True, temperature=temperature, seed=5)
    params = SamplingParams(
        **plain,
        frequency_penalty=penalty,
        presence_penalty=penalty,
        repetition_penalty=1.3,
        logit_bias={17: 1.0},
        min_tokens=8,
    )
    full = _run(ex, {"a": (prompt, params)})["a"]
    assert full != _run(ex, {"a": (prompt, SamplingParams(**plain))})["a"]
    for cut in (2, 5, 8, 11):  # preempted after ``cut`` tokens, resumed with them
        ex.add_request("a", prompt, params, [0, 1])
        got: list[int] = []
        while len(got) < cut:
            got += [o.token_id for o in ex.step().outputs if o.token_id is not None]
        assert ex.abort("a")
        ex.add_request("a", prompt + got, params, [2, 3, 4], prior_output_tokens=len(got))
        while ex.has_work():
            got += [o.token_id for o in ex.step().outputs if o.token_id is not None]
        assert got == full, cut


def test_kernel_and_torch_draw_the_same_tokens(monkeypatch, isa):
    """The C draw and top-k (gpu/csrc/sample.c), in each instruction-set build this CPU runs,
    against the torch expressions they replace."""
    from gpu.model import cpu_ops

    torch.manual_seed(1)
    x = torch.randn(128, 5000) * 2
    settings = [
        SamplingParams(temperature=1.0),
        SamplingParams(temperature=0.7, top_k=50, top_p=0.9),
        SamplingParams(temperature=1.0, min_p=0.1),
        SamplingParams(temperature=1.2, top_p=0.5),
    ]
    fused = [sample(x, [p] * 128, list(range(128)), [0] * 128) for p in settings]
    monkeypatch.setattr(cpu_ops, "sample", lambda *a: None)
    monkeypatch.setattr(cpu_ops, "topk_values", lambda *a: None)
    for p, got in zip(settings, fused, strict=True):
        want = sample(x, [p] * 128, list(range(128)), [0] * 128)
        assert (got == want).sum() >= 127, p  # a float-rounding tie at most


def test_masked_tokens_are_never_drawn(isa):
    """A grammar's -inf (structured output) or a -inf logit_bias: never sampled, at any setting."""
    x = torch.full((256, 3000), float("-inf"))
    allowed = torch.tensor([5, 700, 1999, 2998])
    x[:, allowed] = torch.tensor([0.5, 2.0, -1.0, 1.0])
    for p in (
        SamplingParams(temperature=1.0),
        SamplingParams(temperature=2.0, top_p=0.99),
        SamplingParams(temperature=1.0, top_k=100),
        SamplingParams(temperature=0.5, min_p=0.01),
    ):
        got = sample(x, [p] * 256, list(range(256)), [1] * 256)
        assert set(got.tolist()) <= set(allowed.tolist()), p
        assert len(set(got.tolist())) >= 2, p
