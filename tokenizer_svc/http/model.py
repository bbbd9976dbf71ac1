"""What the HTTP server knows of the model: its names, tokenizer and context length."""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

from tokenizer_svc.http.errors import ApiError

NEG_INF_LOGPROB = -9999.0  # JSON has no -inf; vLLM answers this value too


@dataclass
class ModelInfo:
    """What the HTTP server knows of the model: its names, tokenizer and context length."""

    path: str
    served_name: str
    tokenizer: Any
    vocab_size: int
    max_model_len: int
    aliases: frozenset[str] = frozenset()

    @classmethod
    def load(cls, path: str, served_name: str = "", max_model_len: int | None = None) -> ModelInfo:
        """``path``: the resolved model directory; ``max_model_len``: the runtime's (the model's
        context capped by the KV pool, gpu.kv_cache.resolve_max_model_len)."""
        from transformers import AutoTokenizer

        cfg = json.loads((Path(path) / "config.json").read_text())
        name = served_name or path
        aliases = frozenset({name, path, Path(path).name, str(Path(path).absolute())})
        return cls(
            path=path,
            served_name=name,
            tokenizer=AutoTokenizer.from_pretrained(path),
            vocab_size=int(cfg["vocab_size"]),
            max_model_len=int(max_model_len or cfg.get("max_position_embeddings", 2048)),
            aliases=aliases,
        )

    def check_model(self, name: str | None) -> None:
        if name is not None and name not in self.aliases:
            raise ApiError(
                404,
                f"The model `{name}` does not exist; this server serves `{self.served_name}`",
                param="model",
                code="model_not_found",
            )

    def token_str(self, token_id: int) -> str:
        return _token_str(self.tokenizer, token_id)


@lru_cache(maxsize=65536)
def _token_str(tokenizer: Any, token_id: int) -> str:
    return str(tokenizer.decode([token_id], skip_special_tokens=False))
