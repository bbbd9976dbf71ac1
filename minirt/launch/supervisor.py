"""``minirt up``: start the four actors and the HTTP server as child processes, wait until each
answers a ping, print ``minirt ready <endpoint>`` and then where the HTTP API and the dashboard
are, restart an actor that dies, and stop them all on SIGINT/SIGTERM."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import Any

import trio

from actors.runtime.config import ACTORS, RuntimeConfig, without_settings
from actors.runtime.events import get_logger
from actors.runtime.ping import wait_ready


def prepare(cfg: RuntimeConfig) -> Path:
    """Resolve the model (gpu.model.sources), endpoints, KV pool size and max_model_len; write
    RUN_DIR/config.json (children read it)."""
    from gpu.model.kv_cache import resolve_serving

    cfg.pooler()  # a bad --pooler-config fails here, naming its key
    cfg.lora.check()
    resolve_serving(cfg)
    if cfg.lora.enable_lora:  # a --lora-modules adapter that does not fit fails here
        from actors.shared.lora import LoraError, ModelDims, inspect

        dims = ModelDims.of(cfg.model)
        for name, where in cfg.lora.modules():
            try:
                inspect(name, where, dims, cfg.lora.max_lora_rank)
            except LoraError as e:
                raise ValueError(f"lora_modules {name}={where}: {e}") from None
    cfg.resolve()
    run = Path(cfg.run_dir)
    for sub in ("sock", "events", "logs"):
        (run / sub).mkdir(parents=True, exist_ok=True)
    path = run / "config.json"
    cfg.save(path)
    return path


WEDGE_PROBE_S = 5.0  # the supervisor pings each actor this often (wedge watch)


class RestartBudget:
    """How often an actor may die and be restarted: at most ``limit`` times within any
    ``window_s`` seconds (as Erlang supervisors' intensity and period, or systemd's start limit),
    so a runtime that serves for weeks survives one crash a day, while a crash loop gives up.
    The back-off before a restart doubles with the deaths in the window: 2 s (every peer has
    declared the dead process dead by then) up to 10 s. Pure: times are given in."""

    def __init__(self, limit: int = 5, window_s: float = 600.0) -> None:
        self.limit = limit
        self.window_s = window_s
        self.deaths: deque[float] = deque()
        self.total = 0  # restarts ever

    def died(self, now: float) -> float | None:
        """A death at ``now``: seconds to wait before the restart, or None to give up."""
        while self.deaths and now - self.deaths[0] >= self.window_s:
            self.deaths.popleft()
        if len(self.deaths) >= self.limit:
            return None
        self.deaths.append(now)
        self.total += 1
        return min(max(2.0, 0.5 * 2 ** len(self.deaths)), 10.0)


class Child:
    def __init__(self, name: str, config_path: Path, run_dir: Path, max_restarts: int) -> None:
        self.name = name
        self.config_path = config_path
        self.log_path = run_dir / "logs" / f"{name}.log"
        self.proc: Any = None
        self.budget = RestartBudget(max_restarts)

    async def start(self) -> None:
        cmd = [
            sys.executable,
            "-m",
            "minirt.cli",
            "actor",
            self.name,
            "--config",
            str(self.config_path),
        ]
        out = self.log_path.open("ab")
        # the child's settings are the config file alone: this process already folded the
        # environment's MINIRT_* settings into it (and --model etc. over them), so they go
        self.proc = await trio.lowlevel.open_process(
            cmd,
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=without_settings(dict(os.environ)),
        )
        out.close()

    def signal(self, sig: int) -> None:
        if self.proc is not None and self.proc.returncode is None:
            try:
                self.proc.send_signal(sig)
            except ProcessLookupError:
                pass


class Supervisor:
    def __init__(self, cfg: RuntimeConfig, config_path: Path, max_restarts: int = 5) -> None:
        self.cfg = cfg
        # the four actors, and the HTTP server unless --http-port 0 turned it off
        names = (*ACTORS, "http") if cfg.http.port else ACTORS
        run_dir = Path(cfg.run_dir)
        self.children = {n: Child(n, config_path, run_dir, max_restarts) for n in names}
        self.log = get_logger()
        self.stopping = False
        self._ready_count = 0
        self.curve = cfg.curve_keys()

    async def run(
        self, task_status: Any = trio.TASK_STATUS_IGNORED, ready_timeout: float = 120.0
    ) -> None:
        try:
            async with trio.open_nursery() as nursery:
                for child in self.children.values():
                    await child.start()
                    self.log.info("supervisor.child_started", child=child.name, pid=child.proc.pid)
                async with trio.open_nursery() as waits:
                    waits.start_soon(self._fail_fast)
                    for name in self.children:
                        waits.start_soon(self._ready, waits, name, ready_timeout)
                for child in self.children.values():
                    nursery.start_soon(self._watch, child)
                    if self.cfg.wedged_after_s > 0:
                        nursery.start_soon(self._wedge_watch, child)
                endpoint = self.cfg.endpoints.client
                self.log.info("supervisor.ready", endpoint=endpoint)
                task_status.started(endpoint)
        finally:
            with trio.CancelScope(shield=True):
                await self.stop()

    async def _ready(self, waits: trio.Nursery, name: str, timeout: float) -> None:
        await wait_ready(self.cfg.endpoints.of(name), timeout, 0.2, self.cfg.curve_keys())
        self._ready_count += 1
        if self._ready_count == len(self.children):
            waits.cancel_scope.cancel()  # all ready: stop the fail-fast watcher

    async def _fail_fast(self) -> None:
        """During start-up, a child that exits means a configuration error: stop with its log."""
        while True:
            for child in self.children.values():
                if child.proc.returncode is not None:
                    tail = child.log_path.read_text(errors="replace").splitlines()[-5:]
                    raise RuntimeError(
                        f"{child.name} exited with {child.proc.returncode} during "
                        f"start-up; its log ({child.log_path}) ends:\n" + "\n".join(tail)
                    )
            await trio.sleep(0.1)

    async def _watch(self, child: Child) -> None:
        while True:
            code = await child.proc.wait()
            if self.stopping or code == 0:
                # 0: the actor stopped on a signal (e.g. the terminal's Ctrl-C reached the whole
                # process group); the supervisor is about to stop too.
                return
            budget = child.budget
            self.log.error(
                "supervisor.child_exited",
                child=child.name,
                returncode=code,
                restarts=budget.total,
            )
            backoff = budget.died(trio.current_time())
            if backoff is None:
                raise RuntimeError(
                    f"{child.name} died {budget.limit + 1} times within {budget.window_s:.0f} s; "
                    "giving up"
                )
            # Wait at least until every peer has declared the dead process dead (3 heartbeats),
            # so its successor never receives messages meant for it.
            await trio.sleep(backoff)
            await child.start()
            self.log.info(
                "supervisor.child_restarted",
                child=child.name,
                pid=child.proc.pid,
                restarts=budget.total,
            )

    async def _wedge_watch(self, child: Child) -> None:
        """A slow actor is not dead (its peers only suspect it, and requests wait), but one that
        answers no ping for ``wedged_after_s`` (a deadlock, a lost thread) is killed here, with
        an event naming why; its exit is then a fact every peer sees, and ``_watch`` restarts
        it. Pings every ``WEDGE_PROBE_S``; the time counts from the last answer or start."""
        from actors.runtime.ping import ping

        bound = self.cfg.wedged_after_s
        endpoint = self.cfg.endpoints.of(child.name)
        last, proc = trio.current_time(), child.proc
        while True:
            await trio.sleep(min(WEDGE_PROBE_S, bound))
            pong = await ping(endpoint, timeout=min(WEDGE_PROBE_S, bound), curve=self.curve)
            now = trio.current_time()
            if pong is not None or child.proc is not proc or child.proc.returncode is not None:
                last, proc = now, child.proc  # answered, or restarted (or restarting)
                continue
            if now - last > bound:
                self.log.error(
                    "supervisor.wedged",
                    child=child.name,
                    pid=proc.pid,
                    silent_s=round(now - last, 1),
                    reason=f"no answer to a ping for {now - last:.0f}s (--wedged-after-s {bound:g})",
                )
                child.signal(signal.SIGKILL)
                last = now

    async def stop(self, grace: float = 5.0) -> None:
        """SIGTERM every child, wait up to ``grace`` seconds, then SIGKILL what is left."""
        self.stopping = True
        for child in self.children.values():
            child.signal(signal.SIGTERM)
        deadline = trio.current_time() + grace
        for child in self.children.values():
            if child.proc is None:
                continue
            with trio.move_on_at(deadline):
                await child.proc.wait()
            if child.proc.returncode is None:
                child.signal(signal.SIGKILL)
                await child.proc.wait()
        self.log.info("supervisor.stopped")


def served_at(cfg: RuntimeConfig) -> str:
    """Where a person reaches the runtime: the line ``minirt up`` prints after ``minirt ready``."""
    if not cfg.http.port:
        return "minirt: HTTP off (--http-port 0); clients use the ZMQ endpoint above"
    host = cfg.http.host
    base = f"http://{f'[{host}]' if ':' in host else host}:{cfg.http.port}"
    return f"minirt: OpenAI API {base}/v1, dashboard {base}/dashboard"


async def serve_until_signal(run: Any, announce: Callable[[Any], None]) -> bool:
    """Start ``run`` (``nursery.start``), ``announce`` what it started, and serve until SIGTERM
    or SIGINT; whether it started. The signals are caught from the first moment, so one that
    comes during start-up, or right after the ready line, stops what ``run`` started instead of
    killing this process and leaving its children behind."""
    started = False
    with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
        async with trio.open_nursery() as nursery:

            async def until_signal() -> None:
                async for _ in signals:
                    nursery.cancel_scope.cancel()
                    return

            nursery.start_soon(until_signal)
            value = await nursery.start(run)
            started = True
            announce(value)
            await trio.sleep_forever()
    return started


async def run_up(cfg: RuntimeConfig, config_path: Path) -> bool:
    """``minirt up`` until SIGTERM/SIGINT; whether every actor became ready first."""

    def ready(endpoint: str) -> None:
        print(f"minirt ready {endpoint}", flush=True)
        print(served_at(cfg), flush=True)

    return await serve_until_signal(Supervisor(cfg, config_path).run, ready)
