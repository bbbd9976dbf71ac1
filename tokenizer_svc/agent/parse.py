"""A model's output text as reasoning, answer and tool calls (pure; incremental for streams).

``OutputParser`` takes the generated text as it grows (``feed``) and answers, at any moment,
what is already certain (``parsed``): the reasoning between ``<think>`` and ``</think>``, the
answer's text, and the tool calls, each with its name and as much of its arguments' JSON text as
has arrived. Everything it returns only grows as text arrives (text that could still turn out
to be the start of a tag is held back), so a stream of the differences (``Diff``) adds up to
exactly what the whole text parses to: streamed and non-streamed answers are equal by
construction.

Tool-call formats (``TOOL_PARSERS``, vLLM's names):

- ``hermes``: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` blocks (Qwen2.5,
  Qwen3, Hermes, SmolLM2), text allowed around them.
- ``llama3_json``: the answer is one or more ``{"name": ..., "parameters": {...}}`` objects
  separated by ``;`` (optionally after ``<|python_tag|>``); any other answer is text.
- ``mistral``: ``[TOOL_CALLS]`` then a JSON array of ``{"name": ..., "arguments": {...}}``.

Reasoning formats (``REASONING_PARSERS``): ``qwen3`` (reasoning only when the answer opens with
``<think>``, or the prompt opened it) and ``deepseek_r1`` (the answer starts in reasoning).
A call's arguments are the model's JSON text of the value, as written.
"""

from __future__ import annotations

from dataclasses import dataclass, field

TOOL_PARSERS = ("hermes", "llama3_json", "mistral")
REASONING_PARSERS = ("qwen3", "deepseek_r1")
THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
_WS = " \t\r\n"


@dataclass
class Call:
    name: str
    arguments: str  # the arguments' JSON text so far (whole once ``done``)
    done: bool = False


@dataclass
class Parsed:
    reasoning: str = ""
    content: str = ""
    calls: list[Call] = field(default_factory=list)


def _held(text: str, tag: str) -> int:
    """How many trailing characters of ``text`` could be the start of ``tag``."""
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-k:]):
            return k
    return 0


def _scan_string(s: str, i: int) -> int | None:
    """``s[i] == '"'``: the index after the closing quote, None if not closed yet."""
    j = i + 1
    while j < len(s):
        c = s[j]
        if c == "\\":
            j += 2
            continue
        if c == '"':
            return j + 1
        j += 1
    return None


def _scan_value(s: str, i: int) -> int | None:
    """The index after the JSON value starting at ``s[i]``, None if it is not complete yet
    (a number or literal is complete only once something follows it)."""
    if i >= len(s):
        return None
    c = s[i]
    if c == '"':
        return _scan_string(s, i)
    if c in "{[":
        depth, j = 0, i
        while j < len(s):
            c = s[j]
            if c == '"':
                end = _scan_string(s, j)
                if end is None:
                    return None
                j = end
                continue
            if c in "{[":
                depth += 1
            elif c in "}]":
                depth -= 1
                if depth == 0:
                    return j + 1
            j += 1
        return None
    j = i
    while j < len(s) and s[j] not in ",}] \t\r\n":
        j += 1
    return j if j < len(s) else None


def _skip_ws(s: str, i: int) -> int:
    while i < len(s) and s[i] in _WS:
        i += 1
    return i


@dataclass
class _Obj:
    """One call object ``{"name": ..., "<args key>": ...}`` as far as it has arrived."""

    name: str | None = None
    args: str = ""  # the arguments' text so far
    args_done: bool = False
    end: int | None = None  # index after the closing brace
    bad: bool = False


