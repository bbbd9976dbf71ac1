"""Tools and reasoning at the front door (pure): checked, shown to the model through its chat
template, and enforced by a grammar when a call is required.

- ``check_tools`` / ``check_messages``: a tool's parameters must be a valid JSON Schema
  (``jsonschema``'s meta-schema check), names unique, ``tool_choice`` one of none / auto /
  required / a tool's name; a ``tool`` message must answer a call an assistant made before it,
  and a call's arguments must be a JSON object. Each refusal names its field.
- ``render``: the conversation as the model's chat template writes it, tools included
  (transformers' ``apply_chat_template(tools=...)``, calls and tool answers in transformers'
  message shape). A template that shows no tools (SmolLM2's) gets them in a system message,
  earlier calls in the assistant's text and tool answers as user turns, all in the hermes
  format, the one the parser then reads.
- ``Reading``: how the output is read, decided from the template or the configuration: the
  tool-call format (``hermes`` when the template writes ``<tool_call>``, ``mistral`` for
  ``[TOOL_CALLS]``, ``llama3_json`` for ``<|python_tag|>``, else hermes) and the reasoning
  format (``qwen3`` when the template knows ``<think>``; the prompt may end inside one).
- ``tools_grammar``: for ``required`` or a named tool, a Lark grammar (llguidance) whose every
  sentence is one call (or several, when parallel calls are allowed) in the parser's format,
  naming a given tool, with arguments valid against its schema.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from actors.shared.grammar import json_options
from messages.tokenizer import ChatMessage, Generate, Tool

RESERVED_KWARGS = frozenset({"messages", "tools", "add_generation_prompt", "tokenize", "documents"})
MAX_PARALLEL_CALLS = 8  # calls in one required answer, at most (each a grammar alternative)


class ToolError(ValueError):
    def __init__(self, field: str, reason: str) -> None:
        super().__init__(f"{field}: {reason}")
        self.field = field
        self.reason = reason


@dataclass(frozen=True)
class Reading:
    tool_parser: str = ""  # "": no tool calls to parse
    reasoning_parser: str = ""
    thinking: bool = False  # the prompt ends inside <think>


def template_of(tokenizer: Any) -> str:
    t = getattr(tokenizer, "chat_template", None) or ""
    if isinstance(t, dict):
        return str(t.get("tool_use") or t.get("default") or "")
    return str(t)


def tool_parser_for(template: str, configured: str) -> str:
    if configured != "auto":
        return configured
    if "[TOOL_CALLS]" in template:
        return "mistral"
    if "<|python_tag|>" in template or "ipython" in template:
        return "llama3_json"
    return "hermes"


def reasoning_parser_for(template: str, configured: str) -> str:
    if configured == "none":
        return ""
    if configured != "auto":
        return configured
    return "qwen3" if "<think>" in template else ""


def check_tools(msg: Generate) -> None:
    from jsonschema.exceptions import SchemaError
    from jsonschema.validators import validator_for

    names: set[str] = set()
    for i, t in enumerate(msg.tools):
        if not t.name:
            raise ToolError(f"tools[{i}].name", "must not be empty")
        if t.name in names:
            raise ToolError(f"tools[{i}].name", f"{t.name!r} is defined twice")
        names.add(t.name)
        if t.parameters:
            try:
                validator_for(t.parameters).check_schema(t.parameters)
            except SchemaError as e:
                where = "/".join(str(p) for p in e.path)
                at = f" at {where}" if where else ""
                raise ToolError(
                    f"tools[{i}].parameters", f"not a valid JSON Schema{at}: {e.message}"
                ) from None
            if t.parameters.get("type", "object") != "object":
                raise ToolError(f"tools[{i}].parameters", "must describe an object")
    choice = msg.tool_choice
    if choice in ("none", "auto"):
        return
    if not msg.tools:
        raise ToolError("tool_choice", f"{choice!r} needs tools")
    if choice != "required" and choice not in names:
        raise ToolError("tool_choice", f"names no tool of this request: {choice!r}")


def check_messages(messages: list[ChatMessage]) -> None:
    """Tool answers must answer calls made before them; calls' arguments are JSON objects."""
    open_calls: set[str] = set()
    for i, m in enumerate(messages):
        for j, c in enumerate(m.tool_calls):
            if m.role != "assistant":
                raise ToolError(f"messages[{i}].tool_calls", "only an assistant makes calls")
            try:
                args = json.loads(c.arguments)
            except ValueError:
                args = None
            if not isinstance(args, dict):
                raise ToolError(
                    f"messages[{i}].tool_calls[{j}].arguments", "must be a JSON object's text"
                )
            open_calls.add(c.id)
        if m.role == "tool":
            if not m.tool_call_id:
                raise ToolError(f"messages[{i}].tool_call_id", "required for a tool message")
            if m.tool_call_id not in open_calls:
                raise ToolError(
                    f"messages[{i}].tool_call_id",
                    f"{m.tool_call_id!r} answers no call made before it",
                )


