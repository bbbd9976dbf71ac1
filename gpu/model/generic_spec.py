"""What the transformers model path (``--model-impl transformers``, gpu.model.generic) serves:
any decoder-only causal LM transformers knows whose attention goes through its attention
interface, the KV in minirt's paged cache. Everything else is refused (by gpu.model.loader,
at start) naming the reason given here."""

from __future__ import annotations

import sys
from typing import Any

# Per-layer attention kinds the attention function computes: full causal and sliding-window
# causal ("chunked" attention, Llama 4's, would need another mask).
LAYER_TYPES = ("full_attention", "sliding_attention")
# Config sections of models that take more than text.
_OTHER_INPUTS = ("vision_config", "audio_config", "speech_config", "encoder_config")


def refusal(cfg: Any, raw: dict[str, Any]) -> str | None:
    """Why transformers' code for ``cfg`` cannot run over the paged cache; None if it can."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    model_type = raw.get("model_type")
    if getattr(cfg, "is_encoder_decoder", False):
        return f"model_type {model_type!r} is an encoder-decoder model (decoder-only models only)"
    for name in _OTHER_INPUTS:
        if raw.get(name) is not None:
            return f"{name} is set: the model takes inputs other than text (text models only)"
    if model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        return f"model_type {model_type!r} has no causal-LM class in transformers"
    if getattr(cfg, "quantization_config", None):
        method = dict(cfg.quantization_config).get("quant_method", "?")
        return f"quantization_config (quant_method {method!r}) is not supported"
    cls = model_class(str(model_type))
    if not hasattr(sys.modules[cls.__module__], "ALL_ATTENTION_FUNCTIONS"):
        return (
            f"{cls.__name__} computes attention in its own code, not through transformers' "
            "attention interface"
        )
    for kind in getattr(cfg, "layer_types", None) or []:
        if kind not in LAYER_TYPES:
            return f"layer_types entry {kind!r} is not supported (only {', '.join(LAYER_TYPES)})"
    return None


def model_class(model_type: str) -> Any:
    """transformers' causal-LM class for ``model_type`` (imported)."""
    import transformers
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return getattr(transformers, MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[model_type])


def _ffn_size(cfg: Any) -> int:
    """An MLP width giving the layer's parameter count (weights only; for sizing memory): the
    experts' widths summed for mixture-of-experts models (routed and shared)."""
    hidden = int(cfg.hidden_size)
    width = int(getattr(cfg, "intermediate_size", None) or 4 * hidden)
    experts = getattr(cfg, "num_local_experts", None) or getattr(cfg, "num_experts", None)
    if experts:
        per = int(getattr(cfg, "moe_intermediate_size", None) or width)
        shared = int(getattr(cfg, "shared_expert_intermediate_size", None) or 0)
        width = int(experts) * per + shared
    return width


def fields(cfg: Any, raw: dict[str, Any]) -> dict[str, Any]:
    """The shapes gpu.model.loader.ModelSpec holds, for a config :func:`refusal` passed."""
    heads = int(cfg.num_attention_heads)
    return {
        "arch": str(raw["model_type"]),
        "vocab_size": int(cfg.vocab_size),
        "hidden_size": int(cfg.hidden_size),
        "num_layers": int(cfg.num_hidden_layers),
        "num_heads": heads,
        "num_kv_heads": int(getattr(cfg, "num_key_value_heads", None) or heads),
        "head_dim": int(getattr(cfg, "head_dim", None) or cfg.hidden_size // heads),
        "intermediate_size": _ffn_size(cfg),
        "rms_norm_eps": float(getattr(cfg, "rms_norm_eps", None) or 1e-6),
        "max_model_len": int(getattr(cfg, "max_position_embeddings", None) or 2048),
        "tie_word_embeddings": bool(getattr(cfg, "tie_word_embeddings", False)),
        "qk_norm": False,
    }