def _scan_call(s: str, i: int, args_keys: tuple[str, ...]) -> _Obj:
    """The call object at ``s[i]`` (``{``); key order free, other keys skipped."""
    import json

    o = _Obj()
    if i >= len(s):
        return o
    if s[i] != "{":
        o.bad = True
        return o
    j = i + 1
    while True:
        j = _skip_ws(s, j)
        if j >= len(s):
            return o
        if s[j] == "}":
            o.end = j + 1
            return o
        if s[j] == ",":
            j += 1
            continue
        if s[j] != '"':
            o.bad = True
            return o
        kend = _scan_string(s, j)
        if kend is None:
            return o
        try:
            key = json.loads(s[j:kend])
        except ValueError:
            o.bad = True
            return o
        j = _skip_ws(s, kend)
        if j >= len(s):
            return o
        if s[j] != ":":
            o.bad = True
            return o
        j = _skip_ws(s, j + 1)
        if j >= len(s):
            return o
        vend = _scan_value(s, j)
        if key in args_keys:
            o.args = s[j : len(s) if vend is None else vend]
            if s[j] not in "{[" and vend is None:
                o.args = ""  # a scalar is shown only once whole
            o.args_done = vend is not None
        elif key == "name" and vend is not None:
            try:
                name = json.loads(s[j:vend])
            except ValueError:
                o.bad = True
                return o
            if not isinstance(name, str):
                o.bad = True
                return o
            o.name = name
        if vend is None:
            return o
        j = vend


def _call_of(o: _Obj, final: bool) -> Call | None:
    if o.name is None:
        return None
    return Call(o.name, o.args if o.args else ("{}" if final else ""), o.end is not None)


class OutputParser:
    """Reasoning and tool calls out of one choice's text. ``tools``: a ``TOOL_PARSERS`` name or
    "" (no tool parsing); ``reasoning``: a ``REASONING_PARSERS`` name or ""; ``opened``: the
    prompt ended inside a ``<think>`` block (the template opened it)."""

    def __init__(self, tools: str = "", reasoning: str = "", opened: bool = False) -> None:
        if tools and tools not in TOOL_PARSERS:
            raise ValueError(f"tool parser must be one of {TOOL_PARSERS}, got {tools!r}")
        if reasoning and reasoning not in REASONING_PARSERS:
            raise ValueError(f"reasoning parser must be one of {REASONING_PARSERS}")
        self.tools = tools
        self.reasoning = reasoning
        self.opened = opened or reasoning == "deepseek_r1"
        self.text = ""

    def feed(self, delta: str) -> None:
        self.text += delta

    def parsed(self, final: bool = False) -> Parsed:
        reasoning, answer = self._split_reasoning(final)
        out = Parsed(reasoning=reasoning)
        if answer is None:
            return out
        if not self.tools:
            out.content = answer
            return out
        out.content, out.calls = _TOOLS[self.tools](answer, final)
        return out

    def _split_reasoning(self, final: bool) -> tuple[str, str | None]:
        """``(reasoning, answer)``; answer None while it is not known whether one starts."""
        t = self.text
        if not self.reasoning:
            return "", t
        if not self.opened:
            head = t.lstrip(_WS)
            if head.startswith(THINK_OPEN):
                t = head[len(THINK_OPEN) :]
            elif THINK_OPEN.startswith(head) and not final:
                return "", None  # may still open a think block
            else:
                return "", t
        close = t.find(THINK_CLOSE)
        if close < 0:
            body = t if final else t[: len(t) - _held(t, THINK_CLOSE)]
            return body.strip(_WS) if final else body.lstrip(_WS).rstrip(_WS), None
        return t[:close].strip(_WS), t[close + len(THINK_CLOSE) :].lstrip(_WS)


def _content(text: str, final: bool, has_calls: bool) -> str:
    """Text around calls: trailing whitespace held (it precedes a call, or ends the answer)."""
    if final and not has_calls:
        return text
    return text.rstrip(_WS)


