"""Load a Hugging Face-layout decoder-only model directory: config, weights, tokenizer.

Only the Llama family is supported (Llama, Qwen2, Qwen3, Mistral). transformers is used for the
config (defaults, RoPE parameters) and the tokenizer; the weights are read with safetensors.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

SUPPORTED = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "mistral": "MistralForCausalLM",
}
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class UnsupportedModelError(ValueError):
    """The model directory holds an architecture this runtime does not implement."""


@dataclass
class ModelSpec:
    """Shapes and hyper-parameters of a Llama-family model, read from its config."""

    arch: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    max_model_len: int
    tie_word_embeddings: bool
    qk_norm: bool
    hf_config: Any


def resolve_device(device: str | torch.device | None) -> torch.device:
    """``device`` as given, else cuda when available, else cpu."""
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def resolve_dtype(dtype: str | torch.dtype | None, device: torch.device) -> torch.dtype:
    """``dtype`` as given (name or torch dtype), else bfloat16 on cuda and float32 on cpu.

    Raises ValueError for a dtype other than float32/bfloat16/float16.
    """
    if dtype is None:
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if isinstance(dtype, str):
        if dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
        return DTYPES[dtype]
    if dtype not in DTYPES.values():
        raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
    return dtype


def load_spec(model_dir: str | Path) -> ModelSpec:
    """Read ``config.json``; raise UnsupportedModelError naming the architecture if not Llama-family."""
    model_dir = Path(model_dir)
    raw = json.loads((model_dir / "config.json").read_text())
    model_type = raw.get("model_type")
    archs = raw.get("architectures") or []
    if model_type not in SUPPORTED:
        name = archs[0] if archs else model_type
        raise UnsupportedModelError(
            f"unsupported architecture {name!r} (model_type {model_type!r}); "
            f"supported: {', '.join(SUPPORTED.values())}"
        )
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(str(model_dir))
    window = getattr(cfg, "sliding_window", None)
    if window and getattr(cfg, "use_sliding_window", True):
        raise UnsupportedModelError(f"sliding-window attention ({window}) is not supported")
    if getattr(cfg, "hidden_act", "silu") != "silu":
        raise UnsupportedModelError(f"activation {cfg.hidden_act!r} is not supported (silu only)")
    heads = cfg.num_attention_heads
    return ModelSpec(
        arch=model_type,
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.hidden_size,
        num_layers=cfg.num_hidden_layers,
        num_heads=heads,
        num_kv_heads=getattr(cfg, "num_key_value_heads", None) or heads,
        head_dim=getattr(cfg, "head_dim", None) or cfg.hidden_size // heads,
        intermediate_size=cfg.intermediate_size,
        rms_norm_eps=cfg.rms_norm_eps,
        max_model_len=cfg.max_position_embeddings,
        tie_word_embeddings=bool(getattr(cfg, "tie_word_embeddings", False)),
        qk_norm=model_type == "qwen3",
        hf_config=cfg,
    )


def attention_dtype(dtype: torch.dtype, device: torch.device) -> torch.dtype:
    """The dtype of the attention block (Q/K/V and output projections, the KV cache, the
    attention itself) and of the weights as loaded, for a model run in ``dtype``.

    bfloat16 on CPU keeps the attention block in float32 and runs only the MLP (87% of a Qwen2
    layer's weights) in bfloat16: teacher forced on the 0.39B model, the attention's bfloat16
    roundings were a third of the drift from float32 (top-1 agreement 96.7% -> 97.7%,
    docs/benchmarks/cpu-levers.md) for ~12% of the weight bytes. Elsewhere, ``dtype`` itself."""
    if dtype == torch.bfloat16 and device.type == "cpu":
        return torch.float32
    return dtype


def load_weights(
    model_dir: str | Path, dtype: torch.dtype, device: torch.device
) -> dict[str, torch.Tensor]:
    """All tensors of the model's safetensors shards, cast to ``dtype`` on ``device``."""
    from safetensors.torch import load_file

    model_dir = Path(model_dir)
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors in {model_dir}")
    out: dict[str, torch.Tensor] = {}
    for f in files:
        for name, t in load_file(str(f)).items():
            out[name] = t.to(device=device, dtype=dtype)
    return out


def eos_token_ids(model_dir: str | Path, spec: ModelSpec) -> tuple[int, ...]:
    """EOS ids from generation_config.json and config.json, union, in first-seen order."""
    ids: list[int] = []
    sources = [getattr(spec.hf_config, "eos_token_id", None)]
    gen = Path(model_dir) / "generation_config.json"
    if gen.exists():
        sources.insert(0, json.loads(gen.read_text()).get("eos_token_id"))
    for src in sources:
        for i in [src] if isinstance(src, int) else list(src or []):
            if i not in ids:
                ids.append(int(i))
    return tuple(ids)


def load_tokenizer(model_dir: str | Path):
    """The model's tokenizer through ``AutoTokenizer`` (the executor itself works on ids only)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(model_dir))
