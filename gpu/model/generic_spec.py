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
    shape = attention_shape(cfg, raw)
    if shape is not None and shape[2] != shape[3]:
        return (
            f"{cls.__name__} attends with keys of {shape[2]} and values of {shape[3]} dims "
            "(multi-head latent attention): the paged cache holds one head size"
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


class _Seen(Exception):
    """The first attention call's shapes: query heads, K/V heads, key and value head sizes."""


def _probe(module: Any, query: Any, key: Any, value: Any, *args: Any, **kwargs: Any) -> Any:
    raise _Seen(int(query.shape[1]), int(key.shape[1]), int(key.shape[-1]), int(value.shape[-1]))


_SHAPES: dict[str, tuple[int, ...] | None] = {}


def attention_shape(cfg: Any, raw: dict[str, Any]) -> tuple[int, ...] | None:
    """(heads, K/V heads, key size, value size) of the model's first attention call, from a
    one-token forward of the model built on torch's meta device (no memory, no weights): what
    the paged cache must hold, whatever the config calls it (GPT-2 and Falcon name their K/V
    heads otherwise, or not at all). None where the model cannot run there."""
    import copy
    import json

    import torch
    from transformers import AttentionInterface, AutoModelForCausalLM

    key = json.dumps(raw, sort_keys=True, default=str)
    if key in _SHAPES:
        return _SHAPES[key]
    AttentionInterface.register("minirt_probe", _probe)
    shape: tuple[int, ...] | None = None
    try:
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(
                copy.deepcopy(cfg), attn_implementation="minirt_probe"
            )
            ids = torch.zeros(1, 1, dtype=torch.long)
            getattr(model, model.base_model_prefix)(
                input_ids=ids, position_ids=ids, use_cache=False
            )
    except _Seen as seen:
        shape = tuple(seen.args)
    except Exception:  # an op the meta device lacks: the config's own fields instead
        shape = None
    _SHAPES[key] = shape
    return shape


def fields(cfg: Any, raw: dict[str, Any]) -> dict[str, Any]:
    """The shapes gpu.model.loader.ModelSpec holds, for a config :func:`refusal` passed."""
    heads = int(cfg.num_attention_heads)
    kv_heads = int(getattr(cfg, "num_key_value_heads", None) or heads)
    head_dim = int(getattr(cfg, "head_dim", None) or cfg.hidden_size // heads)
    shape = attention_shape(cfg, raw)
    if shape is not None:
        heads, kv_heads, head_dim, _ = shape
    return {
        "arch": str(raw["model_type"]),
        "vocab_size": int(cfg.vocab_size),
        "hidden_size": int(cfg.hidden_size),
        "num_layers": int(cfg.num_hidden_layers),
        "num_heads": heads,
        "num_kv_heads": kv_heads,
        "head_dim": head_dim,
        "intermediate_size": _ffn_size(cfg),
        "rms_norm_eps": float(getattr(cfg, "rms_norm_eps", None) or 1e-6),
        "max_model_len": int(getattr(cfg, "max_position_embeddings", None) or 2048),
        "tie_word_embeddings": bool(getattr(cfg, "tie_word_embeddings", False)),
        "qk_norm": False,
    }
