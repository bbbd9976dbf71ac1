"""A Responses request as a chat completions request (pure): the same front door, the same
template, the same answers.

- ``instructions``: a system message first (only this request's: never carried over).
- ``previous_response_id``: the stored conversation of that response and its output come next.
- ``input``: a string is one user message; items in turn: a ``message`` is a chat message
  (``developer`` is ``system``; text parts joined by newlines, as chat does), consecutive
  ``function_call`` items are the tool calls of one assistant message (the assistant ``message``
  just before them, if any), a ``function_call_output`` is a ``tool`` message answering its
  ``call_id``, and a ``reasoning`` item's text is the ``reasoning_content`` of the assistant
  message that follows it directly (dropped when none does).
- ``tools`` (function tools) / ``tool_choice`` / ``text.format`` as chat's ``tools`` /
  ``tool_choice`` / ``response_format``; ``max_output_tokens`` as ``max_completion_tokens``.

Every refusal, here or from the front door, names the field as the client spelled it
(``Names.respell``): ``messages[i]`` back to the input item it came from (``input[2].call_id``),
``response_format`` as ``text.format``, ``tools[0].function.x`` as ``tools[0].x``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from pydantic import BaseModel, ValidationError

from minirt.http.errors import ApiError, from_validation, invalid, param_of
from minirt.http.model import ModelInfo
from minirt.http.openai.convert import Plan, plan_chat
from minirt.http.openai.schemas import ChatCompletionRequest
from minirt.http.responses.schema import (
    ITEMS,
    FunctionCallItem,
    FunctionCallOutputItem,
    MessageItem,
    ReasoningItem,
    ResponsesRequest,
    TextPart,
)

Message = dict[str, Any]  # a chat message as chat completions reads it (``ChatMessageIn``)
TEXT_PARTS = ("input_text", "output_text", "text")
_CALL_FIELDS = {".function.arguments": ".arguments", ".function.name": ".name", ".id": ".call_id"}
_RENAMES = [  # chat's spelling -> the Responses spelling (first match wins)
    (r"^response_format\.json_schema\.schema", "text.format.schema"),
    (r"^response_format(\.json_schema)?", "text.format"),
    (r"^max_(completion_)?tokens$", "max_output_tokens"),
    (r"^tools\[(\d+)\]\.function\b", r"tools[\1]"),
    (r"^tool_choice\.function\b", "tool_choice"),
]


@dataclass
class Source:
    """Where a chat message came from: ``where`` is ``input[j]``, ``instructions`` or
    ``previous_response_id``; an assistant message also knows the item of each of its calls."""

    where: str
    tool: bool = False  # a function_call_output: its content is the item's output
    calls: list[int] = field(default_factory=list)
    reasoning: int | None = None

    def spell(self, rest: str) -> str:
        """``messages[i]<rest>`` as the client spelled it."""
        if not self.where.startswith("input["):
            return self.where
        m = re.fullmatch(r"\.tool_calls\[(\d+)\](.*)", rest)
        if m and int(m.group(1)) < len(self.calls):
            sub = m.group(2)
            return f"input[{self.calls[int(m.group(1))]}]{_CALL_FIELDS.get(sub, sub)}"
        if rest == ".tool_calls" and self.calls:
            return f"input[{self.calls[0]}]"
        if rest == ".tool_call_id":
            return f"{self.where}.call_id"
        if self.tool and rest.startswith(".content"):
            return f"{self.where}.output{rest.removeprefix('.content')}"
        if rest == ".reasoning_content" and self.reasoning is not None:
            return f"input[{self.reasoning}].content"
        return self.where + rest


@dataclass
class Names:
    """The chat request's field names as the client spelled them (one ``Source`` a message)."""

    sources: list[Source] = field(default_factory=list)

    def spell(self, param: str) -> str:
        m = re.fullmatch(r"messages\[(\d+)\](.*)", param)
        if m:
            i = int(m.group(1))
            return self.sources[i].spell(m.group(2)) if i < len(self.sources) else "input"
        if param in ("messages", "prompt"):
            return "input"
        for pattern, repl in _RENAMES:
            new, n = re.subn(pattern, repl, param)
            if n:
                return new
        return param

    def respell(self, e: ApiError) -> ApiError:
        """``e`` naming its field as the client spelled it."""
        if not e.param:
            return e
        new = self.spell(e.param)
        if new == e.param:
            return e
        message = e.message
        if message.startswith(e.param):
            message = new + message[len(e.param) :]
        return ApiError(e.status, message, param=new, code=e.code, type=e.type)


@dataclass
class Turn:
    """One Responses request as chat: the request, and the conversation it continues."""

    req: ResponsesRequest
    chat: ChatCompletionRequest
    history: list[Message]  # every message but the instructions: what a next turn continues
    names: Names


def _parse(model: type[BaseModel], raw: dict[str, Any], where: tuple[Any, ...]) -> Any:
    try:
        return model.model_validate(raw)
    except ValidationError as e:
        first = e.errors(include_url=False)[0]
        param = param_of(where + tuple(first.get("loc", ())))
        if first.get("type") == "missing":
            raise invalid(param, f"{param}: field required") from None
        raise invalid(param, f"{param}: {first.get('msg', 'invalid')}") from None


