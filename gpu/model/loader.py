"""Load a Hugging Face-layout decoder-only model directory: config, weights, tokenizer.

Two model paths (``--model-impl``, vLLM's flag): the native one for the Llama family (Llama,
Qwen2, Qwen3, Qwen3-MoE, Mistral; weights read with safetensors, gpu.model.llama), and transformers' own
modeling code for any other decoder-only causal LM whose attention goes through transformers'
attention interface (gpu.model.generic). transformers reads the config and the tokenizer.
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
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "mistral": "MistralForCausalLM",
}
QWEN = ("qwen2", "qwen3", "qwen3_moe")
MODEL_IMPLS = ("auto", "native", "transformers")
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
    impl: str = "native"  # the model path: "native" (gpu.model.llama) or "transformers"
    # mixture of experts (Qwen3-MoE on the native path; 0 / empty: dense)
    experts: int = 0
    experts_per_token: int = 0
    norm_topk_prob: bool = False
    expert_size: int = 0  # each expert's MLP width
    moe_layers: tuple[int, ...] = ()


# Where weights are read to: the host, whatever the executor's device (gpu.model.llama moves them).
HOST = torch.device("cpu")


def tune_process(device: torch.device) -> None:
    """Process-wide settings for an executor on ``device``: on cpu the allocator's
    (gpu.model.cpu_tuning); on cuda cuDNN's SDPA off, since it builds an execution plan per new shape
    on the host, which took most of a run's time with prefill chunks of every length
    (docs/benchmarks/cuda/README.md). Flash and memory-efficient attention build none."""
    if device.type == "cpu":
        from gpu.model import cpu_tuning

        cpu_tuning.tune_malloc()
    else:
        torch.backends.cuda.enable_cudnn_sdp(False)


def resolve_device(device: str | torch.device | None) -> torch.device:
    """``device`` as given, else cuda when available, else cpu."""
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def resolve_dtype(
    dtype: str | torch.dtype | None, device: torch.device, model_dir: str | Path | None = None
) -> torch.dtype:
    """The dtype a model is served in: :func:`choose_dtype`'s, without its reason."""
    return choose_dtype(dtype, device, model_dir)[0]


def checkpoint_dtype(model_dir: str | Path) -> torch.dtype | None:
    """The dtype the checkpoint's config names (``dtype``, or the older ``torch_dtype``)."""
    try:
        cfg = json.loads((Path(model_dir) / "config.json").read_text())
    except (OSError, ValueError):
        return None
    return DTYPES.get(cfg.get("dtype") or cfg.get("torch_dtype") or "")


def fast_bfloat16(device: torch.device) -> str | None:
    """Why this device computes bfloat16 natively (the instructions), or None where it does not:
    on CPU, avx512_bf16 (the kernels' bfloat16 build runs) or AMX."""
    if device.type != "cpu":
        return device.type
    from gpu.kernels import ops

    lib = ops()
    if lib is not None and lib.has_vector("rows_bf16"):
        return "avx512_bf16"
    amx = getattr(torch._C._cpu, "_is_amx_tile_supported", None)
    return "AMX" if amx is not None and amx() else None


def choose_dtype(
    dtype: str | torch.dtype | None, device: torch.device, model_dir: str | Path | None = None
) -> tuple[torch.dtype, str]:
    """The dtype to serve in and why, as vLLM's ``--dtype auto``: ``dtype`` if given; with none
    (or "auto"), bfloat16 on cuda, and on CPU the checkpoint's own where the CPU computes it
    natively (a float16 checkpoint in bfloat16, as vLLM's CPU backend does), else float32.

    Raises ValueError for a dtype other than auto/float32/bfloat16/float16.
    """
    if dtype is not None and dtype != "auto":
        if isinstance(dtype, str):
            if dtype not in DTYPES:
                raise ValueError(f"dtype must be one of {['auto', *sorted(DTYPES)]}, got {dtype!r}")
            return DTYPES[dtype], "as asked (--dtype)"
        if dtype not in DTYPES.values():
            raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
        return dtype, "as asked (--dtype)"
    if device.type == "cuda":
        return torch.bfloat16, "the default on cuda"
    stored = checkpoint_dtype(model_dir) if model_dir is not None else None
    if stored in (torch.bfloat16, torch.float16):
        name = str(stored).removeprefix("torch.")
        why = fast_bfloat16(device)
        if why is not None:
            return torch.bfloat16, f"the checkpoint's ({name}), computed natively ({why})"
        return torch.float32, (
            f"the checkpoint is {name}, but this CPU has neither avx512_bf16 nor AMX: "
            "bfloat16 would be emulated, slower than float32"
        )
    if stored is None:
        return torch.float32, "the checkpoint's config names no dtype"
    return torch.float32, "the checkpoint's"


