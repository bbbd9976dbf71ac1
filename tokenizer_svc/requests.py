"""Validation and tokenization of client requests (pure: tokenizer in, token ids or an error out)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from gpu.structured.grammar import GrammarCache, GrammarError, hf_llg_tokenizer
from messages.common import ErrorCode, StructuredOutput, validate_params
from messages.tokenizer import Generate

MAX_STOP_STRINGS = 16


@dataclass
class Invalid(Exception):
    """A request refused before it reaches the scheduler. ``field`` names the offending field."""

    code: str
    field: str
    reason: str

    def __str__(self) -> str:
        return f"{self.field}: {self.reason}"


_GRAMMARS: dict[int, tuple[Any, GrammarCache]] = {}


def grammar_cache(tokenizer: Any, vocab_size: int) -> GrammarCache:
    """The compiled-constraint cache of ``tokenizer`` (bounded, keyed by the constraint's
    canonical text; one per tokenizer in the process, built on first use)."""
    found = _GRAMMARS.get(id(tokenizer))
    if found is None or found[0] is not tokenizer:
        eos = [] if tokenizer.eos_token_id is None else [int(tokenizer.eos_token_id)]
        cache = GrammarCache(lambda: hf_llg_tokenizer(tokenizer, vocab_size, eos))
        found = _GRAMMARS[id(tokenizer)] = (tokenizer, cache)
    return found[1]


def check_structured(s: StructuredOutput, tokenizer: Any, vocab_size: int) -> None:
    """Raises ``Invalid`` (``params.structured.<kind>``) if the grammar engine cannot compile
    ``s``: a bad schema, a keyword it does not implement, an invalid regex or grammar."""
    try:
        grammar_cache(tokenizer, vocab_size).compile(s)
    except GrammarError as e:
        raise Invalid(ErrorCode.INVALID, f"params.{e.field}", e.reason) from None


def tokenize_request(
    msg: Generate, tokenizer: Any, vocab_size: int, max_model_len: int
) -> list[int]:
    """The prompt's token ids, or raises ``Invalid`` naming the field and why."""
    given = [n for n in ("prompt", "messages", "prompt_ids") if getattr(msg, n) is not None]
    if len(given) != 1:
        raise Invalid(
            ErrorCode.INVALID,
            "prompt",
            f"exactly one of prompt, messages, prompt_ids must be set (got {given or 'none'})",
        )
    bad = validate_params(msg.params, vocab_size)
    if bad is not None:
        raise Invalid(ErrorCode.INVALID, f"params.{bad[0]}", bad[1])
    if msg.params.structured is not None:
        check_structured(msg.params.structured, tokenizer, vocab_size)
    if len(msg.stop) > MAX_STOP_STRINGS or any(not s for s in msg.stop):
        raise Invalid(
            ErrorCode.INVALID, "stop", f"at most {MAX_STOP_STRINGS} non-empty stop strings"
        )
    if msg.prompt is not None:
        if not msg.prompt:
            raise Invalid(ErrorCode.INVALID, "prompt", "must not be empty")
        ids = list(tokenizer(msg.prompt, add_special_tokens=msg.add_special_tokens)["input_ids"])
    elif msg.messages is not None:
        if not msg.messages:
            raise Invalid(ErrorCode.INVALID, "messages", "must not be empty")
        try:
            text = tokenizer.apply_chat_template(
                [{"role": m.role, "content": m.content} for m in msg.messages],
                add_generation_prompt=True,
                tokenize=False,
            )
        except Exception as e:
            raise Invalid(ErrorCode.INVALID, "messages", f"chat template failed: {e}") from None
        ids = list(tokenizer(text, add_special_tokens=False)["input_ids"])
    else:
        ids = list(msg.prompt_ids or [])
        if not ids:
            raise Invalid(ErrorCode.INVALID, "prompt_ids", "must not be empty")
        bad_ids = [t for t in ids if not 0 <= t < vocab_size]
        if bad_ids:
            raise Invalid(
                ErrorCode.INVALID,
                "prompt_ids",
                f"token id {bad_ids[0]} outside the vocabulary [0, {vocab_size})",
            )
    if not ids:
        raise Invalid(ErrorCode.INVALID, "prompt", "tokenizes to zero tokens")
    if len(ids) >= max_model_len:
        raise Invalid(
            ErrorCode.TOO_LONG,
            "prompt",
            f"{len(ids)} tokens; max_model_len is {max_model_len} (the model's context, capped "
            "by what the KV pool holds)",
        )
    if len(ids) + msg.params.max_tokens > max_model_len:
        raise Invalid(
            ErrorCode.TOO_LONG,
            "params.max_tokens",
            f"prompt ({len(ids)} tokens) + max_tokens ({msg.params.max_tokens}) exceeds "
            f"max_model_len {max_model_len} (the model's context, capped by what the KV pool "
            "holds)",
        )
    return ids
