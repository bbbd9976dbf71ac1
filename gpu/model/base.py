"""What the model runner calls on a model, whichever path runs it (gpu.model.paths): the native
Llama-family forward or transformers' own code."""

from __future__ import annotations

from typing import Any

import torch

from gpu.model.attention import AttentionMetadata
from gpu.model.kv_cache import PagedKVCache
from gpu.model.loader import ModelSpec


class Model:
    """``trunk`` runs a step's tokens and writes their K/V; ``logits`` and ``hidden`` read rows of
    its output; ``warm_up`` builds kernels before the first step."""

    spec: ModelSpec

    def warm_up(self) -> None:
        raise NotImplementedError

    def trunk(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        cache: PagedKVCache,
        lora: Any = None,
    ) -> torch.Tensor:
        raise NotImplementedError

    def logits(self, x: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def hidden(self, x: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        cache: PagedKVCache,
        logit_rows: torch.Tensor,
    ) -> torch.Tensor:
        """Run ``[T]`` tokens at ``positions``, writing their K/V into ``cache``: float32 logits
        ``[len(logit_rows), vocab]`` of the rows in ``logit_rows`` only."""
        return self.logits(self.trunk(input_ids, positions, meta, cache), logit_rows)
