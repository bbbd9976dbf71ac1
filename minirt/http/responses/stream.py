"""The server-sent events of a streamed response (pure): ``event: TYPE`` and ``data: {json}``
frames, each with its ``type`` and an increasing ``sequence_number``.

``response.created`` and ``response.in_progress`` open the stream; each output item is announced
(``response.output_item.added``) when the model begins it: the reasoning item
(``response.content_part.added``, ``response.reasoning_text.delta``...), the message item
(``response.content_part.added``, ``response.output_text.delta``...), each function call
(``response.function_call_arguments.delta``...). At the end every item is closed in output order
(``...done``, ``response.content_part.done``, ``response.output_item.done``) and
``response.completed`` (or ``response.incomplete``) carries the whole response. Text that comes
after a call began, before any text did, is held to the end: its message item then follows
the calls, where ``Order`` places it in the response answered whole.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import msgspec

from minirt.http.errors import ApiError
from minirt.http.responses.shape import (
    Order,
    Shape,
    call_item,
    message_item,
    output_items,
    output_text,
    reasoning_item,
)
from tokenizer_svc.agent.parse import Call, Diff, Parsed

_encode = msgspec.json.Encoder().encode


@dataclass
class _Item:
    kind: str  # reasoning | message | call
    output_index: int
    id: str
    call: int = 0  # a call's index among the calls


class EventWriter:
    def __init__(self, shape: Shape) -> None:
        self.shape = shape
        self.seq = 0
        self.diff = Diff()
        self.order = Order()
        self.items: list[_Item] = []
        self.held = ""  # text begun after a call: sent at the end

    def _event(self, kind: str, **fields: Any) -> bytes:
        obj = {"type": kind, "sequence_number": self.seq, **fields}
        self.seq += 1
        return b"event: " + kind.encode() + b"\ndata: " + _encode(obj) + b"\n\n"

    def start(self) -> list[bytes]:
        r = self.shape.response("in_progress", [])
        return [
            self._event("response.created", response=r),
            self._event("response.in_progress", response=r),
        ]

    def _find(self, kind: str, call: int = 0) -> _Item | None:
        for it in self.items:
            if it.kind == kind and it.call == call:
                return it
        return None

    def _open(self, kind: str, item: dict[str, Any], call: int = 0) -> tuple[_Item, list[bytes]]:
        it = _Item(kind, len(self.items), item["id"], call)
        self.items.append(it)
        out = [self._event("response.output_item.added", output_index=it.output_index, item=item)]
        part = {"type": "reasoning_text", "text": ""} if kind == "reasoning" else output_text("")
        if kind != "call":
            out.append(self._event("response.content_part.added", part=part, **self._at(it)))
        return it, out

    def _at(self, it: _Item) -> dict[str, Any]:
        return {"item_id": it.id, "output_index": it.output_index, "content_index": 0}

    def _text(self, kind: str, text: str) -> list[bytes]:
        out: list[bytes] = []
        it = self._find(kind)
        if it is None:
            if kind == "reasoning":
                it, out = self._open(kind, reasoning_item(self.shape, ""))
            else:
                it, out = self._open(kind, message_item(self.shape, None, "in_progress"))
        if kind == "reasoning":
            out.append(self._event("response.reasoning_text.delta", delta=text, **self._at(it)))
        else:
            out.append(
                self._event("response.output_text.delta", delta=text, logprobs=[], **self._at(it))
            )
        return out

    def step(self, parsed: Parsed) -> list[bytes]:
        """The events that bring the client up to ``parsed`` (the output parsed so far)."""
        self.order.see(parsed)
        out: list[bytes] = []
        for ev in self.diff.step(parsed):
            if ev[0] == "reasoning":
                out += self._text("reasoning", ev[1])
            elif ev[0] == "content":
                if self._find("message") is None and any(i.kind == "call" for i in self.items):
                    self.held += ev[1]
                else:
                    out += self._text("message", ev[1])
            elif ev[0] == "call":
                item = call_item(self.shape, ev[1], Call(ev[2], ""), "in_progress")
                out += self._open("call", item, ev[1])[1]
            else:
                it = self._find("call", ev[1])
                assert it is not None
                out.append(
                    self._event(
                        "response.function_call_arguments.delta",
                        item_id=it.id,
                        output_index=it.output_index,
                        delta=ev[2],
                    )
                )
        return out

    def finish(
        self,
        parsed: Parsed,
        status: str,
        usage: dict[str, Any],
        incomplete: dict[str, Any] | None,
    ) -> tuple[list[bytes], dict[str, Any]]:
        """The last events, given the final parse: ``(frames, the whole response)``."""
        out = self.step(parsed)
        if self.held:
            out += self._text("message", self.held)
            self.held = ""
        final = output_items(self.shape, parsed, self.order.final(), status)
        by_id = {item["id"]: item for item in final}
        for it in self.items:
            out += self._close(it, by_id[it.id])
        response = self.shape.response(status, final, usage, incomplete)
        kind = "response.completed" if status == "completed" else "response.incomplete"
        out.append(self._event(kind, response=response))
        return out, response

    def _close(self, it: _Item, item: dict[str, Any]) -> list[bytes]:
        out = []
        at = self._at(it)
        if it.kind == "reasoning":
            text = item["content"][0]["text"]
            out.append(self._event("response.reasoning_text.done", text=text, **at))
            part = {"type": "reasoning_text", "text": text}
            out.append(self._event("response.content_part.done", part=part, **at))
        elif it.kind == "message":
            text = item["content"][0]["text"]
            out.append(self._event("response.output_text.done", text=text, logprobs=[], **at))
            out.append(self._event("response.content_part.done", part=output_text(text), **at))
        else:
            out.append(
                self._event(
                    "response.function_call_arguments.done",
                    item_id=it.id,
                    output_index=it.output_index,
                    name=item["name"],
                    arguments=item["arguments"],
                )
            )
        out.append(
            self._event("response.output_item.done", output_index=it.output_index, item=item)
        )
        return out

    def error(self, e: ApiError) -> bytes:
        """A refusal after the stream began (the front door's ``error``): the last event."""
        return self._event("error", code=e.code or e.type, message=e.message, param=e.param)
