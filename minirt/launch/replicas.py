"""``minirt up --replicas N``, the plan: N full minirt instances on one machine, each with its own
run dir (RUN_DIR/replica-I), HTTP port (BASE_PORT+I, loopback), CPUs and thread count, behind one
router on the cluster's HTTP address (127.0.0.1:8000 by default). Pure: no processes here
(``minirt.launch.cluster`` runs the plan).
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from minirt.launch.router import POLICIES, RouterSpec

# `minirt up` flags the cluster sets per replica, and its own: never passed through as given.
CLUSTER_FLAGS = frozenset(
    {"--replica", "--run-dir", "--http-port", "--http-host", "--metrics-port"}
    | {"--replicas", "--replica-base-port", "--router-policy", "--router-metrics-port"}
    | {"--router-flags", "--gpus", "--gpu-memory-utilization", "--placement", "--ray-address"}
)
PER_INSTANCE_ENDPOINTS = frozenset(
    f"--{n}-endpoint"
    for n in ("client", "tokenizer", "scheduler", "kv-manager", "executor", "http")
)


@dataclass
class ReplicaSpec:
    name: str
    run_dir: Path
    http_port: int
    cpus: tuple[int, ...]  # its CPU share: --threads is its size
    http_host: str = "127.0.0.1"
    metrics_port: int | None = None  # the scheduler's Prometheus port, when the user set one
    pin: bool = False  # pinned to ``cpus`` (only with 2+ CPUs each: see ``plan``)
    gpu: str | None = None  # its card (CUDA_VISIBLE_DEVICES); None: the host's as they are
    gpu_memory_utilization: float | None = None  # its share of that card, when it has one

    @property
    def url(self) -> str:
        return f"http://{self.http_host}:{self.http_port}"

    def argv(self, flags: Sequence[str], python: str) -> list[str]:
        """This replica's ``minirt up`` command line: the cluster's ``up`` flags, then its own."""
        cmd = [python, "-m", "minirt.cli", "up", *flags]
        if "--threads" not in flags:
            cmd += ["--threads", str(len(self.cpus))]
        if self.metrics_port is not None:
            cmd += ["--metrics-port", str(self.metrics_port)]
        if self.gpu_memory_utilization is not None:
            cmd += ["--gpu-memory-utilization", f"{self.gpu_memory_utilization:.4g}"]
        return cmd + [
            "--replica",
            self.name,
            "--run-dir",
            str(self.run_dir),
            "--http-host",
            self.http_host,
            "--http-port",
            str(self.http_port),
        ]

    def env(self, base: dict[str, str] | None = None) -> dict[str, str]:
        env = dict(os.environ if base is None else base)
        env["PYTHONUNBUFFERED"] = "1"
        env["MINIRT_REPLICA"] = self.name  # every process of the replica labels its events
        if self.gpu is not None:  # its card is cuda:0 inside the replica
            env["CUDA_VISIBLE_DEVICES"] = self.gpu
        return env


@dataclass
class ClusterSpec:
    run_dir: Path
    replicas: list[ReplicaSpec]
    router: RouterSpec
    flags: list[str] = field(default_factory=list)  # `minirt up` flags every replica gets


# Pin replicas to their CPUs only when each gets at least this many: a replica's five processes
# on one pinned core stall together when anything else runs there (on a 2-core machine under
# load they missed their heartbeats); the OS scheduler spreads them better.
PIN_MIN_CPUS = 2


def split_cpus(cpus: Sequence[int], n: int) -> list[tuple[int, ...]]:
    """``n`` CPU sets: disjoint contiguous slices when there are at least ``n`` CPUs (the first
    ones get the remainder), else one CPU each, shared round-robin."""
    if n < 1:
        raise ValueError(f"replicas must be at least 1, got {n}")
    cpus = sorted(cpus)
    if not cpus:
        raise ValueError("no CPUs to split between replicas")
    if len(cpus) < n:
        return [(cpus[i % len(cpus)],) for i in range(n)]
    size, extra = divmod(len(cpus), n)
    out, start = [], 0
    for i in range(n):
        end = start + size + (1 if i < extra else 0)
        out.append(tuple(cpus[start:end]))
        start = end
    return out


def assign_gpus(
    n: int, gpus: Sequence[str], utilization: float
) -> list[tuple[str | None, float | None]]:
    """Each of ``n`` replicas' card and share of it: replica I on ``gpus[I % len(gpus)]``, the
    ``utilization`` of a card split evenly among the replicas on it (two on one card: half each,
    so neither sizes its KV pool for the whole card). No cards: ``(None, None)`` each."""
    if not gpus:
        return [(None, None)] * n
    if not 0.0 < utilization <= 1.0:
        raise ValueError(f"--gpu-memory-utilization must be in (0, 1], got {utilization}")
    cards = [gpus[i % len(gpus)] for i in range(n)]
    return [(c, utilization / cards.count(c)) for c in cards]


def visible_gpus(device: str | None, given: str | None = None) -> list[str]:
    """The cards replicas are spread over: ``--gpus`` as given (comma-separated indices or
    UUIDs), else none when the device is cpu, else CUDA_VISIBLE_DEVICES's entries, else every
    card torch sees (none without CUDA)."""
    if given:
        return [g.strip() for g in given.split(",") if g.strip()]
    if device is not None and not device.startswith("cuda"):
        return []
    env = os.environ.get("CUDA_VISIBLE_DEVICES")
    if env is not None:
        return [g.strip() for g in env.split(",") if g.strip()]
    import torch

    return [str(i) for i in range(torch.cuda.device_count())] if torch.cuda.is_available() else []


def plan(
    n: int,
    run_dir: str | Path,
    *,
    http_host: str = "127.0.0.1",
    http_port: int = 8000,
    base_port: int | None = None,
    policy: str = "cache_aware",
    metrics_port: int = 29000,
    api_key: str = "",
    flags: Sequence[str] = (),
    router_flags: Sequence[str] = (),
    cpus: Sequence[int] | None = None,
    replica_metrics_port: int | None = None,
    gpus: Sequence[str] = (),
    gpu_memory_utilization: float = 0.9,
) -> ClusterSpec:
    """The cluster for ``minirt up --replicas n``: replica I on 127.0.0.1:(base_port + I)
    (default: just above the router's port), the router on ``http_host:http_port``. A
    ``replica_metrics_port`` (``--metrics-port``) becomes one port per replica, counting up.
    With ``gpus``, one card per replica, round-robin (:func:`assign_gpus`)."""
    run = Path(run_dir).absolute()
    base = http_port + 1 if base_port is None else base_port
    ports = [base + i for i in range(n)]
    if http_port in ports or metrics_port in ports or metrics_port == http_port:
        raise ValueError(
            f"replica ports {ports[0]}..{ports[-1]} overlap the router's port {http_port} or "
            f"its metrics port {metrics_port}; pick --replica-base-port or --router-metrics-port"
        )
    sets = split_cpus(sorted(os.sched_getaffinity(0)) if cpus is None else cpus, n)
    cards = assign_gpus(n, gpus, gpu_memory_utilization)
    replicas = [
        ReplicaSpec(
            f"replica-{i}",
            run / f"replica-{i}",
            ports[i],
            sets[i],
            metrics_port=None if replica_metrics_port is None else replica_metrics_port + i,
            pin=all(len(c) >= PIN_MIN_CPUS for c in sets),
            gpu=cards[i][0],
            gpu_memory_utilization=cards[i][1],
        )
        for i in range(n)
    ]
    router = RouterSpec(
        workers=[r.url for r in replicas],
        host=http_host,
        port=http_port,
        policy=policy,
        metrics_port=metrics_port,
        api_key=api_key,
        extra=list(router_flags),
    )
    return ClusterSpec(run, replicas, router, list(flags))


def passthrough_flags(
    setup: Callable[[argparse.ArgumentParser], None], args: argparse.Namespace
) -> list[str]:
    """The ``minirt up`` flags the user gave (from the parsed ``args``), as command-line words,
    minus those the cluster sets per replica. Refuses per-instance endpoints (each replica uses
    ipc:// sockets under its own run dir), naming the flag."""
    parser = argparse.ArgumentParser(add_help=False)
    setup(parser)
    words: list[str] = []
    done: set[str] = set()
    for action in parser._actions:
        dest = action.dest
        if not action.option_strings or CLUSTER_FLAGS & set(action.option_strings) or dest in done:
            continue
        value = getattr(args, dest, None)
        if value is None or value == action.default:
            continue
        flag = action.option_strings[0]
        if flag in PER_INSTANCE_ENDPOINTS:
            raise ValueError(
                f"{flag}: with --replicas each replica uses its own ipc:// endpoints under "
                "RUN_DIR/replica-I; start replicas one by one to place actors yourself"
            )
        if isinstance(action, argparse.BooleanOptionalAction):
            no = [s for s in action.option_strings if s.startswith("--no-")]
            words.append(flag if value else no[0])
        elif action.nargs == 0:  # store_true / store_false / store_const: this flag, if it fits
            if getattr(action, "const", None) != value:
                continue
            words.append(flag)
        elif isinstance(value, list):
            for v in value:
                words += [flag, str(v)]
        else:
            words += [flag, str(value)]
        done.add(dest)
    return words


def add_cluster_args(p: argparse.ArgumentParser) -> None:
    """``minirt up`` flags for running several replicas behind the router."""
    g = p.add_argument_group("scale out (see docs/scale-out.md)")
    g.add_argument(
        "--replicas",
        type=int,
        metavar="N",
        help="start N full instances behind sglang-router (scripts/install-router); the router "
        "takes --http-host/--http-port, replica I serves on 127.0.0.1:(--replica-base-port + I)",
    )
    g.add_argument("--replica-base-port", type=int, metavar="N", help="default: HTTP port + 1")
    g.add_argument(
        "--placement",
        choices=("local", "ray"),
        default="local",
        help="local: every replica on this machine; ray: one replica per host of an existing Ray "
        "cluster (hosts offering the resource minirt_host), placed again by Ray when a host is "
        "lost (scripts/install-ray; needs --ray-address, --api-key and RAY_AUTH_MODE=token)",
    )
    g.add_argument(
        "--ray-address",
        metavar="HOST:PORT",
        help="the Ray head's GCS address (ray start --head --port); with --placement ray",
    )
    g.add_argument(
        "--gpus",
        metavar="LIST",
        help="cards for the replicas, comma-separated (replica I gets card I mod len, as its "
        "CUDA_VISIBLE_DEVICES; replicas sharing a card split --gpu-memory-utilization); default: "
        "every visible card unless --device cpu",
    )
    g.add_argument("--router-policy", choices=POLICIES, default="cache_aware")
    g.add_argument(
        "--router-metrics-port",
        type=int,
        default=29000,
        metavar="N",
        help="the router's own Prometheus port (on 127.0.0.1); one per router",
    )
    g.add_argument(
        "--router-flags",
        default="",
        metavar="FLAGS",
        help='more sglang-router flags, as one string: "--cache-threshold 0.5"',
    )
