"""OpenAI requests into the front door's ``Generate`` messages (pure: a request in, a plan out).

The HTTP server forwards what the client sent (the prompt's text or token ids, the chat
messages, the sampling fields, the constraint); the front door, the runtime's one trust
boundary, tokenizes, validates and compiles (``tokenizer_svc/requests.py``), and its refusals
come back as OpenAI errors naming the field as the client spelled it (``errors.from_upstream``).
The chat default ``max_tokens`` (what the context leaves, as vLLM does) is resolved there too
(``Generate.fill_context``). Each prompt with ``n`` choices becomes ``n`` front-door requests
with the same prompt (tokenized once there; they share its KV blocks through the prefix cache),
choice ``i`` seeded ``seed + i``.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Literal

from messages.common import SamplingParams
from messages.tokenizer import ChatMessage, Generate, Tool, ToolCall
from minirt.http.errors import invalid
from minirt.http.model import ModelInfo
from minirt.http.openai.schemas import (
    CHAT_NOT_IMPLEMENTED,
    NOT_IMPLEMENTED,
    ChatCompletionRequest,
    ChatMessageIn,
    CompletionRequest,
    _Sampling,
    refused_fields,
)
from minirt.http.openai.structured import Spelling, structured_of

MAX_CHOICES = 256  # prompts x n in one request


@dataclass
class ChoiceSpec:
    index: int
    prompt_index: int
    generate: Generate
    prompt_param: str = "prompt"  # the prompt's field as the client spelled it, for errors


@dataclass
class Plan:
    kind: Literal["completion", "chat", "embedding"]
    num_prompts: int
    choices: list[ChoiceSpec]
    stream: bool = False
    include_usage: bool = False
    continuous_usage: bool = False
    logprobs: int | None = None  # top-n asked for (0: the sampled token's only); None: none
    echo: list[str] = field(default_factory=list)  # per prompt, the text echoed (completions)
    prompt_logprobs: int | None = None  # vLLM's field: the prompt's logprobs in the answer
    score_only: bool = False  # max_tokens 0 (with echo), embeddings: no output shown
    spelling: Spelling = field(default_factory=Spelling)  # the constraint's fields, for errors
    encoding_format: str = "float"  # embeddings: "float" or "base64" (float32 bytes)
    created: int = field(default_factory=lambda: int(time.time()))


def chat_messages(messages: list[ChatMessageIn]) -> list[ChatMessage]:
    """Messages with plain-string content (text parts joined by newlines), an assistant's
    calls and reasoning, a tool's answer and the call it answers."""
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
        calls = [
            ToolCall(id=c.id, name=c.function.name, arguments=c.function.arguments)
            for c in m.tool_calls or []
        ]
        out.append(
            ChatMessage(
                role="system" if m.role == "developer" else m.role,
                content=text,
                tool_calls=calls,
                tool_call_id=m.tool_call_id or "",
                reasoning=m.reasoning_content or "",
            )
        )
    return out


def tools_of(req: ChatCompletionRequest) -> dict[str, Any]:
    """The request's tools as ``Generate`` fields (the front door checks them)."""
    tools = [
        Tool(
            name=t.function.name,
            description=t.function.description or "",
            parameters=t.function.parameters or {},
        )
        for t in req.tools or []
    ]
    asked = req.tool_choice if req.tool_choice is not None else ("auto" if tools else "none")
    choice = asked if isinstance(asked, str) else asked.function.name
    out: dict[str, Any] = {"tool_choice": choice, "parallel_tool_calls": req.parallel_tool_calls}
    if tools:
        out["tools"] = tools
    if req.chat_template_kwargs:
        out["chat_template_kwargs"] = req.chat_template_kwargs
    return out


def _check_common(req: _Sampling, model: ModelInfo) -> None:
    model.check_model(req.model)
    table = NOT_IMPLEMENTED
    if isinstance(req, ChatCompletionRequest):
        table = {**NOT_IMPLEMENTED, **CHAT_NOT_IMPLEMENTED}
    for name in refused_fields(req, table):
        raise invalid(name, f"{name}: {table[name][1]}")
    if req.stream_options is not None and not req.stream:
        raise invalid("stream_options", "stream_options: only allowed when stream is true")
    if req.best_of is not None and req.best_of > req.n:
        raise invalid("best_of", f"best_of: values above n ({req.n}) are not supported")


def _params(
    req: _Sampling,
    max_tokens: int,
    logprobs: int | None,
    s: Spelling,
    prompt_logprobs: int | None = None,
) -> dict:
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
    structured = structured_of(req, s)  # response_format / structured_outputs; 400 if malformed
    if structured is not None:
        kw["structured"] = structured
    extras: dict[str, tuple[Any, Any]] = {
        "presence_penalty": (req.presence_penalty, 0.0),
        "frequency_penalty": (req.frequency_penalty, 0.0),
        "repetition_penalty": (req.repetition_penalty, 1.0),
        "min_tokens": (req.min_tokens, 0),
        "logit_bias": (_logit_bias(req), {}),
        "allowed_token_ids": (list(req.allowed_token_ids or []), []),
        "prompt_logprobs": (prompt_logprobs, None),
        "bad_words": (list(req.bad_words or []), []),
    }
    known = SamplingParams.__struct_fields__
    for name, (value, default) in extras.items():
        if value != default:
            if name not in known:
                raise invalid(name, f"{name}: not supported by this server yet")
            kw[name] = value
    return kw


