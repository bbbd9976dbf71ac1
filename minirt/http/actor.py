"""The ``http`` actor: the OpenAI-compatible HTTP server, a process next to the front door.

It serves the Starlette app under hypercorn's trio worker with the limits of ``serving``, talks to the front door over one
ZeroMQ client connection, and has an inbox of its own that answers pings (``minirt ping http``,
the supervisor's readiness check: ready once it listens and the front door welcomed it).
"""

from __future__ import annotations

import ipaddress
from functools import partial
from typing import Any, cast

import trio

from actors.runtime.actor import Actor
from actors.runtime.config import HttpConfig, RuntimeConfig
from messages.common import Hello, Ping
from minirt.http.app import ACTORS, Server, build_app
from minirt.http.metrics import scheduler_text
from minirt.http.model import ModelInfo
from minirt.http.serving import hypercorn_config, serve
from minirt.http.upstream import Upstream


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def check_bind(settings: HttpConfig, allow_remote: bool) -> None:
    """A non-loopback address needs ``--allow-remote`` and an API key."""
    if is_loopback(settings.host):
        return
    if not allow_remote or not settings.api_key:
        raise ValueError(
            f"http: refusing to serve on {settings.host!r}: a non-loopback host needs "
            "--allow-remote and --api-key"
        )


class HttpActor(Actor):
    name = "http"
    inbound = Hello | Ping
    peers = ()

    def __init__(self, cfg: RuntimeConfig) -> None:
        super().__init__(cfg)
        self.settings = cfg.http
        check_bind(self.settings, cfg.security.allow_remote)
        self.model = ModelInfo.load(
            cfg.model, self.settings.served_model_name, cfg.max_model_len, cfg.lora.enable_lora
        )
        self.upstream = Upstream(cfg.endpoints.client, cfg.security.curve_dir, self.log)
        self.url = ""

    async def start_tasks(self, nursery: trio.Nursery) -> None:
        server = Server(
            model=self.model,
            upstream=self.upstream,
            endpoints={n: self.cfg.endpoints.of(n) for n in ACTORS},
            log=self.log,
            curve=self.curve,
            api_key=self.settings.api_key,
            runtime_metrics=self.runtime_metrics,
            run_dir=self.cfg.run_dir,
            body_timeout_s=self.settings.body_timeout_s,
            responses_max_count=self.settings.responses_max_count,
            responses_max_bytes=self.settings.responses_max_bytes,
            runner=self.cfg.runner,
            pooler=self.cfg.pooler(),
        )
        nursery.start_soon(self.upstream.run)
        app = cast(Any, build_app(server))
        try:
            binds = await nursery.start(partial(serve, app, self.settings))
        except OSError as e:  # the port is taken, say: say so plainly and stop
            where = hypercorn_config(self.settings).bind[0]
            self.log.error("http.listen_failed", address=where, error=str(e))
            raise SystemExit(f"http: cannot listen on {where}: {e} (see --http-port)") from None
        self.url = binds[0]
        self.log.info(
            "http.listening",
            url=self.url,
            model=self.model.served_name,
            auth=bool(self.settings.api_key),
        )

    async def runtime_metrics(self) -> bytes:
        """The scheduler's Prometheus text (``minirt:*`` and ``vllm:*`` names)."""
        return await scheduler_text(self.cfg.endpoints.of("scheduler"), self.curve)

    def is_ready(self) -> bool:
        return bool(self.url) and self.upstream.client is not None and self.upstream.alive

    def handle(self, ident: bytes, msg: Any) -> None:
        """Only pings and hellos come here; the base class answers both."""