# RoPE types served, each exactly as transformers computes it (gpu.model.llama.LlamaFamilyModel
# ._rope_table, docs/models.md): the first five's tables do not depend on the sequence length;
# "dynamic" and "longrope" recompute theirs once a forward call passes a length, which
# load_spec keeps max_model_len below.
ROPE_TYPES = ("default", "linear", "llama3", "yarn", "proportional", "dynamic", "longrope")
# Config fields of other architectures that change the maths when set; refused if a config of a
# supported architecture carries them (transformers' classes for these would ignore them).
_FOREIGN_FIELDS = ("attn_logit_softcapping", "final_logit_softcapping")


def _refusal(cfg: Any, model_type: str) -> str | None:
    """Why ``cfg`` cannot be served exactly at any length, naming the field; None if it can."""
    if getattr(cfg, "quantization_config", None):
        method = dict(cfg.quantization_config).get("quant_method", "?")
        return (
            f"quantization_config (quant_method {method!r}) is not supported: "
            "weights are read as plain floating point"
        )
    act = getattr(cfg, "hidden_act", "silu")
    if act != "silu":
        return f"hidden_act {act!r} is not supported (silu only)"
    if getattr(cfg, "mlp_bias", False):
        return "mlp_bias=True is not supported (MLP projections without bias only)"
    for name in _FOREIGN_FIELDS:
        if getattr(cfg, name, None) is not None:
            return f"{name} {getattr(cfg, name)!r} is not supported (no logit soft-capping)"
    rp = getattr(cfg, "rope_parameters", None) or {}
    if not rp:
        return "rope_parameters missing (no rope_theta either): a rotary model is expected"
    if "rope_type" not in rp:
        return (
            f"rope_parameters nested per layer type ({', '.join(map(str, rp))}) "
            "is not supported: one RoPE for every layer only"
        )
    rope_type = rp["rope_type"]
    if rope_type not in ROPE_TYPES:
        return (
            f"rope_parameters.rope_type {rope_type!r} is not supported "
            f"(supported: {', '.join(ROPE_TYPES)})"
        )
    partial = rp.get("partial_rotary_factor", 1.0)
    if partial != 1.0 and rope_type != "proportional":
        # transformers' default RoPE ignores it and the scaled types' tables would not fit the
        # head: either way not the model the checkpoint was trained as
        return (
            f"rope_parameters.partial_rotary_factor {partial} is not supported with rope_type "
            f"{rope_type!r} (rotary embeddings over the whole head only)"
        )
    if model_type in QWEN:
        for kind in getattr(cfg, "layer_types", None) or []:
            if kind not in ("full_attention", "sliding_attention"):
                return f"layer_types entry {kind!r} is not supported"
    return None


def _length_caps(cfg: Any, model_type: str) -> dict[str, int]:
    """The lengths past which this runtime would not compute what transformers computes, by
    the config field that sets them; ``max_model_len`` is capped at the least of them.

    - ``rope_parameters.original_max_position_embeddings`` of a "longrope" RoPE: transformers
      switches from the short factors to the long ones for a whole forward call once it reaches
      past that length, so keys already cached keep the short rotation while those of a long
      prompt get the long one; a paged cache that rotates each key once cannot follow that, so
      only the short-factor range is served.
    - ``sliding_window`` (Mistral; Qwen2/Qwen3 with ``use_sliding_window`` and a layer at or past
      ``max_window_layers``): attention over the whole sequence is the windowed attention while
      the sequence fits in the window (a query at i sees keys j with i - j < window).

    "dynamic" needs no cap: its frequencies change only once a forward call passes
    ``max_position_embeddings``, the length served anyway."""
    caps: dict[str, int] = {}
    rp = cfg.rope_parameters
    if rp["rope_type"] == "longrope":
        caps["rope_parameters.original_max_position_embeddings"] = int(
            rp["original_max_position_embeddings"]
        )
    window = getattr(cfg, "sliding_window", None)
    if model_type in QWEN:
        # transformers' Qwen2/Qwen3 configs already set sliding_window to None without
        # use_sliding_window; the window applies to the "sliding_attention" layers only
        if window is not None and "sliding_attention" in (getattr(cfg, "layer_types", None) or []):
            caps["sliding_window"] = int(window)
    elif model_type == "mistral" and window is not None:
        caps["sliding_window"] = int(window)
    return caps


