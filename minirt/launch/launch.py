"""Start a whole runtime (``minirt up`` in a subprocess) and stop it: used by ``minirt bench``
and by the end-to-end tests."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from minirt.eventlog import is_request, read_events


@dataclass
class Runtime:
    run_dir: Path
    proc: subprocess.Popen[str]
    endpoint: str

    def actor_endpoint(self, name: str) -> str:
        return f"ipc://{self.run_dir / 'sock' / name}"

    def events(
        self, name: str | None = None, request_id: str | None = None
    ) -> list[dict[str, Any]]:
        return [
            e
            for e in read_events(self.run_dir)
            if (name is None or e.get("event") == name)
            and (request_id is None or is_request(e.get("request_id"), request_id))
        ]

    def pid_of(self, actor: str) -> int:
        return actor_pids(self.run_dir)[actor]


def actor_pids(run_dir: Path) -> dict[str, int]:
    """Each actor's pid, from its last ``actor.started`` event (a restarted actor's newest)."""
    return {
        e["actor"]: int(e["pid"]) for e in read_events(run_dir) if e.get("event") == "actor.started"
    }


def read_ready(proc: subprocess.Popen[str], timeout: float) -> tuple[str | None, list[str]]:
    """Read ``proc``'s stdout until it prints ``minirt ready ENDPOINT`` (``minirt up``, with or
    without replicas): the endpoint (None if it exited or ``timeout`` passed first) and the
    lines read."""
    deadline = time.monotonic() + timeout
    assert proc.stdout is not None
    lines: list[str] = []
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        lines.append(line)
        if line.startswith("minirt ready "):
            return line.split()[2], lines
    return None, lines


@contextmanager
def start_runtime(
    model: Path, run_dir: Path, *flags: str, timeout: float = 90.0
) -> Iterator[Runtime]:
    """``minirt up`` in a subprocess; yields once it printed ``minirt ready``; stops it after.
    No HTTP server unless ``flags`` ask for one (``--http-port``): runs side by side would all
    want port 8000."""
    if not any(f == "--http-port" or f.startswith("--http-port=") for f in flags):
        flags = (*flags, "--http-port", "0")
    cmd = [
        sys.executable,
        "-m",
        "minirt.cli",
        "up",
        "--model",
        str(model),
        "--run-dir",
        str(run_dir),
        *flags,
    ]
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    proc = subprocess.Popen(
        cmd,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
        start_new_session=True,
    )
    try:
        endpoint, lines = read_ready(proc, timeout)
        if endpoint is None:
            raise RuntimeError("minirt up did not become ready:\n" + "".join(lines))
        yield Runtime(run_dir, proc, endpoint)
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        if proc.stdout is not None:
            proc.stdout.close()
