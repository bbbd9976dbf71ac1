"""What the HTTP server knows of the model: its names, context length and (loaded when first
needed) its tokenizer.

The HTTP server does not tokenize requests (the front door does, ``tokenizer_svc/requests.py``);
it needs the tokenizer only to show tokens as text: ``/tokenize`` and ``/detokenize``, the
token strings of ``logprobs``, and the ``echo`` of a prompt given as token ids. A server whose
clients ask for none of these never loads it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

from minirt.http.errors import ApiError

NEG_INF_LOGPROB = -9999.0  # JSON has no -inf; vLLM answers this value too


@dataclass
class ModelInfo:
    """The served model as the HTTP server sees it; ``tokenizer`` is loaded on first use."""

    path: str
    served_name: str
    vocab_size: int
    max_model_len: int
    aliases: frozenset[str] = frozenset()
    lora: bool = False  # --enable-lora: another model name may be an adapter's
    _tokenizer: Any = None

    @property
    def tokenizer(self) -> Any:
        if self._tokenizer is None:
            from transformers import AutoTokenizer

            self._tokenizer = AutoTokenizer.from_pretrained(self.path)
        return self._tokenizer

    def decode(self, ids: list[int]) -> str:
        return str(self.tokenizer.decode(ids, skip_special_tokens=True))

    @classmethod
    def load(
        cls, path: str, served_name: str = "", max_model_len: int | None = None, lora: bool = False
    ) -> ModelInfo:
        """``path``: the resolved model directory; ``max_model_len``: the runtime's (the model's
        context capped by the KV pool, gpu.model.kv_cache.resolve_max_model_len)."""
        cfg = json.loads((Path(path) / "config.json").read_text())
        name = served_name or path
        aliases = frozenset({name, path, Path(path).name, str(Path(path).absolute())})
        return cls(
            path=path,
            served_name=name,
            vocab_size=int(cfg["vocab_size"]),
            max_model_len=int(max_model_len or cfg.get("max_position_embeddings", 2048)),
            aliases=aliases,
            lora=lora,
        )

    def check_model(self, name: str | None) -> None:
        """404 for a ``model`` that is not this server's; with LoRA enabled any other name may be
        an adapter's, which the front door resolves (``lora_of``)."""
        if name is not None and name not in self.aliases and not self.lora:
            raise ApiError(
                404,
                f"The model `{name}` does not exist; this server serves `{self.served_name}`",
                param="model",
                code="model_not_found",
            )

    def lora_of(self, name: str | None) -> str:
        """The adapter a request's ``model`` names ("": the base model)."""
        return "" if name is None or name in self.aliases else name

    def token_str(self, token_id: int) -> str:
        return _token_str(self.tokenizer, token_id)


@lru_cache(maxsize=65536)
def _token_str(tokenizer: Any, token_id: int) -> str:
    return str(tokenizer.decode([token_id], skip_special_tokens=False))
