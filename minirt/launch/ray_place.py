"""``minirt up --placement ray``, the Ray side: runs in Ray's own venv (``scripts/install-ray``)
with the standard library and ``ray`` only; never imported by the project's venv.

The launcher (``minirt.launch.ray_cluster``) starts ``python -m minirt.launch.ray_place`` as
a driver of an existing Ray cluster and writes it one JSON line (the plan). The driver:

- makes (or finds again, after a launcher restart) a detached placement group of one bundle per
  replica, ``STRICT_SPREAD`` over nodes that offer the custom resource ``minirt_host``: one
  replica per host, never on the head unless the head offers it;
- places one detached ``ReplicaHost`` actor in each bundle, restarted by Ray without limit: it
  runs a whole replica (``minirt up``: four actors and HTTP) on its node's address, the replica
  dying with it (parent-death signal) and it dying with the replica (so Ray places it again);
- reports on stdout, one line each (``minirt-ray`` and a JSON object): ``placed`` (a replica serves: name, URL, node, pid,
  incarnation), ``lost`` (its actor or host is gone: name, URL, why), ``stopped``.

When a host leaves the cluster, Ray moves its bundle to a spare host and restarts the actor
there; the launcher tells the router. On stdin EOF or SIGTERM the driver kills the actors and
removes the placement group (``stop``); the cluster itself is the operator's (``ray start``).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

NAMESPACE = "minirt"
HOST_RESOURCE = "minirt_host"  # `ray start --resources '{"minirt_host": 1}'` on replica hosts


# The replica's keeper, run as `python -c KEEPER WORKER_PID FD ARGV...` by the Ray actor. It
# forks away (so it is no child of the Ray worker: Ray kills a dead worker's children with
# SIGKILL, which would leave the replica's processes behind), starts the replica (`minirt up`:
# the supervisor and its four actors, one process group of its own), and stops that whole group
# when the worker is gone (its host's Ray node stopped or lost) or on SIGTERM (the actor's
# `stop`): SIGTERM, then SIGKILL to whatever of the group is left after 10 s. It reports on the
# pipe FD: "PID REPLICA_PID" once, "exit CODE" at the end (the pipe's end: it is gone).
KEEPER = """
import os, signal, subprocess, sys, time
worker, fd, argv = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3:]
if os.fork():
    os._exit(0)
os.setsid()
def born(pid):
    try:
        return open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[19]
    except OSError:
        return None
mark = born(worker)
child = subprocess.Popen(argv, start_new_session=True)
os.write(fd, f"{os.getpid()} {child.pid}\\n".encode())
def down(*_):
    for sig, wait in ((signal.SIGTERM, 10.0), (signal.SIGKILL, 0.0)):
        try:
            os.killpg(child.pid, sig)
        except ProcessLookupError:
            pass
        end = time.monotonic() + wait
        while child.poll() is None and time.monotonic() < end:
            time.sleep(0.1)
    child.wait()
signal.signal(signal.SIGTERM, lambda *_: (down(), os.write(fd, b"exit -15\\n"), os._exit(0)))
while child.poll() is None:
    if born(worker) != mark:
        down()
        break
    time.sleep(0.5)
try:
    os.killpg(child.pid, signal.SIGKILL)
except ProcessLookupError:
    pass
os.write(fd, f"exit {child.wait()}\\n".encode())
"""


def _health(url: str, timeout: float = 2.0) -> int:
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=timeout) as r:
            return int(r.status)
    except Exception:
        return 0


class ReplicaHost:
    """A Ray actor that runs one whole replica on its node (made remote in :func:`place`)."""

    def __init__(self, spec: dict[str, Any]) -> None:
        import ray

        ctx = ray.get_runtime_context()
        self.name = spec["name"]
        self.node_ip = ray.util.get_node_ip_address()
        self.node_id = ctx.get_node_id()
        self.url = f"http://{self.node_ip}:{spec['port']}"
        argv = list(spec["argv"]) + ["--http-host", self.node_ip, "--http-port", str(spec["port"])]
        logs = Path(spec["run_dir"]) / "logs"
        logs.mkdir(parents=True, exist_ok=True)
        self.log_path = logs / f"replica-{self.node_ip}.log"
        env = dict(os.environ, **spec.get("env", {}), PYTHONUNBUFFERED="1")
        r, w = os.pipe()
        with self.log_path.open("ab") as out:
            subprocess.run(  # the keeper's first process: it forks the keeper and exits
                [sys.executable, "-c", KEEPER, str(os.getpid()), str(w), *argv],
                cwd=spec.get("cwd") or None,
                env=env,
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                pass_fds=(w,),
                check=True,
            )
        os.close(w)
        self.reports = os.fdopen(r, "r")
        self.keeper, self.pid = (int(x) for x in self.reports.readline().split())
        self.started = time.time()
        self.stopping = False
        self.exited = threading.Event()
        self.code: int | None = None
        threading.Thread(target=self._exit_with_replica, daemon=True).start()

    def _exit_with_replica(self) -> None:
        """A replica that exits on its own takes its actor with it, so Ray restarts both."""
        for line in self.reports:  # until the keeper is gone
            if line.startswith("exit "):
                self.code = int(line.split()[1])
        self.exited.set()
        if not self.stopping:
            print(f"minirt replica {self.name} exited ({self.code})", file=sys.stderr, flush=True)
            os._exit(1)

    def ready(self, timeout: float) -> dict[str, Any]:
        """Block until the replica answers ``GET /health`` with 200; its address and node."""
        deadline = time.monotonic() + timeout
        while _health(self.url) != 200:
            if time.monotonic() > deadline:
                raise TimeoutError(f"{self.name} on {self.url} not healthy after {timeout:.0f}s")
            time.sleep(0.25)
        return self.info()

    def info(self) -> dict[str, Any]:
        return {
            "replica": self.name,
            "url": self.url,
            "node_ip": self.node_ip,
            "node_id": self.node_id,
            "pid": self.pid,
            "actor_pid": os.getpid(),
            "started": self.started,
        }

    def watch(self) -> int | None:
        """Returns when the replica exits (never, while it serves): a call left waiting here
        fails the moment the actor or its host is gone."""
        self.exited.wait()
        return self.code

    def stop(self) -> int | None:
        """The keeper stops the replica's group (SIGTERM, SIGKILL after 10 s) and exits."""
        self.stopping = True
        try:
            os.kill(self.keeper, signal.SIGTERM)
        except ProcessLookupError:
            pass
        self.exited.wait(30)
        return self.code


