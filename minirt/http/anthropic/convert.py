"""An Anthropic Messages request as a chat completions request: the system prompt, user and
assistant turns with their text, an assistant's ``tool_use`` blocks as its tool calls, a user's
``tool_result`` blocks as tool messages answering them, the tools and the tool choice. The plan
is chat's (``plan_chat``): the front door validates, renders the template and tokenizes, once,
as for chat completions, so a conversation gets the same tokens whichever API sent it."""

from __future__ import annotations

import json
from typing import Any

from pydantic import ValidationError

from minirt.http.anthropic.schema import Block, MessagesRequest
from minirt.http.errors import invalid
from minirt.http.model import ModelInfo
from minirt.http.openai.convert import Plan, plan_chat
from minirt.http.openai.schemas import ChatCompletionRequest

TOOL_CHOICE = {"auto": "auto", "any": "required", "none": "none"}


def text_of(content: str | list[Block] | None, where: str) -> str:
    """Text content: a string, or text blocks joined by newlines."""
    if content is None or isinstance(content, str):
        return content or ""
    parts = []
    for j, b in enumerate(content):
        if b.type != "text":
            raise invalid(
                f"{where}[{j}].type", f"{where}[{j}].type: only text here, got {b.type!r}"
            )
        parts.append(b.text or "")
    return "\n".join(parts)


def chat_messages(req: MessagesRequest) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    if req.system:
        out.append({"role": "system", "content": text_of(req.system, "system")})
    for i, m in enumerate(req.messages):
        if isinstance(m.content, str):
            out.append({"role": m.role, "content": m.content})
            continue
        texts: list[str] = []
        calls: list[dict[str, Any]] = []
        results: list[dict[str, Any]] = []
        for j, b in enumerate(m.content):
            where = f"messages[{i}].content[{j}]"
            if b.type == "text":
                texts.append(b.text or "")
            elif b.type == "tool_use" and m.role == "assistant":
                if not b.name:
                    raise invalid(f"{where}.name", f"{where}.name: required for a tool_use block")
                arguments = json.dumps(b.input or {})
                fn = {"name": b.name, "arguments": arguments}
                calls.append({"id": b.id or f"toolu_{i}_{j}", "type": "function", "function": fn})
            elif b.type == "tool_result" and m.role == "user":
                if not b.tool_use_id:
                    raise invalid(f"{where}.tool_use_id", f"{where}.tool_use_id: required")
                text = text_of(b.content, f"{where}.content")
                results.append({"role": "tool", "tool_call_id": b.tool_use_id, "content": text})
            else:
                raise invalid(
                    f"{where}.type", f"{where}.type: {b.type!r} is not supported in a {m.role} turn"
                )
        out.extend(results)  # they answer the assistant's calls, so they come first
        if texts or calls or not results:
            entry: dict[str, Any] = {"role": m.role, "content": "\n".join(texts)}
            if calls:
                entry["tool_calls"] = calls
            out.append(entry)
    return out


def chat_request(req: MessagesRequest) -> ChatCompletionRequest:
    body: dict[str, Any] = {
        "model": req.model,
        "messages": chat_messages(req),
        "max_tokens": req.max_tokens,
        "temperature": req.temperature,
        "top_p": req.top_p,
        "top_k": req.top_k,
        "stream": req.stream,
    }
    if req.stop_sequences:
        body["stop"] = req.stop_sequences
    if req.tools:
        body["tools"] = [
            {
                "type": "function",
                "function": {
                    "name": t.name,
                    "description": t.description,
                    "parameters": t.input_schema,
                },
            }
            for t in req.tools
        ]
    tc = req.tool_choice
    if tc is not None:
        if tc.type == "tool" and not tc.name:
            raise invalid("tool_choice.name", "tool_choice.name: required with type 'tool'")
        named = {"type": "function", "function": {"name": tc.name}}
        body["tool_choice"] = TOOL_CHOICE.get(tc.type, named)
        body["parallel_tool_calls"] = not tc.disable_parallel_tool_use
    try:
        return ChatCompletionRequest.model_validate(body)
    except ValidationError as e:  # what the chat schema checks beyond this one (rarely)
        err = e.errors()[0]
        where = ".".join(str(x) for x in err["loc"])
        raise invalid(where, f"{where}: {err['msg']}") from None


def plan_messages(req: MessagesRequest, model: ModelInfo, rid: str) -> Plan:
    return plan_chat(chat_request(req), model, rid)
