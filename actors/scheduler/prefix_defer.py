"""Prefix-aware admission: don't compute the same prefix twice at once.

Requests that share a long prompt prefix (a system prompt, a few-shot header) often arrive
together. Admitted together, each computes the shared prefix itself: the prefix cache only learns
it once a prefill finishes. So while a request whose prompt starts with the same ``tokens`` tokens
is admitted but not yet prefilled (its *owner*), a waiting request with that prefix is held back;
when the owner's prefill is done the held requests go back to the head of the queue and, admitted
then, find the prefix in the cache. The wait is one prefill; the saving is every other copy.
Pure bookkeeping: O(1) per request.
"""

from __future__ import annotations

from actors.scheduler.state import SchedRequest, Status

Key = tuple[str | int, ...]


class PrefixDeferral:
    def __init__(self, tokens: int) -> None:
        self.tokens = tokens  # 0 disables
        self.owners: dict[Key, str] = {}  # prefix -> request computing it
        self.key_of: dict[str, Key] = {}  # owner -> its prefix
        self.held: dict[Key, list[SchedRequest]] = {}

    def _key(self, req: SchedRequest) -> Key | None:
        tokens = req.tokens_now()
        if not self.tokens or len(tokens) <= self.tokens:
            return None
        return (req.cache_salt, *tokens[: self.tokens])  # one salt's prefix is not another's

    def owner_for(self, req: SchedRequest) -> str | None:
        """The request computing ``req``'s prefix right now, if any (then ``req`` should wait)."""
        key = self._key(req)
        owner = self.owners.get(key) if key is not None else None
        return owner if owner != req.request_id else None

    def hold(self, req: SchedRequest) -> None:
        key = self._key(req)
        assert key is not None
        self.held.setdefault(key, []).append(req)

    def admitted(self, req: SchedRequest, cached_tokens: int) -> None:
        """``req`` got its blocks; unless its prefix was already cached in the pool
        (``cached_tokens``: the pool's part) it now computes it, or loads it from disk."""
        key = self._key(req)
        if key is not None and cached_tokens < self.tokens and key not in self.owners:
            self.owners[key] = req.request_id
            self.key_of[req.request_id] = key

    def release(self, request_id: str) -> list[SchedRequest]:
        """``request_id`` finished its prefill (or left): the requests it held, in arrival order,
        minus any that ended meanwhile."""
        key = self.key_of.pop(request_id, None)
        if key is None:
            return []
        self.owners.pop(key, None)
        return [r for r in self.held.pop(key, []) if r.status is not Status.DONE]

    def clear(self) -> list[SchedRequest]:
        held = [r for v in self.held.values() for r in v]
        self.owners.clear()
        self.key_of.clear()
        self.held.clear()
        return held
