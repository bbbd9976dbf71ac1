"""Logit processors of the wire ``SamplingParams``: ``logit_bias``, ``min_tokens`` and the
repetition, frequency and presence penalties.

They rewrite a request's raw logits before temperature and the filters (``gpu.sampling``), in
vLLM's order: logit bias, min-tokens mask, repetition penalty, frequency/presence penalties.

- ``logit_bias``: ``logits[t] += bias[t]``.
- ``min_tokens``: while fewer than ``min_tokens`` tokens were generated, the request's stop ids
  (``stop_token_ids``, plus EOS unless ``ignore_eos``) get ``-inf``: they cannot be sampled.
- ``repetition_penalty`` (transformers/vLLM): for every token in the prompt or the output, a
  positive logit is divided by it and a negative one multiplied.
- ``frequency_penalty``/``presence_penalty`` (OpenAI): ``logits[t] -= f * c[t] + p * (c[t] > 0)``
  with ``c[t]`` the times ``t`` was *generated* (prompt tokens do not count).

Under speculative decoding a draft's row is processed as if the drafts before it had been
generated (``apply_processors``' ``pending``): its penalties count them, so its target is the
token the request would sample there without speculation.

Only a request that uses one of them gets a :class:`LogitsProcessors` (``build`` returns None
otherwise), and :func:`apply_processors` touches only those rows, so a batch of plain requests
runs the sampler exactly as without this module. The state is a pure function of the request's
token history: a request resumed after a preemption (its earlier outputs at the end of its
prompt, counted by ``prior``) starts with the counts it had when it was preempted.
"""

from __future__ import annotations

from collections.abc import Set

import torch

from messages.common import SamplingParams


class LogitsProcessors:
    """One request's processor settings and token statistics (dense ``[vocab]`` tensors on the
    model's device, kept only for the processors the request uses)."""

    __slots__ = (
        "bias_ids",
        "bias_vals",
        "counts",
        "frequency",
        "min_tokens",
        "presence",
        "repetition",
        "seen",
        "stop_ids",
    )

    def __init__(
        self,
        params: SamplingParams,
        prompt: list[int],
        prior: int,
        stop: Set[int],
        vocab: int,
        device: torch.device,
    ) -> None:
        self.presence = params.presence_penalty
        self.frequency = params.frequency_penalty
        self.repetition = params.repetition_penalty
        self.min_tokens = params.min_tokens
        # Output counts (frequency/presence): the last ``prior`` prompt tokens are outputs.
        self.counts: torch.Tensor | None = None
        if self.presence or self.frequency:
            self.counts = torch.zeros(vocab, dtype=torch.float32, device=device)
            outs = prompt[len(prompt) - prior :]
            if outs:
                ids = torch.tensor(outs, dtype=torch.long, device=device)
                self.counts.index_add_(0, ids, torch.ones(len(outs), device=device))
        # Tokens seen in prompt + output (repetition penalty).
        self.seen: torch.Tensor | None = None
        if self.repetition != 1.0:
            self.seen = torch.zeros(vocab, dtype=torch.bool, device=device)
            self.seen[torch.tensor(prompt, dtype=torch.long, device=device)] = True
        self.bias_ids: torch.Tensor | None = None
        self.bias_vals: torch.Tensor | None = None
        if params.logit_bias:
            items = sorted(params.logit_bias.items())
            self.bias_ids = torch.tensor([t for t, _ in items], dtype=torch.long, device=device)
            self.bias_vals = torch.tensor([b for _, b in items], dtype=torch.float32, device=device)
        self.stop_ids: torch.Tensor | None = None
        if self.min_tokens > prior and stop:
            self.stop_ids = torch.tensor(sorted(stop), dtype=torch.long, device=device)

    @classmethod
    def build(
        cls,
        params: SamplingParams,
        prompt: list[int],
        prior: int,
        stop: Set[int],
        vocab: int,
        device: torch.device,
    ) -> LogitsProcessors | None:
        """The request's processors, or None when it uses none (the defaults do nothing)."""
        used = (
            params.presence_penalty != 0.0
            or params.frequency_penalty != 0.0
            or params.repetition_penalty != 1.0
            or bool(params.logit_bias)
            or (params.min_tokens > prior and bool(stop))
        )
        return cls(params, prompt, prior, stop, vocab, device) if used else None

    def observe(self, token: int) -> None:
        """Count a newly generated token."""
        if self.counts is not None:
            self.counts[token] += 1.0
        if self.seen is not None:
            self.seen[token] = True


