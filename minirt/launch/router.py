"""The router in front of minirt replicas: the SGLang Model Gateway (``sglang-router`` on PyPI).

minirt does not route: the router is an established, separately installed program
(``scripts/install-router`` puts it in its own venv, ``.minirt/router-venv``). This module finds
it, builds its command line with settings fit for failover, and asks it which workers it holds.
What the router asks of a worker, with evidence, is in docs/scale-out.md.
"""

from __future__ import annotations

import http.client
import json
import os
import signal
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

POLICIES = ("cache_aware", "round_robin", "random", "power_of_two")
ROUTER_VERSION = "0.3.2"  # what scripts/install-router installs and docs/scale-out.md describes
_REPO = Path(__file__).resolve().parents[2]


class RouterMissing(RuntimeError):
    """No router installed where minirt looks for one."""


def router_venvs() -> list[Path]:
    """Where the router is looked for, in order: $MINIRT_ROUTER_VENV, ./.minirt/router-venv,
    and .minirt/router-venv in the source tree."""
    found = [Path(os.environ["MINIRT_ROUTER_VENV"])] if os.environ.get("MINIRT_ROUTER_VENV") else []
    for base in (Path.cwd(), _REPO):
        venv = base / ".minirt" / "router-venv"
        if venv not in found:
            found.append(venv)
    return found


def find_router() -> Path:
    """The router venv's Python interpreter; raises RouterMissing saying how to install it."""
    for venv in router_venvs():
        python = venv / "bin" / "python"
        if python.exists() and any(venv.glob("lib/python*/site-packages/sglang_router")):
            return python
    where = ", ".join(str(v) for v in router_venvs())
    raise RouterMissing(
        f"no sglang-router found (looked in {where}); install it with scripts/install-router "
        "or point MINIRT_ROUTER_VENV at a venv that has sglang-router"
    )


@dataclass
class RouterSpec:
    """One router process. The defaults differ from the router's own where failover needs it:
    the router binds 0.0.0.0 and checks health every 60 s, and its circuit breaker waits 60 s."""

    workers: list[str]
    port: int = 8000
    host: str = "127.0.0.1"
    policy: str = "cache_aware"
    metrics_port: int = 29000  # the router's own Prometheus endpoint; one per router
    metrics_host: str = "127.0.0.1"
    api_key: str = ""  # required from clients and sent to every worker
    health_interval_s: int = 1
    health_timeout_s: int = 3
    health_failure_threshold: int = 2
    health_success_threshold: int = 1
    cb_failure_threshold: int = 3
    cb_timeout_s: int = 3
    request_timeout_s: int = 600
    log_level: str = "warn"
    extra: list[str] = field(default_factory=list)  # more router flags, passed as given

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise ValueError(f"router policy must be one of {POLICIES}, got {self.policy!r}")
        if not self.workers:
            raise ValueError("router workers: give at least one worker URL")
        for url in self.workers:
            if not url.startswith(("http://", "https://")):
                raise ValueError(f"router workers: {url!r} is not an http(s):// URL")

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    def argv(self, python: Path | str) -> list[str]:
        """The router's command line (``python -m sglang_router.launch_router ...``)."""
        args = [
            str(python),
            "-m",
            "sglang_router.launch_router",
            "--host",
            self.host,
            "--port",
            str(self.port),
            "--prometheus-host",
            self.metrics_host,
            "--prometheus-port",
            str(self.metrics_port),
            "--policy",
            self.policy,
            "--worker-urls",
            *self.workers,
            "--health-check-interval-secs",
            str(self.health_interval_s),
            "--health-check-timeout-secs",
            str(self.health_timeout_s),
            "--health-failure-threshold",
            str(self.health_failure_threshold),
            "--health-success-threshold",
            str(self.health_success_threshold),
            "--cb-failure-threshold",
            str(self.cb_failure_threshold),
            "--cb-timeout-duration-secs",
            str(self.cb_timeout_s),
            # A worker not up when the router starts is checked again after this (default 30 s).
            "--worker-startup-check-interval",
            "1",
            "--request-timeout-secs",
            str(self.request_timeout_s),
            # In-flight requests get this long after SIGTERM (default 180 s).
            "--shutdown-grace-period-secs",
            "5",
            "--log-level",
            self.log_level,
        ]
        if self.api_key:
            args += ["--api-key", self.api_key]
        return args + list(self.extra)


