"""The model runner: owns the model and the paged KV cache, runs one mixed prefill/decode step at a
time (the executor actor drives it through its core, ``gpu/core.py``).

It never allocates KV blocks: callers hand it block tables (plain ints) with each request and
grow them with :meth:`ModelRunner.extend`. Each :meth:`ModelRunner.step` schedules decodes first (one
token each, FCFS), then prefill chunks FCFS within the token budget, runs one forward over the
flat batch, samples, and drops finished requests (the caller frees their blocks). With
speculative decoding on (``gpu/spec/``), a decode may also verify drafts in the same forward and
emit several tokens in one step.
"""

from __future__ import annotations

import functools
import random
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from actors.shared.grammar import Compiled
from gpu.logits_processors import LogitsProcessors
from gpu.lora.slots import LoraSlots
from gpu.model import cpu_tuning, loader, paths
from gpu.model.attention import build_metadata
from gpu.model.kv_cache import PagedKVCache, loaded_pool
from gpu.model.memory import DEFAULT_GPU_MEMORY_UTILIZATION
from gpu.pooling import pool
from gpu.request_table import RequestTable
from gpu.requests import (
    ExecutorInputError,
    RequestState,
    StepResult,
    TokenOutput,
    check_invariants,
)
from gpu.sampling import row_logprobs, sample_rows, split_scores
from gpu.spec import config as spec_config
from gpu.spec import cost as spec_cost
from gpu.spec.explore import Allowance
from gpu.spec.ngram import NgramTokens
from gpu.spec.plan import SpecPlan, plan_drafts
from gpu.spec.verify import accepted
from gpu.step import batch as step_batch
from gpu.step.budget import AdaptiveBudget
from gpu.step.plan import StepBudget
from gpu.structured.engine import StructuredEngine
from messages.common import SamplingParams
from messages.executor import Run

__all__ = ["ExecutorInputError", "ModelRunner", "StepResult", "TokenOutput"]


