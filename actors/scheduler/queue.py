"""Waiting queues: who is admitted next. Pure data structures, no I/O.

Contract (every policy): ``push`` adds a new request; ``push_front`` puts a preempted one back
ahead of all others; ``peek(now)`` returns the next candidate without removing it (None when
empty); ``remove`` takes a request out (admitted, aborted). No method scans the whole queue:
``push``/``remove`` are O(log n) at worst and ``peek`` is O(log n) plus, for ``lpm``, a window
of at most ``lpm_window`` requests.

Aging (all policies): a request that has waited longer than ``max_wait_s`` goes first, oldest
first, so no policy can starve anyone.

A policy that needs the KV manager's cached-prefix lengths to choose (``lpm``) owns that query's
state: ``match_query()`` names the requests to ask about (None: choose now) and
``match_reply(cached_tokens)`` takes the answer. The scheduler core sends the query and passes
the reply on without knowing which policy asked.
"""

from __future__ import annotations

import heapq
import itertools
from collections import OrderedDict
from collections.abc import Iterator

from actors.scheduler.state import SchedRequest


class WaitingQueue:
    """FCFS with aging and a front lane for preempted requests. Subclasses change ``_best``."""

    name = "fcfs"

    def __init__(self, max_wait_s: float = 60.0) -> None:
        self.max_wait_s = max_wait_s
        self._front: OrderedDict[str, SchedRequest] = OrderedDict()
        self._arrival: OrderedDict[str, SchedRequest] = OrderedDict()  # all, by arrival

    def __len__(self) -> int:
        return len(self._arrival)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._arrival

    def __iter__(self) -> Iterator[SchedRequest]:
        return iter(self._arrival.values())

    def push(self, req: SchedRequest) -> None:
        self._arrival[req.request_id] = req
        self._added(req)

    def push_front(self, req: SchedRequest) -> None:
        self._arrival[req.request_id] = req
        self._front[req.request_id] = req
        self._front.move_to_end(req.request_id, last=False)

    def remove(self, request_id: str) -> SchedRequest | None:
        self._front.pop(request_id, None)
        return self._arrival.pop(request_id, None)

    def peek(self, now: float = 0.0) -> SchedRequest | None:
        if self._front:
            return next(iter(self._front.values()))
        if not self._arrival:
            return None
        oldest = next(iter(self._arrival.values()))
        if now - oldest.enqueued > self.max_wait_s:
            return oldest  # aged: it goes first whatever the policy says
        return self._best()

    def aged(self, req: SchedRequest, now: float) -> bool:
        return now - req.enqueued > self.max_wait_s

    def match_query(self) -> list[SchedRequest] | None:
        """The requests whose cached-prefix lengths this policy needs before its next choice
        (the core asks the KV manager), or None: ``peek`` can choose now."""
        return None

    def match_reply(self, cached_tokens: list[int]) -> None:
        """The cached-prefix lengths of the requests of the last ``match_query``, in order."""

    # policy hooks
    def _added(self, req: SchedRequest) -> None:
        pass

    def _best(self) -> SchedRequest | None:
        return next(iter(self._arrival.values()))


class _HeapQueue(WaitingQueue):
    """A policy ordered by a key, kept in a heap with lazy deletion (removed entries skipped)."""

    def __init__(self, max_wait_s: float = 60.0) -> None:
        super().__init__(max_wait_s)
        self._heap: list[tuple[tuple[int, ...], int, str]] = []
        self._tie = itertools.count()

    def key(self, req: SchedRequest) -> tuple[int, ...]:
        raise NotImplementedError

    def _added(self, req: SchedRequest) -> None:
        heapq.heappush(self._heap, (self.key(req), next(self._tie), req.request_id))

    def _best(self) -> SchedRequest | None:
        heap = self._heap
        while heap:
            rid = heap[0][2]
            req = self._arrival.get(rid)
            if req is not None and rid not in self._front:
                return req
            heapq.heappop(heap)  # removed (or moved to the front lane): drop the stale entry
        return None

    def remove(self, request_id: str) -> SchedRequest | None:
        req = super().remove(request_id)
        if len(self._heap) > 2 * len(self._arrival) + 64:  # keep stale entries bounded
            self._heap = [e for e in self._heap if e[2] in self._arrival]
            heapq.heapify(self._heap)
        return req


class PriorityQueue(_HeapQueue):
    """Lower ``priority`` value first (as vLLM); ties by arrival."""

    name = "priority"

    def key(self, req: SchedRequest) -> tuple[int, ...]:
        return (req.priority, req.seq)


class SJFQueue(_HeapQueue):
    """Shortest prompt first; ties by arrival. Aging keeps long prompts from starving."""

    name = "sjf"

    def key(self, req: SchedRequest) -> tuple[int, ...]:
        return (len(req.prompt_ids), req.seq)


class LPMQueue(WaitingQueue):
    """Longest cached prefix first among the ``lpm_window`` oldest requests, using match lengths
    the KV manager reported (``set_scores``); FCFS when the queue is longer than ``fallback``
    (matching a long queue costs more than it saves, as SGLang found) or before scores exist."""

    name = "lpm"

    def __init__(self, max_wait_s: float = 60.0, window: int = 32, fallback: int = 128) -> None:
        super().__init__(max_wait_s)
        self.window = window
        self.fallback = fallback
        self.scores: dict[str, int] = {}
        self.asked: list[str] = []  # the candidates of the last match query
        self.fresh = False  # ``scores`` answer ``asked``: good for the next choice only

    def candidates(self) -> list[SchedRequest]:
        """The requests whose match lengths ``_best`` would use (empty: no query needed)."""
        if len(self._arrival) <= 1 or len(self._arrival) > self.fallback:
            return []
        return list(itertools.islice(self._arrival.values(), self.window))

    def set_scores(self, scores: dict[str, int]) -> None:
        self.scores = scores

    def match_query(self) -> list[SchedRequest] | None:
        """Ask for the candidates' match lengths unless fresh ones for exactly these candidates
        just came back; those serve one choice (the cache changes with every admission)."""
        cands = self.candidates()
        if not cands:
            return None
        ids = [r.request_id for r in cands]
        if self.fresh and ids == self.asked:
            self.fresh = False
            return None
        self.asked, self.fresh = ids, False
        return cands

    def match_reply(self, cached_tokens: list[int]) -> None:
        self.set_scores(dict(zip(self.asked, cached_tokens, strict=False)))
        self.fresh = True

    def _best(self) -> SchedRequest | None:
        window = itertools.islice(self._arrival.values(), self.window)
        if len(self._arrival) > self.fallback or not self.scores:
            return next(iter(self._arrival.values()))
        best = None
        for req in window:  # max score; ties keep arrival order
            if best is None or self.scores.get(req.request_id, 0) > self.scores.get(
                best.request_id, 0
            ):
                best = req
        return best

    def remove(self, request_id: str) -> SchedRequest | None:
        self.scores.pop(request_id, None)
        return super().remove(request_id)


POLICIES = {"fcfs": WaitingQueue, "priority": PriorityQueue, "sjf": SJFQueue, "lpm": LPMQueue}


def make_queue(policy: str, max_wait_s: float = 60.0) -> WaitingQueue:
    try:
        return POLICIES[policy](max_wait_s)
    except KeyError:
        raise ValueError(
            f"unknown scheduler policy {policy!r}; known: {sorted(POLICIES)}"
        ) from None
