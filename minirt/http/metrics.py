"""``GET /metrics``: the runtime's Prometheus metrics plus the HTTP server's own.

The runtime-wide ones (``minirt:*`` and the ``vllm:*`` names that routers and benchmark tools
read: running/waiting requests, KV usage, prefix-cache token counters, TTFT/TPOT/e2e histograms)
are the scheduler's, fetched from it at scrape time, so requests from every client count. The
HTTP server adds request counts by endpoint and status, durations, requests in flight and
disconnects.
"""

from __future__ import annotations

from typing import Any

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    disable_created_metrics,
    generate_latest,
)

_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)


class HttpMetrics:
    def __init__(self) -> None:
        disable_created_metrics()  # no ``*_created`` series (this process has only these)
        r = self.registry = CollectorRegistry()
        self.requests = Counter(
            "minirt:http_requests", "HTTP requests answered", ["endpoint", "status"], registry=r
        )
        self.duration = Histogram(
            "minirt:http_request_duration_seconds",
            "HTTP request duration, arrival to the last byte",
            ["endpoint"],
            buckets=_BUCKETS,
            registry=r,
        )
        self.in_flight = Gauge("minirt:http_requests_in_flight", "HTTP requests open", registry=r)
        self.disconnects = Counter(
            "minirt:http_disconnects", "Requests whose client went away before the end", registry=r
        )

    def observe(self, endpoint: str, status: int, duration: float, disconnected: bool) -> None:
        self.requests.labels(endpoint=endpoint, status=str(status)).inc()
        self.duration.labels(endpoint=endpoint).observe(duration)
        if disconnected:
            self.disconnects.inc()

    def render(self) -> bytes:
        return bytes(generate_latest(self.registry))


async def scheduler_text(endpoint: str, curve: Any = None, timeout: float = 2.0) -> bytes:
    """The scheduler's metrics (``metrics`` query, answered with ``metrics_text``); empty when
    it does not answer in time."""
    import trio
    import zmq

    from actors.runtime.transport import open_socket
    from messages.codec import BadFrame, Decoder, encode
    from messages.scheduler import MetricsQuery, MetricsText

    sock = open_socket(zmq.Context.instance(), zmq.DEALER, connect=[endpoint], curve=curve)
    decoder: Decoder[MetricsText] = Decoder(MetricsText)
    try:
        with trio.move_on_after(timeout):
            await sock.send([encode(MetricsQuery())])
            while True:
                frames = await sock.recv()
                try:
                    return decoder.decode(frames[-1]).text.encode()
                except BadFrame:
                    continue  # not the answer (a hello ack, say)
        return b""
    finally:
        sock.close()
