"""What the executor needs of structured output: compile (cached), a request's grammar state,
the step's mask over the constrained rows, and the end of a constrained answer.

The tokenizer (and llguidance's view of it) is loaded on the first constrained request, so a
runtime that never sees one pays nothing. Ending rules (:meth:`StructuredEngine.finish`): a
constrained answer ends with ``stop`` when the grammar has stopped (it accepts and nothing more
can follow, or it consumed an EOS it allowed), or when a ``stop_token_ids`` token it consumed
as text leaves it accepting (with ``min_tokens`` reached); an EOS or stop id can never end it
where the grammar does not accept.
"""

from __future__ import annotations

import os
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import torch

from actors.shared.grammar import Compiled, GrammarCache, GrammarError, hf_llg_tokenizer
from gpu.requests import ExecutorInputError, RequestState
from gpu.structured.masks import GrammarState, Masker
from messages.common import SamplingParams, StructuredOutput


class StructuredEngine:
    def __init__(
        self,
        model_dir: str | Path,
        vocab_size: int,
        eos_ids: list[int],
        device: torch.device,
        capacity: int | None = None,
    ) -> None:
        self.model_dir = str(model_dir)
        self.vocab_size = vocab_size
        self.eos_ids = list(eos_ids)
        self.device = device
        self.cache = (
            GrammarCache(self._tokenizer)
            if capacity is None
            else GrammarCache(self._tokenizer, capacity)
        )
        self._masker: Masker | None = None
        self._filler: ThreadPoolExecutor | None = None

    def _tokenizer(self):
        from transformers import AutoTokenizer

        hf = AutoTokenizer.from_pretrained(self.model_dir)
        return hf_llg_tokenizer(hf, self.vocab_size, self.eos_ids)

    def compile(self, s: StructuredOutput) -> tuple[Compiled, bool]:
        """``(compiled, cache_hit)``; raises GrammarError naming the field. Thread-safe."""
        return self.cache.compile(s)

    def state(
        self,
        request_id: str,
        params: SamplingParams,
        prompt: list[int],
        prior: int,
        compiled: Compiled | None = None,
    ) -> GrammarState | None:
        """A new request's grammar state (None if unconstrained), past its ``prior`` earlier
        outputs (the end of ``prompt``); compiled here (cached) unless given. Raises
        ExecutorInputError for a constraint that does not compile or outputs it rejects."""
        if params.structured is None:
            return None
        try:
            compiled = compiled or self.compile(params.structured)[0]
            return GrammarState(compiled, prompt[len(prompt) - prior :] if prior else [])
        except GrammarError as e:
            raise ExecutorInputError(request_id, e.field, e.reason) from None
        except ValueError as e:
            raise ExecutorInputError(request_id, "prior_output_tokens", str(e)) from None

    @property
    def masker(self) -> Masker:
        if self._masker is None:
            # On a CPU device the fill overlaps the forward, which holds every core: one
            # thread, so as not to oversubscribe them. Beside an accelerator the cores are free.
            cores = os.cpu_count() or 1
            threads = 1 if self.device.type == "cpu" else max(1, min(8, cores // 2))
            self._masker = Masker(self.vocab_size, self.eos_ids, self.device, threads)
        return self._masker

    def start(
        self,
        reqs: list[RequestState],
        offsets: list[int] | None = None,
        drafts: dict[str, list[int]] | None = None,
    ) -> Future | None:
        """Start filling the bitmask of the constrained rows among ``reqs`` (the step's sampling
        rows, their grammars already advanced by the previous step) in a worker thread, so it
        runs while the forward does (llguidance releases the GIL). None: no constrained row.
        With speculative decoding, ``offsets`` (each row's output index past the request's
        next) and ``drafts`` (per request id): a speculating request's rows are its next
        token's and one per draft, each masked as the grammar stands after the drafts before."""
        rows = [i for i, r in enumerate(reqs) if r.grammar is not None]
        if not rows:
            return None
        at = offsets or [0] * len(reqs)
        firsts = [i for i in rows if at[i] == 0]  # a request's first row (its state's)
        states = [reqs[i].grammar for i in firsts]
        ahead = [drafts.get(reqs[i].rid, []) for i in firsts] if drafts else None
        no_eos = [_no_eos(reqs[i].params, reqs[i].prior + len(reqs[i].out) + at[i]) for i in rows]
        if self._filler is None:
            self._filler = ThreadPoolExecutor(1, thread_name_prefix="minirt-mask")
        masker = self.masker
        return self._filler.submit(lambda: (rows, masker.fill(states, no_eos, ahead)))  # type: ignore[arg-type]

    def mask(
        self, logits: torch.Tensor, reqs: list[RequestState], pending: Future | None
    ) -> torch.Tensor:
        """``logits`` (one row per entry of ``reqs``) with each constrained row's forbidden
        tokens at ``-inf`` (the bitmask ``start`` filled); the unconstrained rows untouched.
        Changed in place unless a request wants logprobs (they are of the raw logits)."""
        if pending is None:
            return logits
        rows, mask = pending.result()
        inplace = all(r.params.logprobs is None for r in reqs)
        return self.masker.apply(logits, rows, mask, inplace=inplace)

    @staticmethod
    def finish(req: RequestState, token: int) -> tuple[str | None, str | None]:
        """Advance ``req``'s grammar by ``token`` (just appended to ``req.out``):
        ``(finish_reason or None, error or None)``; the length limit is the caller's."""
        g = req.grammar
        assert g is not None
        if not g.advance(token):
            return None, g.error()
        if g.stopped:
            return "stop", None
        before = req.prior + len(req.out) - 1  # outputs before this one
        if token in req.stop and g.accepting and before >= req.params.min_tokens:
            return "stop", None
        return None, None


def _no_eos(p: SamplingParams, n_out: int) -> bool:
    return p.ignore_eos or n_out < p.min_tokens
