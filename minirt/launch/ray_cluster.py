"""``minirt up --replicas N --placement ray --ray-address HOST:PORT``, the launcher's side: the
replicas are placed by an existing Ray cluster, one per host, and restarted by Ray on a spare
host when theirs is lost; the router runs here and is told each move.

Ray lives in its own venv (``scripts/install-ray``): this process starts the driver
(``minirt.launch.ray_place``) with that venv's Python, hands it the plan as one JSON line and
reads its reports (``placed``, ``lost``, ``stopped``). Once every replica is placed and the
router holds them all healthy it prints ``minirt ready URL``; after that a lost replica is taken
out of the router (``DELETE /workers/ID``) and its new placement added (``POST /workers``).
SIGINT/SIGTERM: the driver stops the replicas and removes the placement group, then the router
stops. See docs/scale-out.md.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import trio

from actors.runtime.events import get_logger
from minirt.launch.processes import Managed, start_router
from minirt.launch.replicas import ClusterSpec
from minirt.launch.router import add_worker, find_router, remove_worker
from minirt.launch.supervisor import serve_until_signal

RAY_VERSION = "2.60.0"  # what scripts/install-ray installs
REPORT = b"minirt-ray "  # the driver's report lines (minirt.launch.ray_place.REPORT)
_REPO = Path(__file__).resolve().parents[2]


class RayMissing(RuntimeError):
    """No Ray venv where minirt looks for one."""


def find_ray() -> Path:
    """The Ray venv's Python: $MINIRT_RAY_VENV, ./.minirt/ray-venv, then .minirt/ray-venv in the
    source tree. Raises RayMissing saying how to install it."""
    venvs = [Path(os.environ["MINIRT_RAY_VENV"])] if os.environ.get("MINIRT_RAY_VENV") else []
    venvs += [base / ".minirt" / "ray-venv" for base in (Path.cwd(), _REPO)]
    for venv in venvs:
        if (venv / "bin" / "python").exists() and any(venv.glob("lib/python*/site-packages/ray")):
            return venv / "bin" / "python"
    raise RayMissing(
        f"no Ray found (looked in {', '.join(map(str, venvs))}); install it with "
        "scripts/install-ray or point MINIRT_RAY_VENV at a venv that has ray"
    )


def check_ray_args(address: str | None, api_key: str, env: dict[str, str]) -> None:
    """What ``--placement ray`` needs before anything starts; ValueError naming what is wrong."""
    if not address:
        raise ValueError("--placement ray needs --ray-address HOST:PORT (the head's GCS address)")
    if not api_key:
        raise ValueError(
            "--placement ray: replicas listen on their hosts' addresses; give --api-key KEY "
            "(the router sends it to every replica, which refuses requests without it)"
        )
    if env.get("RAY_AUTH_MODE") != "token" or not (
        env.get("RAY_AUTH_TOKEN") or env.get("RAY_AUTH_TOKEN_PATH")
    ):
        raise ValueError(
            "--placement ray: set RAY_AUTH_MODE=token and RAY_AUTH_TOKEN (or RAY_AUTH_TOKEN_PATH) "
            "as on every node of the cluster: minirt joins only a Ray cluster with token auth"
        )


def ray_plan(spec: ClusterSpec, address: str, python: str, timeout: float) -> dict[str, Any]:
    """The driver's plan: each replica's ``minirt up`` command, minus the address it binds,
    which its actor adds from the node it lands on."""
    replicas = []
    for r in spec.replicas:
        argv = [python, "-m", "minirt.cli", "up", *spec.flags, "--allow-remote"]
        if r.metrics_port is not None:
            argv += ["--metrics-port", str(r.metrics_port)]
        argv += ["--replica", r.name, "--run-dir", str(r.run_dir)]
        replicas.append(
            {
                "name": r.name,
                "port": r.http_port,
                "run_dir": str(r.run_dir),
                "cwd": os.getcwd(),
                "env": {"MINIRT_REPLICA": r.name},
                "argv": argv,
            }
        )
    return {
        "address": address,
        "cluster": spec.run_dir.name or "minirt",
        "timeout": timeout,
        "replicas": replicas,
    }


class RayCluster:
    def __init__(self, spec: ClusterSpec, address: str, ray_python: Path, timeout: float = 300.0):
        self.spec, self.address, self.ray_python, self.timeout = spec, address, ray_python, timeout
        self.log = get_logger()
        self.urls: dict[str, str] = {}  # replica -> URL it serves on now
        logs = spec.run_dir / "logs"
        self.driver_log = logs / "ray-driver.log"
        self.router = Managed(
            "router", [], logs / "router.log", dict(os.environ, PYTHONUNBUFFERED="1")
        )
        self.driver: Any = None

    async def run(self, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
        try:
            await self._start_driver()
            reports = self._reports()
            with trio.move_on_after(self.timeout + 30):
                async for report in reports:
                    self._note(report)
                    if len(self.urls) == len(self.spec.replicas):
                        break
            if len(self.urls) < len(self.spec.replicas):
                raise RuntimeError(
                    f"Ray placed {len(self.urls)} of {len(self.spec.replicas)} replicas; the "
                    f"driver's log ({self.driver_log}) ends:\n{self._tail()}"
                )
            self.spec.router.workers = [self.urls[r.name] for r in self.spec.replicas]
            self.router.argv = self.spec.router.argv(find_router())
            await start_router(self.router, self.spec.router, self.timeout)
            self.log.info(
                "cluster.ready", url=self.spec.router.url, replicas=list(self.urls.values())
            )
            task_status.started(self.spec.router.url)
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self._watch_router)
                async for report in reports:
                    lost = self._note(report)
                    if report["event"] == "lost" and lost:
                        await self._router("remove", report["replica"], lost)
                    elif report["event"] == "placed":
                        await self._router("add", report["replica"], report["url"])
                raise RuntimeError(
                    f"the Ray driver exited; its log ({self.driver_log}) ends:\n{self._tail()}"
                )
        finally:
            with trio.CancelScope(shield=True):
                await self.stop()

    async def _watch_router(self, max_restarts: int = 5) -> None:
        """A router that dies is started again with the replicas' URLs of now."""
        for restarts in range(max_restarts + 1):
            code = await self.router.proc.wait()
            self.log.error(
                "cluster.child_exited", child="router", returncode=code, restarts=restarts
            )
            self.router.kill_group(signal.SIGKILL)
            if restarts == max_restarts:
                raise RuntimeError(f"the router died {restarts + 1} times; giving up")
            await trio.sleep(min(0.5 * 2**restarts, 10.0))
            self.spec.router.workers = list(self.urls.values()) or self.spec.router.workers
            self.router.argv = self.spec.router.argv(find_router())
            await self.router.start()
            self.log.info("cluster.child_restarted", child="router", pid=self.router.proc.pid)

    def _write_workers(self) -> None:
        """RUN_DIR/workers.json, the replicas' URLs of now in the worker-discovery file format
        of smg (sglang-router's successor: ``--discovery-provider file --discovery-file``);
        replaced whole (rename), so a reader never sees half a file."""
        path = self.spec.run_dir / "workers.json"
        tmp = path.with_suffix(".json.tmp")
        workers = [{"id": name, "url": url} for name, url in sorted(self.urls.items())]
        tmp.write_text(json.dumps({"version": 1, "workers": workers}, indent=1) + "\n")
        tmp.replace(path)

    async def _start_driver(self) -> None:
        self.driver_log.parent.mkdir(parents=True, exist_ok=True)
        env = dict(os.environ, PYTHONUNBUFFERED="1", PYTHONPATH=str(_REPO))
        with self.driver_log.open("ab") as err:
            self.driver = await trio.lowlevel.open_process(
                [str(self.ray_python), "-m", "minirt.launch.ray_place"],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=err,
                env=env,
                cwd=str(_REPO),
                start_new_session=True,
            )
        plan = ray_plan(self.spec, self.address, sys.executable, self.timeout)
        await self.driver.stdin.send_all(json.dumps(plan).encode() + b"\n")

    async def _reports(self) -> Any:
        """The driver's JSON lines, as dicts, until it exits."""
        buf = b""
        while True:
            chunk = await self.driver.stdout.receive_some(65536)
            if not chunk:
                return
            buf += chunk
            *lines, buf = buf.split(b"\n")
            for line in lines:
                if line.startswith(REPORT):
                    yield json.loads(line[len(REPORT) :])
                elif line.strip():  # Ray's own messages (a raylet that died, ...): to the log
                    with self.driver_log.open("ab") as log:
                        log.write(line + b"\n")

    def _note(self, report: dict[str, Any]) -> str | None:
        """Record a report and log it; for ``lost``, the URL the replica served on, if known."""
        name = str(report.get("replica"))
        if report["event"] == "placed":
            self.urls[name] = report["url"]
            self._write_workers()
            self.log.info(
                "cluster.replica_placed",
                child=name,
                url=report["url"],
                node_ip=report["node_ip"],
                node_id=report["node_id"],
                incarnation=report["incarnation"],
                pid=report["pid"],
            )
        elif report["event"] == "lost":
            url = self.urls.pop(name, None)
            self._write_workers()
            self.log.error("cluster.replica_lost", child=name, url=url, reason=report["reason"])
            return url
        return None

    async def _router(self, op: str, name: str, url: str) -> None:
        call = add_worker if op == "add" else remove_worker
        ok = await trio.to_thread.run_sync(call, self.spec.router, url)
        self.log.info("cluster.router_updated", child=name, op=op, url=url, ok=ok)

    def _tail(self, lines: int = 12) -> str:
        try:
            return "\n".join(self.driver_log.read_text(errors="replace").splitlines()[-lines:])
        except FileNotFoundError:
            return ""

    async def stop(self, grace: float = 60.0) -> None:
        """The driver stops the replicas and removes the placement group (its stdin closed),
        then the router gets SIGTERM; whatever is left after ``grace`` s is killed."""
        if self.driver is not None:
            with trio.move_on_after(5):
                await self.driver.stdin.aclose()
            with trio.move_on_after(grace):
                await self.driver.wait()
            if self.driver.returncode is None:
                os.killpg(self.driver.pid, signal.SIGKILL)
                await self.driver.wait()
        if self.router.proc is not None and self.router.proc.returncode is None:
            self.router.proc.send_signal(signal.SIGTERM)
            with trio.move_on_after(10):
                await self.router.proc.wait()
            self.router.kill_group(signal.SIGKILL)
            await self.router.proc.wait()
        self.log.info("cluster.stopped")


async def run_ray_cluster(spec: ClusterSpec, address: str, ray_python: Path) -> None:
    """Run until SIGINT/SIGTERM; prints ``minirt ready URL`` once the router serves."""
    # the signals are ours from the start: Ctrl-C while Ray places the replicas stops them too
    await serve_until_signal(
        RayCluster(spec, address, ray_python).run,
        lambda url: print(f"minirt ready {url}", flush=True),
    )
