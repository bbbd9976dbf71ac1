"""Every RoPE and attention variant the supported configs carry, token-identical to transformers
on a tiny random model (or served up to the length where it is: longrope, sliding window), and
every config field the runtime does not compute refused at start, naming the field.

docs/models.md has the table; gpu.model.loader.load_spec the refusals and caps; gpu.model.llama's
``LlamaFamilyModel._rope_table`` the RoPE tables.
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoConfig, AutoModelForCausalLM

from gpu.model.loader import UnsupportedModelError, load_spec
from gpu.model.make_model import make_model
from gpu.model_runner import ExecutorInputError, ModelRunner
from messages.common import SamplingParams
from tests.executor.test_executor import Driver, compare, reference

NEW_TOKENS = 16
THETA = 10000.0
HALF = 8  # head_dim // 2 of the tiny size: the number of RoPE frequencies
# RoPE models serve 256 positions; prompts run to 200 tokens, past every original length below
ROPE_LEN = 256
LONG_PROMPTS = (1, 45, 200)


def _rope(rope_type: str, **kw: Any) -> dict[str, Any]:
    return {
        "max_position_embeddings": ROPE_LEN,
        "rope_parameters": {"rope_type": rope_type, "rope_theta": THETA, **kw},
    }


SHORT = [1.0 + 0.15 * i for i in range(HALF)]
LONG = [1.0 + 1.5 * i for i in range(HALF)]

# (arch, config overrides, tensors given random values, prompt lengths, positions served)
VARIANTS: dict[str, tuple[str, dict[str, Any], tuple[str, ...], tuple[int, ...], int]] = {
    "linear": ("llama", _rope("linear", factor=4.0), (), LONG_PROMPTS, ROPE_LEN),
    "llama3": (
        "llama",
        # wavelengths 6.3 (kept), 20 (smoothed: between 32/4 and 32/1), 63 and up (divided by 8)
        _rope(
            "llama3",
            factor=8.0,
            low_freq_factor=1.0,
            high_freq_factor=4.0,
            original_max_position_embeddings=32,
        ),
        (),
        LONG_PROMPTS,
        ROPE_LEN,
    ),
    # attention_factor 0.1 ln 8 + 1 scales cos/sin; exact at every position, so past 32
    "yarn": (
        "llama",
        _rope("yarn", factor=8.0, original_max_position_embeddings=32),
        (),
        LONG_PROMPTS,
        ROPE_LEN,
    ),
    "yarn_explicit": (
        "llama",
        _rope(
            "yarn",
            factor=8.0,
            original_max_position_embeddings=32,
            attention_factor=1.3,
            beta_fast=16.0,
            beta_slow=2.0,
        ),
        (),
        LONG_PROMPTS,
        ROPE_LEN,
    ),
    # half the head rotated, the other half's frequencies zero
    "proportional": (
        "llama",
        _rope("proportional", factor=2.0, partial_rotary_factor=0.5),
        (),
        LONG_PROMPTS,
        ROPE_LEN,
    ),
    # the NTK base changes only past max_position_embeddings, never served: default RoPE up to
    # there (the prompts reach its last positions)
    "dynamic": (
        "llama",
        {**_rope("dynamic", factor=4.0), "max_position_embeddings": 96},
        (),
        (1, 40, 80),
        96,
    ),
    # transformers turns to the long factors past 64: served up to 64, the short factors and
    # the attention factor sqrt(1 + ln 4 / ln 64) of max/original = 4
    "longrope": (
        "llama",
        _rope(
            "longrope",
            short_factor=SHORT,
            long_factor=LONG,
            original_max_position_embeddings=64,
        ),
        (),
        (3, 30, 55),
        64,
    ),
    # original = max: the short factors at every position, nothing capped
    "longrope_uncapped": (
        "llama",
        _rope(
            "longrope",
            short_factor=SHORT,
            long_factor=LONG,
            original_max_position_embeddings=ROPE_LEN,
            factor=4.0,
        ),
        (),
        LONG_PROMPTS,
        ROPE_LEN,
    ),
    # q/k RMSNorm per head (norm weights made random: transformers starts them at one)
    "qwen3_qk_norm": ("qwen3", {}, ("q_norm.weight", "k_norm.weight"), (1, 37, 150), 1024),
    "qwen3_qk_norm_bias": (
        "qwen3",
        {"attention_bias": True, "tie_word_embeddings": False},
        ("q_norm.weight", "k_norm.weight", "_proj.bias"),
        (1, 37, 150),
        1024,
    ),
    # q/k/v/o biases (random: transformers starts them at zero), untied head
    "llama_attention_bias": (
        "llama",
        {"attention_bias": True},
        ("_proj.bias",),
        (1, 37, 150),
        1024,
    ),
    "llama_tied": ("llama", {"tie_word_embeddings": True}, (), (1, 37, 150), 1024),
    "qwen2_untied": (
        "qwen2",
        {"tie_word_embeddings": False},
        ("_proj.bias",),
        (1, 37, 150),
        1024,
    ),
    # full attention is windowed attention while the sequence fits in the window: served to 48
    "mistral_sliding_window": ("mistral", {"sliding_window": 48}, (), (2, 30, 44), 48),
    # layer 1 (at max_window_layers and past) windowed: served to 40
    "qwen2_sliding_window": (
        "qwen2",
        {"use_sliding_window": True, "sliding_window": 40, "max_window_layers": 1},
        ("_proj.bias",),
        (2, 20, 35),
        40,
    ),
}


def _randomize(model_dir: Path, suffixes: tuple[str, ...], seed: int = 0) -> None:
    """Give the tensors whose names end with one of ``suffixes`` random values, in place."""
    path = model_dir / "model.safetensors"
    weights = load_file(str(path))
    gen = torch.Generator().manual_seed(seed)
    hit = 0
    for name in sorted(weights):
        if name.endswith(suffixes):
            t = weights[name]
            weights[name] = t + 0.5 * torch.randn(t.shape, generator=gen, dtype=t.dtype)
            hit += 1
    assert hit, f"no tensor ends with {suffixes}"
    save_file(weights, str(path), metadata={"format": "pt"})


def _greedy_matches(model_dir: Path, lengths: tuple[int, ...], seed: int = 0) -> ModelRunner:
    """Greedy tokens of minirt's executor (chunked prefill, paged cache) and of transformers'
    ``generate`` for prompts of ``lengths``, each up to the served length; they must agree (a
    first difference only at a near-tie of transformers' logits, at most once)."""
    ex = ModelRunner(
        model_dir, device="cpu", dtype="float32", num_blocks=64, chunk_cap=7, step_budget=40
    )
    hf = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    rng = random.Random(seed)
    prompts = [[rng.randrange(ex.vocab_size) for _ in range(n)] for n in lengths]
    wanted = [min(NEW_TOKENS, ex.max_model_len - len(p)) for p in prompts]
    drv = Driver(ex)
    for i, (p, n) in enumerate(zip(prompts, wanted, strict=True)):
        drv.add(f"r{i}", p, SamplingParams(max_tokens=n))
    drv.run()
    ties = sum(
        compare(hf, p, drv.outs[f"r{i}"], reference(hf, p, n))
        for i, (p, n) in enumerate(zip(prompts, wanted, strict=True))
    )
    assert ties <= 1, f"{ties} near-tie divergences"
    return ex


@pytest.mark.parametrize("name", list(VARIANTS))
def test_variant_matches_transformers(tmp_path, name):
    arch, overrides, randomize, lengths, served = VARIANTS[name]
    model_dir = make_model(arch, "tiny", tmp_path / name, config_overrides=overrides)
    if randomize:
        _randomize(model_dir, randomize)
    ex = _greedy_matches(model_dir, lengths)
    assert ex.max_model_len == served
    with pytest.raises(ExecutorInputError, match="max positions"):
        ex.add_request("long", [1] * served, SamplingParams(max_tokens=1), list(range(64)))


def test_untied_head_without_its_weights_is_refused(tmp_path):
    """transformers would start a missing untied head from random values: refused instead."""
    model_dir = make_model("llama", "tiny", tmp_path / "m")  # untied
    path = model_dir / "model.safetensors"
    weights = load_file(str(path))
    del weights["lm_head.weight"]
    save_file(weights, str(path), metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"tie_word_embeddings is false but .* no lm_head\.weight"):
        ModelRunner(model_dir, device="cpu", dtype="float32", num_blocks=8)


# ---- refused at start, naming the field; capped where exact only below a length ------------


def _config_dir(tmp_path: Path, arch: str, **fields: Any) -> Path:
    """A model directory holding only a tiny ``arch`` config.json with ``fields`` set in it."""
    from gpu.model.make_model import _sizes

    cfg = AutoConfig.for_model(arch, **_sizes("tiny"))  # the tiny test models' shapes
    cfg.save_pretrained(str(tmp_path))
    raw = json.loads((tmp_path / "config.json").read_text())
    raw.pop("layer_types", None)  # as in Qwen2's own configs: derived from max_window_layers
    raw.update(fields)
    (tmp_path / "config.json").write_text(json.dumps(raw))
    return tmp_path


ROPE_BASE = {"rope_theta": THETA}
REFUSED: dict[str, tuple[str, dict[str, Any], str]] = {
    "hidden_act": ("llama", {"hidden_act": "gelu"}, r"hidden_act 'gelu'"),
    "mlp_bias": ("llama", {"mlp_bias": True}, r"mlp_bias"),
    "rope_type": (
        "llama",
        {"rope_parameters": {"rope_type": "axial", **ROPE_BASE}},
        r"rope_parameters\.rope_type 'axial'",
    ),
    "partial_rotary": (
        "llama",
        {"rope_parameters": {"rope_type": "default", "partial_rotary_factor": 0.5, **ROPE_BASE}},
        r"rope_parameters\.partial_rotary_factor 0\.5",
    ),
    "partial_rotary_scaled": (
        "qwen2",
        {
            "rope_parameters": {
                "rope_type": "linear",
                "factor": 2.0,
                "partial_rotary_factor": 0.25,
                **ROPE_BASE,
            }
        },
        r"rope_parameters\.partial_rotary_factor 0\.25",
    ),
    "nested_rope": (
        "qwen2",
        {
            "rope_parameters": {
                "full_attention": {"rope_type": "default", **ROPE_BASE},
                "sliding_attention": {"rope_type": "linear", "factor": 2.0, **ROPE_BASE},
            },
            "layer_types": ["full_attention", "sliding_attention"],
        },
        # older transformers (5.17) cannot even read such a config: refused all the same
        r"rope_parameters nested per layer type|config.json could not be read by transformers",
    ),
    "quantization": (
        "llama",
        {"quantization_config": {"quant_method": "gptq", "bits": 4}},
        r"quantization_config \(quant_method 'gptq'\)",
    ),
    "softcapping": ("mistral", {"final_logit_softcapping": 30.0}, r"final_logit_softcapping"),
    "layer_types": (
        "qwen3",
        {"layer_types": ["full_attention", "linear_attention"]},
        r"layer_types entry 'linear_attention'",
    ),
}


@pytest.mark.parametrize("name", list(REFUSED))
def test_refused_naming_the_field(tmp_path, name):
    arch, fields, message = REFUSED[name]
    model_dir = _config_dir(tmp_path, arch, **fields)
    with pytest.raises(UnsupportedModelError, match=message):
        load_spec(model_dir)
    with pytest.raises(UnsupportedModelError, match=message):
        ModelRunner(model_dir)  # refused before any weight is read: there are none here


CAPS: dict[str, tuple[str, dict[str, Any], int]] = {
    # served length: max_position_embeddings (1024) unless a field makes it exact only below
    "mistral_window": ("mistral", {"sliding_window": 48}, 48),
    "mistral_no_window": ("mistral", {"sliding_window": None}, 1024),
    "mistral_window_past_max": ("mistral", {"sliding_window": 4096}, 1024),
    # layer 1 at or past max_window_layers: windowed
    "qwen2_window": (
        "qwen2",
        {"use_sliding_window": True, "sliding_window": 40, "max_window_layers": 1},
        40,
    ),
    # no layer at or past max_window_layers: no windowed layer
    "qwen2_window_no_layer": (
        "qwen2",
        {"use_sliding_window": True, "sliding_window": 40, "max_window_layers": 2},
        1024,
    ),
    "qwen2_window_off": ("qwen2", {"use_sliding_window": False, "sliding_window": 40}, 1024),
    "qwen3_window": (
        "qwen3",
        {"use_sliding_window": True, "sliding_window": 100, "max_window_layers": 0},
        100,
    ),
    "longrope": (
        "llama",
        {
            "rope_parameters": {
                "rope_type": "longrope",
                "short_factor": SHORT,
                "long_factor": LONG,
                "original_max_position_embeddings": 128,
                **ROPE_BASE,
            }
        },
        128,
    ),
    "dynamic": (
        "llama",
        {"rope_parameters": {"rope_type": "dynamic", "factor": 2.0, **ROPE_BASE}},
        1024,
    ),
    "pretraining_tp": ("llama", {"pretraining_tp": 2}, 1024),  # transformers ignores it
}


@pytest.mark.parametrize("name", list(CAPS))
def test_served_length(tmp_path, name):
    arch, fields, served = CAPS[name]
    assert load_spec(_config_dir(tmp_path, arch, **fields)).max_model_len == served
