"""Sampling: filters, seeded determinism, batch independence and preemption safety."""

from __future__ import annotations

import pytest
import torch

from gpu.executor import Executor
from gpu.sampling import SamplingParams, SamplingParamsError, filter_logits, sample

LOGITS = torch.tensor([2.0, 1.5, 1.0, 0.5, 0.0, -0.5, -1.0, -3.0])
# Chi-square critical values at p = 0.001 by degrees of freedom.
CHI2_001 = {1: 10.83, 2: 13.82, 3: 16.27, 4: 18.47, 5: 20.52, 6: 22.46, 7: 24.32}


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
    expected = _expected(**kw)
    counts = _draw(SamplingParams(**kw))
    n = counts.sum()
    kept = expected > 0
    assert counts[~kept].sum() == 0, "a filtered-out token was sampled"
    exp = expected[kept] * n
    chi2 = float(((counts[kept] - exp) ** 2 / exp).sum())
    df = int(kept.sum()) - 1
    if df:
        assert chi2 < CHI2_001[df], (kw, chi2, counts.tolist(), exp.tolist())


def test_filters_directly():
    x = LOGITS[None]
    one = torch.ones(1)
    out = filter_logits(x, one, torch.tensor([2]), one, torch.zeros(1))
    assert torch.isfinite(out[0]).tolist() == [True, True] + [False] * 6
    out = filter_logits(x, one, torch.tensor([0]), torch.tensor([0.5]), torch.zeros(1))
    p = torch.softmax(LOGITS, -1)
    n_keep = int((p.cumsum(0) - p < 0.5).sum())
    assert int(torch.isfinite(out[0]).sum()) == n_keep
    out = filter_logits(x, one, torch.tensor([0]), one, torch.tensor([0.3]))
    assert torch.isfinite(out[0]).tolist() == (p >= 0.3 * p.max()).tolist()


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
        ("top_k", dict(top_k=-1)),
        ("top_p", dict(top_p=1.5)),
        ("min_p", dict(min_p=-0.1)),
        ("max_tokens", dict(max_tokens=0)),
        ("stop_token_ids", dict(stop_token_ids=(-1,))),
        ("logprobs", dict(logprobs=21)),
    ]:
        with pytest.raises(SamplingParamsError) as err:
            SamplingParams(**kw).validate()
        assert err.value.field == field and field in str(err.value)
    SamplingParams(temperature=0.7, top_k=40, top_p=0.9, min_p=0.05, logprobs=20).validate()


def _run(ex: Executor, reqs: dict[str, tuple[list[int], SamplingParams]]) -> dict[str, list[int]]:
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
    ex = Executor(tiny_model, num_blocks=512, chunk_cap=9, step_budget=50)
    target = (
        [30, 31, 32, 33, 34] * 9,
        SamplingParams(temperature=1.0, top_p=0.95, seed=1234, max_tokens=20, ignore_eos=True),
    )
    alone = _run(ex, {"t": target})["t"]
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
        ex, {**dict(list(others.items())[:7]), "t": target, **dict(list(others.items())[7:])}
    )
    assert batch["t"] == alone
    assert len(set(alone)) > 3
    greedy = _run(ex, {"g": (target[0], SamplingParams(max_tokens=20, ignore_eos=True))})["g"]
    assert greedy != alone  # the seeded request really sampled
    top1 = SamplingParams(temperature=1.3, top_k=1, seed=5, max_tokens=20, ignore_eos=True)
    assert _run(ex, {"k": (target[0], top1)})["k"] == greedy


def test_seeded_request_survives_preemption(tiny_model):
    ex = Executor(tiny_model, num_blocks=64)
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