class ModelRunner:
    """Model + KV cache + in-flight requests. Not thread-safe; one caller drives it.

    Attributes: ``num_blocks``, ``block_size``, ``kv_bytes``, ``max_model_len``, ``vocab_size``,
    ``eos_token_ids``, ``device``, ``dtype`` (``--dtype auto``: the checkpoint's where the
    device computes it natively; ``dtype_reason`` says why). ``kv_memory`` is bytes (int) or a fraction of free
    device memory (float in (0, 1]); ``num_blocks`` wins over it; with neither, the default of
    ``gpu.model.kv_cache.pool_blocks`` (a fraction of the memory left after the weights, at most what
    ``max_batch_size`` requests of the model's context can use). ``max_model_len`` (default: the
    model's context, capped by the pool's tokens) bounds prompt plus output. ``threads`` sets
    torch's intra-op thread count (process-wide). ``speculative``: ``--speculative-config``
    (``gpu/spec/config.py``; its text, dict or parsed form; empty or None: off); with it,
    draft rows are priced on forward times measured at start (``gpu/spec/cost.py``), or
    ``spec_rows``: any step of up to that many rows drafts, none of more.
    ``model_impl``: ``--model-impl`` (gpu.model.loader.load_spec), the native Llama-family
    path or transformers' own modeling code (gpu.model.generic).
    Raises UnsupportedModelError (a ValueError) for a model neither path serves.
    """

    def __init__(
        self,
        model_dir: str | Path,
        *,
        dtype: str | torch.dtype | None = None,
        device: str | torch.device | None = None,
        num_blocks: int | None = None,
        kv_memory: int | float | None = None,
        block_size: int = 16,
        chunk_cap: int = 1024,
        step_budget: int = 8192,
        max_batch_size: int = 256,
        long_prefill_threshold: int = 0,
        max_long_prefills: int = 1,
        decode_first: bool = True,
        threads: int | None = None,
        max_model_len: int | None = None,
        gpu_memory_utilization: float = DEFAULT_GPU_MEMORY_UTILIZATION,
        speculative: str | dict | spec_config.SpecConfig | None = None,
        spec_rows: int | None = None,
        budget_policy: str = "fixed",
        step_target_ms: float = 0.0,
        bind_threads: bool = False,
        max_loras: int = 0,
        max_lora_rank: int = 16,
        model_impl: str = "auto",
    ) -> None:
        if threads is not None:
            torch.set_num_threads(threads)
        self.speculative = spec_config.parse(speculative)  # refused (ValueError) before loading
        self.budget = StepBudget(
            step_budget,
            chunk_cap,
            max_batch_size,
            long_prefill_threshold,
            max_long_prefills,
            decode_first,
            budget_policy,
            step_target_ms,
        )
        self.budget.check()
        if block_size < 1:
            raise ValueError("block_size must be >= 1")
        self.device = loader.resolve_device(device)
        loader.tune_process(self.device)
        # --bind-threads: each OpenMP thread pinned to one CPU (this thread, which runs the
        # steps, to the first); the CPUs before, for threads that should not be pinned
        self.cpus_before_bind: list[int] | None = None
        self.bound_cpus: list[int] | None = None
        if bind_threads and self.device.type == "cpu":
            self.cpus_before_bind, self.bound_cpus = cpu_tuning.bind_threads()
        self.dtype, self.dtype_reason = loader.choose_dtype(dtype, self.device, model_dir)
        self.spec = spec = loader.load_spec(model_dir, model_impl)
        self.model_dir = Path(model_dir)
        # the KV cache and the weights as loaded: the attention's (loader.attention_dtype)
        self.kv_dtype = loader.attention_dtype(self.dtype, self.device)
        self.model = paths.build(
            spec, model_dir, self.dtype, self.kv_dtype, self.device, lora=max_loras > 0
        )
        self.model.warm_up()
        self.vocab_size = spec.vocab_size
        self.eos_token_ids = loader.eos_token_ids(model_dir, spec)
        self.block_size = block_size
        num_blocks, per_block = loaded_pool(
            spec,
            self.kv_dtype,
            self.device,
            block_size,
            num_blocks,
            kv_memory,
            utilization=gpu_memory_utilization,
            step_tokens=step_budget,
            batch_rows=max_batch_size,
        )
        self.num_blocks = num_blocks
        self.max_model_len = min(
            max_model_len or spec.max_model_len, spec.max_model_len, num_blocks * block_size
        )
        self.kv_bytes = num_blocks * per_block
        self.cache = PagedKVCache(
            spec.num_layers,
            spec.num_kv_heads,
            spec.head_dim,
            num_blocks,
            block_size,
            self.kv_dtype,
            self.device,
        )
        self.requests = RequestTable(self.budget, block_size, num_blocks, self.max_model_len)
        # LoRA: a step's adapters' slots; ``adapter``: a resident one (gpu/lora/cache.py)
        self.lora_slots: LoraSlots | None = None
        if max_loras > 0:
            self.requests.max_loras = max_loras
            self.lora_slots = LoraSlots.of(self.model, max_loras, max_lora_rank, self.device)
        self.adapter: Callable[[str], Any] = lambda key: None
        # the start's step-time model (the adaptive budget's seed) and what a step's rows cost
        self.seed_costs, self.spec_cost = spec_cost.timed_at_start(
            self.model, spec, self.kv_dtype, self.device, block_size, bool(self.speculative),
            spec_rows,
        )  # fmt: skip
        self.explore = Allowance()  # what draft explorations may spend (gpu/spec/explore.py)
        self.adaptive: AdaptiveBudget | None = None
        if budget_policy == "adaptive":
            self.adaptive = AdaptiveBudget(self.seed_costs, step_budget, step_target_ms / 1000.0)
        # Structured output: compiled constraints (bounded cache) and the step's token masks.
        self.structured = StructuredEngine(
            model_dir, self.vocab_size, list(self.eos_token_ids), self.device
        )

    # ---- request management -------------------------------------------------------------

    def add_request(
        self,
        request_id: str,
        prompt_ids: list[int],
        params: SamplingParams,
        block_table: list[int],
        num_cached_tokens: int = 0,
        prior_output_tokens: int = 0,
        grammar: Compiled | None = None,
    ) -> None:
        """Queue a request whose prompt K/V goes to ``block_table``; the first ``num_cached_tokens``
        (a multiple of block_size, < len(prompt)) are already in those blocks and are not recomputed.

        ``prior_output_tokens``: to resume a preempted request, pass the original prompt plus the
        outputs it had produced as ``prompt_ids``, their count here, and the original params:
        sampling indices, ``max_tokens`` and ``num_output_tokens`` continue from there, so a seeded
        request yields the same tokens as if never preempted.

        ``grammar``: ``params.structured``'s matcher, built beforehand from the front door's
        grammar (the actor: ``self.structured.cache.build`` in a worker thread); a caller that
        drives the executor directly (tests, benchmarks) may leave it out, and the constraint is
        compiled here (cached). Its matcher replays the prior outputs.

        The request is trusted (the front door validated it): only the invariants that keep
        the KV pool whole are checked (``check_invariants``). Raises ExecutorInputError naming
        the request and field; on error nothing changes.
        """

        if request_id in self.requests:
            raise ExecutorInputError(request_id, "request_id", "already in flight")
        prompt, table = list(prompt_ids), list(block_table)
        check_invariants(
            request_id,
            prompt,
            params,
            table,
            num_cached_tokens,
            prior_output_tokens,
            max_model_len=self.max_model_len,
            num_blocks=self.num_blocks,
            block_size=self.block_size,
        )
        state = self.structured.state(request_id, params, prompt, prior_output_tokens, grammar)
        seed = params.seed if params.seed is not None else random.getrandbits(63)
        stop = set(params.stop_token_ids)
        if not params.ignore_eos:
            stop.update(self.eos_token_ids)
        # prompt logprobs and mean pooling read every prompt row: a cached prefix (of their own:
        # the front door salts them apart) is computed again
        whole = params.prompt_logprobs is not None or params.pooling == "mean"
        req = RequestState(
            request_id,
            prompt,
            params,
            table,
            0 if whole else num_cached_tokens,
            seed,
            frozenset(stop),
            prior_output_tokens,
            # min_tokens of a constrained request acts on its grammar mask instead
            procs=LogitsProcessors.build(
                params,
                prompt,
                prior_output_tokens,
                set() if state else stop,
                self.vocab_size,
                self.device,
            ),
            grammar=state,
        )
        if self.speculative is not None:  # its proposer (gpu/spec/plan.py)
            req.ngram = NgramTokens(prompt)
        if params.lora is not None:  # resident: the executor core loaded it first
            req.lora = self.adapter(params.lora.digest)
            if req.lora is None:
                raise ExecutorInputError(request_id, "lora", f"{params.lora.name!r} not loaded")
        self.requests.add(req)

    def start(self, run: Run, grammar: Compiled | None) -> None:
        """``add_request`` for an ``x_run`` (the executor core's way in)."""
        self.add_request(
            run.request_id,
            run.prompt_ids,
            run.params,
            run.block_table,
            run.cached_tokens,
            prior_output_tokens=run.output_offset,
            grammar=grammar,
        )

    def extend(self, request_id: str, new_blocks: list[int]) -> None:
        """Append ``new_blocks`` to the request's block table. Raises ExecutorInputError."""
        self.requests.extend(request_id, new_blocks)

    def abort(self, request_id: str) -> bool:
        """Forget the request (abort or preemption); True if it was in flight."""
        return self.requests.abort(request_id)

    def has_work(self) -> bool:
        return self.requests.has_work()

    def num_requests(self) -> int:
        return self.requests.num_requests()

    def fills_a_step(self) -> bool:
        return self.requests.fills_a_step()

    # ---- stepping -----------------------------------------------------------------------

    def step(self, on_planned: Callable[[list[str]], None] | None = None) -> StepResult:
        """Run one forward over the scheduled decodes and prefill chunks; see the module doc.

        ``on_planned``, if given, is called once the step is planned, before the forward, with
        the requests whose prompt this step completes: their prompt KV is in the cache once
        the step returns (whatever else happens in it; a forward that raises raises here)."""
        t0 = time.perf_counter()
        cap = None
        if self.adaptive is not None and self.requests.prefilling:
            cap = self.adaptive.cap(*self.requests.decode_load())
        plan = self.requests.plan(cap)
        decodes, chunks, skipped = plan.decodes, plan.chunks, plan.skipped
        if not decodes and not chunks:
            return StepResult([], 0, 0, 0, skipped, 0.0, time.perf_counter() - t0)
        if on_planned is not None and (finals := plan.completing()):
            on_planned([r.rid for r in finals])

        shape = plan.shape()  # for step-time models
        sp = self._spec_plan(decodes, len(decodes) + shape.prefill_tokens)
        drafts = sp.drafts if sp is not None else {}
        batch = step_batch.build(decodes, chunks, drafts)
        samplers = batch.samplers
        dev = self.device
        plain = [(r.table, r.computed) for r in batch.plain]
        meta = build_metadata(plain, batch.spans, self.cache, self.kv_dtype, dev)
        t1 = time.perf_counter()
        # the grammar masks (a draft row's past the drafts before it), while the forward runs
        masking = self.structured.start(samplers, batch.offsets, drafts)
        longs = functools.partial(torch.tensor, dtype=torch.long, device=dev)
        lora = self.lora_slots.rows(batch.owners) if self.lora_slots is not None else None
        x = self.model.trunk(longs(batch.ids), longs(batch.pos), meta, self.cache, lora)
        read = longs(batch.logit_rows + batch.score_rows)
        logits, pooled = self.model.logits(x, read), pool(self.model, x, batch)  # + embeddings
        logits, scores = split_scores(logits, batch)  # prompt logprobs: scored and set apart
        masked, mask_s = logits, 0.0
        if masking is not None:
            tm = time.perf_counter()
            masked = self.structured.mask(logits, samplers, masking)  # constrained rows only
            mask_s = time.perf_counter() - tm
        # the raw logits outlive the sampler only for logprobs (else it may rewrite them)
        scratch = masked is not logits or all(r.params.logprobs is None for r in samplers)
        tokens_t = sample_rows(masked, samplers, batch.offsets if drafts else None, drafts, scratch)
        tokens = tokens_t.tolist()
        forward_s = time.perf_counter() - t1
        if sp is not None and not chunks:  # what a served step's rows cost (gpu/spec/cost.py)
            self.spec_cost.observe(len(batch.ids), forward_s)
        lps, tops = row_logprobs(logits, tokens_t, [r.params for r in samplers])  # before the mask

        outputs = step_batch.prefilled(chunks)  # the chunks' progress
        failed: list[tuple[str, str, str]] = []
        stats = sp.stats() if sp is not None else None
        emit = functools.partial(
            step_batch.emit, self.requests, self.structured, self.max_model_len
        )
        for req, i, d in batch.runs:
            n = 1
            if d:
                n += accepted(tokens[i : i + len(d)], d)
                assert sp is not None and stats is not None and req.ngram is not None
                req.ngram.settle(len(d), n - 1)
                stats.add(req.rid, len(d), n - 1, req.rid in sp.explored)
            if req.out:  # a decode: its input and accepted drafts are in the cache now
                req.computed += n
            for j in range(i, i + n):
                mask_s += emit(req, tokens[j], lps[j], tops[j], outputs, failed)
                if req.rid not in self.requests:
                    break  # it ended
        step_s = time.perf_counter() - t0
        refit = None
        if self.adaptive is not None:
            rows = len(decodes) + (sum(len(d) for d in drafts.values()) if drafts else 0)
            if self.adaptive.observe(shape.prefill_tokens, rows, shape.decode_ctx, step_s):
                refit = self.adaptive.costs
        return StepResult(
            outputs,
            shape.prefill_tokens,
            len(decodes),
            len(decodes) + len(chunks),
            skipped,
            forward_s,
            step_s,
            mask_s,
            sum(r.grammar is not None for r in samplers),
            failed,
            decode_ctx=shape.decode_ctx,
            prefill_ctx=shape.prefill_ctx,
            spec=stats,
            prefill_cap=cap,
            refit=refit,
            prompt=scores,
            pooled=pooled,
            loras=lora.adapters if lora is not None else 0,
        )

    def _spec_plan(self, decodes: list[RequestState], rows: int) -> SpecPlan | None:
        """The step's drafts (``gpu/spec/plan.py``); None when speculation is off."""
        if self.speculative is None:
            return None
        return plan_drafts(
            decodes, rows, self.speculative, self.budget.step_budget, self.spec_cost,
            self.block_size, self.max_model_len, self.explore,
        )  # fmt: skip
