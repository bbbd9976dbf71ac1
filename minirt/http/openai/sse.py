"""Server-sent events: OpenAI's framing (``data: {json}\\n\\n`` ... ``data: [DONE]\\n\\n``) and the
chunks of one streamed request, built from the front door's messages as they arrive."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import AsyncIterator
from typing import Any

import msgspec
import trio

from messages import client as cm
from minirt.http.errors import ApiError
from minirt.http.model import ModelInfo
from minirt.http.openai.convert import Plan
from minirt.http.openai.shapes import (
    Choices,
    call_id,
    chat_logprobs,
    chunk,
    finish_of,
    stream_choice,
)
from tokenizer_svc.agent.parse import Diff

DONE = b"data: [DONE]\n\n"
_encode = msgspec.json.Encoder().encode


def frame(obj: Any) -> bytes:
    return b"data: " + _encode(obj) + b"\n\n"


class StreamWriter:
    """Turns ``(choice index, message)`` items into SSE frames for one request."""

    def __init__(self, plan: Plan, choices: Choices, model: ModelInfo, rid: str) -> None:
        self.plan = plan
        self.choices = choices
        self.model = model
        self.rid = rid
        self.started: set[int] = set()
        self.chars: dict[int, int] = {}  # characters sent per choice (completions text_offset)
        self.completed = False
        self.error: ApiError | None = None
        self.diffs: dict[int, Diff] = defaultdict(Diff)  # per choice: what its stream sent

    def _chunk(self, index: int, choice: dict[str, Any]) -> bytes:
        usage = self.choices.choice_usage(index) if self.plan.continuous_usage else None
        return frame(chunk(self.plan, self.model, self.rid, choice, usage))

    def _start(self, index: int) -> list[bytes]:
        """What opens a choice: the assistant role (chat) or the echoed prompt (completions)."""
        self.started.add(index)
        plan = self.plan
        if plan.kind == "chat":
            return [
                self._chunk(index, stream_choice(plan, self.model, index, "", [], None, role=True))
            ]
        prompt_index = self.choices.by_index[index].prompt_index
        echo = plan.echo[prompt_index] if plan.echo else ""
        self.chars[index] = len(echo)
        if not echo:
            return []
        return [self._chunk(index, stream_choice(plan, self.model, index, echo, [], None))]

    def feed(self, index: int, msg: Any, now: float) -> list[bytes]:
        if isinstance(msg, ApiError):
            self.error = msg
            return [frame(msg.body())]
        if not isinstance(msg, (cm.Delta, cm.Final)):
            self.choices.feed(index, msg, now)
            return []
        out = [] if index in self.started else self._start(index)
        text, entries = self.choices.feed(index, msg, now)
        plan = self.plan
        if self.choices.by_index[index].parser is not None:
            return out + self._parsed(index, msg, entries)
        if isinstance(msg, cm.Delta):
            if not text and not entries and not msg.token_ids:
                return out
            # One chunk per token, as vLLM sends them, even when its text is held back (part of
            # a character or of a possible stop string) or empty (a special token).
            offset = self.chars.get(index, 0)
            self.chars[index] = offset + len(text)
            out.append(
                self._chunk(
                    index, stream_choice(plan, self.model, index, text, entries, None, offset)
                )
            )
            return out
        finish = self.choices.by_index[index].finish_reason
        none = None if plan.kind == "chat" else ""
        out.append(self._chunk(index, stream_choice(plan, self.model, index, none, [], finish)))
        return out

    def _parsed(self, index: int, msg: Any, entries: list) -> list[bytes]:
        """A chat choice read by its parser: reasoning, content and tool calls, each as it
        becomes certain (a tag or a call's JSON is never sent half-read)."""
        ch = self.choices.by_index[index]
        final = isinstance(msg, cm.Final)
        parsed = ch.parsed(final)
        deltas = [_delta(ev, self._cid(index)) for ev in self.diffs[index].step(parsed)]
        if entries and not deltas:
            deltas = [{}]
        out = []
        for i, delta in enumerate(deltas):
            lps = chat_logprobs(self.model, entries) if entries and i == 0 else None
            if self.plan.logprobs is None:
                lps = None
            choice = {"index": index, "delta": delta, "logprobs": lps, "finish_reason": None}
            out.append(self._chunk(index, choice))
        if final:
            finish = finish_of(ch, parsed)
            choice = {"index": index, "delta": {}, "logprobs": None, "finish_reason": finish}
            out.append(self._chunk(index, choice))
        return out

    def _cid(self, index: int) -> str:
        return self.plan.choices[index].generate.request_id

    def end(self) -> list[bytes]:
        out = []
        if self.plan.include_usage and self.error is None:
            out.append(frame(chunk(self.plan, self.model, self.rid, None, self.choices.usage())))
        out.append(DONE)
        return out


def _delta(ev: tuple, cid: str) -> dict[str, Any]:
    kind = ev[0]
    if kind == "content":
        return {"content": ev[1]}
    if kind == "reasoning":
        return {"reasoning_content": ev[1]}
    if kind == "call":  # id, type and name first, the arguments in the chunks after
        call = {"name": ev[2], "arguments": ""}
        return {
            "tool_calls": [
                {"index": ev[1], "id": call_id(cid, ev[1]), "type": "function", "function": call}
            ]
        }
    return {"tool_calls": [{"index": ev[1], "function": {"arguments": ev[2]}}]}


async def body(
    writer: StreamWriter,
    first: list[bytes],
    items: AsyncIterator[tuple[int, Any]],
) -> AsyncIterator[bytes]:
    """The response body: frames already made, then one per message, then the end."""
    for f in first:
        yield f
    if writer.error is None:
        async for index, msg in items:
            frames = writer.feed(index, msg, trio.current_time())
            if frames:
                yield b"".join(frames)
            if writer.error is not None:
                break
    writer.completed = True  # everything is produced; only the last frames are left to send
    yield b"".join(writer.end())
