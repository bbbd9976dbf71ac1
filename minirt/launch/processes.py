"""The child processes a multi-replica launch manages (``minirt up --replicas``, on this host or
placed by Ray): each in its own session, restarted with the same command; and the router's
start, which waits until it holds every replica as healthy."""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path
from typing import Any

import trio

from actors.runtime.events import get_logger
from minirt.launch.router import RouterSpec, router_workers


class Managed:
    """One child process in its own session (so the whole replica can be signalled at once)."""

    def __init__(
        self, name: str, argv: list[str], log_path: Path, env: dict[str, str], cpus: Any = None
    ) -> None:
        self.name, self.argv, self.log_path, self.env, self.cpus = name, argv, log_path, env, cpus
        self.proc: Any = None
        self.restarts = 0
        self.started_at = 0.0

    async def start(self) -> None:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        cpus = self.cpus
        with self.log_path.open("ab") as out:
            self.proc = await trio.lowlevel.open_process(
                self.argv,
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=self.env,
                start_new_session=True,
                preexec_fn=(lambda: os.sched_setaffinity(0, cpus)) if cpus else None,
            )
        self.started_at = time.monotonic()

    def kill_group(self, sig: int) -> None:
        """Signal the child's whole session (a replica's supervisor and its four actors)."""
        if self.proc is None:
            return
        try:
            os.killpg(self.proc.pid, sig)
        except (ProcessLookupError, PermissionError):
            pass

    def log_tail(self, lines: int = 8) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except FileNotFoundError:
            return ""


async def start_router(router: Managed, spec: RouterSpec, timeout: float) -> None:
    """Start the router process (``cluster.router_started``) and wait until it holds every one
    of ``spec.workers`` healthy."""
    await router.start()
    log = get_logger()
    log.info("cluster.router_started", pid=router.proc.pid, url=spec.url, policy=spec.policy)
    await router_ready(router, spec, timeout)


async def router_ready(router: Managed, spec: RouterSpec, timeout: float) -> None:
    """Wait until the router process holds every one of ``spec.workers`` as healthy."""
    want = set(spec.workers)
    with trio.move_on_after(timeout):
        while True:
            if router.proc.returncode is not None:
                raise RuntimeError(
                    f"the router exited with {router.proc.returncode}; its log ({router.log_path}) ends:\n{router.log_tail()}"
                )
            seen = await trio.to_thread.run_sync(router_workers, spec, 2.0)
            if want <= {url for url, ok in seen.items() if ok}:
                return
            await trio.sleep(0.25)
    raise RuntimeError(
        f"the router did not hold every replica healthy within {timeout:.0f}s; its log ends:\n{router.log_tail()}"
    )
