"""``--speculative-config``: vLLM's JSON for speculative decoding, parsed into a frozen dataclass.

Only ``{"method": "ngram", ...}`` (prompt lookup) is supported. Keys, as vLLM names them:

- ``num_speculative_tokens`` (required): the most draft tokens a request verifies per step (K);
- ``prompt_lookup_max`` / ``prompt_lookup_min``: the longest and shortest suffix n-gram looked
  up in the request's tokens. vLLM's defaults: both absent, both 5; one absent, it takes the
  other's value.

An unknown key, a missing or ill-typed value, or a value out of range raises ``ValueError``
naming the key. ``""`` (the default of ``ExecutorConfig.speculative_config``) means off.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

METHODS = ("ngram",)
KEYS = ("method", "num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min")
DEFAULT_LOOKUP = 5  # vLLM's, when neither prompt_lookup_max nor prompt_lookup_min is given


@dataclass(frozen=True)
class SpecConfig:
    method: str
    num_speculative_tokens: int
    prompt_lookup_max: int
    prompt_lookup_min: int

    @property
    def k(self) -> int:
        return self.num_speculative_tokens


def parse(text: str | dict[str, Any] | SpecConfig | None) -> SpecConfig | None:
    """The config a ``--speculative-config`` value describes; None for ``""``/None (off).
    Takes the JSON text, its dict, or a ``SpecConfig`` (returned as is)."""
    if text is None or isinstance(text, SpecConfig):
        return text
    if isinstance(text, str):
        if not text.strip():
            return None
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"speculative_config: not JSON ({e})") from None
    else:
        data = text
    if not isinstance(data, dict):
        raise ValueError("speculative_config: expected a JSON object")
    unknown = sorted(set(data) - set(KEYS))
    if unknown:
        raise ValueError(f"speculative_config: unknown keys {unknown}; known: {list(KEYS)}")
    method = data.get("method")
    if method not in METHODS:
        raise ValueError(f"speculative_config.method: {method!r} is not one of {list(METHODS)}")
    k = _int(data, "num_speculative_tokens", required=True)
    hi = _int(data, "prompt_lookup_max")
    lo = _int(data, "prompt_lookup_min")
    if hi is None and lo is None:
        hi = lo = DEFAULT_LOOKUP
    hi = lo if hi is None else hi
    lo = hi if lo is None else lo
    assert k is not None and hi is not None and lo is not None
    if lo > hi:
        raise ValueError(
            f"speculative_config.prompt_lookup_min: {lo} must be <= prompt_lookup_max ({hi})"
        )
    return SpecConfig(method, k, hi, lo)


def _int(data: dict[str, Any], key: str, required: bool = False) -> int | None:
    value = data.get(key)
    if value is None:
        if required:
            raise ValueError(f"speculative_config.{key}: required for method ngram")
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"speculative_config.{key}: expected an integer, got {value!r}")
    if value < 1:
        raise ValueError(f"speculative_config.{key}: {value} must be >= 1")
    return value