def apply_processors(
    logits: torch.Tensor,
    rows: list[tuple[int, LogitsProcessors, int]],
    pending: list[list[int]] | None = None,
) -> torch.Tensor:
    """New ``[B, V]`` logits with ``rows`` processed; ``logits`` is not mutated.

    ``rows``: ``(row, processors, outputs generated so far)`` for each row that has processors.
    ``pending[j]``: tokens generated before ``rows[j]``'s output that its processors have not
    observed (a draft row: the drafts before it), counted by its penalties as if they had been.
    """
    dev = logits.device
    idx = torch.tensor([r for r, _, _ in rows], dtype=torch.long, device=dev)
    x = logits.index_select(0, idx)
    procs = [p for _, p, _ in rows]

    bias = [(j, p.bias_ids, p.bias_vals) for j, p in enumerate(procs) if p.bias_ids is not None]
    if bias:
        r, t = _flat([(j, ids) for j, ids, _ in bias])
        vals = [v for _, _, v in bias if v is not None]  # set with bias_ids, always
        x.index_put_((r, t), torch.cat(vals), accumulate=True)

    banned = [
        (j, p.stop_ids)
        for j, (_, p, n) in enumerate(rows)
        if p.stop_ids is not None and n < p.min_tokens
    ]
    if banned:
        r, t = _flat(banned)
        x.index_put_((r, t), torch.tensor(float("-inf"), device=dev))

    rep = [j for j, p in enumerate(procs) if p.seen is not None]
    if rep:
        sel = torch.tensor(rep, dtype=torch.long, device=dev)
        sub = x.index_select(0, sel)
        seen = torch.stack([procs[j].seen for j in rep])  # type: ignore[misc]
        for i, j in enumerate(rep):
            if pending and pending[j]:
                seen[i, torch.tensor(pending[j], dtype=torch.long, device=dev)] = True
        pen = torch.tensor([procs[j].repetition for j in rep], dtype=x.dtype, device=dev)[:, None]
        x.index_copy_(0, sel, torch.where(seen, torch.where(sub < 0, sub * pen, sub / pen), sub))

    pf = [j for j, p in enumerate(procs) if p.counts is not None]
    if pf:
        sel = torch.tensor(pf, dtype=torch.long, device=dev)
        counts = torch.stack([procs[j].counts for j in pf]).double()  # type: ignore[misc]
        for i, j in enumerate(pf):
            if pending and pending[j]:
                ids = torch.tensor(pending[j], dtype=torch.long, device=dev)
                counts[i].index_add_(0, ids, torch.ones(len(ids), dtype=counts.dtype, device=dev))
        f = torch.tensor([procs[j].frequency for j in pf], dtype=torch.float64, device=dev)
        p = torch.tensor([procs[j].presence for j in pf], dtype=torch.float64, device=dev)
        # In float64, rounded once: the same as subtracting ``f * c + p`` token by token.
        penalty = (f[:, None] * counts + p[:, None] * (counts > 0)).to(x.dtype)
        x.index_copy_(0, sel, x.index_select(0, sel) - penalty)

    return logits.index_copy(0, idx, x)


def _flat(parts: list[tuple[int, torch.Tensor]]) -> tuple[torch.Tensor, torch.Tensor]:
    """Row and token index tensors for ``[(row, token ids)]``."""
    r = torch.cat([torch.full_like(t, j) for j, t in parts])
    return r, torch.cat([t for _, t in parts])
