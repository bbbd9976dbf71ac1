"""The executor's section of the runtime configuration (``[executor]``, ``--chunk-cap`` ...):
its step budget, dtype and device, threads, burst wait and speculative decoding."""

from __future__ import annotations

from dataclasses import dataclass, field

from actors.runtime.options import doc


@dataclass
class ExecutorConfig:
    chunk_cap: int = field(default=1024, metadata=doc("max prefill tokens per request per step"))
    step_budget: int = field(default=8192, metadata=doc("max tokens (prefill + decode) per step"))
    long_prefill_threshold: int = field(
        default=0, metadata=doc("prompts longer than this are long (0: no limit)")
    )
    max_long_prefills: int = field(
        default=1, metadata=doc("long prompts prefilling in the same step, at most")
    )
    budget_policy: str = field(
        default="adaptive",
        metadata=doc(
            "each step's prefill tokens: adaptive (what a step-time target leaves once the "
            "decodes are priced, from a model fitted online; gpu/step/budget.py) or fixed "
            "(--step-budget)",
            choices=("adaptive", "fixed"),
        ),
    )
    step_target_ms: float = field(
        default=0.0,
        metadata=doc(
            "adaptive budget: the step time to keep to (0: what a step prefilling 1,024 prompt "
            "tokens alone takes, timed at start)"
        ),
    )
    bind_threads: bool = field(
        default=False,
        metadata=doc(
            "pin each of the executor's OpenMP threads to one CPU (the one running the steps to "
            "the first), as vLLM's CPU worker binds its threads"
        ),
    )
    decode_first: bool = field(
        default=True,
        metadata=doc(
            "schedule decodes before prefill chunks in each step",
            off_flag="prefill-first",
            off_help="schedule prefill chunks before decodes in each step",
        ),
    )
    dtype: str | None = field(
        default=None,
        metadata=doc(
            "weights and activations; auto (the default, as vLLM's): the checkpoint's dtype "
            "where the device computes it natively, else float32 (cuda: bfloat16)",
            choices=("auto", "float32", "bfloat16", "float16"),
        ),
    )
    model_impl: str = field(
        default="auto",
        metadata=doc(
            "the model's code, as vLLM's flag: auto (native for Llama, Qwen2, Qwen3 and "
            "Mistral, else transformers'), native, or transformers (the model's own modeling "
            "code with minirt's paged attention; docs/models.md)",
            choices=("auto", "native", "transformers"),
        ),
    )
    device: str | None = field(default=None, metadata=doc("torch device (cpu, cuda, cuda:1...)"))
    gpu_memory_utilization: float = field(
        default=0.9,
        metadata=doc(
            "cuda: the share of the card's total memory this instance uses (weights, "
            "activations, KV), as vLLM's flag; replicas sharing a card split it"
        ),
    )
    threads: int | None = field(default=None, metadata=doc("torch threads (default: all cores)"))
    burst_wait_ms: float = field(
        default=100.0,
        metadata=doc(
            "with nothing running, wait up to this long for the rest of a burst being admitted "
            "(x_run.more) before the first step, or until a step's budget is full (0: start at "
            "once)"
        ),
    )
    speculative_config: str = field(
        default="",
        metadata=doc(
            "speculative decoding, as vLLM's JSON object: method (ngram: prompt lookup, the "
            "only one), num_speculative_tokens, prompt_lookup_max, prompt_lookup_min (empty: "
            "off)"
        ),
    )
    spec_max_rows: int = field(
        default=0,
        metadata=doc(
            "speculative decoding: draft rows ride in any step of up to this many rows, in "
            "none of more (0: priced on forward times measured at start, drafts only where "
            "they raise the step's expected tokens per second)"
        ),
    )
