"""Logit processors of the wire ``SamplingParams``: ``allowed_token_ids``, bad words,
``logit_bias``, ``min_tokens`` and the repetition, frequency and presence penalties.

They rewrite a request's raw logits before temperature and the filters (``gpu.sampling``): the
masks first (allowed ids, bad words), then vLLM's order: logit bias, min-tokens mask,
repetition penalty, frequency/presence penalties.

- ``allowed_token_ids``: every other id gets ``-inf``.
- ``bad_words_ids`` (the front door tokenizes ``bad_words`` into them): a one-token word's id
  gets ``-inf`` always; a longer word's last token gets it wherever the output so far ends with
  the word's other tokens.

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
    """One request's processor settings and token statistics, kept sparse (the tokens it has
    seen and generated, never a tensor of the vocabulary's size), only for the processors the
    request uses."""

    __slots__ = (
        "allowed",
        "bad_seqs",
        "bad_single",
        "bias_ids",
        "bias_vals",
        "counts",
        "device",
        "frequency",
        "min_tokens",
        "presence",
        "recent",
        "repetition",
        "seen",
        "seen_ids",
        "seen_new",
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
        self.device = device
        self.presence = params.presence_penalty
        self.frequency = params.frequency_penalty
        self.repetition = params.repetition_penalty
        self.min_tokens = params.min_tokens
        # Output counts (frequency/presence): the last ``prior`` prompt tokens are outputs.
        self.counts: dict[int, int] | None = None
        if self.presence or self.frequency:
            self.counts = {}
            for t in prompt[len(prompt) - prior :]:
                self.counts[t] = self.counts.get(t, 0) + 1
        # Tokens seen in prompt + output (repetition penalty): the set, its ids as a tensor, and
        # those seen since the tensor was made.
        self.seen: set[int] | None = None
        self.seen_ids = torch.empty(0, dtype=torch.long, device=device)
        self.seen_new: list[int] = []
        if self.repetition != 1.0:
            self.seen = set(prompt)
            self.seen_new = list(self.seen)
        self.bias_ids: torch.Tensor | None = None
        self.bias_vals: torch.Tensor | None = None
        if params.logit_bias:
            items = sorted(params.logit_bias.items())
            self.bias_ids = torch.tensor([t for t, _ in items], dtype=torch.long, device=device)
            self.bias_vals = torch.tensor([b for _, b in items], dtype=torch.float32, device=device)
        self.stop_ids: torch.Tensor | None = None
        if self.min_tokens > prior and stop:
            self.stop_ids = torch.tensor(sorted(stop), dtype=torch.long, device=device)
        self.allowed: torch.Tensor | None = None
        if params.allowed_token_ids:
            ids = sorted(set(params.allowed_token_ids))
            self.allowed = torch.tensor(ids, dtype=torch.long, device=device)
        # bad words: one-token ones always banned; a longer one's last token after the rest,
        # matched on the last outputs (``recent``, as long as the longest word's rest)
        self.bad_single = sorted({w[0] for w in params.bad_words_ids if len(w) == 1})
        self.bad_seqs = [(tuple(w[:-1]), w[-1]) for w in params.bad_words_ids if len(w) > 1]
        longest = max((len(rest) for rest, _ in self.bad_seqs), default=0)
        self.recent = prompt[len(prompt) - prior :][-longest:] if longest else []

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
            or bool(params.allowed_token_ids)
            or bool(params.bad_words_ids)
        )
        return cls(params, prompt, prior, stop, vocab, device) if used else None

    def observe(self, token: int) -> None:
        """Count a newly generated token."""
        if self.bad_seqs:
            self.recent.append(token)
            longest = max(len(rest) for rest, _ in self.bad_seqs)
            del self.recent[:-longest]
        if self.counts is not None:
            self.counts[token] = self.counts.get(token, 0) + 1
        if self.seen is not None and token not in self.seen:
            self.seen.add(token)
            self.seen_new.append(token)

    def bad_now(self, pending: list[int]) -> list[int]:
        """The bad words' tokens banned at the next output (``pending`` generated before it)."""
        out = list(self.bad_single)
        if self.bad_seqs:
            tail = self.recent + pending
            for rest, last in self.bad_seqs:
                if len(tail) >= len(rest) and tuple(tail[len(tail) - len(rest) :]) == rest:
                    out.append(last)
        return out

    def seen_tensor(self, pending: list[int]) -> torch.Tensor:
        """The ids seen (each once), with ``pending``'s unseen ones after them."""
        assert self.seen is not None
        if self.seen_new:
            new = torch.tensor(self.seen_new, dtype=torch.long, device=self.device)
            self.seen_ids = torch.cat([self.seen_ids, new])
            self.seen_new = []
        extra = [t for t in dict.fromkeys(pending) if t not in self.seen]
        if not extra:
            return self.seen_ids
        return torch.cat([self.seen_ids, torch.tensor(extra, dtype=torch.long, device=self.device)])

    def count_items(self, pending: list[int]) -> tuple[list[int], list[int]]:
        """The generated ids and their counts, ``pending`` counted as generated."""
        assert self.counts is not None
        counts = self.counts
        if pending:
            counts = dict(counts)
            for t in pending:
                counts[t] = counts.get(t, 0) + 1
        return list(counts), list(counts.values())


