"""The executor's own progress as a clock for tests: its steps counted from its event log, a
process that signals an actor once the log shows a given step, and a Stopper built on it.

A test that acts "N steps into a run" must not count the tokens its clients have read: on a
loaded machine they lag far behind the executor (the tiny model ends a whole workload in well
under a second). The watcher is a process of its own, not a thread of the test (behind the
client's backlog and the GIL a thread read the log so late that the run had ended), and it runs
at real-time priority where the machine allows it, so busy processes beside the runtime cannot
delay its reads; it reads the log each time the executor writes to it (inotify), and reports
the step it acted at."""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import trio

from messages import executor as xm
from tests.support.runtime import query, wait_until

STEP = b'"event": "executor.step"'

WATCH = """\
import ctypes, os, signal, sys, time
path, off, n, step, pid, sig = sys.argv[1], *map(int, sys.argv[2:])
try:  # a sleeper at real-time priority: it costs nothing, and nothing busy can delay it
    os.sched_setscheduler(0, os.SCHED_FIFO, os.sched_param(1))
    prio = "real-time"
except (AttributeError, OSError):
    prio = "normal"
libc = ctypes.CDLL(None, use_errno=True)
changes = libc.inotify_init1(os.O_CLOEXEC)  # woken by each write to the log (IN_MODIFY)
assert changes >= 0 and libc.inotify_add_watch(changes, path.encode(), 0x2) >= 0
print("ready", flush=True)
while True:
    with open(path, "rb") as f:
        f.seek(off)
        chunk = f.read()
    end = chunk.rfind(b"\\n") + 1
    n += chunk[:end].count(b'"event": "executor.step"')
    off += end
    if n >= step:
        break
    os.read(changes, 4096)  # until the executor writes to its log again
os.kill(pid, sig)
print(f"signal {sig} sent at step {n} (target {step}), time {time.time():.3f}, "
      f"{prio} priority, on the log's writes", flush=True)
"""


IN_MODIFY = 0x2


class LogWrites:
    """Wakes a trio task on each write to a file (inotify ``IN_MODIFY``): an actor's event log,
    which it appends to (a restarted actor appends to the same file)."""

    def __init__(self, path: Path) -> None:
        libc = ctypes.CDLL(None, use_errno=True)
        self.fd = libc.inotify_init1(os.O_NONBLOCK | os.O_CLOEXEC)
        if self.fd < 0 or libc.inotify_add_watch(self.fd, str(path).encode(), IN_MODIFY) < 0:
            raise OSError(ctypes.get_errno(), f"cannot watch {path}")

    async def wait(self) -> None:
        """Until the file has been written to since the last wait."""
        await trio.lowlevel.wait_readable(self.fd)
        try:
            while os.read(self.fd, 4096):
                pass
        except BlockingIOError:
            pass

    def close(self) -> None:
        os.close(self.fd)


class Steps:
    """Counts the ``executor.step`` lines of the executor's event log, reading only what is new."""

    def __init__(self, path: Path) -> None:
        self.path, self.offset, self.n = path, 0, 0

    @classmethod
    def of(cls, rt: Any) -> Steps:
        return cls(rt.run_dir / "events" / "executor.jsonl")

    def count(self) -> int:
        with open(self.path, "rb") as f:
            f.seek(self.offset)
            chunk = f.read()
        end = chunk.rfind(b"\n") + 1  # whole lines only
        self.n += chunk[:end].count(STEP)
        self.offset += end
        return self.n

    async def reach(self, n: int) -> int:
        """Wait until the log shows ``n`` steps, woken by the executor's writes to it."""
        writes = LogWrites(self.path)
        try:
            while self.count() < n:
                await writes.wait()
        finally:
            writes.close()
        return self.n

    async def settled(self, rt: Any) -> int:
        """The steps logged once the executor is idle and its log has every step it made (it
        logs a step after sending its tokens: the streams can end before its last steps are
        in the log)."""

        async def idle() -> list[int] | None:  # [n]: truthy even for a fresh executor's 0
            x = await query(rt.actor_endpoint("executor"), xm.Stats(), xm.ExecutorStats)
            n = self.count()
            return [n] if x.running == 0 and n >= x.steps else None

        return (await wait_until(idle, timeout=30))[0]

    def killer(self, step: int, pid: int, sig: int = signal.SIGKILL) -> subprocess.Popen:
        """A process that sends ``sig`` to ``pid`` once the log shows ``step`` steps, says when
        on its stdout, then exits 0 (terminated first, it never sent it); returned once it
        watches."""
        count = self.count()
        args = [str(self.path), str(self.offset), str(count), str(step), str(pid), str(int(sig))]
        proc = subprocess.Popen([sys.executable, "-c", WATCH, *args], stdout=subprocess.PIPE)
        assert proc.stdout is not None and proc.stdout.readline() == b"ready\n"
        return proc


def said(proc: subprocess.Popen) -> tuple[bool, str]:
    """Stop a watcher: whether it sent its signal, and what it said about when."""
    proc.terminate()
    sent = proc.wait() == 0
    assert proc.stdout is not None
    return sent, proc.stdout.read().decode().strip()


class Stopper:
    """The executor stopped (SIGSTOP) once it has made ``steps`` more steps: what a client does
    meanwhile happens while its request is surely in flight, however far a loaded machine makes
    the clients lag behind the runtime. Made by :meth:`start`, which first waits until the
    executor is idle and has logged every step it made (a runtime shared between tests may
    still be logging the steps of the one before, which would count). ``resume()`` lets it run
    on; ``close()`` always does."""

    def __init__(self, rt: Any, log: Steps, steps: int) -> None:
        self.pid = rt.pid_of("executor")
        self.proc = log.killer(log.count() + steps, self.pid, signal.SIGSTOP)

    @classmethod
    async def start(cls, rt: Any, steps: int) -> Stopper:
        log = Steps.of(rt)
        await log.settled(rt)
        return cls(rt, log, steps)

    async def stopped(self) -> None:
        await wait_until(lambda: self.proc.poll() is not None, timeout=30, interval=0.01)

    def resume(self) -> None:
        try:
            os.kill(self.pid, signal.SIGCONT)
        except ProcessLookupError:  # the test killed the executor itself, and it is reaped
            pass

    def close(self) -> None:
        self.proc.terminate()
        self.proc.wait()
        self.resume()
