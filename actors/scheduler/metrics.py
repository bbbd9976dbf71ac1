"""Prometheus metrics of the runtime, served by the scheduler on ``127.0.0.1:metrics_port``.

Names follow vLLM's (``vllm:`` becomes ``minirt:``): request counters by finish reason, queue
length, running requests, KV usage, prefix-cache hits, preemptions, token counters and histograms
of time to first token, time per output token, queue time and end-to-end latency. Gauges are
read from the scheduler's state at scrape time; the rest is fed by protocol messages.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import trio
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from messages.scheduler import AdmitResult, Completed, RequestDone

_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
_TPOT_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0)


class Metrics:
    def __init__(
        self,
        waiting: Callable[[], float],
        running: Callable[[], float],
        preemptions: Callable[[], float],
    ) -> None:
        r = self.registry = CollectorRegistry()
        Gauge(
            "minirt:num_requests_waiting", "Requests waiting for admission", registry=r
        ).set_function(waiting)
        Gauge("minirt:num_requests_running", "Requests holding KV blocks", registry=r).set_function(
            running
        )
        self.kv_usage = Gauge(
            "minirt:kv_cache_usage_perc",
            "Fraction of KV blocks used by running requests",
            registry=r,
        )
        self.prefix_hit_rate = Gauge(
            "minirt:prefix_cache_hit_rate", "Cached prompt tokens / prompt tokens", registry=r
        )
        preempt = Counter("minirt:num_preemptions", "Requests preempted", registry=r)
        self._preempt_seen = 0.0
        self._preempt_src = preemptions
        self._preempt = preempt
        self.success = Counter(
            "minirt:request_success", "Finished requests", ["finished_reason"], registry=r
        )
        self.prompt_tokens = Counter("minirt:prompt_tokens", "Prompt tokens processed", registry=r)
        self.generation_tokens = Counter("minirt:generation_tokens", "Tokens generated", registry=r)
        self.prefix_hits = Counter(
            "minirt:prefix_cache_hits", "Prompt tokens served from the prefix cache", registry=r
        )
        self.prefix_queries = Counter(
            "minirt:prefix_cache_queries", "Prompt tokens looked up in the prefix cache", registry=r
        )
        self.disk_bytes = Gauge(
            "minirt:kv_disk_bytes",
            "Bytes of the prefix cache's disk tier (--kv-disk-dir), writes in flight included",
            registry=r,
        )
        # hits by tier: the pool's and the disk tier's (--kv-disk-dir) prompt tokens, at admission
        self.tier_hits = Counter(
            "minirt:prefix_cache_hits_by_tier",
            "Prompt tokens found cached at admission, by tier (pool, disk)",
            ["tier"],
            registry=r,
        )
        # speculative decoding, vLLM V1's counters (counted when a request leaves the executor)
        self.spec_drafts = Counter(
            "minirt:spec_decode_num_drafts", "Steps in which a request verified drafts", registry=r
        )
        self.spec_draft_tokens = Counter(
            "minirt:spec_decode_num_draft_tokens", "Draft tokens verified", registry=r
        )
        self.spec_accepted = Counter(
            "minirt:spec_decode_num_accepted_tokens", "Draft tokens accepted", registry=r
        )
        self.ttft = Histogram(
            "minirt:time_to_first_token_seconds",
            "Time to first token",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.tpot = Histogram(
            "minirt:time_per_output_token_seconds",
            "Time per output token",
            buckets=_TPOT_BUCKETS,
            registry=r,
        )
        self.queue = Histogram(
            "minirt:request_queue_time_seconds",
            "Time waiting for admission",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.e2e = Histogram(
            "minirt:e2e_request_latency_seconds",
            "End-to-end request latency",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )

    def admitted(self, msg: AdmitResult, block_size: int) -> None:
        disk = len(msg.load_keys) * block_size
        self.tier_hits.labels(tier="pool").inc(msg.cached_tokens - disk)
        self.tier_hits.labels(tier="disk").inc(disk)

    def done(self, msg: RequestDone) -> None:
        """An attempt ended at the executor: its speculative decoding, counted."""
        if msg.spec_drafts:
            self.spec_drafts.inc(msg.spec_drafts)
            self.spec_draft_tokens.inc(msg.spec_draft_tokens)
            self.spec_accepted.inc(msg.spec_accepted)

    def completed(self, msg: Completed) -> None:
        self.success.labels(finished_reason=msg.finish_reason).inc()
        self.prompt_tokens.inc(msg.prompt_tokens)
        self.generation_tokens.inc(msg.completion_tokens)
        self.prefix_hits.inc(msg.cached_tokens)
        self.prefix_queries.inc(msg.prompt_tokens)
        q = self.prefix_queries._value.get()
        self.prefix_hit_rate.set(self.prefix_hits._value.get() / q if q else 0.0)
        if msg.completion_tokens:
            self.ttft.observe(msg.ttft_s)
            self.queue.observe(msg.queue_s)
            self.e2e.observe(msg.e2e_s)
        if msg.completion_tokens > 1:
            self.tpot.observe(msg.tpot_s)

    def kv(self, in_use: int, num_blocks: int) -> None:
        if num_blocks:
            self.kv_usage.set(in_use / num_blocks)

    def disk(self, nbytes: int) -> None:
        self.disk_bytes.set(nbytes)

    def render(self) -> bytes:
        now = self._preempt_src()
        if now > self._preempt_seen:
            self._preempt.inc(now - self._preempt_seen)
            self._preempt_seen = now
        text = bytes(generate_latest(self.registry))
        # and again under vLLM's own names, which routers and benchmark clients read
        return text + text.replace(b"minirt:", b"vllm:")


async def serve_metrics(
    metrics: Metrics, port: int, log: Any, task_status: Any = trio.TASK_STATUS_IGNORED
) -> None:
    """A minimal HTTP/1.1 server: ``GET /metrics`` answers the Prometheus text format."""

    async def handle(stream: trio.SocketStream) -> None:
        try:
            data = b""
            with trio.move_on_after(5):
                while b"\r\n\r\n" not in data and len(data) < 8192:
                    chunk = await stream.receive_some(4096)
                    if not chunk:
                        break
                    data += chunk
            line = data.split(b"\r\n", 1)[0].split()
            if len(line) >= 2 and line[0] == b"GET" and line[1].split(b"?")[0] == b"/metrics":
                body, status = metrics.render(), b"200 OK"
                ctype = b"text/plain; version=0.0.4; charset=utf-8"
            else:
                body, status, ctype = (
                    b"not found: try GET /metrics\n",
                    b"404 Not Found",
                    b"text/plain",
                )
            head = (
                b"HTTP/1.1 "
                + status
                + b"\r\nContent-Type: "
                + ctype
                + b"\r\nContent-Length: "
                + str(len(body)).encode()
                + b"\r\nConnection: close\r\n\r\n"
            )
            await stream.send_all(head + body)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            pass
        finally:
            await stream.aclose()

    listeners = await trio.open_tcp_listeners(port, host="127.0.0.1")
    bound = listeners[0].socket.getsockname()[1]
    log.info("metrics.listening", url=f"http://127.0.0.1:{bound}/metrics")
    task_status.started(bound)
    await trio.serve_listeners(handle, listeners)
