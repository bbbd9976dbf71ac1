"""Incremental detokenization: turn a growing list of token ids into text deltas.

Byte-level tokenizers can split one UTF-8 character over several tokens. The detokenizer decodes a
window ``ids[prefix:]`` and emits only the text past ``ids[prefix:read]``, and only once it does not
end in U+FFFD (an incomplete character), so a delta never splits a multi-byte character. The
concatenated deltas plus ``flush()`` equal ``tokenizer.decode(ids)``.

A fast (``tokenizers``) tokenizer that does not clean up spaces after decoding is decoded through
its backend directly: transformers' ``decode`` converts and checks the ids in Python first, which
was most of the front door's detokenization time (docs/benchmarks/cpu-levers/README.md).
"""

from __future__ import annotations

from typing import Any


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Any, skip_special_tokens: bool = True) -> None:
        self._tok = tokenizer
        self._skip = skip_special_tokens
        backend = getattr(tokenizer, "backend_tokenizer", None)
        self._backend = (
            backend
            if backend is not None and not getattr(tokenizer, "clean_up_tokenization_spaces", True)
            else None
        )
        self.ids: list[int] = []
        self._prefix = 0  # start of the decode window
        self._read = 0  # tokens before this index have been emitted

    def _decode(self, ids: list[int]) -> str:
        if self._backend is not None:
            return str(self._backend.decode(ids, skip_special_tokens=self._skip))
        return str(self._tok.decode(ids, skip_special_tokens=self._skip))

    def push(self, token_id: int) -> str:
        """Add one token; return the new text that is now complete (may be empty)."""
        self.ids.append(token_id)
        prefix_text = self._decode(self.ids[self._prefix : self._read])
        full = self._decode(self.ids[self._prefix :])
        if len(full) > len(prefix_text) and not full.endswith("\ufffd"):
            self._prefix, self._read = self._read, len(self.ids)
            return full[len(prefix_text) :]
        return ""

    def flush(self) -> str:
        """Text held back at the end of the stream (an incomplete character decodes as U+FFFD)."""
        prefix_text = self._decode(self.ids[self._prefix : self._read])
        full = self._decode(self.ids[self._prefix :])
        self._prefix = self._read = len(self.ids)
        return full[len(prefix_text) :]
