"""The model a spec's path runs (``--model-impl``, gpu.model.loader.load_spec): the native
Llama-family forward or transformers' own modeling code with minirt's attention."""

from __future__ import annotations

from pathlib import Path

import torch

from gpu.model import loader
from gpu.model.base import Model
from gpu.model.generic import TransformersModel
from gpu.model.llama import LlamaFamilyModel
from gpu.model.loader import ModelSpec


def build(
    spec: ModelSpec,
    model_dir: str | Path,
    dtype: torch.dtype,
    kv_dtype: torch.dtype,
    device: torch.device,
    lora: bool = False,
) -> Model:
    """The model of ``spec`` served in ``dtype`` (its attention block and KV cache in
    ``kv_dtype``), weights loaded; ``lora``: adapters will be served (native dense models only:
    ValueError otherwise)."""
    if spec.impl == "transformers":
        if lora:
            raise ValueError("--enable-lora is served on the native model path only")
        # transformers' own code, in one dtype throughout (the KV cache's)
        return TransformersModel(spec, model_dir, kv_dtype, device)
    if lora and spec.experts:
        raise ValueError("--enable-lora is not supported with mixture-of-experts models")
    # read on the host and handed over whole: the model fuses each layer's tensors there and
    # moves the fused ones to the device once (no second copy on the card)
    weights = loader.load_weights(model_dir, kv_dtype, loader.HOST, spec.tie_word_embeddings)
    return LlamaFamilyModel(spec, weights, device, dtype)
