"""A batched sampler for the wire ``SamplingParams`` (``messages.common``, validated there).

Randomness is a pure function of ``(seed, output index)``: each sampled row draws its noise from
a generator seeded with a hash of the two, so a request yields the same tokens whatever else is
in the batch and after being preempted and recomputed. Filters apply in transformers' order:
temperature, top-k, top-p, min-p; then a categorical draw by the exponential race
``argmax(p / E)``, ``E ~ Exp(1)`` (equivalent to Gumbel-max). Penalties, ``logit_bias`` and
``min_tokens`` are applied before, by ``gpu.logits_processors`` (on the rows that use them).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from gpu.logits_processors import apply_processors
from gpu.model import cpu_ops
from messages.common import SamplingParams

if TYPE_CHECKING:
    from gpu.requests import RequestState

_M64 = (1 << 64) - 1


def is_greedy(p: SamplingParams) -> bool:
    """Whether ``p`` picks the argmax (temperature 0 or top-k 1): no noise, no filters."""
    return p.temperature == 0.0 or p.top_k == 1


def noise_seed(seed: int, index: int) -> int:
    """A 63-bit generator seed that depends only on ``(seed, index)`` (splitmix64 mix)."""
    x = (seed * 0x9E3779B97F4A7C15 + index * 0xD1B54A32D192ED03 + 0x632BE59BD9B4E019) & _M64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _M64
    return (x ^ (x >> 31)) >> 1


def exponential_noise(seeds: list[int], indices: list[int], vocab: int, device) -> torch.Tensor:
    """``[len(seeds), vocab]`` Exp(1) noise; row i depends only on ``(seeds[i], indices[i])``."""
    out = torch.empty(len(seeds), vocab, dtype=torch.float32, device=device)
    gen = torch.Generator(device=device)
    for i, (s, j) in enumerate(zip(seeds, indices, strict=True)):
        gen.manual_seed(noise_seed(s, j))
        out[i].exponential_(generator=gen)
    return out


def filter_logits(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    min_p: torch.Tensor,
) -> torch.Tensor:
    """Apply temperature, top-k, top-p and min-p row-wise; removed tokens get -inf.

    ``logits`` ``[B, V]`` float32 (not mutated); the others ``[B]`` (temperature > 0, top_k 0 =
    off). Ties at a top-k/top-p boundary are all kept. Returns new ``[B, V]`` logits.
    """
    x = logits / temperature[:, None]
    vocab = x.shape[-1]
    use_k = bool((top_k > 0).any())
    use_p = bool((top_p < 1.0).any())
    if use_k or use_p:
        srt = x.sort(dim=-1, descending=True).values
        k = torch.where(top_k > 0, top_k.clamp(max=vocab), vocab).long()
        thresh = srt.gather(1, (k - 1)[:, None])
        if use_p:
            srt = srt.masked_fill(srt < thresh, float("-inf"))
            probs = torch.softmax(srt, dim=-1)
            before = probs.cumsum(dim=-1) - probs
            keep = (before < top_p[:, None]).sum(dim=-1).clamp(min=1)
            thresh = torch.maximum(thresh, srt.gather(1, (keep - 1)[:, None]))
        x = x.masked_fill(x < thresh, float("-inf"))
    if bool((min_p > 0).any()):
        probs = torch.softmax(x, dim=-1)
        cut = probs.max(dim=-1, keepdim=True).values * min_p[:, None]
        x = x.masked_fill(probs < cut, float("-inf"))
    return x


def sample(
    logits: torch.Tensor, params: list[SamplingParams], seeds: list[int], indices: list[int]
) -> torch.Tensor:
    """One token per row of ``logits`` (``[B, V]`` float32): argmax for greedy rows, else a draw.

    ``seeds[i]``/``indices[i]``: the request's seed and the output index being sampled. Returns
    ``[B]`` int64 on the logits' device. Pure: same inputs, same tokens.
    """
    tokens = logits.argmax(dim=-1)
    rows = [i for i, p in enumerate(params) if not is_greedy(p)]
    if not rows:
        return tokens
    dev = logits.device
    sub = [params[i] for i in rows]
    x = filter_logits(
        logits[rows],
        torch.tensor([p.temperature for p in sub], device=dev),
        torch.tensor([p.top_k for p in sub], device=dev),
        torch.tensor([p.top_p for p in sub], device=dev),
        torch.tensor([p.min_p for p in sub], device=dev),
    )
    probs = torch.softmax(x, dim=-1)
    noise = exponential_noise(
        [seeds[i] for i in rows], [indices[i] for i in rows], x.shape[-1], dev
    )
    tokens[rows] = (probs / noise).argmax(dim=-1)
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
) -> torch.Tensor:
    """A step's tokens, one per sampling row of ``reqs``: logit processors first, on their rows
    only (a batch of requests without penalties, bias or min_tokens takes the same path as
    without them), then greedy or seeded sampling. ``offsets[i]``: row ``i`` samples output
    ``len(out) + offsets[i]`` of its request (a draft's row: ``gpu/spec/verify.py``), default 0,
    its penalties counting the request's ``drafts`` before it."""
    at = [r.prior + len(r.out) for r in reqs]
    if offsets is not None:
        at = [n + o for n, o in zip(at, offsets, strict=True)]
    procs = [(i, r.procs, at[i]) for i, r in enumerate(reqs) if r.procs is not None]
    if procs:
        pending = None
        if drafts and offsets is not None:
            pending = [drafts.get(reqs[i].rid, [])[: offsets[i]] for i, _, _ in procs]
        logits = apply_processors(logits, procs, pending)
    if all(is_greedy(r.params) for r in reqs):
        # argmax's indices (first maximum), 3x faster on CPU (docs/benchmarks/cpu-levers/README.md);
        # one C pass where it applies (see gpu.model.cpu_ops.argmax)
        fused = cpu_ops.argmax(logits)
        return fused if fused is not None else logits.max(dim=-1).indices
    return sample(logits, [r.params for r in reqs], [r.seed for r in reqs], at)
