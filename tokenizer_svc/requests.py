"""Validation and tokenization of client requests (pure: tokenizer in, token ids or an error out).

This is the runtime's one trust boundary: every request, whether a ZeroMQ client or the HTTP
server sent it, is checked here once (fields, token ids, lengths), tokenized once (chat template
included) and its constraint compiled once; the scheduler and the executor trust what passed.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import msgspec

from actors.shared.grammar import GrammarCache, GrammarError, hf_llg_tokenizer
from actors.shared.lora import LoraError
from messages.common import ErrorCode, SamplingParams, StructuredOutput, validate_params
from messages.tokenizer import Generate
from tokenizer_svc.agent.tools import (
    RESERVED_KWARGS,
    Reading,
    ToolError,
    check_messages,
    check_tools,
    ends_thinking,
    reasoning_parser_for,
    render,
    template_of,
    tool_parser_for,
    tools_grammar,
)

if TYPE_CHECKING:
    from tokenizer_svc.loras import Loras

MAX_STOP_STRINGS = 16
MAX_CACHE_SALT = 256  # characters of a cache_salt (as the HTTP door bounds it)


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


def check_structured(s: StructuredOutput, tokenizer: Any, vocab_size: int) -> str:
    """``s`` compiled: llguidance's grammar (JSON text), which the executor builds its matcher
    from. Raises ``Invalid`` (``params.structured.<kind>``) if the grammar engine cannot compile
    ``s``: a bad schema, a keyword it does not implement, an invalid regex or grammar."""
    try:
        return grammar_cache(tokenizer, vocab_size).compile(s)[0].grammar
    except GrammarError as e:
        raise Invalid(ErrorCode.INVALID, f"params.{e.field}", e.reason) from None


@dataclass
class Checked:
    """A request that passed: its prompt's ids, its params (``max_tokens`` resolved where the
    client left it to the context), its constraint compiled (``""``: none) and how its output
    is read (tool calls, reasoning)."""

    ids: list[int]
    params: SamplingParams
    grammar: str = ""
    reading: Reading = field(default_factory=Reading)


@dataclass(frozen=True)
class Parsers:
    """The configured output formats (``--tool-call-parser``, ``--reasoning-parser``)."""

    tools: str = "auto"
    reasoning: str = "auto"


class Prompts:
    """The latest prompts tokenized, by their text (a few: the ``n`` choices of one HTTP
    request arrive as ``n`` requests with the same prompt, and are tokenized once)."""

    def __init__(self, capacity: int = 32) -> None:
        self.capacity = capacity
        self._lru: OrderedDict[tuple[str, bool], list[int]] = OrderedDict()

    def ids(self, tokenizer: Any, text: str, add_special_tokens: bool) -> list[int]:
        key = (text, add_special_tokens)
        found = self._lru.get(key)
        if found is None:
            found = list(tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"])
            self._lru[key] = found
            if len(self._lru) > self.capacity:
                self._lru.popitem(last=False)
        else:
            self._lru.move_to_end(key)
        return list(found)


def check_request(
    msg: Generate,
    tokenizer: Any,
    vocab_size: int,
    max_model_len: int,
    prompts: Prompts,
    parsers: Parsers = Parsers(),
    runner: str = "generate",
    loras: Loras | None = None,
) -> Checked:
    """The request checked, tokenized and its constraint compiled, or raises ``Invalid``
    naming the field and why. ``runner``: the server's ``--runner`` (``pooling``: embeddings
    only, every request with ``params.pooling``; else none). ``loras``: the adapters served
    (``generate.lora`` becomes ``params.lora``); None: none."""
    given = [n for n in ("prompt", "messages", "prompt_ids") if getattr(msg, n) is not None]
    if len(given) != 1:
        raise Invalid(
            ErrorCode.INVALID,
            "prompt",
            f"exactly one of prompt, messages, prompt_ids must be set (got {given or 'none'})",
        )
    try:
        msg, reading = _agent(msg, tokenizer, parsers)
    except ToolError as e:
        raise Invalid(ErrorCode.INVALID, e.field, e.reason) from None
    params = msg.params
    if msg.fill_context:  # checked with the most it could be; resolved once the prompt is known
        params = msgspec.structs.replace(params, max_tokens=max_model_len)
    bad = validate_params(params, vocab_size)
    if bad is not None:
        raise Invalid(ErrorCode.INVALID, f"params.{bad[0]}", bad[1])
    if (params.pooling is not None) != (runner == "pooling"):
        why = (
            "this server was started with --runner pooling: it computes embeddings (set "
            "params.pooling), it does not generate"
            if runner == "pooling"
            else "embeddings need a server started with --runner pooling; this one generates"
        )
        raise Invalid(ErrorCode.INVALID, "params.pooling", why)
    if params.pooling is not None:  # it ends with its prefill (the token sampled there unshown)
        params = msgspec.structs.replace(params, max_tokens=1, min_tokens=0)
    grammar = ""
    if params.structured is not None:
        try:
            grammar = check_structured(params.structured, tokenizer, vocab_size)
        except Invalid as e:
            if reading.tool_parser and msg.tool_choice != "auto":  # the tools' grammar
                raise Invalid(e.code, "tools", e.reason) from None
            raise
    if params.lora is not None:
        raise Invalid(ErrorCode.INVALID, "params.lora", "set by the server: name it in lora")
    if msg.lora:
        try:
            ref = loras.resolve(msg.lora) if loras is not None else None
        except LoraError as e:
            raise Invalid(ErrorCode.INVALID, e.field, e.reason) from None
        if ref is None:
            raise Invalid(ErrorCode.INVALID, "lora", "no LoRA adapters served (--enable-lora)")
        params = msgspec.structs.replace(params, lora=ref)
    if len(msg.cache_salt) > MAX_CACHE_SALT:
        raise Invalid(ErrorCode.INVALID, "cache_salt", f"at most {MAX_CACHE_SALT} characters")
    if len(msg.stop) > MAX_STOP_STRINGS or any(not s for s in msg.stop):
        raise Invalid(
            ErrorCode.INVALID, "stop", f"at most {MAX_STOP_STRINGS} non-empty stop strings"
        )
    if params.bad_words:
        params = msgspec.structs.replace(
            params,
            bad_words_ids=[*params.bad_words_ids, *bad_words_ids(tokenizer, params.bad_words)],
        )
    ids = _prompt_ids(msg, tokenizer, vocab_size, prompts)
    _check_length(len(ids), params.max_tokens if not msg.fill_context else 1, max_model_len)
    if msg.fill_context:
        room = max_model_len - len(ids)
        if params.min_tokens > room:
            raise Invalid(
                ErrorCode.INVALID,
                "params.min_tokens",
                f"{params.min_tokens} is more than the {room} tokens the context leaves",
            )
        params = msgspec.structs.replace(params, max_tokens=room)
    if reading.tool_parser or reading.reasoning_parser:
        text = tokenizer.decode(ids[-8:]) if reading.reasoning_parser else ""
        reading = Reading(reading.tool_parser, reading.reasoning_parser, ends_thinking(text))
    return Checked(ids, params, grammar, reading)


def bad_words_ids(tokenizer: Any, words: list[str]) -> list[list[int]]:
    """Each bad word's token ids, as vLLM reads ``bad_words``: the word as given (leading spaces
    dropped), and again after a space where that tokenizes to as many tokens starting with
    another one (the word inside a sentence)."""
    out = []
    for word in words:
        bare = list(tokenizer(word.lstrip(), add_special_tokens=False)["input_ids"])
        out.append(bare)
        spaced = list(tokenizer(" " + word.lstrip(), add_special_tokens=False)["input_ids"])
        if len(spaced) == len(bare) and spaced[0] != bare[0]:
            out.append(spaced)
    return out


def _agent(msg: Generate, tokenizer: Any, parsers: Parsers) -> tuple[Generate, Reading]:
    """Tools and reasoning checked; with a required call, its grammar as the constraint.
    Returns the request (constrained where a call is required) and how to read its output."""
    if msg.messages is None:
        if msg.tools or msg.tool_choice not in ("auto", "none") or msg.chat_template_kwargs:
            raise ToolError("tools", "tools and chat_template_kwargs need chat messages")
        return msg, Reading()
    bad = sorted(RESERVED_KWARGS.intersection(msg.chat_template_kwargs))
    if bad:
        raise ToolError("chat_template_kwargs", f"{bad[0]!r} is set by the server")
    check_tools(msg)
    check_messages(msg.messages)
    template = template_of(tokenizer)
    reasoning = reasoning_parser_for(template, parsers.reasoning)
    if not msg.tools or msg.tool_choice == "none":
        return msg, Reading("", reasoning)
    parser = tool_parser_for(template, parsers.tools)
    lark = tools_grammar(msg, parser)
    if lark is not None:
        if msg.params.structured is not None:
            raise ToolError(
                "tool_choice", f"{msg.tool_choice!r} cannot be combined with a response format"
            )
        constraint = StructuredOutput(grammar=lark)
        msg = msgspec.structs.replace(
            msg, params=msgspec.structs.replace(msg.params, structured=constraint)
        )
    return msg, Reading(parser, reasoning)


def _prompt_ids(msg: Generate, tokenizer: Any, vocab_size: int, prompts: Prompts) -> list[int]:
    if msg.prompt is not None:
        if not msg.prompt:
            raise Invalid(ErrorCode.INVALID, "prompt", "must not be empty")
        ids = prompts.ids(tokenizer, msg.prompt, msg.add_special_tokens)
    elif msg.messages is not None:
        if not msg.messages:
            raise Invalid(ErrorCode.INVALID, "messages", "must not be empty")
        try:
            text = render(tokenizer, msg)
        except Exception as e:
            raise Invalid(ErrorCode.INVALID, "messages", f"chat template failed: {e}") from None
        ids = prompts.ids(tokenizer, text, False)
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
    return ids


def _check_length(n: int, max_tokens: int, max_model_len: int) -> None:
    """Refuse (``too_long``, OpenAI's ``context_length_exceeded``) a prompt of ``n`` tokens
    that leaves no room for ``max_tokens`` more in the context."""
    if n >= max_model_len:
        raise Invalid(
            ErrorCode.TOO_LONG,
            "prompt",
            f"This model's maximum context length is {max_model_len} tokens (the model's "
            f"context, capped by what the KV pool holds); the prompt has {n}",
        )
    if n + max_tokens > max_model_len:
        raise Invalid(
            ErrorCode.TOO_LONG,
            "params.max_tokens",
            f"This model's maximum context length is {max_model_len} tokens (the model's "
            f"context, capped by what the KV pool holds); you requested {n + max_tokens} "
            f"tokens ({n} in the prompt, {max_tokens} for the completion)",
        )
