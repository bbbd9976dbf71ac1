"""The HTTP API's refusals, in OpenAI's error shape, against a real `minirt up` with an API key
and a small scheduler (2 running, 2 waiting); disconnects cancel and free their blocks; a dead
actor gives 503 and /health says which."""

from __future__ import annotations

import os
import signal
import socket
import time

import httpx
import openai
import pytest
import trio

from tests.support.http_server import health, start_http_runtime, wait_healthy
from tests.support.runtime import kv_stats, poll_until, wait_until
from tests.support.steps import Stopper

KEY = "sk-minirt-test"
AUTH = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def server(tiny_model, tmp_path_factory):
    flags = ("--num-blocks", "512", "--max-batch-size", "2", "--max-waiting", "2")
    with start_http_runtime(
        tiny_model, tmp_path_factory.mktemp("http_err"), *flags, api_key=KEY
    ) as h:
        yield h


def post(server, path: str, body, timeout: float = 30) -> httpx.Response:
    if isinstance(body, (bytes, str)):
        return httpx.post(server.url + path, content=body, headers=AUTH, timeout=timeout)
    return httpx.post(server.url + path, json=body, headers=AUTH, timeout=timeout)


CHAT = "/v1/chat/completions"
COMP = "/v1/completions"
MSGS = [{"role": "user", "content": "hi"}]

BAD = [
    (COMP, {"prompt": "x", "temperature": -1}, "temperature", None),
    (COMP, {"prompt": "x", "top_p": 2}, "top_p", None),
    (COMP, {"prompt": "x", "max_tokens": 0}, "max_tokens", None),
    (COMP, {"prompt": "x", "n": 0}, "n", None),
    (COMP, {"prompt": "x", "logprobs": 50}, "logprobs", None),
    (COMP, {"prompt": "x", "seed": -3}, "seed", None),
    (COMP, {"prompt": "x", "presence_penalty": 5}, "presence_penalty", None),
    (COMP, {"prompt": "x", "logit_bias": {"abc": 1}}, "logit_bias", None),
    (COMP, {"prompt": "x", "logit_bias": {"3": 500}}, "logit_bias", None),
    (COMP, {"prompt": "x", "stop": ["s"] * 17}, "stop", None),
    (COMP, {"prompt": "x", "cache_salt": ""}, "cache_salt", None),
    (COMP, {"prompt": "x", "cache_salt": "s" * 257}, "cache_salt", None),
    (COMP, {"prompt": "x", "stop_token_ids": [10**6]}, "stop_token_ids", None),
    (COMP, {"prompt": "x", "stream_options": {"include_usage": True}}, "stream_options", None),
    (COMP, {"prompt": "x", "response_format": {"type": "xml"}}, "response_format.type", None),
    (COMP, {"prompt": "x", "echo": True, "logprobs": 1, "stream": True}, "stream", None),
    (COMP, {"prompt": "x", "prompt_logprobs": 21}, "prompt_logprobs", None),
    (COMP, {"prompt": [1, 2, 10**6]}, "prompt", None),
    # fields OpenAI or vLLM define that this server does not implement: never silently ignored
    (COMP, {"prompt": "x", "use_beam_search": True}, "use_beam_search", None),
    (COMP, {"prompt": "x", "length_penalty": 0.5}, "length_penalty", None),
    (COMP, {"prompt": "x", "skip_special_tokens": False}, "skip_special_tokens", None),
    (COMP, {"prompt": "x", "guided_json": {"type": "object"}}, "guided_json", None),
    (CHAT, {"messages": MSGS, "echo": True}, "echo", None),
    (CHAT, {"messages": MSGS, "store": True}, "store", None),
    (COMP, {"prompt": "x", "allowed_token_ids": [10**6]}, "allowed_token_ids", None),
    (COMP, {"prompt": "x", "allowed_token_ids": "7"}, "allowed_token_ids", None),
    (COMP, {"prompt": "x", "bad_words": ["  "]}, "bad_words", None),
    (COMP, {"prompt": ""}, "prompt", None),
    (COMP, {"prompt": []}, "prompt", None),
    (COMP, {"max_tokens": 3}, "prompt", None),
    (COMP, {"prompt": {"a": 1}}, "prompt", None),
    (COMP, {"prompt": [5] * 2000}, "prompt", "context_length_exceeded"),
    (COMP, {"prompt": [5] * 100, "max_tokens": 1000}, "prompt", "context_length_exceeded"),
    (CHAT, {"messages": MSGS, "temperature": "hot"}, "temperature", None),
    (CHAT, {"messages": []}, "messages", None),
    (CHAT, {"messages": [MSGS[0], {"role": "user", "content": 5}]}, "messages[1].content", None),
    (CHAT, {"messages": [{"role": "wizard", "content": "x"}]}, "messages[0].role", None),
    (CHAT, {"messages": [{"role": "user"}]}, "messages[0].content", None),
    (
        CHAT,
        {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
        "messages[0].content[0].type",
        None,
    ),
    (CHAT, {"messages": MSGS, "top_logprobs": 2}, "top_logprobs", None),
    (
        CHAT,
        {"messages": MSGS, "max_completion_tokens": 5000},
        "messages",
        "context_length_exceeded",
    ),
    (
        CHAT,
        {"messages": [{"role": "user", "content": "x " * 1500}]},
        "messages",
        "context_length_exceeded",
    ),
    (
        CHAT,
        {"messages": MSGS, "response_format": {"type": "json_schema"}},
        "response_format.json_schema.schema",
        None,
    ),
    (CHAT, {"messages": MSGS, "tools": [{"type": "function"}]}, "tools[0].function", None),
]


def test_every_bad_value_is_a_400_naming_the_field(server):
    for path, body, param, code in BAD:
        r = post(server, path, body)
        assert r.status_code == 400, (body, r.text)
        err = r.json()["error"]
        assert err["param"] == param, (body, err)
        assert err["type"] == "invalid_request_error" and err["message"]
        assert err["code"] == code, (body, err)
        assert "Traceback" not in r.text


def test_fields_asking_for_what_the_server_does_anyway_and_unknown_fields_are_accepted(server):
    body = {
        "prompt": "x",
        "max_tokens": 2,
        "use_beam_search": False,
        "skip_special_tokens": True,
        "store": False,
        "stop": None,
        "best_of": 1,
        "some_future_field": {"a": 1},
    }
    r = post(server, COMP, body)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 2


def test_malformed_json_and_wrong_shapes_are_400(server):
    for raw in (b"{not json", b"[1, 2]", b"", b'"text"'):
        r = post(server, COMP, raw)
        assert r.status_code == 400, (raw, r.text)
        assert set(r.json()["error"]) == {"message", "type", "param", "code"}


def test_unknown_model_and_path_are_404(server):
    r = post(server, COMP, {"model": "gpt-4", "prompt": "x"})
    assert r.status_code == 404
    assert r.json()["error"]["param"] == "model"
    assert r.json()["error"]["code"] == "model_not_found"
    r = httpx.get(server.url + "/v1/nothing", headers=AUTH)
    assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error"
    r = httpx.get(server.url + COMP, headers=AUTH)  # wrong method
    assert r.status_code == 405 and "error" in r.json()


def test_unknown_fields_clients_send_are_ignored(server):
    body = {
        "model": str(server.model),
        "prompt": "hello",
        "max_tokens": 2,
        "best_of": 1,
        "stop": None,
        "user": "u-1",
        "some_new_field": {"x": 1},
        "suffix": None,
    }
    r = post(server, COMP, body)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] >= 1