def _hermes(s: str, final: bool) -> tuple[str, list[Call]]:
    open_, close = "<tool_call>", "</tool_call>"
    content: list[str] = []
    calls: list[Call] = []
    i = 0
    while True:
        k = s.find(open_, i)
        if k < 0:
            rest = s[i:]
            if not final:
                rest = rest[: len(rest) - _held(rest, open_)]
            content.append(rest)
            break
        content.append(s[i:k])
        j = _skip_ws(s, k + len(open_))
        o = _scan_call(s, j, ("arguments", "parameters"))
        c = _call_of(o, final)
        if c is None and (o.bad or final or o.end is not None):
            # not a call after all: the block is text (up to its close, or all of it)
            e = s.find(close, k)
            stop = len(s) if e < 0 else e + len(close)
            if e < 0 and not final:
                break  # may still be repaired by nothing: held until the end
            content.append(s[k:stop])
            i = stop
            continue
        if c is not None:
            calls.append(c)  # named: a call, even if its JSON breaks later
        if o.bad:
            e = s.find(close, k)
            if e < 0:
                break
            i = e + len(close)
            continue
        if o.end is None:
            break
        e = _skip_ws(s, o.end)
        if s.startswith(close, e):
            i = e + len(close)
        elif close.startswith(s[e:]) and not final:
            break
        else:
            i = e  # a call without its closing tag: what follows is text
    return _content("".join(content), final, bool(calls)), calls


def _llama3(s: str, final: bool) -> tuple[str, list[Call]]:
    tag = "<|python_tag|>"
    head = s.lstrip(_WS)
    if head.startswith(tag):
        head = head[len(tag) :].lstrip(_WS)
    elif not final and tag.startswith(head):
        return "", []
    if not head and not final:
        return "", []
    if not head.startswith("{"):
        return (s if final else s.rstrip(_WS)), []
    calls: list[Call] = []
    i = 0
    while True:
        o = _scan_call(head, i, ("parameters", "arguments"))
        c = _call_of(o, final)
        if o.bad:
            break
        if c is not None:
            calls.append(c)
        if o.end is None:
            break
        i = _skip_ws(head, o.end)
        if not head.startswith(";", i):
            break
        i = _skip_ws(head, i + 1)
    if not calls and final:
        return s, []
    return "", calls


def _mistral(s: str, final: bool) -> tuple[str, list[Call]]:
    tag = "[TOOL_CALLS]"
    k = s.find(tag)
    if k < 0:
        body = s if final else s[: len(s) - _held(s, tag)]
        return _content(body, final, False), []
    content = s[:k]
    j = _skip_ws(s, k + len(tag))
    calls: list[Call] = []
    if j < len(s) and s[j] == "[":
        j += 1
        while True:
            j = _skip_ws(s, j)
            o = _scan_call(s, j, ("arguments", "parameters"))
            c = _call_of(o, final)
            if c is not None:
                calls.append(c)
            if o.bad or o.end is None:
                break
            j = _skip_ws(s, o.end)
            if not s.startswith(",", j):
                break
            j += 1
    return _content(content, final, True), calls


_TOOLS = {"hermes": _hermes, "llama3_json": _llama3, "mistral": _mistral}


@dataclass
class Diff:
    """What a stream still has to send: ``("reasoning", text)``, ``("content", text)``,
    ``("call", index, name)`` (a call starts) and ``("arguments", index, piece)``."""

    sent: Parsed = field(default_factory=Parsed)

    def step(self, now: Parsed) -> list[tuple]:
        out: list[tuple] = []
        s = self.sent
        if len(now.reasoning) > len(s.reasoning):
            out.append(("reasoning", now.reasoning[len(s.reasoning) :]))
            s.reasoning = now.reasoning
        if len(now.content) > len(s.content):
            out.append(("content", now.content[len(s.content) :]))
            s.content = now.content
        for i, c in enumerate(now.calls):
            if i >= len(s.calls):
                out.append(("call", i, c.name))
                s.calls.append(Call(c.name, ""))
            sent = s.calls[i]
            if len(c.arguments) > len(sent.arguments):
                out.append(("arguments", i, c.arguments[len(sent.arguments) :]))
                sent.arguments = c.arguments
        return out
