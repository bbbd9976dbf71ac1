"""Run one actor in this process: ``minirt actor NAME`` and each child of ``minirt up``."""

from __future__ import annotations

import os
import signal
from typing import Any

import trio

from actors.runtime.config import ACTORS, RuntimeConfig
from actors.runtime.events import configure, get_logger

# Niceness of the scheduler and the KV manager (``MINIRT_ACTOR_NICE``, e.g. 10; off by default).
# The executor never waits on them (it asks for blocks ahead of need, see gpu/actor.py), so their
# work is off its critical path; at equal priority their CPU time takes turns with the executor's
# two threads on a 2-core machine (the pipeline delivered 79% of the executor alone). At nice 10
# the kernel gives a competing executor thread ~10x their share, and they still run whenever the
# executor's threads sleep between steps. Off by default until a race it exposes is fixed:
# tests/test_e2e.py::test_abort_and_disconnect_free_every_block failed 2 of 3 runs with every
# non-executor actor at nice 10 (a client's cancel reported as a disconnect: the front door,
# scheduled late, handled the closed connection before the cancel queued ahead of it), 1 of 6
# with only these two niced, 0 of 7 at nice 0. The tokenizer is never niced, for that reason.
DEFAULT_ACTOR_NICE = 0
NICED_ACTORS = ("scheduler", "kv_manager")


def _yield_cores_to_executor() -> None:
    try:
        nice = int(os.environ.get("MINIRT_ACTOR_NICE", DEFAULT_ACTOR_NICE))
    except ValueError:
        raise ValueError("MINIRT_ACTOR_NICE must be an integer") from None
    if nice > 0 and hasattr(os, "nice"):
        os.nice(nice)


def build_actor(name: str, cfg: RuntimeConfig) -> Any:
    """The actor object for ``name`` (imports only what that actor needs)."""
    if name in NICED_ACTORS:
        _yield_cores_to_executor()
    if name == "tokenizer":
        from tokenizer_svc.actor import TokenizerService

        return TokenizerService(cfg)
    if name == "scheduler":
        from actors.scheduler.actor import SchedulerActor

        return SchedulerActor(cfg)
    if name == "kv_manager":
        from actors.kv.actor import KVManagerActor

        if cfg.kv.num_blocks:  # set by `minirt up` or the config: no need to load torch here
            return KVManagerActor(cfg, int(cfg.kv.num_blocks))
        from gpu.kv_cache import resolve_num_blocks

        return KVManagerActor(cfg, resolve_num_blocks(cfg))
    if name == "executor":
        # The step runs in a worker thread; without an explicit OpenMP thread count, torch ran
        # about 20% slower there than on the main thread (measured on the bench model, 2 cores).
        # Set it before torch is imported.
        threads = str(cfg.executor.threads or len(os.sched_getaffinity(0)))
        os.environ.setdefault("OMP_NUM_THREADS", threads)
        os.environ.setdefault("MKL_NUM_THREADS", threads)
        # Sleep at OpenMP barriers instead of spinning: the other actors share these cores, and a
        # spinning team lost 35-40% of W1 pipeline throughput to them (measured: 220 tok/s with
        # OMP_WAIT_POLICY=ACTIVE, 340-360 unset, 365-380 PASSIVE, bench model on 2 cores).
        os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
        from gpu.actor import ExecutorActor

        return ExecutorActor(cfg)
    if name == "http":  # the OpenAI API, next to the front door (not one of the four actors)
        from tokenizer_svc.http.actor import HttpActor

        return HttpActor(cfg)
    raise ValueError(f"unknown actor {name!r}; known: {[*ACTORS, 'http']}")


async def _serve(actor: Any) -> None:
    log = get_logger()
    async with trio.open_nursery() as nursery:
        await nursery.start(actor.serve)
        log.info("actor.ready", pid=os.getpid())
        with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
            async for sig in signals:
                log.info("actor.stopping", signal=signal.Signals(sig).name)
                nursery.cancel_scope.cancel()
                break


def run_actor(name: str, cfg: RuntimeConfig) -> int:
    """Serve ``name`` until SIGTERM/SIGINT. Events go to stdout and RUN_DIR/events/NAME.jsonl."""
    cfg.resolve()
    configure(name, cfg.run_dir)
    log = get_logger()
    try:
        actor = build_actor(name, cfg)
    except Exception as e:
        log.exception("actor.failed_to_start", error=str(e))
        return 2
    trio.run(_serve, actor)
    log.info("actor.stopped")
    return 0