def test_a_body_declared_over_32_mib_is_refused_413_before_it_is_sent(server):
    """The limit holds while the body is read: a client that announces 40 MB gets 413 at once,
    nothing of its body buffered (it has sent none)."""
    host, port = server.url.removeprefix("http://").rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=30) as s:
        s.sendall(
            f"POST {COMP} HTTP/1.1\r\nHost: x\r\nAuthorization: {AUTH['Authorization']}\r\n"
            "Content-Type: application/json\r\nContent-Length: 40000000\r\n\r\n{".encode()
        )
        data = b""
        while b"\r\n\r\n" not in data or len(data.partition(b"\r\n\r\n")[2]) < length(data):
            chunk = s.recv(65536)
            if not chunk:
                break
            data += chunk
    answer = data.decode()
    assert answer.startswith("HTTP/1.1 413"), answer[:200]
    assert "request body over 33554432 bytes" in answer


def length(response: bytes) -> int:
    """The Content-Length of an HTTP response's head (0 until it is all there)."""
    head = response.partition(b"\r\n\r\n")[0].decode().lower()
    for line in head.split("\r\n"):
        if line.startswith("content-length:"):
            return int(line.split(":", 1)[1])
    return 0


def test_api_key_is_required_except_for_health(server):
    for method, path in (("POST", COMP), ("GET", "/v1/models"), ("GET", "/metrics")):
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}):
            r = httpx.request(method, server.url + path, headers=headers, json={"prompt": "x"})
            assert r.status_code == 401, (path, headers)
            assert r.json()["error"]["code"] == "invalid_api_key"
    assert httpx.get(server.url + "/health").status_code == 200
    bad = openai.OpenAI(base_url=server.base_url, api_key="nope", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()
    good = openai.OpenAI(base_url=server.base_url, api_key=KEY, max_retries=0)
    assert good.models.list().data[0].id == str(server.model)


async def drained(server) -> bool:
    s = await kv_stats(server.rt)
    return s.in_use == 0 and s.running == 0 and s.check_ok


async def test_overloaded_scheduler_gives_429_with_retry_after(server):
    body = {"prompt": [7, 8, 9], "max_tokens": 400, "ignore_eos": True, "temperature": 0}
    results: list[httpx.Response] = []
    async with httpx.AsyncClient(base_url=server.url, headers=AUTH, timeout=60) as c:

        async def one(stream: bool) -> None:
            results.append(await c.post(COMP, json={**body, "stream": stream}))

        async with trio.open_nursery() as nursery:
            for i in range(10):
                nursery.start_soon(one, i % 2 == 0)
    refused = [r for r in results if r.status_code == 429]
    assert refused, [r.status_code for r in results]
    assert len([r for r in results if r.status_code == 200]) >= 2
    for r in refused:
        assert r.headers["retry-after"] == "1"
        assert r.json()["error"]["code"] == "overloaded"
    await wait_until(lambda: drained(server), timeout=15)


async def test_dropped_connections_cancel_and_free_their_blocks(server):
    body = {"prompt": [5, 6, 7, 8], "max_tokens": 1000, "ignore_eos": True, "temperature": 0}
    async with (
        httpx.AsyncClient(base_url=server.url, headers=AUTH, timeout=60) as c,
        c.stream("POST", COMP, json={**body, "stream": True}) as r,
    ):
        assert r.status_code == 200
        async for _ in r.aiter_bytes():
            break  # one chunk, then hang up
    await wait_until(lambda: drained(server), timeout=15)

    async def admitted() -> bool:
        return (await kv_stats(server.rt)).in_use > 0

    # a plain (non-streamed) request, hung up on while it runs: the executor is stopped
    # (SIGSTOP) meanwhile, so the request cannot end before the client hangs up however fast
    # the model or however loaded the machine (a fixed wait lost that race on CI)
    executor = server.rt.pid_of("executor")
    os.kill(executor, signal.SIGSTOP)
    try:
        async with (
            httpx.AsyncClient(base_url=server.url, headers=AUTH, timeout=60) as c,
            trio.open_nursery() as nursery,
        ):

            async def hang_up_once_admitted() -> None:
                await wait_until(admitted, timeout=15)
                nursery.cancel_scope.cancel()

            nursery.start_soon(hang_up_once_admitted)
            r = await c.post(COMP, json=body)
            pytest.fail(f"the request finished while the executor was stopped: {r.status_code}")
    finally:
        os.kill(executor, signal.SIGCONT)
    rt = server.rt
    await wait_until(
        lambda: len([e for e in rt.events("http.response") if e.get("disconnected")]) >= 2,
        timeout=15,
    )
    gone = [e for e in rt.events("http.response") if e.get("disconnected")]
    assert all(e["completion_tokens"] < 1000 for e in gone)
    await wait_until(lambda: drained(server), timeout=15)


async def test_a_plain_request_whose_client_hangs_up_ends_within_one_step(server):
    """A non-streamed request generating when its client goes away: the executor is stopped
    (SIGSTOP) from a token on until the hang-up has reached it, so the disconnect lands between
    two steps however fast the model; once it runs again, at most the step it was in finishes
    before the request is aborted and its blocks are freed."""
    rt = server.rt
    body = {"prompt": [5, 6, 7], "max_tokens": 1000, "ignore_eos": True, "temperature": 0}
    aborted, sent = len(rt.events("executor.aborted")), len(rt.events("request.aborted"))
    # a watcher process stops the executor 5 steps in, however far a loaded machine makes the
    # test's own reads lag (the tiny model ends 1,000 tokens in well under a second)
    stopper = await Stopper.start(rt, 5)
    try:
        async with (
            httpx.AsyncClient(base_url=server.url, headers=AUTH, timeout=60) as c,
            trio.open_nursery() as nursery,
        ):

            async def hang_up_once_generating() -> None:
                await stopper.stopped()
                nursery.cancel_scope.cancel()

            nursery.start_soon(hang_up_once_generating)
            await c.post(COMP, json=body)
            pytest.fail("the request finished before its client hung up")
        # the hang-up seen by the HTTP server and the abort sent on by the scheduler
        await wait_until(lambda: len(rt.events("request.aborted")) > sent, timeout=15)
    finally:
        resumed = time.time()
        stopper.close()  # the executor runs on
    await wait_until(lambda: len(rt.events("executor.aborted")) > aborted, timeout=15)
    gone = rt.events("executor.aborted")[-1]
    # steps that ended after it ran again, before the abort: the one it was in, and one more
    # at most when the abort still sat in its socket's I/O thread (stopped with it) as that
    # step ended; a request that went on generating would run hundreds
    late = [e for e in rt.events("executor.step") if resumed < e["ts"] < gone["ts"]]
    assert len(late) <= 2, late
    assert gone["reason"] == "cancel" and gone["output_tokens"] < 1000
    await wait_until(lambda: drained(server), timeout=15)


async def test_a_stopped_actor_is_suspect_in_health_not_down_and_its_requests_complete(server):
    """SIGSTOP is what a debugger, a checkpoint or a throttled cgroup does to a process: it does
    not answer, but it lives. /health says so (503: it cannot serve now) and a request sent
    meanwhile completes once it runs again."""
    pid = server.rt.pid_of("executor")
    deaths = len(server.rt.events("peer.dead"))
    os.kill(pid, signal.SIGSTOP)
    answers: list[httpx.Response] = []
    try:
        async with (
            httpx.AsyncClient(base_url=server.url, headers=AUTH, timeout=90) as c,
            trio.open_nursery() as nursery,
        ):

            async def one() -> None:
                body = {"prompt": "x", "max_tokens": 4, "ignore_eos": True}  # all 4, always
                answers.append(await c.post(COMP, json=body))

            nursery.start_soon(one)

            async def suspect() -> dict | None:
                r = await c.get("/health")
                return r.json() if r.status_code == 503 else None

            body = await wait_until(suspect, timeout=15)
            assert body["actors"]["executor"] == {
                "alive": True,
                "ready": False,
                "state": "suspect",
            }, body
            assert "executor (suspect: not answering, process alive)" in body["missing"]
            assert not answers  # it waits
            os.kill(pid, signal.SIGCONT)
    finally:
        os.kill(pid, signal.SIGCONT)
    assert answers[0].status_code == 200, answers[0].text
    assert answers[0].json()["usage"]["completion_tokens"] == 4
    await trio.to_thread.run_sync(lambda: wait_healthy(server.url, timeout=30))
    assert server.rt.pid_of("executor") == pid  # never restarted
    assert len(server.rt.events("peer.dead")) == deaths


def test_a_dead_actor_turns_health_503_naming_it_and_requests_wait_for_it(server):
    os.kill(server.rt.pid_of("executor"), signal.SIGKILL)

    def unhealthy() -> httpx.Response | None:
        r = health(server.url)
        return r if r is not None and r.status_code == 503 else None

    down = poll_until(unhealthy, 15, "health to turn 503")
    assert "executor" in down.json()["missing"], down.json()
    assert down.json()["actors"]["executor"] == {"alive": False, "ready": False, "state": "down"}

    # a request sent while the executor is down is held, not refused, and answered once the
    # supervisor restarted it (tokenizer_svc: client.held)
    held = post(server, COMP, {"prompt": "x", "max_tokens": 2}, timeout=90)
    assert held.status_code == 200, held.text
    assert server.rt.events("client.held")
    wait_healthy(server.url, timeout=60)  # the supervisor restarted it
    again = post(server, COMP, {"prompt": "x", "max_tokens": 2})
    assert again.status_code == 200, again.text


def test_the_http_server_reconnects_after_the_front_door_restarts(server):
    before = post(server, COMP, {"prompt": "x", "max_tokens": 2}, timeout=60)
    assert before.status_code == 200
    os.kill(server.rt.pid_of("tokenizer"), signal.SIGKILL)
    poll_until(
        lambda: (r := health(server.url)) is not None and r.status_code == 503,
        15,
        "health to turn 503",
    )
    wait_healthy(server.url, timeout=60)
    after = post(server, COMP, {"prompt": "x", "max_tokens": 2}, timeout=60)
    assert after.status_code == 200, after.text
    # a fresh connection: the HTTP server sees the new boot id on its next ping (WATCH_S), which
    # can come after the request above went through its old, reconnected socket
    poll_until(
        lambda: len(server.rt.events("http.upstream_connected")) >= 2,
        15,
        "the HTTP server's fresh connection to the restarted front door",
    )
