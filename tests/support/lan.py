"""Hosts on one LAN, for real on one machine: each host is a network namespace plus a PID
namespace (so ``ray stop`` in a host stops only that host's processes, as on a real machine),
all on one bridge that lives in a namespace of its own (nothing in the root namespace's
firewall or sysctls is involved); the root namespace (the test) gets an address on it too.

    root 10.201.N.1 ──┐
    host-0 10.201.N.10 ┼── bridge (in its own namespace)
    host-1 10.201.N.11 ┤
    ...                ┘

A host's PID 1 is a small reaper (so processes killed there leave no zombies); killing it ends
every process of the host. Everything made here (namespaces, links, processes) is removed on
exit, also when the test fails.
"""

from __future__ import annotations

import itertools
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

# PID 1 of a host: reaps orphans (what a host's init does), exits on SIGTERM.
_INIT = (
    "import os, signal, time\n"
    "signal.signal(signal.SIGTERM, lambda *_: os._exit(0))\n"
    "while True:\n"
    "    try:\n"
    "        os.wait()\n"
    "    except ChildProcessError:\n"
    "        time.sleep(0.2)\n"
)


@dataclass
class Host:
    name: str  # its network namespace
    addr: str
    init: subprocess.Popen[bytes]  # `unshare`, whose child is the host's PID 1
    pid1: int  # that PID 1, as the root namespace numbers it

    def cmd(self, argv: list[str], cwd: str | None = None) -> list[str]:
        """``argv`` run on this host (its network, PID and mount namespaces)."""
        wd = [f"--wd={cwd or os.getcwd()}"]
        return ["nsenter", "-t", str(self.pid1), "-n", "-p", "-m", *wd, *argv]

    def pids(self) -> set[int]:
        """The processes running on this host (root-namespace pids)."""
        mine = os.readlink(f"/proc/{self.pid1}/ns/pid")
        out = set()
        for d in Path("/proc").iterdir():
            if d.name.isdigit():
                try:
                    if os.readlink(d / "ns" / "pid") == mine:
                        out.add(int(d.name))
                except OSError:
                    pass
        return out


@dataclass
class Lan:
    hosts: list[Host]
    gateway: str  # the root namespace's address on the LAN
    prefix: str  # "10.201.N"


def _ip(*args: str, ns: str | None = None) -> None:
    cmd = ["ip", *(["-n", ns] if ns else []), *args]
    subprocess.run(cmd, check=True, capture_output=True, text=True, timeout=20)


def _child_of(pid: int, timeout: float = 10.0) -> int:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            kids = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
        except FileNotFoundError:
            kids = []
        if kids:
            return int(kids[0])
        time.sleep(0.05)
    raise RuntimeError(f"process {pid} started no PID 1")


_made = itertools.count()


@contextmanager
def lan(n: int) -> Iterator[Lan]:
    """``n`` hosts on one bridge; all removed on exit."""
    k = next(_made)
    tag = f"{(os.getpid() * 4 + k) % 10000:04d}"
    prefix = f"10.201.{(os.getpid() + k) % 250}"
    sw, root = f"mrl{tag}sw", f"mrl{tag}r"
    names = [f"mrl{tag}h{i}" for i in range(n)]
    made: list[str] = []
    hosts: list[Host] = []
    try:
        _ip("netns", "add", sw)
        made.append(sw)
        _ip("link", "add", "br0", "type", "bridge", ns=sw)
        _ip("link", "set", "br0", "up", ns=sw)
        _ip("link", "add", root, "type", "veth", "peer", "name", "up0", "netns", sw)
        _ip("addr", "add", f"{prefix}.1/24", "dev", root)
        _ip("link", "set", root, "up")
        for i, ns in enumerate(["", *names]):
            port = f"p{i}"
            if ns:
                _ip("netns", "add", ns)
                made.append(ns)
                _ip("link", "set", "lo", "up", ns=ns)
                _ip("link", "add", "eth0", "netns", ns, "type", "veth", "peer", "name", port, ns=sw)
                _ip("addr", "add", f"{prefix}.{10 + i - 1}/24", "dev", "eth0", ns=ns)
                _ip("link", "set", "eth0", "up", ns=ns)
            else:
                _ip("link", "set", "up0", "name", port, ns=sw)
            _ip("link", "set", port, "master", "br0", ns=sw)
            _ip("link", "set", port, "up", ns=sw)
        for i, ns in enumerate(names):
            init = subprocess.Popen(
                ["ip", "netns", "exec", ns, "unshare", "--pid", "--fork", "--mount-proc"]
                + ["--kill-child", sys.executable, "-c", _INIT],
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )
            hosts.append(Host(ns, f"{prefix}.{10 + i}", init, _child_of(init.pid)))
        yield Lan(hosts, f"{prefix}.1", prefix)
    finally:
        for h in hosts:  # PID 1 gone: the kernel kills every process of the host
            try:
                os.kill(h.pid1, 9)
            except ProcessLookupError:
                pass
            h.init.wait(timeout=20)
        subprocess.run(["ip", "link", "del", root], capture_output=True, timeout=20)
        for ns in made:  # deleting a namespace deletes the veth ends inside it
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=20)
