"""A minirt instance is a worker that sglang-router accepts: each probe the router sends (listed,
with evidence, in docs/scale-out.md) gets the answer the router needs. The probes are replayed
here with an HTTP client (no router needed); then, where the router is installed, the router
itself registers the instance and serves through it, and the instance's events show every probe
answered without an error.
"""

from __future__ import annotations

import os
import socket

import h2.connection
import h2.events
import httpx
import pytest

from benchmarks.scale_out import free_port
from minirt.launch.router import RouterMissing, RouterSpec, find_router, running_router
from tests.support.runtime import start_runtime

KEY = "router-test-key"


@pytest.fixture(scope="module")
def worker(tiny_model, tmp_path_factory):
    port = free_port()
    run = tmp_path_factory.mktemp("worker")
    flags = ["--http-port", str(port), "--api-key", KEY, "--served-model-name", "tiny"]
    with start_runtime(tiny_model, run, *flags, timeout=180) as rt:
        yield rt, f"http://127.0.0.1:{port}", port


def _client(**kw) -> httpx.Client:
    return httpx.Client(trust_env=False, timeout=30, **kw)


def test_health_needs_no_key_everything_else_does(worker):
    _, url, _ = worker
    with _client() as c:
        assert c.get(f"{url}/health").status_code == 200  # the router's first probe: no key
        for path in ("/v1/models", "/metrics", "/server_info"):
            r = c.get(f"{url}{path}")
            assert r.status_code == 401, path
            assert r.json()["error"]["code"] == "invalid_api_key"
        auth = {"Authorization": f"Bearer {KEY}"}
        assert c.get(f"{url}/v1/models", headers=auth).json()["data"][0]["id"] == "tiny"


def test_info_probes_answer_json_or_a_clean_404(worker):
    _, url, _ = worker
    with _client(headers={"Authorization": f"Bearer {KEY}"}) as c:
        info = c.get(f"{url}/server_info")  # the router takes the served model name from here
        assert info.status_code == 200 and info.json()["served_model_name"] == "tiny"
        for path in ("/get_server_info", "/model_info", "/get_model_info"):
            r = c.get(f"{url}{path}")
            assert r.status_code == 404, (path, r.status_code)
            assert r.json()["error"]["code"] == "not_found"  # JSON, not a page or a traceback


def _grpc_probe(port: int) -> str | None:
    """What sglang-router sends on a worker's port: HTTP/2 prior knowledge, a gRPC health check
    with a request body (a DATA frame). The response's status, or None if the server closed the
    connection."""
    conn = h2.connection.H2Connection()
    conn.initiate_connection()
    path = "/sglang.grpc.scheduler.SglangScheduler/HealthCheck"
    headers = [
        (":method", "POST"),
        (":scheme", "http"),
        (":authority", f"127.0.0.1:{port}"),
        (":path", path),
        ("te", "trailers"),
        ("content-type", "application/grpc"),
    ]
    conn.send_headers(1, headers)
    conn.send_data(1, b"\x00\x00\x00\x00\x00", end_stream=True)  # an empty gRPC message
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        try:
            s.sendall(conn.data_to_send())
            while data := s.recv(65536):
                for ev in conn.receive_data(data):
                    if isinstance(ev, h2.events.ResponseReceived):
                        assert b"grpc-status" not in dict(ev.headers)
                        return dict(ev.headers)[b":status"].decode()
                s.sendall(conn.data_to_send())
        except (BrokenPipeError, ConnectionResetError):
            pass
    return None


def test_the_routers_grpc_probe_over_http2_is_refused_and_http1_still_serves(worker):
    """A failed gRPC probe makes the router talk HTTP/1.1; the probe must not hurt the server
    (hypercorn's HTTP/2 code stopped the whole server on this probe, now and then)."""
    rt, url, port = worker
    http_starts = len([e for e in rt.events("actor.started") if e.get("actor") == "http"])
    for _ in range(20):
        assert _grpc_probe(port) is None  # the connection is closed, unanswered
    body = {"model": "tiny", "prompt": "hello", "max_tokens": 3}
    with _client() as c:
        r = c.post(f"{url}/v1/completions", json=body, headers={"Authorization": f"Bearer {KEY}"})
        assert r.status_code == 200, r.text
    assert len([e for e in rt.events("actor.started") if e.get("actor") == "http"]) == http_starts
    assert not [e for e in rt.events("http.request") if "grpc" in e.get("path", "")]


def test_the_fields_the_router_adds_are_accepted(worker):
    _, url, _ = worker
    added = {
        "stream": False,
        "echo": False,
        "no_stop_trim": False,
        "ignore_eos": False,
        "skip_special_tokens": True,
        "return_hidden_states": False,
    }
    chat_added = {
        "logprobs": False,
        "continue_final_message": False,
        "separate_reasoning": True,
        "stream_reasoning": True,
        "return_hidden_states": False,
        "no_stop_trim": False,
        "ignore_eos": False,
        "skip_special_tokens": True,
        "stream": False,
    }
    with _client(headers={"Authorization": f"Bearer {KEY}"}) as c:
        r = c.post(
            f"{url}/v1/completions",
            json={"model": "tiny", "prompt": "hello", "max_tokens": 3, **added},
        )
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] >= 1
        messages = [{"role": "user", "content": "hi"}]
        r = c.post(
            f"{url}/v1/chat/completions",
            json={"model": "tiny", "messages": messages, "max_completion_tokens": 3, **chat_added},
        )
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["message"]["role"] == "assistant"


def test_the_router_registers_the_worker_and_serves_through_it(worker):
    try:
        find_router()
    except RouterMissing as e:
        if os.environ.get("CI") == "true":
            raise
        pytest.skip(str(e))
    rt, url, _ = worker
    spec = RouterSpec([url], port=free_port(), metrics_port=free_port(), api_key=KEY)
    # a new connection per request: the router may close a kept-alive one between requests
    # (seen after its 401: "Server disconnected without sending a response" on the next)
    fresh = httpx.Limits(max_keepalive_connections=0)
    with running_router(spec, rt.run_dir / "logs" / "router.log"), _client(limits=fresh) as c:
        auth = {"Authorization": f"Bearer {KEY}", "X-Request-Id": "via-router-1"}
        body = {"model": "tiny", "prompt": "hello there", "max_tokens": 4}
        r = c.post(f"{spec.url}/v1/completions", json=body, headers=auth)
        assert r.status_code == 200, r.text
        assert c.post(f"{spec.url}/v1/completions", json=body).status_code == 401
        models = c.get(f"{spec.url}/v1/models", headers=auth).json()
        assert [m["id"] for m in models["data"]] == ["tiny"]  # from the worker's /server_info
    seen = [e for e in rt.events() if e.get("event") == "http.response"]
    paths = {e["path"]: e["status"] for e in seen}
    assert paths.get("/health") == 200, paths
    assert not rt.events("http.error"), rt.events("http.error")
    assert any(e.get("request_id") == "via-router-1" and e["status"] == 200 for e in seen)
    print("router probes answered:", sorted(paths.items()), "router models:", models)
