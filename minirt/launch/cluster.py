"""``minirt up --replicas N``, the processes: start every replica (a whole ``minirt up`` in its own
session, pinned to its CPUs), wait until each answers ``GET /health``, start the router and wait
until it holds every replica as healthy, print ``minirt ready URL``. A replica or the router that
dies is started again with the same command and run dir (its leftover processes killed first);
SIGINT/SIGTERM stops the router, then every replica.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from typing import Any

import trio

from actors.runtime.events import get_logger
from minirt.launch.processes import Managed, start_router
from minirt.launch.replicas import ClusterSpec, ReplicaSpec
from minirt.launch.router import find_router, http_get
from minirt.launch.supervisor import serve_until_signal


class Cluster:
    def __init__(self, spec: ClusterSpec, max_restarts: int = 5) -> None:
        self.spec = spec
        self.log = get_logger()
        self.max_restarts = max_restarts
        self.stopping = False
        logs = spec.run_dir / "logs"
        self.replicas = {
            r.name: (
                r,
                Managed(
                    r.name,
                    r.argv(spec.flags, sys.executable),
                    logs / f"{r.name}.log",
                    r.env(),
                    r.cpus if r.pin else None,
                ),
            )
            for r in spec.replicas
        }
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        self.router = Managed("router", spec.router.argv(find_router()), logs / "router.log", env)

    async def run(
        self, task_status: Any = trio.TASK_STATUS_IGNORED, timeout: float = 300.0
    ) -> None:
        try:
            async with trio.open_nursery() as nursery:
                async with trio.open_nursery() as waits:
                    for spec, child in self.replicas.values():
                        await child.start()
                        self.log.info(
                            "cluster.replica_started",
                            child=spec.name,
                            pid=child.proc.pid,
                            url=spec.url,
                            cpus=list(spec.cpus),
                            pinned=spec.pin,
                        )
                        waits.start_soon(self._replica_ready, spec, child, timeout, True)
                await start_router(self.router, self.spec.router, timeout)
                for spec, child in self.replicas.values():
                    nursery.start_soon(self._watch, child, spec)
                nursery.start_soon(self._watch, self.router, None)
                self.log.info(
                    "cluster.ready",
                    url=self.spec.router.url,
                    replicas=[s.url for s, _ in self.replicas.values()],
                )
                task_status.started(self.spec.router.url)
        finally:
            with trio.CancelScope(shield=True):
                await self.stop()

    async def _replica_ready(
        self, spec: ReplicaSpec, child: Managed, timeout: float, fatal: bool
    ) -> None:
        """Wait until the replica answers ``GET /health`` with 200. During start-up (``fatal``) a
        replica that exits or stays unready is a configuration error: raise with its log."""
        with trio.move_on_after(timeout) as scope:
            while True:
                if child.proc.returncode is not None:
                    if not fatal:
                        return
                    raise RuntimeError(
                        f"{spec.name} exited with {child.proc.returncode} during start-up; "
                        f"its log ({child.log_path}) ends:\n{child.log_tail()}"
                    )
                status, _ = await trio.to_thread.run_sync(http_get, f"{spec.url}/health", "", 2.0)
                if status == 200:
                    self.log.info("cluster.replica_ready", child=spec.name, url=spec.url)
                    return
                await trio.sleep(0.25)
        if scope.cancelled_caught and fatal:
            raise RuntimeError(
                f"{spec.name} did not answer {spec.url}/health within {timeout:.0f}s; its log ends:\n{child.log_tail()}"
            )

    async def _watch(self, child: Managed, spec: ReplicaSpec | None) -> None:
        """Start ``child`` again when it dies (not when the cluster stops it)."""
        name = child.name
        while True:
            code = await child.proc.wait()
            if self.stopping:
                return
            child.kill_group(signal.SIGKILL)  # a replica's actors outlive a killed supervisor
            if time.monotonic() - child.started_at > 300:
                child.restarts = 0  # ran for a while: a new run of bad luck, not a crash loop
            self.log.error(
                "cluster.child_exited", child=name, returncode=code, restarts=child.restarts
            )
            if child.restarts >= self.max_restarts:
                raise RuntimeError(f"{name} died {child.restarts + 1} times; giving up")
            child.restarts += 1
            await trio.sleep(min(0.5 * 2**child.restarts, 10.0))
            await child.start()
            self.log.info("cluster.child_restarted", child=name, pid=child.proc.pid)
            if spec is not None:
                await self._replica_ready(spec, child, 300.0, False)

    async def stop(self, grace: float = 10.0) -> None:
        """SIGTERM the router and every replica, wait up to ``grace`` s, then SIGKILL what is left."""
        self.stopping = True
        children = [self.router] + [c for _, c in self.replicas.values()]
        for child in children:
            if child.proc is not None and child.proc.returncode is None:
                child.proc.send_signal(signal.SIGTERM)
        deadline = trio.current_time() + grace
        for child in children:
            if child.proc is None:
                continue
            with trio.move_on_at(deadline):
                await child.proc.wait()
            child.kill_group(signal.SIGKILL)  # whatever is left of its session
            await child.proc.wait()
        self.log.info("cluster.stopped")


async def run_cluster(spec: ClusterSpec) -> None:
    """Run the cluster until SIGINT/SIGTERM; prints ``minirt ready URL`` once it serves."""
    await serve_until_signal(
        Cluster(spec).run, lambda url: print(f"minirt ready {url}", flush=True)
    )


def up_cluster(args: Any, setup: Any, cfg: Any) -> int:
    """``minirt up --replicas N``: plan from the parsed flags (``setup`` is ``up``'s argument
    setup, ``cfg`` the config they give), then run until Ctrl-C."""
    import shlex

    from actors.runtime.events import configure
    from actors.runtime.security import is_local
    from minirt.launch.replicas import passthrough_flags, plan, visible_gpus

    http = cfg.http
    try:
        if args.replicas < 1:
            raise ValueError(f"--replicas must be at least 1, got {args.replicas}")
        if not http.port:
            raise ValueError("--http-port 0: with --replicas the router needs an HTTP port")
        if not is_local(f"tcp://{http.host}:1") and not (
            cfg.security.allow_remote and http.api_key
        ):
            raise ValueError(
                f"--http-host {http.host}: the router would listen beyond loopback; that needs "
                "--allow-remote and --api-key KEY"
            )
        if args.placement == "ray":
            from minirt.launch.ray_cluster import check_ray_args, find_ray

            check_ray_args(args.ray_address, http.api_key, dict(os.environ))
            ray_python = find_ray()
        elif args.ray_address:
            raise ValueError("--ray-address: only with --placement ray")
        flags = passthrough_flags(setup, args)
        if not cfg.model:  # resolve the default model once, not in every replica at once
            from gpu.model.sources import resolve

            default = resolve("")
            flags += ["--model", str(default.path)]
            if not http.served_model_name:
                flags += ["--served-model-name", default.name]
        spec = plan(
            args.replicas,
            cfg.run_dir,
            http_host=http.host,
            http_port=http.port,
            base_port=args.replica_base_port,
            policy=args.router_policy,
            metrics_port=args.router_metrics_port,
            api_key=http.api_key,
            flags=flags,
            router_flags=shlex.split(args.router_flags),
            replica_metrics_port=cfg.scheduler.metrics_port,
            gpus=visible_gpus(cfg.executor.device, args.gpus),
            gpu_memory_utilization=cfg.executor.gpu_memory_utilization,
        )
        find_router()
    except (ValueError, RuntimeError) as e:  # RouterMissing, RayMissing: how to install
        print(f"minirt up: {e}", file=sys.stderr)
        return 2
    configure("supervisor", spec.run_dir, stdout=False)
    if args.placement == "ray":
        from minirt.launch.ray_cluster import run_ray_cluster

        print(
            f"minirt: {args.replicas} replicas placed by Ray ({args.ray_address}), router "
            f"({spec.router.policy}) on {spec.router.url}, run dir {spec.run_dir}",
            file=sys.stderr,
            flush=True,
        )
        failed = False
        try:
            trio.run(run_ray_cluster, spec, args.ray_address, ray_python)
        except* RuntimeError as group:  # the driver could not place them, or exited: its words
            for err in group.exceptions:
                print(f"minirt up: {err}", file=sys.stderr)
            failed = True
        return 1 if failed else 0
    print(
        f"minirt: {args.replicas} replicas, router ({spec.router.policy}) on {spec.router.url}, "
        f"run dir {spec.run_dir}",
        file=sys.stderr,
        flush=True,
    )
    trio.run(run_cluster, spec)
    return 0