def apply_processors(
    logits: torch.Tensor,
    rows: list[tuple[int, LogitsProcessors, int]],
    pending: list[list[int]] | None = None,
    inplace: bool = False,
) -> torch.Tensor:
    """``[B, V]`` logits with ``rows`` processed: a new tensor, or ``logits`` itself rewritten
    with ``inplace``. Only the tokens a row's processors name are touched.

    ``rows``: ``(row, processors, outputs generated so far)`` for each row that has processors.
    ``pending[j]``: tokens generated before ``rows[j]``'s output that its processors have not
    observed (a draft row: the drafts before it), counted by its penalties as if they had been.
    """
    with torch.inference_mode():  # the forward's logits are inference tensors
        return _apply(logits if inplace else logits.clone(), rows, pending)


def _apply(
    x: torch.Tensor,
    rows: list[tuple[int, LogitsProcessors, int]],
    pending: list[list[int]] | None,
) -> torch.Tensor:
    dev = x.device
    todo = [[] if pending is None else pending[j] for j in range(len(rows))]

    for row, procs, _ in rows:
        if procs.allowed is not None:  # every id but these: -inf
            keep = x[row, procs.allowed].clone()
            x[row].fill_(float("-inf"))
            x[row, procs.allowed] = keep

    now = [(row, procs.bad_now(todo[j])) for j, (row, procs, _) in enumerate(rows)]
    bad = [(row, torch.tensor(ids, dtype=torch.long, device=dev)) for row, ids in now if ids]
    if bad:
        r, t = _flat(bad)
        x.index_put_((r, t), torch.tensor(float("-inf"), device=dev))

    bias = [(r, p.bias_ids, p.bias_vals) for r, p, _ in rows if p.bias_ids is not None]
    if bias:
        r, t = _flat([(r, ids) for r, ids, _ in bias])
        vals = [v for _, _, v in bias if v is not None]  # set with bias_ids, always
        x.index_put_((r, t), torch.cat(vals), accumulate=True)

    banned = [(r, p.stop_ids) for r, p, n in rows if p.stop_ids is not None and n < p.min_tokens]
    if banned:
        r, t = _flat(banned)
        x.index_put_((r, t), torch.tensor(float("-inf"), device=dev))

    rep = [
        (r, p.seen_tensor(todo[j]), p.repetition)
        for j, (r, p, _) in enumerate(rows)
        if p.seen is not None
    ]
    if rep:
        r, t = _flat([(r, ids) for r, ids, _ in rep])
        pen = torch.cat(
            [torch.full((len(ids),), pen, dtype=x.dtype, device=dev) for _, ids, pen in rep]
        )
        v = x[r, t]
        x[r, t] = torch.where(v < 0, v * pen, v / pen)

    pf = [
        (r, p, *p.count_items(todo[j])) for j, (r, p, _) in enumerate(rows) if p.counts is not None
    ]
    pf = [e for e in pf if e[2]]
    if pf:
        r = torch.tensor([r for r, _, ids, _ in pf for _ in ids], dtype=torch.long, device=dev)
        t = torch.tensor([i for _, _, ids, _ in pf for i in ids], dtype=torch.long, device=dev)
        c = torch.tensor([n for _, _, _, cs in pf for n in cs], dtype=torch.float64, device=dev)
        f = torch.tensor(
            [p.frequency for _, p, ids, _ in pf for _ in ids], dtype=torch.float64, device=dev
        )
        q = torch.tensor(
            [p.presence for _, p, ids, _ in pf for _ in ids], dtype=torch.float64, device=dev
        )
        # In float64, rounded once: the same as subtracting ``f * c + p`` token by token.
        x[r, t] = x[r, t] - (f * c + q).to(x.dtype)

    return x


def _flat(parts: list[tuple[int, torch.Tensor]]) -> tuple[torch.Tensor, torch.Tensor]:
    """Row and token index tensors for ``[(row, token ids)]``."""
    r = torch.cat([torch.full_like(t, j) for j, t in parts])
    return r, torch.cat([t for _, t in parts])
