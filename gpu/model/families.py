"""Tiny random-weight configs of causal-LM families beyond the native four, for the transformers
model path (gpu.model.generic): each sets what makes its family differ (mixture of experts,
sliding windows, soft-capping, partial rotary, multipliers), at the tiny size's shapes
(gpu.model.make_model). ``minirt make-model --arch gemma2`` writes one; the tests serve them
all against transformers' own ``generate``.

Sliding windows are 8 tokens, so the tests' prompts run past them."""

from __future__ import annotations

from typing import Any

WINDOW = 8
_MOE = {"num_experts_per_tok": 2, "norm_topk_prob": True}

FAMILIES: dict[str, dict[str, Any]] = {
    # mixture of experts: routed experts, top-2 of 4
    "qwen3_moe": {
        **_MOE,
        "num_experts": 4,
        "moe_intermediate_size": 32,
        "decoder_sparse_step": 1,
        "head_dim": 16,
    },
    "mixtral": {**_MOE, "num_local_experts": 4, "sliding_window": None},
    "olmoe": {**_MOE, "num_experts": 4},
    "granitemoe": {**_MOE, "num_local_experts": 4, "logits_scaling": 2.0},
    "qwen2_moe": {  # routed experts beside a gated shared expert
        **_MOE,
        "num_experts": 4,
        "moe_intermediate_size": 32,
        "shared_expert_intermediate_size": 64,
    },
    # alternating sliding windows, logit soft-capping on attention and on the head
    "gemma2": {
        "head_dim": 16,
        "sliding_window": WINDOW,
        "attn_logit_softcapping": 20.0,
        "final_logit_softcapping": 10.0,
        "query_pre_attn_scalar": 16,
        "layer_types": ["sliding_attention", "full_attention"],
    },
    "gemma3_text": {
        "head_dim": 16,
        "sliding_window": WINDOW,
        "query_pre_attn_scalar": 16,
        "layer_types": ["sliding_attention", "full_attention"],
    },
    "gemma": {"head_dim": 16},
    # partial rotary
    "phi3": {"partial_rotary_factor": 0.5},
    "stablelm": {"partial_rotary_factor": 0.25, "use_qkv_bias": True},
    "gpt_neox": {"rotary_pct": 0.25, "num_key_value_heads": None},  # no grouped KV heads
    "phi": {"partial_rotary_factor": 0.5},
    "glm": {"head_dim": 16, "partial_rotary_factor": 0.5},
    # one K/V head shared by every query head (multi-query), named by no config field
    "falcon": {"multi_query": True},
    # multipliers on the embedding, residual, attention and logits
    "granite": {
        "embedding_multiplier": 2.0,
        "residual_multiplier": 0.5,
        "attention_multiplier": 0.1,
        "logits_scaling": 2.0,
    },
    "cohere": {"logit_scale": 0.5},
    "olmo2": {},
    "starcoder2": {"sliding_window": WINDOW, "use_bias": True},
    "exaone4": {"sliding_window": WINDOW, "head_dim": 16},
    "nemotron": {"head_dim": 16},  # squared-ReLU MLP, LayerNorm1P
    "smollm3": {},
}
