"""Waiting queues. A queue decides who is admitted next; the scheduler core asks ``peek``.

Contract: ``push`` adds a new request, ``push_front`` puts a preempted one back ahead of the
others, ``peek`` returns the next candidate without removing it (None when empty), ``remove``
takes a request out (admitted or aborted). All are O(1) or O(log n); none scan the whole queue.
"""

from __future__ import annotations

from collections import OrderedDict

from actors.scheduler.state import SchedRequest


class FCFSQueue:
    """First come, first served; preempted requests go back to the head."""

    def __init__(self) -> None:
        self._front: OrderedDict[str, SchedRequest] = OrderedDict()  # requeued after preemption
        self._main: OrderedDict[str, SchedRequest] = OrderedDict()

    def __len__(self) -> int:
        return len(self._front) + len(self._main)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._front or request_id in self._main

    def push(self, req: SchedRequest) -> None:
        self._main[req.request_id] = req

    def push_front(self, req: SchedRequest) -> None:
        self._front[req.request_id] = req
        self._front.move_to_end(req.request_id, last=False)

    def peek(self) -> SchedRequest | None:
        for q in (self._front, self._main):
            if q:
                return next(iter(q.values()))
        return None

    def remove(self, request_id: str) -> SchedRequest | None:
        return self._front.pop(request_id, None) or self._main.pop(request_id, None)


def make_queue(policy: str) -> FCFSQueue:
    if policy == "fcfs":
        return FCFSQueue()
    raise ValueError(f"unknown scheduler policy {policy!r}; known: ['fcfs']")
