"""The Response object of OpenAI's Responses API and its output items (pure).

A response's output is, in the order the model began them: a ``reasoning`` item (its reasoning
text, when it reasoned), a ``message`` item (its text, when it wrote any) and one
``function_call`` item per tool call. Reasoning comes first; the text comes before the calls
unless a call began before any text did (``Order``), the same rule streamed or not, so a
streamed response ends equal to the one answered whole.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from typing import Any

from minirt.http.openai.shapes import Choices, call_id
from minirt.http.responses.schema import ResponsesRequest
from tokenizer_svc.agent.parse import Call, Parsed

KINDS = ("reasoning", "message", "calls")


def new_id() -> str:
    return f"resp_{uuid.uuid4().hex}"


@dataclass
class Shape:
    """One response's id, time, model and the request fields it echoes (``echo_of``)."""

    id: str
    created_at: int
    model: str
    echo: dict[str, Any]

    @property
    def hex(self) -> str:
        return self.id.removeprefix("resp_")

    def item_id(self, kind: str, index: int = 0) -> str:
        if kind == "reasoning":
            return f"rs_{self.hex}"
        if kind == "message":
            return f"msg_{self.hex}"
        return f"fc_{self.hex}_{index}"

    def call_id(self, index: int) -> str:
        return call_id(self.id, index)

    def response(
        self,
        status: str,
        output: list[dict[str, Any]],
        usage: dict[str, Any] | None = None,
        incomplete: dict[str, Any] | None = None,
    ) -> dict[str, Any]:
        return {
            "id": self.id,
            "object": "response",
            "created_at": self.created_at,
            "status": status,
            "error": None,
            "incomplete_details": incomplete,
            "model": self.model,
            "output": output,
            "usage": usage,
            **self.echo,
        }


def echo_of(req: ResponsesRequest, stored: bool) -> dict[str, Any]:
    """The request's fields as the Response object repeats them (defaults filled in)."""
    fmt = req.text.format if req.text is not None else None
    text = {"format": {"type": "text"}}
    if fmt is not None:
        text = {"format": fmt.model_dump(by_alias=True, exclude_none=True)}
    choice: Any = req.tool_choice if req.tool_choice is not None else "auto"
    if not isinstance(choice, str):
        choice = choice.model_dump()
    return {
        "instructions": req.instructions,
        "max_output_tokens": req.max_output_tokens,
        "parallel_tool_calls": req.parallel_tool_calls,
        "previous_response_id": req.previous_response_id,
        "reasoning": req.reasoning,
        "store": stored,
        "temperature": 1.0 if req.temperature is None else req.temperature,
        "text": text,
        "tool_choice": choice,
        "tools": [t.model_dump() for t in req.tools or []],
        "top_p": 1.0 if req.top_p is None else req.top_p,
        "truncation": "disabled",
        "user": req.user,
        "metadata": req.metadata or {},
    }


@dataclass
class Order:
    """Which of reasoning, text and calls the model began first (fed the partial parses)."""

    kinds: list[str] = field(default_factory=list)

    @property
    def decided(self) -> bool:
        """Whether the answer (text or a call) has begun: the order cannot change after."""
        return "message" in self.kinds or "calls" in self.kinds

    def see(self, p: Parsed) -> None:
        for kind, present in zip(KINDS, (p.reasoning, p.content, p.calls), strict=True):
            if present and kind not in self.kinds:
                self.kinds.append(kind)

    def final(self) -> list[str]:
        seen = [k for k in self.kinds if k != "reasoning"]
        return ["reasoning"] + seen + [k for k in KINDS[1:] if k not in seen]


def reasoning_item(shape: Shape, text: str) -> dict[str, Any]:
    content = [{"type": "reasoning_text", "text": text}] if text else []
    return {
        "type": "reasoning",
        "id": shape.item_id("reasoning"),
        "summary": [],
        "content": content,
    }


def message_item(shape: Shape, text: str | None, status: str) -> dict[str, Any]:
    """The text's item; ``text`` None: as it opens, without its content part yet."""
    content = [] if text is None else [output_text(text)]
    return {
        "type": "message",
        "id": shape.item_id("message"),
        "status": status,
        "role": "assistant",
        "content": content,
    }


def output_text(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": []}


def call_item(shape: Shape, index: int, call: Call, status: str) -> dict[str, Any]:
    return {
        "type": "function_call",
        "id": shape.item_id("calls", index),
        "call_id": shape.call_id(index),
        "name": call.name,
        "arguments": call.arguments,
        "status": status,
    }


def output_items(shape: Shape, p: Parsed, order: list[str], status: str) -> list[dict[str, Any]]:
    """The output items of the final parse ``p``, in ``order`` (``Order.final``)."""
    item_status = "completed" if status == "completed" else "incomplete"
    out: list[dict[str, Any]] = []
    for kind in order:
        if kind == "reasoning" and p.reasoning:
            out.append(reasoning_item(shape, p.reasoning))
        elif kind == "message" and p.content:
            out.append(message_item(shape, p.content, item_status))
        elif kind == "calls":
            out += [call_item(shape, i, c, item_status) for i, c in enumerate(p.calls)]
    return out


def status_of(finish_reason: str | None) -> tuple[str, dict[str, Any] | None]:
    """``(status, incomplete_details)``: a stop completes; the length limit leaves it
    incomplete (``max_output_tokens``), as does an abort (no reason)."""
    if finish_reason == "length":
        return "incomplete", {"reason": "max_output_tokens"}
    if finish_reason == "abort":
        return "incomplete", {"reason": None}
    return "completed", None


def usage_of(choices: Choices) -> dict[str, Any]:
    u = choices.usage()
    return {
        "input_tokens": u["prompt_tokens"],
        "input_tokens_details": {
            "cached_tokens": u["prompt_tokens_details"]["cached_tokens"],
            "cache_write_tokens": 0,
        },
        "output_tokens": u["completion_tokens"],
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": u["total_tokens"],
    }


def assistant_message(shape: Shape, p: Parsed) -> dict[str, Any]:
    """The output as one chat message, for the conversation a next turn continues."""
    m: dict[str, Any] = {"role": "assistant", "content": p.content or None}
    if p.reasoning:
        m["reasoning_content"] = p.reasoning
    if p.calls:
        m["tool_calls"] = [
            {
                "id": shape.call_id(i),
                "type": "function",
                "function": {"name": c.name, "arguments": c.arguments},
            }
            for i, c in enumerate(p.calls)
        ]
    return m
