"""The dashboard's server side: API key on every route, the event-log tail behind the SSE stream,
the stream itself over a real hypercorn (trio) server, and the static export."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
import trio
from starlette.applications import Starlette
from starlette.testclient import TestClient

from minirt.http.dashboard.export import SCRIPTS, export_html, render_html, request_window
from minirt.http.dashboard.page import (
    COOKIE,
    MAX_STREAMS,
    STREAMS,
    cookie_token,
    dashboard_routes,
    serve,
)
from minirt.http.dashboard.tail import LogTail
from tests.support.runtime import wait_until


def _line(**e) -> str:
    return json.dumps(e) + "\n"


@pytest.fixture
def run_dir(tmp_path: Path) -> Path:
    (tmp_path / "events").mkdir()
    (tmp_path / "events" / "scheduler.jsonl").write_text(
        _line(ts=1.0, actor="scheduler", event="scheduler.config", policy="fcfs")
        + _line(ts=2.0, actor="scheduler", event="request.queued", request_id="a@c1")
    )
    return tmp_path


def _client(run_dir: Path, key: str | None) -> TestClient:
    return TestClient(Starlette(routes=dashboard_routes(run_dir, key)), follow_redirects=False)


def test_every_route_needs_the_key_when_one_is_set(run_dir):
    c = _client(run_dir, "sekret")
    for path in ("/dashboard", "/dashboard/static/dashboard.js", "/dashboard/events"):
        r = c.get(path)
        assert r.status_code == 401, path
        assert r.headers["www-authenticate"] == "Bearer"
        r = c.get(path, headers={"Authorization": "Bearer wrong"})
        assert r.status_code == 401, path
    assert c.get("/dashboard/events").json()["error"]["code"] == "invalid_api_key"
    assert "?key=" in c.get("/dashboard").text  # the browser is told how to get in
    # ?key= sets the cookie (not the key itself) and drops the key from the address
    r = c.get("/dashboard?key=sekret&window_s=30")
    assert r.status_code == 303
    assert r.headers["location"].endswith("/dashboard?window_s=30")
    cookie = r.headers["set-cookie"]
    assert f"{COOKIE}={cookie_token('sekret')}" in cookie and "sekret;" not in cookie
    assert "HttpOnly" in cookie and "samesite=strict" in cookie.lower()
    assert "Path=/dashboard" in cookie
    c.cookies.set(COOKIE, cookie_token("sekret"))
    assert c.get("/dashboard").status_code == 200
    assert c.get("/dashboard/static/state.js").status_code == 200
    c.cookies.set(COOKIE, cookie_token("other"))
    assert c.get("/dashboard/static/state.js").status_code == 401
    c.cookies.clear()
    # a Bearer header works too, and the page then sets the cookie for its EventSource
    r = c.get("/dashboard", headers={"Authorization": "Bearer sekret"})
    assert r.status_code == 200 and COOKIE in r.headers["set-cookie"]


def test_open_server_serves_page_files_and_nothing_else(run_dir):
    c = _client(run_dir, None)
    r = c.get("/")
    assert r.status_code == 307 and r.headers["location"] == "dashboard"
    page = c.get("/dashboard")
    assert page.status_code == 200 and "<title>minirt" in page.text
    assert "default-src 'self'" in page.headers["content-security-policy"]
    for name in (*SCRIPTS, "dashboard.css"):
        assert f"dashboard/static/{name}" in page.text
        assert c.get(f"/dashboard/static/{name}").status_code == 200
    assert c.get("/dashboard/static/nope.js").status_code == 404
    assert c.get("/dashboard/static/..%2Fdashboard.py").status_code == 404
    # the page loads nothing from elsewhere
    assert "http://" not in page.text and "https://" not in page.text


def test_tail_passes_complete_lines_only_and_follows_files(tmp_path):
    ev = tmp_path / "events"
    ev.mkdir()
    f = ev / "kv_manager.jsonl"
    f.write_text('{"event": "kv.config", "ts": 1}\n{"event": "kv.allo')
    tail = LogTail(tmp_path)
    assert tail.backlog() == [("events/kv_manager.jsonl", ['{"event": "kv.config", "ts": 1}'])]
    assert tail.poll() == []  # the torn line waits for its newline
    with f.open("a") as out:
        out.write('cated", "ts": 2}\n')
    assert tail.poll() == [("events/kv_manager.jsonl", ['{"event": "kv.allocated", "ts": 2}'])]
    assert tail.poll() == []
    # a replica's log (minirt up --replicas layout) appears while following
    (tmp_path / "replica-1" / "events").mkdir(parents=True)
    (tmp_path / "replica-1" / "events" / "scheduler.jsonl").write_text('{"ts": 3}\n')
    assert tail.poll() == [("replica-1/events/scheduler.jsonl", ['{"ts": 3}'])]
    # a new run in the same directory: the shrunk file is read from its start
    f.write_text('{"ts": 9}\n')
    assert tail.poll() == [("events/kv_manager.jsonl", ['{"ts": 9}'])]


def test_tail_backlog_window_keeps_config_events_and_chunks_are_bounded(tmp_path):
    ev = tmp_path / "events"
    ev.mkdir()
    lines = [json.dumps({"event": "kv.config", "num_blocks": 8})] + [
        json.dumps({"event": "executor.step", "step": i}) for i in range(2000)
    ]
    (ev / "x.jsonl").write_text("\n".join(lines) + "\n")
    tail = LogTail(tmp_path, backlog_bytes=4096, chunk_bytes=1024)
    [(_, got)] = tail.backlog()
    assert got[0] == lines[0]  # older than the window, kept for the pool size
    assert got[-1] == lines[-1] and len(got) < 200
    assert all(json.loads(g) for g in got)  # no torn first line
    with (ev / "x.jsonl").open("a") as out:
        out.write("".join(json.dumps({"event": "e", "i": i}) + "\n" for i in range(500)))
    seen: list[str] = []
    for _ in range(100):
        batch = tail.poll()
        if not batch:
            break
        assert sum(len(s) + 1 for s in batch[0][1]) <= 1024
        seen += batch[0][1]
    assert [json.loads(s)["i"] for s in seen] == list(range(500))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def _sse_messages(lines, want: int) -> list[tuple[str, list[str]]]:
    out: list[tuple[str, list[str]]] = []
    event, data = "", []
    async for line in lines:
        if line.startswith("event: "):
            event = line[7:]
        elif line.startswith("data: "):
            data.append(line[6:])
        elif line == "" and event:
            out.append((event, data))
            event, data = "", []
            if len(out) >= want:
                return out
    return out


async def test_sse_stream_over_hypercorn_sends_backlog_then_new_lines(run_dir):
    port = _free_port()
    async with trio.open_nursery() as nursery:
        with trio.fail_after(20):
            await nursery.start(serve, run_dir, "127.0.0.1", port, "k3y")  # listening
        base = f"http://127.0.0.1:{port}"
        async with httpx.AsyncClient(base_url=base, timeout=10) as http:
            r = await http.get("/dashboard/events")
            assert r.status_code == 401
            http.cookies.set(COOKIE, cookie_token("k3y"))  # what the page's EventSource sends
            async with http.stream("GET", "/dashboard/events") as resp:
                assert resp.status_code == 200
                assert resp.headers["content-type"].startswith("text/event-stream")
                lines = resp.aiter_lines()
                first = await _sse_messages(lines, 3)
                assert [m[0] for m in first] == ["hello", "backlog", "ready"]
                assert json.loads(first[1][1][0]) == {"src": "events/scheduler.jsonl"}
                assert [json.loads(x)["event"] for x in first[1][1][1:]] == [
                    "scheduler.config",
                    "request.queued",
                ]
                with (run_dir / "events" / "kv_manager.jsonl").open("a") as f:
                    f.write(_line(ts=3.0, actor="kv_manager", event="kv.refused", blocks_needed=4))
                more = await _sse_messages(lines, 1)
                while more[0][0] == "tick":
                    more = await _sse_messages(lines, 1)
                assert more[0][0] == "events"
                assert json.loads(more[0][1][1])["blocks_needed"] == 4
                assert STREAMS["open"] == 1
            # the client went away: its stream ends on the server
            await wait_until(lambda: not STREAMS["open"], timeout=10)
        nursery.cancel_scope.cancel()


def test_static_export_embeds_events_safely_and_fetches_nothing(run_dir, tmp_path):
    events = [
        {"ts": 1.0, "actor": "kv_manager", "event": "kv.config", "num_blocks": 8},
        {"ts": 2.0, "actor": "scheduler", "event": "request.queued", "request_id": "x@c"},
        {
            "ts": 3.0,
            "actor": "tokenizer",
            "event": "client.failed",
            "request_id": "x@c",
            "reason": "</script><script>alert(1)</script>",
        },
        {"ts": 4.0, "actor": "scheduler", "event": "request.queued", "request_id": "y@c"},
    ]
    html = render_html(events, "t", focus="x@c")
    assert "</script><script>alert" not in html
    assert "<script src=" not in html and '<link rel="stylesheet"' not in html
    assert "http://" not in html and "https://" not in html
    assert "default-src 'none'" in html
    start = html.index('id="minirt-events">') + len('id="minirt-events">')
    assert json.loads(html[start : html.index("</script>", start)]) == events
    # a request's window: its events, what happened meanwhile, and the config events
    assert [e["ts"] for e in request_window(events, "x")] == [1.0, 2.0, 3.0]
    assert request_window(events, "nobody") == []
    out = tmp_path / "run.html"
    assert export_html(run_dir, out) == 0 and "request.queued" in out.read_text()
    assert export_html(run_dir, tmp_path / "r.html", request_id="nobody") == 1
    assert export_html(tmp_path / "missing", tmp_path / "m.html") == 1


def test_cli_writes_the_export_for_a_run_and_for_a_request(run_dir, tmp_path):
    cli = [sys.executable, "-m", "minirt.cli"]
    out = tmp_path / "all.html"
    done = subprocess.run(
        [*cli, "events", "--run-dir", str(run_dir), "--html", str(out)],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert '"scheduler.config"' in out.read_text()
    one = tmp_path / "a.html"
    done = subprocess.run(
        [*cli, "trace", "a", "--run-dir", str(run_dir), "--html", str(one)],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert '"focus":"a"' in one.read_text()
    done = subprocess.run(
        [*cli, "trace", "nobody", "--run-dir", str(run_dir), "--html", str(one)],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert done.returncode == 1 and "no events for request nobody" in done.stderr


def test_too_many_open_dashboards_are_answered_503(run_dir, monkeypatch):
    monkeypatch.setitem(STREAMS, "open", MAX_STREAMS)
    r = _client(run_dir, None).get("/dashboard/events")
    assert r.status_code == 503 and r.headers["retry-after"] == "5"
    assert r.json()["error"]["code"] == "too_many_dashboards"