# Workers and routers are reached directly: an HTTP(S)_PROXY from the environment must not apply.
_OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def http_get(url: str, api_key: str = "", timeout: float = 2.0) -> tuple[int, bytes]:
    """``(status, body)`` of a GET; ``(0, b"")`` when nothing answers. Blocking: call it from a
    thread (``trio.to_thread.run_sync``) in async code."""
    req = urllib.request.Request(url)
    if api_key:
        req.add_header("Authorization", f"Bearer {api_key}")
    try:
        with _OPENER.open(req, timeout=timeout) as resp:
            return int(resp.status), resp.read()
    except urllib.error.HTTPError as e:
        return int(e.code), e.read()
    except (OSError, ValueError, http.client.HTTPException):
        # HTTPException: no HTTP answer, e.g. BadStatusLine "GET /health HTTP/1.1" when the
        # connect to a port nobody listens on yet met itself (a TCP self-connect on loopback)
        return 0, b""


def http_call(
    method: str, url: str, api_key: str = "", body: Any = None, timeout: float = 5.0
) -> tuple[int, Any]:
    """``(status, JSON answer or None)`` of a request with an optional JSON body; ``(0, None)``
    when nothing answers. Blocking, like :func:`http_get`."""
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method=method)
    req.add_header("content-type", "application/json")
    if api_key:
        req.add_header("Authorization", f"Bearer {api_key}")
    try:
        with _OPENER.open(req, timeout=timeout) as resp:
            status, raw = int(resp.status), resp.read()
    except urllib.error.HTTPError as e:
        status, raw = int(e.code), e.read()
    except (OSError, ValueError, http.client.HTTPException):
        return 0, None
    try:
        return status, json.loads(raw)
    except ValueError:
        return status, None


def add_worker(spec: RouterSpec, url: str) -> bool:
    """Register a worker with the running router (``POST /workers``, sglang-router 0.3.2: the
    router checks it and adds it in the background); True when the router accepted it."""
    status, _ = http_call("POST", f"{spec.url}/workers", spec.api_key, {"url": url})
    return 200 <= status < 300


def remove_worker(spec: RouterSpec, url: str) -> bool:
    """Take a worker out of the running router (``DELETE /workers/{id}``, its id read from
    ``GET /workers``); True when it was there and the router accepted the removal."""
    status, data = http_call("GET", f"{spec.url}/workers", spec.api_key)
    ids = [
        str(w.get("id"))
        for w in (data or {}).get("workers", [])
        if isinstance(w, dict) and w.get("url") == url
    ]
    ok = status == 200 and bool(ids)
    for wid in ids:
        code, _ = http_call("DELETE", f"{spec.url}/workers/{wid}", spec.api_key)
        ok = ok and 200 <= code < 300
    return ok


def router_workers(spec: RouterSpec, timeout: float = 2.0) -> dict[str, bool]:
    """``{worker URL: healthy}`` as the router sees it now (its ``GET /workers``); empty when the
    router does not answer."""
    status, body = http_get(f"{spec.url}/workers", spec.api_key, timeout)
    if status != 200:
        return {}
    try:
        data: Any = json.loads(body)
        return {str(w["url"]): bool(w["is_healthy"]) for w in data.get("workers", [])}
    except (ValueError, KeyError, TypeError, AttributeError):
        return {}


@contextmanager
def running_router(
    spec: RouterSpec, log_path: Path, timeout: float = 60.0
) -> Iterator[subprocess.Popen[bytes]]:
    """A router process (its own session) that holds every worker healthy; stopped after."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with log_path.open("ab") as out:
        proc = subprocess.Popen(
            spec.argv(find_router()),
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
    try:
        deadline = time.monotonic() + timeout
        while set(spec.workers) - {u for u, ok in router_workers(spec).items() if ok}:
            if proc.poll() is not None or time.monotonic() > deadline:
                tail = log_path.read_text(errors="replace").splitlines()[-8:]
                raise RuntimeError(
                    f"router on {spec.url} not ready (exit {proc.poll()}); log:\n" + "\n".join(tail)
                )
            time.sleep(0.2)
        yield proc
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