def _text(content: str | list[TextPart], where: str, kinds: tuple[str, ...]) -> str:
    if isinstance(content, str):
        return content
    parts = []
    for k, part in enumerate(content):
        if part.type not in kinds:
            raise invalid(
                f"{where}[{k}].type",
                f"{where}[{k}].type: only {', '.join(kinds)} parts are supported, got {part.type!r}",
            )
        if part.text is None:
            raise invalid(f"{where}[{k}].text", f"{where}[{k}].text: field required")
        parts.append(part.text)
    return "\n".join(parts)


class _Items:
    """The input items folded into chat messages (see the module's docstring)."""

    def __init__(self, messages: list[Message], sources: list[Source]) -> None:
        self.messages = messages
        self.sources = sources
        self.open: int | None = None  # the assistant message function calls join
        self.reasoning: tuple[str, int] | None = None  # a reasoning item's text, waiting

    def _add(self, m: Message, src: Source) -> None:
        if m["role"] == "assistant" and self.reasoning is not None:
            m["reasoning_content"], src.reasoning = self.reasoning
        self.reasoning = None
        self.messages.append(m)
        self.sources.append(src)
        self.open = len(self.messages) - 1 if m["role"] == "assistant" else None

    def add(self, j: int, raw: Any) -> None:
        where = f"input[{j}]"
        if not isinstance(raw, dict):
            raise invalid(where, f"{where}: an input item must be an object")
        kind = raw.get("type", "message")
        if kind not in ITEMS:
            known = ", ".join(ITEMS)
            raise invalid(
                f"{where}.type", f"{where}.type: {kind!r} is not supported (only {known})"
            )
        item = _parse(ITEMS[kind], raw, ("input", j))
        if isinstance(item, MessageItem):
            text = _text(item.content, f"{where}.content", TEXT_PARTS)
            self._add({"role": item.role, "content": text}, Source(where))
        elif isinstance(item, FunctionCallItem):
            call = {
                "id": item.call_id,
                "type": "function",
                "function": {"name": item.name, "arguments": item.arguments},
            }
            if self.open is not None and self.reasoning is None:
                self.messages[self.open].setdefault("tool_calls", []).append(call)
                self.sources[self.open].calls.append(j)
            else:
                m = {"role": "assistant", "content": None, "tool_calls": [call]}
                self._add(m, Source(where, calls=[j]))
        elif isinstance(item, FunctionCallOutputItem):
            text = _text(item.output, f"{where}.output", TEXT_PARTS)
            m = {"role": "tool", "tool_call_id": item.call_id, "content": text}
            self._add(m, Source(where, tool=True))
        elif isinstance(item, ReasoningItem):
            parts = [p.text for p in item.content or [] if p.text]
            self.reasoning = ("\n".join(parts), j) if parts else None
            self.open = None


def _response_format(req: ResponsesRequest) -> dict[str, Any] | None:
    fmt = req.text.format if req.text is not None else None
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return {"type": "json_object"}
    spec: dict[str, Any] = {"name": fmt.name, "description": fmt.description, "strict": fmt.strict}
    if fmt.schema_ is not None:
        spec["schema"] = fmt.schema_
    return {"type": "json_schema", "json_schema": spec}


def _tools(req: ResponsesRequest) -> dict[str, Any]:
    out: dict[str, Any] = {"parallel_tool_calls": req.parallel_tool_calls}
    if req.tools:
        out["tools"] = [
            {"type": "function", "function": t.model_dump(exclude={"type"}, exclude_none=True)}
            for t in req.tools
        ]
    choice = req.tool_choice
    if isinstance(choice, str):
        out["tool_choice"] = choice
    elif choice is not None:
        out["tool_choice"] = {"type": "function", "function": {"name": choice.name}}
    return out


def turn_of(req: ResponsesRequest, previous: list[Message] | None = None) -> Turn:
    """The chat request for ``req`` after the ``previous`` conversation (its stored messages
    and output), or an ``ApiError`` naming the field."""
    messages: list[Message] = []
    sources: list[Source] = []
    if req.instructions:
        messages.append({"role": "system", "content": req.instructions})
        sources.append(Source("instructions"))
    for m in previous or []:
        messages.append(m)
        sources.append(Source("previous_response_id"))
    if isinstance(req.input, str):
        messages.append({"role": "user", "content": req.input})
        sources.append(Source("input"))
    elif not req.input:
        raise invalid("input", "input: must not be empty")
    items = _Items(messages, sources)
    for j, raw in enumerate(req.input if isinstance(req.input, list) else []):
        items.add(j, raw)
    body: dict[str, Any] = {
        "model": req.model,
        "messages": messages,
        "max_completion_tokens": req.max_output_tokens,
        "temperature": req.temperature,
        "top_p": req.top_p,
        "seed": req.seed,
        "top_k": req.top_k,
        "min_p": req.min_p,
        "ignore_eos": req.ignore_eos,
        "user": req.user,
        "chat_template_kwargs": req.chat_template_kwargs,
        "response_format": _response_format(req),
        "stream": req.stream,
        **_tools(req),
    }
    names = Names(sources)
    try:
        chat = ChatCompletionRequest.model_validate(
            {k: v for k, v in body.items() if v is not None}
        )
    except ValidationError as e:
        raise names.respell(from_validation(e)) from None
    history = messages[1:] if req.instructions else list(messages)
    return Turn(req, chat, history, names)


def plan_turn(turn: Turn, model: ModelInfo, rid: str) -> Plan:
    """The front-door plan of ``turn`` (one choice); refusals named as the client spelled them."""
    try:
        return plan_chat(turn.chat, model, rid)
    except ApiError as e:
        raise turn.names.respell(e) from None
