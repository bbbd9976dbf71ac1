"""A batched sampler for the wire ``SamplingParams`` (``messages.common``, validated there).

Randomness is a pure function of ``(seed, output index)``: each sampled row draws one uniform
``u`` from a hash of the two, so a request yields the same tokens whatever else is in the batch,
after being preempted and recomputed, and after a restart that resumes it. Filters apply in
transformers' order (temperature, top-k, top-p, min-p) and together keep the tokens whose logit
is at least a cut, one per row (:func:`cut_floors`); the token is then drawn by inverting the
kept distribution's cumulative sum at ``u`` (``gpu/csrc/sample.c``: one pass to exponentiate
and sum, no noise tensor of the vocabulary's size; a torch expression of the same where the
kernel does not run). Penalties, ``logit_bias`` and ``min_tokens`` are applied before, by
``gpu.logits_processors`` (on the rows that use them).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch

from gpu.logits_processors import apply_processors
from gpu.model import cpu_ops
from messages.common import SamplingParams
from messages.tokenizer import PromptScores

if TYPE_CHECKING:
    from gpu.requests import RequestState
    from gpu.step.batch import StepBatch

_M64 = (1 << 64) - 1
# a top-p row without top-k looks for its cut among its best tokens first; a full sort of the
# row only when they hold less than top_p of the probability
TOP_P_CANDIDATES = 1024


def is_greedy(p: SamplingParams) -> bool:
    """Whether ``p`` picks the argmax (temperature 0 or top-k 1): no noise, no filters."""
    return p.temperature == 0.0 or p.top_k == 1


def noise_seed(seed: int, index: int) -> int:
    """A 63-bit value that depends only on ``(seed, index)`` (splitmix64 mix)."""
    x = (seed * 0x9E3779B97F4A7C15 + index * 0xD1B54A32D192ED03 + 0x632BE59BD9B4E019) & _M64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _M64
    return (x ^ (x >> 31)) >> 1


def uniform(seed: int, index: int) -> float:
    """A uniform in [0, 1) with 53 random bits, a pure function of ``(seed, index)``."""
    return (noise_seed(seed, index) >> 10) * 2.0**-53


def _top_p_cut(vals: torch.Tensor, z: torch.Tensor, t: torch.Tensor, top_p: torch.Tensor):
    """Per row: the lowest of ``vals`` (sorted descending, -inf past a row's candidates) kept by
    top-p at temperature ``t`` with log-normaliser ``z``, and whether the candidates held
    ``top_p`` of the mass (else the cut lies further down)."""
    probs = torch.exp(vals / t[:, None] - z[:, None])
    mass = probs.cumsum(dim=-1)
    keep = ((mass - probs) < top_p[:, None]).sum(dim=-1).clamp(min=1, max=vals.shape[1])
    return vals.gather(1, (keep - 1)[:, None])[:, 0], mass[:, -1] >= top_p


def _best(logits: torch.Tensor, rows: torch.Tensor, k: int) -> torch.Tensor:
    """The ``k`` largest logits of each of ``rows``, sorted descending."""
    vals = cpu_ops.topk_values(logits, rows, k)
    return vals if vals is not None else logits.index_select(0, rows).topk(k, dim=-1).values


def cut_floors(
    logits: torch.Tensor,
    rows: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
) -> torch.Tensor:
    """The lowest logit each of ``rows`` keeps under its top-k and top-p (``[len(rows)]``, -inf
    where neither applies; ``logits`` ``[B, V]`` float32; the others one per row, top_k 0 = off).

    Both keep a row's best tokens down to some logit, so together they keep those at or above
    the higher cut: top-k's is the k-th largest logit; top-p's the last of the fewest best tokens
    whose probability (at the row's temperature, after top-k) reaches top_p. min-p's cut,
    ``max + T * ln(min_p)``, is the draw's (:func:`draw`). Ties at a cut are all kept."""
    vocab = logits.shape[1]
    dev = logits.device
    floor = torch.full((len(rows),), float("-inf"), dtype=torch.float32, device=dev)
    use_p = top_p < 1.0
    kp = ((top_k > 0) | use_p).nonzero()[:, 0]
    if not kp.numel():
        return floor
    k, p, t = top_k[kp].long(), top_p[kp], temperature[kp]
    has_k = k > 0
    width = torch.where(has_k, k.clamp(max=vocab), min(vocab, TOP_P_CANDIDATES))
    m = int(width.max())
    src = rows[kp]
    vals = _best(logits, src, m)
    fl = torch.where(has_k, vals.gather(1, (width - 1)[:, None])[:, 0], float("-inf"))
    prow = use_p[kp]
    if bool(prow.any()):
        cand = vals.masked_fill(torch.arange(m, device=dev)[None, :] >= width[:, None], -torch.inf)
        # top-k's set is normalised over itself; without top-k, over the whole row
        z = torch.logsumexp(cand / t[:, None], dim=-1)
        whole = (prow & ~has_k).nonzero()[:, 0]
        if whole.numel():
            x = logits.index_select(0, src[whole])
            z[whole] = torch.logsumexp(x / t[whole][:, None], dim=-1)
        cut, enough = _top_p_cut(cand, z, t, p)
        short = (prow & ~enough & ~has_k).nonzero()[:, 0]
        if short.numel():  # the candidates hold too little: sort those rows whole
            full = logits.index_select(0, src[short]).sort(dim=-1, descending=True).values
            cut[short], _ = _top_p_cut(full, z[short], t[short], p[short])
        fl = torch.where(prow, torch.maximum(fl, cut), fl)
    floor[kp] = fl
    return floor


def draw(
    logits: torch.Tensor,
    rows: torch.Tensor,
    inv_temp: torch.Tensor,
    floor: torch.Tensor,
    log_min_p: torch.Tensor,
    u: torch.Tensor,
) -> torch.Tensor:
    """One token per entry of ``rows``: the first whose cumulative probability (at ``inv_temp``,
    the tokens below ``floor`` and min-p's cut removed) passes ``u``; the C kernel, else the same
    in torch."""
    out = cpu_ops.sample(logits, rows, inv_temp, floor, log_min_p, u)
    if out is not None:
        return out
    x = logits.index_select(0, rows)
    best = x.max(dim=-1, keepdim=True).values
    floor = torch.maximum(floor[:, None], best + log_min_p[:, None] / inv_temp[:, None])
    keep = (x >= floor) & (x > float("-inf"))
    e = torch.where(keep, torch.exp((x - best) * inv_temp[:, None]), 0.0)
    cdf = e.double().cumsum(dim=-1)
    target = (u.to(cdf.device) * cdf[:, -1])[:, None]
    return torch.searchsorted(cdf, target, right=True)[:, 0].clamp(max=x.shape[1] - 1)


def sample(
    logits: torch.Tensor, params: list[SamplingParams], seeds: list[int], indices: list[int]
) -> torch.Tensor:
    """One token per row of ``logits`` (``[B, V]`` float32): argmax for greedy rows, else a draw.

    ``seeds[i]``/``indices[i]``: the request's seed and the output index being sampled. Returns
    ``[B]`` int64 on the logits' device. Pure: same inputs, same tokens.
    """
    rows = [i for i, p in enumerate(params) if not is_greedy(p)]
    if len(rows) < len(params):
        # the first maximum, in one C pass where it applies (torch's max(dim).indices otherwise,
        # 3x faster than argmax on CPU: docs/benchmarks/cpu-levers/README.md)
        fused = cpu_ops.argmax(logits)
        tokens = fused if fused is not None else logits.max(dim=-1).indices
    else:
        tokens = torch.empty(len(params), dtype=torch.long, device=logits.device)
    if not rows:
        return tokens
    dev = logits.device
    sub = [params[i] for i in rows]
    idx = torch.tensor(rows, dtype=torch.long, device=dev)
    temperature = torch.tensor([p.temperature for p in sub], dtype=torch.float32, device=dev)
    top_k = torch.tensor([p.top_k for p in sub], device=dev)
    top_p = torch.tensor([p.top_p for p in sub], dtype=torch.float32, device=dev)
    floor = cut_floors(logits, idx, temperature, top_k, top_p)
    log_min_p = torch.tensor(
        [math.log(p.min_p) if p.min_p > 0 else -math.inf for p in sub], device=dev
    )
    u = torch.tensor([uniform(seeds[i], indices[i]) for i in rows], dtype=torch.float64, device=dev)
    tokens[idx] = draw(logits, idx, 1.0 / temperature, floor, log_min_p, u)
    return tokens


def logprobs_of(
    logits: torch.Tensor, tokens: torch.Tensor, top_n: int
) -> tuple[list[float], list[list[tuple[int, float]]]]:
    """Log-softmax of the raw logits: each row's sampled-token logprob, and its top ``top_n``."""
    lp = torch.log_softmax(logits, dim=-1)
    chosen = lp.gather(1, tokens[:, None])[:, 0].tolist()
    if top_n <= 0:
        return chosen, [[] for _ in chosen]
    vals, ids = lp.topk(top_n, dim=-1)
    tops = [list(zip(i, v, strict=True)) for i, v in zip(ids.tolist(), vals.tolist(), strict=True)]
    return chosen, tops


def row_logprobs(
    logits: torch.Tensor, tokens: torch.Tensor, params: list[SamplingParams]
) -> tuple[list, list]:
    """Per row: (sampled logprob or None, top list or None), for the rows that ask for them."""
    none: list = [None] * len(params)
    want = [i for i, p in enumerate(params) if p.logprobs is not None]
    if not want:
        return none, list(none)
    top_n = max(params[i].logprobs or 0 for i in want)
    chosen, tops = logprobs_of(logits[want], tokens[want], top_n)
    lps, top_out = list(none), list(none)
    for j, i in enumerate(want):
        lps[i] = chosen[j]
        top_out[i] = tops[j][: params[i].logprobs]
    return lps, top_out


def sample_rows(
    logits: torch.Tensor,
    reqs: list[RequestState],
    offsets: list[int] | None = None,
    drafts: dict[str, list[int]] | None = None,
    scratch: bool = False,
) -> torch.Tensor:
    """A step's tokens, one per sampling row of ``reqs``: logit processors first, on their rows
    only (a batch of requests without penalties, bias or min_tokens takes the same path as
    without them), then greedy or seeded sampling. ``offsets[i]``: row ``i`` samples output
    ``len(out) + offsets[i]`` of its request (a draft's row: ``gpu/spec/verify.py``), default 0,
    its penalties counting the request's ``drafts`` before it. ``scratch``: the caller no longer
    needs ``logits`` (the processors rewrite it instead of a copy: a vocabulary-wide row is
    megabytes)."""
    at = [r.prior + len(r.out) for r in reqs]
    if offsets is not None:
        at = [n + o for n, o in zip(at, offsets, strict=True)]
    procs = [(i, r.procs, at[i]) for i, r in enumerate(reqs) if r.procs is not None]
    if procs:
        pending = None
        if drafts and offsets is not None:
            pending = [drafts.get(reqs[i].rid, [])[: offsets[i]] for i, _, _ in procs]
        logits = apply_processors(logits, procs, pending, inplace=scratch)
    return sample(logits, [r.params for r in reqs], [r.seed for r in reqs], at)


def prompt_scores(
    logits: torch.Tensor, scored: list[tuple[RequestState, int, int, int]]
) -> list[PromptScores]:
    """The prompt logprobs of a step's scoring rows (``StepBatch.scored``): per request, each
    scored prompt token's logprob in the raw distribution (float32 log-softmax, as vLLM's
    ``prompt_logprobs``), its rank, and the ``prompt_logprobs`` most likely tokens."""
    out = []
    with torch.inference_mode():
        for req, start, row, n in scored:
            lp = torch.log_softmax(logits[row : row + n].float(), dim=-1)
            target = torch.tensor(req.prompt[start : start + n], device=lp.device)
            chosen = lp.gather(1, target[:, None])[:, 0]
            ranks = (lp > chosen[:, None]).sum(dim=1) + 1
            k = req.params.prompt_logprobs or 0
            tops: list[list[tuple[int, float]]] = []
            if k:
                vals, ids = lp.topk(k, dim=-1)
                tops = [
                    list(zip(i, v, strict=True))
                    for i, v in zip(ids.tolist(), vals.tolist(), strict=True)
                ]
            out.append(PromptScores(req.rid, start, chosen.tolist(), ranks.tolist(), tops))
    return out


def split_scores(logits: torch.Tensor, batch: StepBatch) -> tuple[torch.Tensor, list[PromptScores]]:
    """A step's logits without its scoring rows (they follow the sampling rows), and the prompt
    logprobs those rows give (none when the step scores no prompt)."""
    n = len(batch.logit_rows)
    if not batch.score_rows:
        return logits, []
    return logits[:n], prompt_scores(logits[n:], batch.scored)
