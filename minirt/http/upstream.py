"""The HTTP server's connection to the front door, and the running of one request's choices.

One ``open_client`` connection carries every HTTP request (many in flight, demultiplexed by
request id). The front door is pinged every second; when it answers with a new boot id (it was
restarted) a fresh connection replaces the old one, which stays open until the requests on it have
ended (the client fails them as ``actor_dead``).
"""

from __future__ import annotations

import math
from collections.abc import AsyncGenerator, AsyncIterator
from contextlib import aclosing, asynccontextmanager
from typing import Any

import trio

from actors.runtime.ping import ping
from minirt.client import AsyncClient, RequestError, open_client
from minirt.http.errors import ApiError, from_upstream
from minirt.http.openai.convert import ChoiceSpec, Plan

CONNECT_TIMEOUT_S = 10.0  # then log http.upstream_waiting and try again
WATCH_S = 1.0
DEAD_AFTER = 3  # missed pings in a row


class Upstream:
    def __init__(self, endpoint: str, curve_dir: str | None, log: Any) -> None:
        self.endpoint = endpoint
        self.curve_dir = curve_dir or None
        self.log = log
        self.client: AsyncClient | None = None
        self.alive = False
        self._inflight: dict[int, int] = {}
        self._retired: set[int] = set()
        self._changed = trio.Event()

    def _curve(self) -> Any:
        if self.curve_dir is None:
            return None
        from actors.runtime.security import CurveKeys

        return CurveKeys.load(self.curve_dir)

    async def run(self, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
        """Keep a welcomed connection to the front door; ``started`` once the first one is."""
        started = False
        async with trio.open_nursery() as nursery:
            while True:
                try:
                    with trio.fail_after(CONNECT_TIMEOUT_S):
                        client = await nursery.start(self._connection)
                except (trio.TooSlowError, TimeoutError):  # not up, or not serving yet
                    self.alive = False
                    self.log.warning("http.upstream_waiting", endpoint=self.endpoint)
                    continue
                self.client, self.alive = client, True
                boot = client.welcome.boot_id if client.welcome else ""
                self.log.info("http.upstream_connected", endpoint=self.endpoint, boot_id=boot)
                if not started:
                    task_status.started()
                    started = True
                await self._watch(boot)
                self.alive = False
                self.client = None
                self._retired.add(id(client))
                self._poke()

    async def _watch(self, boot: str) -> None:
        """Return when the front door answers with another boot id (it restarted)."""
        curve = self._curve()
        missed = 0
        while True:
            await trio.sleep(WATCH_S)
            pong = await ping(self.endpoint, timeout=WATCH_S, curve=curve)
            missed = 0 if pong is not None else missed + 1
            self.alive = missed < DEAD_AFTER  # one slow answer under load is not a death
            if pong is not None and boot and pong.boot_id and pong.boot_id != boot:
                self.log.warning("http.upstream_restarted", old=boot, new=pong.boot_id)
                return

    async def _connection(self, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
        # resume=False: its requests fail as actor_dead when the front door restarts (above)
        async with open_client(self.endpoint, curve_dir=self.curve_dir, resume=False) as client:
            key = id(client)
            self._inflight[key] = 0
            task_status.started(client)
            while key not in self._retired or self._inflight[key]:
                await self._changed.wait()
            del self._inflight[key]
            self._retired.discard(key)

    def _poke(self) -> None:
        self._changed.set()
        self._changed = trio.Event()

    @asynccontextmanager
    async def use(self) -> AsyncIterator[AsyncClient]:
        """The current connection, held for one request; 503 naming the front door if none."""
        client = self.client
        if client is None or not self.alive:
            raise ApiError(
                503, "tokenizer (the front door) is not answering; retry", code="actor_dead"
            )
        key = id(client)
        self._inflight[key] += 1
        try:
            yield client
        finally:
            self._inflight[key] -= 1
            if key in self._retired:
                self._poke()


def choice_messages(
    client: AsyncClient, plan: Plan, nursery: trio.Nursery
) -> AsyncGenerator[tuple[int, Any], None]:
    """``(index, message)`` for every choice of ``plan``, or ``(index, ApiError)`` for a
    refusal. One choice (nearly every request) is read in the caller's task: each token wakes
    one task, the one that writes the stream, not a relay task as well. Several run in
    ``nursery`` (``run_choices``), through a channel. Close it (``aclosing``), then cancel
    ``nursery``: what still runs upstream is cancelled there."""
    if len(plan.choices) == 1:
        return _choice(client, plan, plan.choices[0])
    return _relayed(client, plan, nursery)


async def _choice(
    client: AsyncClient, plan: Plan, c: ChoiceSpec
) -> AsyncGenerator[tuple[int, Any], None]:
    """One choice's messages; closing it cancels its request upstream."""
    try:
        messages: Any = client.stream(c.generate)  # an async generator: closed on cancel
        async with aclosing(messages) as stream:
            async for msg in stream:
                yield c.index, msg
    except RequestError as e:
        s = plan.spelling
        yield c.index, from_upstream(e.code, e.field, e.message, c.prompt_param, s.param, s.rename)


async def _relayed(
    client: AsyncClient, plan: Plan, nursery: trio.Nursery
) -> AsyncGenerator[tuple[int, Any], None]:
    send, items = trio.open_memory_channel[tuple[int, Any]](math.inf)
    nursery.start_soon(run_choices, client, plan, send)
    async for item in items:  # left open: choices still running when this closes are
        yield item  # cancelled with ``nursery``, and never find it closed


async def run_choices(
    client: AsyncClient, plan: Plan, send: trio.MemorySendChannel[tuple[int, Any]]
) -> None:
    """Run every choice of ``plan`` at once; send what :func:`_choice` yields for each. Closes
    ``send`` when all have ended. Cancelling this cancels every choice's request upstream."""
    async with send, trio.open_nursery() as nursery:
        for c in plan.choices:
            nursery.start_soon(_relay, _choice(client, plan, c), send)


async def _relay(
    messages: AsyncGenerator[tuple[int, Any], None],
    send: trio.MemorySendChannel[tuple[int, Any]],
) -> None:
    async with aclosing(messages) as items:
        async for item in items:
            await send.send(item)