REPORT = "minirt-ray "  # starts each report line: Ray itself prints to the driver's stdout too


def emit(kind: str, **fields: Any) -> None:
    print(REPORT + json.dumps({"event": kind, **fields}), flush=True)


class Placement:
    """The driver: the placement group, one actor per bundle, a watcher thread per replica."""

    def __init__(self, plan: dict[str, Any], done: threading.Event) -> None:
        import ray
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        self.ray, self.plan = ray, plan
        self.timeout = float(plan.get("timeout", 300.0))
        self.done = done
        replicas = plan["replicas"]
        bundle = {HOST_RESOURCE: 1.0, **plan.get("bundle", {})}
        self.pg = placement_group(
            [dict(bundle) for _ in replicas],
            strategy="STRICT_SPREAD",
            name=f"minirt-{plan['cluster']}",
            lifetime="detached",
        )
        try:
            ray.get(self.pg.ready(), timeout=self.timeout)
        except ray.exceptions.GetTimeoutError:
            from ray.util.placement_group import remove_placement_group

            remove_placement_group(self.pg)  # detached: it would hold hosts as they join
            raise RuntimeError(
                f"no room for {len(replicas)} replicas, one per host, within {self.timeout:.0f}s: "
                f"fewer than {len(replicas)} alive nodes offer the resource {HOST_RESOURCE} "
                f"(ray start --resources '{{\"{HOST_RESOURCE}\": 1}}'), or they lack {bundle}"
            ) from None
        host = ray.remote(ReplicaHost)
        self.actors = [
            host.options(
                name=f"{plan['cluster']}-{r['name']}",
                namespace=NAMESPACE,
                get_if_exists=True,
                lifetime="detached",
                max_restarts=-1,
                max_task_retries=0,
                max_concurrency=4,
                num_cpus=0,
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    self.pg, placement_group_bundle_index=i
                ),
            ).remote(r)
            for i, r in enumerate(replicas)
        ]

    def watch(self, i: int) -> None:
        """Report replica ``i``'s placements and losses until the driver stops."""
        name, actor, last, incarnation = self.plan["replicas"][i]["name"], self.actors[i], None, 0
        while not self.done.is_set():
            try:
                info = self.ray.get(actor.ready.remote(self.timeout))
            except Exception as e:
                if self.done.wait(0.5):
                    return
                if last is not None:
                    emit("lost", replica=name, url=last["url"], reason=type(e).__name__)
                    last = None
                continue
            if last is None or info["actor_pid"] != last["actor_pid"]:
                incarnation += 1
                emit("placed", incarnation=incarnation, **info)
            last = info
            try:
                code = self.ray.get(actor.watch.remote())
                why = f"replica exited with {code}"
            except Exception as e:
                why = type(e).__name__
            if not self.done.is_set():
                emit("lost", replica=name, url=last["url"], node_ip=last["node_ip"], reason=why)
                last = None

    def stop(self) -> None:
        self.done.set()
        for actor in self.actors:
            try:
                self.ray.get(actor.stop.remote(), timeout=15)
            except Exception:
                pass
            self.ray.kill(actor, no_restart=True)
        from ray.util.placement_group import remove_placement_group

        remove_placement_group(self.pg)
        emit("stopped")


def main() -> int:
    import ray
    from ray import cloudpickle

    plan = json.loads(sys.stdin.readline())
    host, _, port = plan["address"].rpartition(":")
    try:  # a wrong address fails now, not after Ray's own minutes of retries
        socket.create_connection((host, int(port)), timeout=10).close()
    except (OSError, ValueError) as e:
        print(f"minirt: no Ray head answers at {plan['address']}: {e}", file=sys.stderr, flush=True)
        return 1
    done, creating = threading.Event(), threading.Event()

    def until_eof() -> None:  # the launcher closed our stdin (or died): stop
        sys.stdin.read()
        if not creating.is_set():
            os._exit(0)  # nothing placed yet: nothing to undo
        done.set()

    threading.Thread(target=until_eof, daemon=True).start()
    signal.signal(signal.SIGTERM, lambda *_: done.set())
    # the actor class travels by value: Ray's workers need not find this source tree
    cloudpickle.register_pickle_by_value(sys.modules[__name__])
    ray.init(address=plan["address"], namespace=NAMESPACE, log_to_driver=False)
    creating.set()
    try:
        placement = Placement(plan, done)
    except RuntimeError as e:
        print(f"minirt: {e}", file=sys.stderr, flush=True)
        return 1
    for i in range(len(placement.actors)):
        threading.Thread(target=placement.watch, args=(i,), daemon=True).start()
    while not done.wait(1.0):
        pass
    placement.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
