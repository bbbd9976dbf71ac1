"""Run one actor in this process: ``minirt actor NAME`` and each child of ``minirt up``."""

from __future__ import annotations

import contextvars
import os
import signal
import sys
import threading
from typing import Any

import trio

from actors.runtime.config import ACTORS, RuntimeConfig, settings_in_env
from actors.runtime.events import configure, get_logger

# ``--actor-nice N``: these actors are off the executor's critical path, so may yield it the cores;
# off by default: niced, first tokens come later (docs/benchmarks/openai/actor-nice/README.md)
NICED_ACTORS = ("tokenizer", "scheduler", "kv_manager", "http")


def build_actor(name: str, cfg: RuntimeConfig) -> Any:
    """The actor object for ``name`` (imports only what that actor needs)."""
    if name in NICED_ACTORS and cfg.actor_nice > 0 and hasattr(os, "nice"):
        os.nice(cfg.actor_nice)
    if name == "tokenizer":
        from tokenizer_svc.actor import TokenizerActor

        return TokenizerActor(cfg)
    if name == "scheduler":
        from actors.scheduler.actor import SchedulerActor

        return SchedulerActor(cfg)
    if name == "kv_manager":
        from actors.kv.actor import KVManagerActor

        if cfg.kv.num_blocks:  # set by `minirt up` or the config: no need to load torch here
            return KVManagerActor(cfg, int(cfg.kv.num_blocks))
        from gpu.model.kv_cache import resolve_num_blocks

        return KVManagerActor(cfg, resolve_num_blocks(cfg))
    if name == "executor":
        # One OpenMP/MKL thread per core unless --threads says otherwise; set before torch is
        # imported.
        threads = str(cfg.executor.threads or len(os.sched_getaffinity(0)))
        os.environ.setdefault("OMP_NUM_THREADS", threads)
        os.environ.setdefault("MKL_NUM_THREADS", threads)
        # OpenMP's default wait policy (spin briefly at barriers, then sleep): its steps run on
        # the main thread (gpu/main_thread.py). ACTIVE (spin forever) loses a third of W1 to the
        # other actors; PASSIVE (sleep at once) a fifth of the forward's speed.
        from gpu.actor import ExecutorActor

        return ExecutorActor(cfg)
    if name == "http":  # the OpenAI API, next to the front door (not one of the four actors)
        from minirt.http.actor import HttpActor

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


def _serve_off_main(actor: Any) -> None:
    """The executor: trio in a thread of its own, the steps on the main thread (see
    gpu/main_thread.py); SIGTERM/SIGINT reach the main thread and stop trio."""
    from gpu.main_thread import MainThreadSteps

    steps = MainThreadSteps()
    actor.run_step = steps.run
    stopped = threading.Event()
    stop: dict[str, Any] = {}
    failure: list[BaseException] = []

    async def serve() -> None:
        log = get_logger()
        async with trio.open_nursery() as nursery:
            await nursery.start(actor.serve)
            log.info("actor.ready", pid=os.getpid())

            def on_signal(sig: int) -> None:
                log.info("actor.stopping", signal=signal.Signals(sig).name)
                nursery.cancel_scope.cancel()

            stop["token"], stop["fn"] = trio.lowlevel.current_trio_token(), on_signal
            await trio.sleep_forever()

    # --bind-threads pinned the main thread (the steps) to one CPU: trio's thread, made by it,
    # takes back every CPU the process had
    cpus = getattr(getattr(actor, "ex", None), "cpus_before_bind", None)

    def trio_thread() -> None:
        try:
            if cpus:
                os.sched_setaffinity(0, cpus)
            trio.run(serve)
        except BaseException as e:  # re-raised on the main thread
            failure.append(e)
        finally:
            stopped.set()

    def handler(sig: int, frame: Any) -> None:
        if "token" in stop:
            try:
                stop["token"].run_sync_soon(stop["fn"], sig)
            except trio.RunFinishedError:
                pass
        else:
            stopped.set()  # not serving yet

    signal.signal(signal.SIGTERM, handler)
    signal.signal(signal.SIGINT, handler)
    ctx = contextvars.copy_context()  # the events' bound actor name, in trio's thread too
    thread = threading.Thread(target=ctx.run, args=(trio_thread,), name="trio", daemon=True)
    thread.start()
    steps.serve(stopped)
    thread.join(timeout=10)
    if failure:
        raise failure[0]


def run_actor(name: str, cfg: RuntimeConfig, config_path: str | None = None) -> int:
    """Serve ``name`` until SIGTERM/SIGINT. Events go to stdout and RUN_DIR/events/NAME.jsonl.
    ``config_path``: the file the settings were read from, named in a refusal to start."""
    cfg.resolve()
    configure(name, cfg.run_dir)
    log = get_logger()
    try:
        if cfg.max_model_len is None:  # not from `minirt up` (compose): resolve here
            from gpu.model.kv_cache import resolve_serving

            resolve_serving(cfg)
        actor = build_actor(name, cfg)
    except Exception as e:  # say what was read and from where: a wrong path has a source
        env = settings_in_env()
        log.exception(
            "actor.failed_to_start",
            error=str(e),
            model=cfg.model,
            config=config_path or "",
            env=env,
        )
        where = f"the config {config_path}" if config_path else "the defaults"
        print(
            f"minirt actor {name}: {e} (model {cfg.model!r}, from {where}"
            + (f" and the environment's {', '.join(env)}" if env else "")
            + ")",
            file=sys.stderr,
            flush=True,
        )
        return 2
    if name == "executor":
        _serve_off_main(actor)
    else:
        trio.run(_serve, actor)
    log.info("actor.stopped")
    return 0