def _message(m: ChatMessage) -> dict[str, Any]:
    out: dict[str, Any] = {"role": m.role, "content": m.content}
    if m.tool_calls:
        out["tool_calls"] = [
            {
                "id": c.id,
                "type": "function",
                "function": {"name": c.name, "arguments": json.loads(c.arguments)},
            }
            for c in m.tool_calls
        ]
    if m.tool_call_id:
        out["tool_call_id"] = m.tool_call_id
    if m.reasoning:
        out["reasoning_content"] = m.reasoning
    return out


def _tool(t: Tool) -> dict[str, Any]:
    fn: dict[str, Any] = {"name": t.name, "parameters": t.parameters or _NO_ARGS}
    if t.description:
        fn["description"] = t.description
    return {"type": "function", "function": fn}


_NO_ARGS = {"type": "object", "properties": {}}


def tools_system_text(tools: list[Tool]) -> str:
    """The tools in a system message, for a template that shows none (hermes format)."""
    lines = [json.dumps(_tool(t)["function"], ensure_ascii=False) for t in tools]
    return (
        "You can call these functions:\n<tools>\n" + "\n".join(lines) + "\n</tools>\n"
        "To call one, answer with <tool_call>\n"
        '{"name": <function name>, "arguments": <arguments as a JSON object>}\n</tool_call>'
    )


def _as_text(m: ChatMessage) -> dict[str, Any]:
    """A message for a template that knows no tools: calls written into the assistant's text
    and tool answers as user turns, both in the hermes format."""
    if m.role == "tool":
        return {"role": "user", "content": f"<tool_response>\n{m.content}\n</tool_response>"}
    calls = "".join(
        "<tool_call>\n"
        + json.dumps({"name": c.name, "arguments": json.loads(c.arguments)}, ensure_ascii=False)
        + "\n</tool_call>"
        for c in m.tool_calls
    )
    content = m.content + ("\n" if m.content and calls else "") + calls
    return {"role": m.role, "content": content}


def render(tokenizer: Any, msg: Generate) -> str:
    """The prompt's text: the conversation (and tools) through the chat template."""
    assert msg.messages is not None
    tools = [_tool(t) for t in msg.tools] or None
    if "tools" in template_of(tokenizer):
        messages = [_message(m) for m in msg.messages]
    else:  # the template shows no tools: shown here, in the format the parser reads
        messages = [_as_text(m) for m in msg.messages]
    if tools and "tools" not in template_of(tokenizer):
        text = tools_system_text(msg.tools)
        if messages and messages[0]["role"] == "system":
            messages[0] = {**messages[0], "content": messages[0]["content"] + "\n\n" + text}
        else:
            messages.insert(0, {"role": "system", "content": text})
        tools = None
    return str(
        tokenizer.apply_chat_template(
            messages,
            tools=tools,
            add_generation_prompt=True,
            tokenize=False,
            **msg.chat_template_kwargs,
        )
    )


def ends_thinking(prompt: str) -> bool:
    """Whether the prompt leaves the model inside a ``<think>`` block."""
    return prompt.rfind("<think>") > prompt.rfind("</think>")


# ---------------------------------------------------------------- the grammar of a required call
def _call_rule(t: Tool, args_key: str) -> str:
    schema = dict(t.parameters or _NO_ARGS)
    schema["x-guidance"] = json_options("spaces")  # as tool calls are written
    head = json.dumps('{"name": ' + json.dumps(t.name) + f', "{args_key}": ')
    return f"{head} %json {json.dumps(schema)} " + json.dumps("}")


def tools_grammar(msg: Generate, parser: str) -> str | None:
    """The Lark grammar a ``required`` or named ``tool_choice`` constrains the answer to (None
    for none / auto: the model writes what it likes and the parser reads it)."""
    if msg.tool_choice in ("none", "auto"):
        return None
    tools = [t for t in msg.tools if msg.tool_choice in ("required", t.name)]
    args_key = "parameters" if parser == "llama3_json" else "arguments"
    calls = [_call_rule(t, args_key) for t in tools]
    many = msg.parallel_tool_calls and msg.tool_choice == "required"
    lines = ["obj: " + "\n   | ".join(calls)]
    if parser == "hermes":
        lines.append('call: "<tool_call>\\n" obj "\\n</tool_call>"')
        sep = '"\\n"'
    elif parser == "llama3_json":
        lines.append("call: obj")
        sep = '"; "'
    else:  # mistral
        lines.append("call: obj")
        sep = '", "'
    body = f"call ({sep} call){{0,{MAX_PARALLEL_CALLS - 1}}}" if many else "call"
    if parser == "mistral":
        body = f'"[TOOL_CALLS][" {body} "]"'
    return "\n".join([f"start: {body}", *lines]) + "\n"
