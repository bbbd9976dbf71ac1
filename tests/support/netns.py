"""Two network namespaces standing in for two hosts, made and removed by the test that uses them.

Topology (one /24 of 10.200.0.0/16 per test process, three /30 links, no bridge and no IP
forwarding, so nothing in the root namespace's firewall or sysctls is involved or changed):

    root 10.200.N.1 ── veth ── 10.200.N.2  host_a
    root 10.200.N.5 ── veth ── 10.200.N.6  host_b
    host_a 10.200.N.9 ── veth ── 10.200.N.10 host_b   (host_b reaches 10.200.N.2 over this link)

Every address lives on a veth end the test created; the namespaces and the veth pairs are
deleted on exit, also when the test fails.
"""

from __future__ import annotations

import itertools
import os
import shutil
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass


def unavailable() -> str | None:
    """Why namespaces cannot be made here, or None when they can."""
    if shutil.which("ip") is None:
        return "the `ip` command (iproute2) is not installed"
    if os.geteuid() != 0:
        return "making network namespaces needs root (CAP_NET_ADMIN)"
    return None


@dataclass
class Hosts:
    a: str  # namespace names
    b: str
    a_addr: str  # the address the root namespace (the router) reaches host_a on
    b_addr: str
    root_a: str  # the root namespace's addresses on each link
    root_b: str
    link_a: str  # host_a's and host_b's addresses on their direct link
    link_b: str

    def cmd(self, ns: str, argv: list[str]) -> list[str]:
        """``argv`` run inside namespace ``ns``."""
        return ["ip", "netns", "exec", ns, *argv]


def _ip(*args: str, ns: str | None = None) -> None:
    cmd = ["ip", *(["-n", ns] if ns else []), *args]
    subprocess.run(cmd, check=True, capture_output=True, text=True, timeout=20)


_made = itertools.count()


@contextmanager
def two_hosts() -> Iterator[Hosts]:
    n = next(_made)
    tag = (os.getpid() * 8 + n) % 100000
    net = f"10.200.{100 + (os.getpid() + n) % 150}"
    a, b = f"mrt{tag}a", f"mrt{tag}b"
    links = [
        (f"mrt{tag}ra", f"mrt{tag}ar"),
        (f"mrt{tag}rb", f"mrt{tag}br"),
        (f"mrt{tag}ab", f"mrt{tag}ba"),
    ]
    made: list[str] = []
    try:
        for ns in (a, b):
            _ip("netns", "add", ns)
            made.append(ns)
            _ip("link", "set", "lo", "up", ns=ns)
        (ra, ar), (rb, br), (ab, ba) = links
        _ip("link", "add", ra, "type", "veth", "peer", "name", ar, "netns", a)
        _ip("link", "add", rb, "type", "veth", "peer", "name", br, "netns", b)
        _ip("link", "add", ab, "netns", a, "type", "veth", "peer", "name", ba, "netns", b)
        for dev, addr, ns in (
            (ra, f"{net}.1/30", None),
            (ar, f"{net}.2/30", a),
            (rb, f"{net}.5/30", None),
            (br, f"{net}.6/30", b),
            (ab, f"{net}.9/30", a),
            (ba, f"{net}.10/30", b),
        ):
            _ip("addr", "add", addr, "dev", dev, ns=ns)
            _ip("link", "set", dev, "up", ns=ns)
        # host_b reaches host_a's service address over the direct link, as on a LAN.
        _ip("route", "add", f"{net}.2/32", "via", f"{net}.9", ns=b)
        yield Hosts(a, b, f"{net}.2", f"{net}.6", f"{net}.1", f"{net}.5", f"{net}.9", f"{net}.10")
    finally:
        for dev, _ in links[:2]:
            subprocess.run(["ip", "link", "del", dev], capture_output=True, timeout=20)
        for ns in made:  # deleting a namespace deletes the veth ends inside it
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=20)