def _logit_bias(req: _Sampling) -> dict[int, float]:
    """The JSON object's keys as token ids (the front door checks ids and biases)."""
    out: dict[int, float] = {}
    for key, bias in (req.logit_bias or {}).items():
        try:
            out[int(key)] = float(bias)
        except ValueError:
            raise invalid("logit_bias", f"logit_bias: key {key!r} is not a token id") from None
    return out


Prompt = dict[str, Any]  # Generate's prompt fields: prompt | prompt_ids | messages (+ fill_context)


def _choices(
    req: _Sampling,
    prompts: list[Prompt],
    kw: dict,
    rid: str,
    stops: list[str],
    param: str,
    lora: str = "",
) -> list[ChoiceSpec]:
    if len(prompts) * req.n > MAX_CHOICES:
        raise invalid("n", f"n x prompts must be at most {MAX_CHOICES}")
    choices = []
    for p, prompt in enumerate(prompts):
        where = param if len(prompts) == 1 else f"{param}[{p}]"
        for i in range(req.n):
            index = p * req.n + i
            seed = None if req.seed is None else (req.seed + i) % 2**63
            gen = Generate(
                params=SamplingParams(**kw, seed=seed),
                stop=stops,
                cache_salt=req.cache_salt or "",
                lora=lora,
                **prompt,
            )
            choices.append(ChoiceSpec(index, p, gen, where))
    ids_of = [rid] if len(choices) == 1 else [f"{rid}-{c.index}" for c in choices]
    for c, cid in zip(choices, ids_of, strict=True):
        c.generate.request_id = cid
    return choices


def _stops(stop: str | list[str] | None) -> list[str]:
    if stop is None:
        return []
    return [stop] if isinstance(stop, str) else list(stop)


def plan_completion(req: CompletionRequest, model: ModelInfo, rid: str) -> Plan:
    _check_common(req, model)
    if req.suffix:
        raise invalid("suffix", "suffix: not supported")
    if req.max_tokens == 0 and not req.echo:
        raise invalid("max_tokens", "max_tokens: 0 needs echo (the prompt scored, nothing more)")
    # echo with logprobs: the prompt's tokens and their logprobs lead the answer's (vLLM's)
    scored = req.prompt_logprobs
    if req.echo and req.logprobs is not None:
        scored = max(scored or 0, req.logprobs)
    if scored is not None and req.stream:
        raise invalid("stream", "stream: prompt logprobs are answered only without streaming")
    raw = req.prompt
    items: list[str | list[int]]
    if isinstance(raw, str) or (raw and all(isinstance(t, int) for t in raw)):
        items = [raw]  # type: ignore[list-item]
    else:
        items = list(raw)  # type: ignore[arg-type]
    if not items:
        raise invalid("prompt", "prompt: must not be empty")
    prompts: list[Prompt] = [
        {"prompt": it, "add_special_tokens": req.add_special_tokens}
        if isinstance(it, str)
        else {"prompt_ids": list(it)}
        for it in items
    ]
    spelling = Spelling()
    # max_tokens 0: one token is generated (the prefill samples it) and not shown
    max_tokens = 16 if req.max_tokens is None else max(req.max_tokens, 1)
    kw = _params(req, max_tokens, req.logprobs, spelling, scored)
    echo = []
    if req.echo:
        echo = [it if isinstance(it, str) else model.decode(it) for it in items]
    opts = req.stream_options
    return Plan(
        kind="completion",
        num_prompts=len(prompts),
        choices=_choices(
            req, prompts, kw, rid, _stops(req.stop), "prompt", model.lora_of(req.model)
        ),
        stream=req.stream,
        include_usage=bool(opts and opts.include_usage),
        continuous_usage=bool(opts and opts.continuous_usage_stats),
        logprobs=req.logprobs,
        echo=echo,
        spelling=spelling,
        prompt_logprobs=req.prompt_logprobs,
        score_only=req.max_tokens == 0,
    )


def plan_chat(req: ChatCompletionRequest, model: ModelInfo, rid: str) -> Plan:
    _check_common(req, model)
    if req.top_logprobs is not None and not req.logprobs:
        raise invalid("top_logprobs", "top_logprobs: requires logprobs to be true")
    prompt: Prompt = {"messages": chat_messages(req.messages), **tools_of(req)}
    asked = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    if asked is None:  # what the context leaves after the prompt, resolved by the front door
        prompt["fill_context"] = True
    logprobs = (req.top_logprobs or 0) if req.logprobs else None
    spelling = Spelling(renames=[(r"^tools\[(\d+)\]\.", r"tools[\1].function.")])
    if req.prompt_logprobs is not None and req.stream:
        raise invalid("stream", "stream: prompt logprobs are answered only without streaming")
    kw = _params(req, asked or 1, logprobs, spelling, req.prompt_logprobs)
    opts = req.stream_options
    return Plan(
        kind="chat",
        num_prompts=1,
        choices=_choices(
            req, [prompt], kw, rid, _stops(req.stop), "messages", model.lora_of(req.model)
        ),
        stream=req.stream,
        include_usage=bool(opts and opts.include_usage),
        continuous_usage=bool(opts and opts.continuous_usage_stats),
        logprobs=logprobs,
        spelling=spelling,
        prompt_logprobs=req.prompt_logprobs,
    )
