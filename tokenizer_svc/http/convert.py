"""OpenAI requests into the front door's ``Generate`` messages (pure: a tokenizer in, a plan out).

The HTTP server tokenizes (chat template included, with the front door's own function), so it
knows each prompt's length: for the chat default ``max_tokens`` (what is left of the context, as
vLLM does), for ``context_length_exceeded`` naming the prompt, and for ``echo``. Each prompt with
``n`` choices becomes ``n`` front-door requests with the same token ids (they share the prompt's
KV blocks through the prefix cache), choice ``i`` seeded ``seed + i``.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Literal

from messages.common import ErrorCode, SamplingParams
from messages.tokenizer import ChatMessage, Generate
from tokenizer_svc.http.errors import invalid
from tokenizer_svc.http.model import ModelInfo
from tokenizer_svc.http.schemas import (
    ChatCompletionRequest,
    ChatMessageIn,
    CompletionRequest,
    _Sampling,
)
from tokenizer_svc.http.structured import structured_of
from tokenizer_svc.requests import Invalid, tokenize_request

MAX_CHOICES = 256  # prompts x n in one request


@dataclass
class ChoiceSpec:
    index: int
    prompt_index: int
    generate: Generate


@dataclass
class Plan:
    kind: Literal["completion", "chat"]
    prompts: list[list[int]]
    choices: list[ChoiceSpec]
    stream: bool = False
    include_usage: bool = False
    continuous_usage: bool = False
    logprobs: int | None = None  # top-n asked for (0: the sampled token's only); None: none
    echo: list[str] = field(default_factory=list)  # per prompt, the text echoed (completions)
    prompt_param: str = "prompt"
    created: int = field(default_factory=lambda: int(time.time()))


def chat_messages(messages: list[ChatMessageIn]) -> list[ChatMessage]:
    """Messages with plain-string content: text parts joined by newlines."""
    out = []
    for i, m in enumerate(messages):
        content = m.content
        if content is None:
            if m.role != "assistant":
                raise invalid(f"messages[{i}].content", f"messages[{i}].content: required")
            text = ""
        elif isinstance(content, str):
            text = content
        else:
            parts = []
            for j, part in enumerate(content):
                if part.type != "text":
                    raise invalid(
                        f"messages[{i}].content[{j}].type",
                        f"messages[{i}].content[{j}].type: only 'text' parts are supported, "
                        f"got {part.type!r}",
                    )
                if part.text is None:
                    raise invalid(
                        f"messages[{i}].content[{j}].text",
                        f"messages[{i}].content[{j}].text: required for a text part",
                    )
                parts.append(part.text)
            text = "\n".join(parts)
        out.append(ChatMessage(role="system" if m.role == "developer" else m.role, content=text))
    return out


def _tokenize(gen: Generate, model: ModelInfo, param: str) -> list[int]:
    try:
        return tokenize_request(gen, model.tokenizer, model.vocab_size, model.max_model_len)
    except Invalid as e:
        if e.code == ErrorCode.TOO_LONG:
            raise invalid(
                param, _context_message(model, e.reason), "context_length_exceeded"
            ) from None
        raise invalid(param, f"{param}: {e.reason}") from None


def _context_message(model: ModelInfo, detail: str) -> str:
    return f"This model's maximum context length is {model.max_model_len} tokens: {detail}"


def _check_common(req: _Sampling, model: ModelInfo) -> None:
    model.check_model(req.model)
    if req.stream_options is not None and not req.stream:
        raise invalid("stream_options", "stream_options: only allowed when stream is true")
    if req.best_of is not None and req.best_of > req.n:
        raise invalid("best_of", f"best_of: values above n ({req.n}) are not supported")


def _params(req: _Sampling, model: ModelInfo, max_tokens: int, logprobs: int | None) -> dict:
    kw: dict[str, Any] = dict(
        max_tokens=max_tokens,
        temperature=req.temperature,
        top_k=max(req.top_k, 0),
        top_p=req.top_p,
        min_p=req.min_p,
        stop_token_ids=list(req.stop_token_ids or []),
        ignore_eos=req.ignore_eos,
        logprobs=logprobs,
        priority=req.priority,
    )
    structured = structured_of(req, model)  # response_format / structured_outputs; 400 if bad
    if structured is not None:
        kw["structured"] = structured
    extras: dict[str, tuple[Any, Any]] = {
        "presence_penalty": (req.presence_penalty, 0.0),
        "frequency_penalty": (req.frequency_penalty, 0.0),
        "repetition_penalty": (req.repetition_penalty, 1.0),
        "min_tokens": (req.min_tokens, 0),
        "logit_bias": (_logit_bias(req, model), {}),
    }
    known = SamplingParams.__struct_fields__
    for name, (value, default) in extras.items():
        if value != default:
            if name not in known:
                raise invalid(name, f"{name}: not supported by this server yet")
            kw[name] = value
    if req.min_tokens > max_tokens:
        raise invalid(
            "min_tokens", f"min_tokens ({req.min_tokens}) exceeds max_tokens ({max_tokens})"
        )
    return kw


def _logit_bias(req: _Sampling, model: ModelInfo) -> dict[int, float]:
    out: dict[int, float] = {}
    for key, bias in (req.logit_bias or {}).items():
        try:
            tid = int(key)
        except ValueError:
            raise invalid("logit_bias", f"logit_bias: key {key!r} is not a token id") from None
        if not 0 <= tid < model.vocab_size:
            raise invalid(
                "logit_bias", f"logit_bias: token id {tid} outside [0, {model.vocab_size})"
            )
        if not -100.0 <= bias <= 100.0:
            raise invalid("logit_bias", f"logit_bias: bias for {tid} must be in [-100, 100]")
        out[tid] = float(bias)
    return out


def _choices(
    req: _Sampling, prompts: list[list[int]], params: list[dict], rid: str, stops: list[str]
) -> list[ChoiceSpec]:
    if len(prompts) * req.n > MAX_CHOICES:
        raise invalid("n", f"n x prompts must be at most {MAX_CHOICES}")
    choices = []
    for p, (ids, kw) in enumerate(zip(prompts, params, strict=True)):
        for i in range(req.n):
            index = p * req.n + i
            seed = None if req.seed is None else (req.seed + i) % 2**63
            choices.append(
                ChoiceSpec(
                    index,
                    p,
                    Generate(
                        prompt_ids=ids,
                        params=SamplingParams(**kw, seed=seed),
                        request_id="",
                        stop=stops,
                    ),
                )
            )
    ids_of = [rid] if len(choices) == 1 else [f"{rid}-{c.index}" for c in choices]
    for c, cid in zip(choices, ids_of, strict=True):
        c.generate.request_id = cid
    return choices


def _stops(stop: str | list[str] | None) -> list[str]:
    if stop is None:
        return []
    return [stop] if isinstance(stop, str) else list(stop)


def _fit(model: ModelInfo, n_prompt: int, max_tokens: int | None, default: int, param: str) -> int:
    """``max_tokens`` (or the default) if prompt + it fits the context, else 400."""
    room = model.max_model_len - n_prompt
    want = default if max_tokens is None else max_tokens
    if want > room or room < 1:
        raise invalid(
            param,
            _context_message(
                model,
                f"you requested {n_prompt + want} tokens ({n_prompt} in the {param}, "
                f"{want} for the completion); reduce the {param} or max_tokens",
            ),
            "context_length_exceeded",
        )
    return want


def plan_completion(req: CompletionRequest, model: ModelInfo, rid: str) -> Plan:
    _check_common(req, model)
    if req.suffix:
        raise invalid("suffix", "suffix: not supported")
    if req.echo and req.logprobs is not None:
        raise invalid("echo", "echo: prompt logprobs (echo with logprobs) are not supported")
    raw = req.prompt
    items: list[str | list[int]]
    if isinstance(raw, str) or (raw and all(isinstance(t, int) for t in raw)):
        items = [raw]  # type: ignore[list-item]
    else:
        items = list(raw)  # type: ignore[arg-type]
    if not items:
        raise invalid("prompt", "prompt: must not be empty")
    prompts = []
    for k, item in enumerate(items):
        param = "prompt" if len(items) == 1 else f"prompt[{k}]"
        gen = (
            Generate(prompt=item, params=SamplingParams(max_tokens=1))
            if isinstance(item, str)
            else Generate(prompt_ids=list(item), params=SamplingParams(max_tokens=1))
        )
        prompts.append(_tokenize(gen, model, param))
    limits = [_fit(model, len(ids), req.max_tokens, 16, "prompt") for ids in prompts]
    params = [_params(req, model, m, req.logprobs) for m in limits]
    echo = []
    if req.echo:
        echo = [
            it if isinstance(it, str) else str(model.tokenizer.decode(it, skip_special_tokens=True))
            for it in items
        ]
    opts = req.stream_options
    return Plan(
        kind="completion",
        prompts=prompts,
        choices=_choices(req, prompts, params, rid, _stops(req.stop)),
        stream=req.stream,
        include_usage=bool(opts and opts.include_usage),
        continuous_usage=bool(opts and opts.continuous_usage_stats),
        logprobs=req.logprobs,
        echo=echo,
        prompt_param="prompt",
    )


def plan_chat(req: ChatCompletionRequest, model: ModelInfo, rid: str) -> Plan:
    _check_common(req, model)
    if req.tools:
        raise invalid("tools", "tools: tool calling is not supported")
    if req.top_logprobs is not None and not req.logprobs:
        raise invalid("top_logprobs", "top_logprobs: requires logprobs to be true")
    gen = Generate(messages=chat_messages(req.messages), params=SamplingParams(max_tokens=1))
    ids = _tokenize(gen, model, "messages")
    asked = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    room = model.max_model_len - len(ids)
    max_tokens = _fit(model, len(ids), asked, room, "messages")
    logprobs = (req.top_logprobs or 0) if req.logprobs else None
    opts = req.stream_options
    return Plan(
        kind="chat",
        prompts=[ids],
        choices=_choices(
            req, [ids], [_params(req, model, max_tokens, logprobs)], rid, _stops(req.stop)
        ),
        stream=req.stream,
        include_usage=bool(opts and opts.include_usage),
        continuous_usage=bool(opts and opts.continuous_usage_stats),
        logprobs=logprobs,
        prompt_param="messages",
    )
