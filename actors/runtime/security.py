"""Security defaults: loopback or ipc:// endpoints unless told otherwise, and CURVE when not.

- Every endpoint binds to ipc:// or a loopback tcp address by default. Binding any other address
  needs ``allow_remote`` *and* CURVE keys (``curve_dir``); otherwise the actor refuses to start.
- With ``curve_dir`` set, every socket uses ZeroMQ CURVE (encryption + authentication): servers
  (ROUTER inboxes, the client endpoint) hold the server key pair and accept only clients whose
  public key is in ``curve_dir/authorized/``; clients (actors' DEALERs, ``minirt`` clients) hold
  a client key pair and the server's public key. ``minirt keys DIR`` makes all of them.
- No pickle anywhere: every frame is msgpack decoded into a typed struct.
"""

from __future__ import annotations

import ipaddress
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import zmq
import zmq.auth
from zmq.auth.thread import ThreadAuthenticator


class InsecureBind(ValueError):
    """Refused to bind a non-loopback address without ``allow_remote`` and CURVE."""


def is_local(endpoint: str) -> bool:
    """ipc:// or tcp to a loopback address."""
    if endpoint.startswith("ipc://"):
        return True
    if not endpoint.startswith("tcp://"):
        return False
    host = urlsplit(endpoint).hostname or ""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # "*", an interface name or a DNS name: not provably local


def check_bind(endpoint: str, allow_remote: bool, curve: bool) -> None:
    if is_local(endpoint):
        return
    if not allow_remote:
        raise InsecureBind(
            f"refusing to bind {endpoint}: not loopback or ipc://; pass "
            "--allow-remote (and --curve-dir from `minirt keys`) to serve remote peers"
        )
    if not curve:
        raise InsecureBind(
            f"refusing to bind {endpoint} without CURVE authentication; "
            "make keys with `minirt keys DIR` and pass --curve-dir DIR"
        )


@dataclass(frozen=True)
class CurveKeys:
    server_public: bytes
    server_secret: bytes | None
    client_public: bytes
    client_secret: bytes
    authorized: Path

    @classmethod
    def load(cls, directory: str | Path, client: str = "client") -> CurveKeys:
        d = Path(directory)
        spub, ssec = _load_pair(d, "server")
        cpub, csec = _load_pair(d, client)
        if csec is None:
            raise FileNotFoundError(f"{d}/{client}.key_secret missing: not a client key pair")
        return cls(spub, ssec, cpub, csec, d / "authorized")

    def server(self, sock: zmq.Socket[Any]) -> None:
        if self.server_secret is None:
            raise FileNotFoundError("server.key_secret missing: this key dir is client-only")
        sock.curve_server = True
        sock.curve_publickey = self.server_public
        sock.curve_secretkey = self.server_secret

    def client(self, sock: zmq.Socket[Any]) -> None:
        sock.curve_serverkey = self.server_public
        sock.curve_publickey = self.client_public
        sock.curve_secretkey = self.client_secret


def _load_pair(d: Path, name: str) -> tuple[bytes, bytes | None]:
    secret = d / f"{name}.key_secret"
    pub, sec = zmq.auth.load_certificate(secret if secret.exists() else d / f"{name}.key")
    return pub, sec


def start_authenticator(ctx: zmq.Context[Any], keys: CurveKeys) -> ThreadAuthenticator:
    """ZAP handler (a thread) that admits only the public keys in ``authorized/``."""
    auth = ThreadAuthenticator(ctx)
    auth.start()
    auth.configure_curve(domain="*", location=str(keys.authorized))
    return auth


def make_keys(directory: str | Path, clients: tuple[str, ...] = ("client",)) -> list[Path]:
    """Create the server key pair (if missing) and client key pairs, authorizing the clients."""
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    (d / "authorized").mkdir(exist_ok=True)
    made = []
    if not (d / "server.key_secret").exists():
        zmq.auth.create_certificates(d, "server")
        made.append(d / "server.key")
    for name in clients:
        pub, _ = zmq.auth.create_certificates(d, name)
        shutil.copy(pub, d / "authorized" / f"{name}.key")
        made.append(Path(pub))
    for secret in d.glob("*.key_secret"):
        secret.chmod(0o600)
    return made
