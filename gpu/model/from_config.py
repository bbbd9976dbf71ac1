"""The executor a runtime's configuration describes (its executor, KV and scheduler sections,
the model and its context)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from gpu.model.kv_cache import resolve_num_blocks
from gpu.model_runner import ModelRunner

if TYPE_CHECKING:
    from actors.runtime.config import RuntimeConfig


def executor_from_config(cfg: RuntimeConfig) -> ModelRunner:
    x = cfg.executor
    return ModelRunner(
        cfg.model,
        dtype=x.dtype,
        device=x.device,
        num_blocks=resolve_num_blocks(cfg),
        block_size=cfg.kv.block_size,
        chunk_cap=x.chunk_cap,
        step_budget=x.step_budget,
        max_batch_size=cfg.scheduler.max_batch_size,
        long_prefill_threshold=x.long_prefill_threshold,
        max_long_prefills=x.max_long_prefills,
        decode_first=x.decode_first,
        threads=x.threads,
        max_model_len=cfg.max_model_len,
        gpu_memory_utilization=x.gpu_memory_utilization,
        speculative=x.speculative_config,
        spec_rows=x.spec_max_rows or None,
        budget_policy=x.budget_policy,
        step_target_ms=x.step_target_ms,
        bind_threads=x.bind_threads,
        max_loras=cfg.lora.max_loras if cfg.lora.enable_lora else 0,
        max_lora_rank=cfg.lora.max_lora_rank,
        model_impl=x.model_impl,
    )