def load_spec(model_dir: str | Path, model_impl: str = "auto") -> ModelSpec:
    """Read ``config.json`` into the spec of the path that serves it (``model_impl``: auto, the
    native path for the Llama family and transformers' code for any other causal LM; native;
    transformers). Raises UnsupportedModelError (a ValueError) naming the architecture if no
    path serves it, or naming the config field if it sets something the native path does not
    compute as transformers does (activation, MLP bias, RoPE type, partial rotary, nested
    per-layer RoPE, quantization, logit soft-capping); gpu.model.generic_spec names the
    transformers path's refusals.

    ``max_model_len`` is ``max_position_embeddings``, on the native path capped where its maths
    is exact only below a length (see :func:`_length_caps`: longrope's original length, a
    sliding window); a cap is logged as a warning. docs/models.md lists what loads."""
    import logging

    if model_impl not in MODEL_IMPLS:
        raise ValueError(f"model_impl must be one of {list(MODEL_IMPLS)}, got {model_impl!r}")
    model_dir = Path(model_dir)
    raw = json.loads((model_dir / "config.json").read_text())
    model_type = raw.get("model_type")
    archs = raw.get("architectures") or []
    if model_impl == "transformers" or (model_impl == "auto" and model_type not in SUPPORTED):
        from gpu.model import generic_spec

        cfg = _read_config(model_dir)
        why = generic_spec.refusal(cfg, raw)
        if why is not None:
            raise UnsupportedModelError(f"{model_dir.name}: {why}")
        return ModelSpec(**generic_spec.fields(cfg, raw), hf_config=cfg, impl="transformers")
    if model_type not in SUPPORTED:
        name = archs[0] if archs else model_type
        raise UnsupportedModelError(
            f"unsupported architecture {name!r} (model_type {model_type!r}) on the native "
            f"path; it serves {', '.join(SUPPORTED.values())} (--model-impl transformers or "
            "auto runs transformers' own code for other causal LMs)"
        )
    cfg = _read_config(model_dir)
    why = _refusal(cfg, model_type)
    if why is not None:
        raise UnsupportedModelError(
            f"{model_dir.name}: {why} on the native path (--model-impl transformers runs "
            "transformers' own code for it)"
        )
    max_len = int(cfg.max_position_embeddings)
    for field, cap in _length_caps(cfg, model_type).items():
        if cap < max_len:
            logging.getLogger(__name__).warning(
                "%s: serving %d of max_position_embeddings %d positions: %s is %d, and the "
                "model computes what transformers does only up to there (docs/models.md)",
                model_dir.name,
                cap,
                cfg.max_position_embeddings,
                field,
                cap,
            )
            max_len = cap
    from gpu.model.experts import config_fields

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
        max_model_len=max_len,
        tie_word_embeddings=bool(getattr(cfg, "tie_word_embeddings", False)),
        qk_norm=model_type in ("qwen3", "qwen3_moe"),
        hf_config=cfg,
        **(config_fields(cfg) if model_type == "qwen3_moe" else {}),
    )


def _read_config(model_dir: Path) -> Any:
    """``config.json`` through transformers' ``AutoConfig`` (its defaults and legacy fields
    standardized); UnsupportedModelError where transformers cannot read it."""
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(str(model_dir))
    except (AttributeError, TypeError, KeyError, ValueError) as e:
        import transformers

        raise UnsupportedModelError(
            f"{model_dir.name}: config.json could not be read by transformers "
            f"{transformers.__version__}: {type(e).__name__}: {e}"
        ) from e


def attention_dtype(dtype: torch.dtype, device: torch.device) -> torch.dtype:
    """The dtype of the attention block (Q/K/V and output projections, the KV cache, the
    attention itself) and of the weights as loaded, for a model run in ``dtype``.

    ``dtype`` itself, except bfloat16 on a CPU without native bfloat16 (:func:`fast_bfloat16`):
    there only the MLP runs in bfloat16 (the packed bfloat16 kernels need avx512_bf16) and the
    attention block stays float32. With bfloat16 the residual stream, the norms, RoPE and the LM
    head are float32 wherever it runs (``gpu.model.llama``)."""
    if dtype == torch.bfloat16 and device.type == "cpu" and fast_bfloat16(device) is None:
        return torch.float32
    return dtype


def load_weights(
    model_dir: str | Path, dtype: torch.dtype, device: torch.device, tied: bool = False
) -> dict[str, torch.Tensor]:
    """All tensors of the model's safetensors shards, cast to ``dtype`` on ``device``; with
    ``tied`` (the config ties the head to the embedding) the shared tensor under either name."""
    from safetensors.torch import load_file

    model_dir = Path(model_dir)
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors in {model_dir}")
    out: dict[str, torch.Tensor] = {}
    for f in files:
        for name, t in load_file(str(f)).items():
            out[name] = t.to(device=device, dtype=dtype)
    # A tied head is stored once, under either name: transformers' save_pretrained keeps
    # model.embed_tokens.weight, safetensors.torch.save_model (and some converters)
    # lm_head.weight.
    embed, head = "model.embed_tokens.weight", "lm_head.weight"
    if tied and embed not in out and head in out:
        out[embed] = out[head]
    if embed not in out:
        raise UnsupportedModelError(f"{model_dir}: no {embed} (nor a tied {head}) in the weights")
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
