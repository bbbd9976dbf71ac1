"""Stop strings, matched on the streamed text.

``StopMatcher.feed(delta)`` returns the text that is safe to emit and, when a stop string shows
up, that string. Text that might be the beginning of a stop string is held back until the next
delta decides, so a client never sees part of a stop string. The stop string itself is not
emitted (OpenAI semantics).

``feed(delta, armed=False)`` is for text that may not end the request (it came before the
request's ``min_tokens``): a stop string that ends inside such text is emitted as ordinary text,
but one that begins there and ends in later, armed text still counts.
"""

from __future__ import annotations


class StopMatcher:
    def __init__(self, stops: list[str]) -> None:
        self.stops = [s for s in stops if s]
        self._hold = ""
        self._unarmed = 0  # leading characters of the held text that came from unarmed feeds
        self._longest = max((len(s) for s in self.stops), default=0)

    def feed(self, delta: str, armed: bool = True) -> tuple[str, str | None]:
        """Returns ``(text_to_emit, matched_stop_or_None)``. After a match, stop feeding."""
        if not self.stops:
            return delta, None
        text = self._hold + delta
        if armed:
            # a match must end after the unarmed text: it starts at or after this offset
            after = self._unarmed
            best: tuple[int, str] | None = None
            for s in self.stops:
                i = text.find(s, max(0, after - len(s) + 1))
                if i >= 0 and (best is None or i < best[0]):
                    best = (i, s)
            if best is not None:
                self._hold, self._unarmed = "", 0
                return text[: best[0]], best[1]
        keep = 0
        for k in range(min(self._longest - 1, len(text)), 0, -1):
            tail = text[-k:]
            if any(s.startswith(tail) for s in self.stops):
                keep = k
                break
        emitted = len(text) - keep
        self._hold = text[emitted:]
        self._unarmed = len(self._hold) if not armed else max(0, self._unarmed - emitted)
        return text[:emitted], None

    def flush(self) -> str:
        """At the end of a stream, the held-back text (it did not become a stop string)."""
        out, self._hold, self._unarmed = self._hold, "", 0
        return out
