"""Streaming over the HTTP API against a real `minirt up`: the `openai` package's sync and async
streams, 32 concurrent streams against transformers, and the SSE framing byte for byte with a
raw socket."""

from __future__ import annotations

import json
import socket

import trio

from tests.support.http_server import MAX_NEW, PROMPT, aclient, random_ids
from tests.support.runtime import hf_greedy

pytest_plugins = ("tests.support.http_fixture",)  # one runtime (server, client, tok) for this
# module and its sibling


def test_stream_deltas_equal_the_full_text_and_usage_comes_only_when_asked(server, client):
    kw = dict(
        model=str(server.model), max_tokens=16, temperature=0, extra_body={"ignore_eos": True}
    )
    messages = [{"role": "user", "content": "stream me a story"}]
    full = client.chat.completions.create(messages=messages, **kw)
    chunks = list(
        client.chat.completions.create(
            messages=messages, stream=True, stream_options={"include_usage": True}, **kw
        )
    )
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    *content, usage_chunk = chunks
    assert usage_chunk.choices == [] and usage_chunk.usage.completion_tokens == 16
    assert usage_chunk.usage.prompt_tokens == full.usage.prompt_tokens
    assert content[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in content)
    assert text == full.choices[0].message.content
    assert content[-1].choices[0].finish_reason == "length"
    assert all(c.usage is None for c in content)

    prompt_full = client.completions.create(prompt=PROMPT, **kw)
    stream = client.completions.create(
        prompt=PROMPT,
        stream=True,
        stream_options={"include_usage": False, "continuous_usage_stats": True},
        **kw,
    )
    parts = list(stream)
    assert "".join(p.choices[0].text for p in parts) == prompt_full.choices[0].text
    assert all(p.choices for p in parts)  # no usage-only chunk without include_usage
    # continuous usage: every chunk counts the tokens so far
    counts = [p.usage.completion_tokens for p in parts]
    assert counts == sorted(counts) and counts[-1] == 16


async def test_async_client_streams_and_completes(server):
    c = aclient(server)
    kw = dict(model=str(server.model), prompt=PROMPT, max_tokens=MAX_NEW, temperature=0)
    full = await c.completions.create(**kw)
    text = ""
    async for part in await c.completions.create(stream=True, **kw):
        text += part.choices[0].text
    assert text == full.choices[0].text and text
    await c.close()


async def test_32_concurrent_streams_each_equal_their_reference(server, tok):
    prompts = random_ids(32, 4, 60, seed=5)
    expected = [
        tok.decode(ids, skip_special_tokens=True)
        for ids in hf_greedy(server.model, prompts, MAX_NEW)
    ]
    texts: list[str] = [""] * len(prompts)
    c = aclient(server)

    async def one(i: int) -> None:
        stream = await c.completions.create(
            model=str(server.model),
            prompt=prompts[i],
            max_tokens=MAX_NEW,
            temperature=0,
            stream=True,
        )
        async for part in stream:
            texts[i] += part.choices[0].text

    async with trio.open_nursery() as nursery:
        for i in range(len(prompts)):
            nursery.start_soon(one, i)
    await c.close()
    assert texts == expected


def _raw_request(url: str, path: str, body: dict) -> bytes:
    host, port = url.removeprefix("http://").split(":")
    data = json.dumps(body).encode()
    head = (
        f"POST {path} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(data)}\r\n\r\n"
    ).encode()
    with socket.create_connection((host, int(port)), timeout=30) as s:
        s.sendall(head + data)
        out = b""
        while not out.endswith(b"\r\n0\r\n\r\n"):  # the chunked body's last chunk
            chunk = s.recv(65536)
            assert chunk, "connection closed before the body ended"
            out += chunk
    return out


def _dechunk(body: bytes) -> bytes:
    out = b""
    while body:
        size, _, rest = body.partition(b"\r\n")
        n = int(size, 16)
        if n == 0:
            return out
        out, body = out + rest[:n], rest[n + 2 :]
    raise AssertionError("chunked body ended without the last chunk")


def test_sse_framing_byte_for_byte(server, client):
    body = {
        "model": str(server.model),
        "messages": [{"role": "user", "content": "frame me"}],
        "max_tokens": 6,
        "temperature": 0,
        "stream": True,
        "ignore_eos": True,
    }
    raw = _raw_request(server.url, "/v1/chat/completions", body)
    head, _, payload = raw.partition(b"\r\n\r\n")
    lines = head.split(b"\r\n")
    assert lines[0].startswith(b"HTTP/1.1 200")
    headers = {k.lower(): v.strip() for k, _, v in (ln.partition(b":") for ln in lines[1:])}
    assert headers[b"content-type"] == b"text/event-stream; charset=utf-8"
    assert headers[b"transfer-encoding"] == b"chunked"
    sse = _dechunk(payload)
    assert sse.endswith(b"\n\ndata: [DONE]\n\n") and b"\r" not in sse
    events = sse.split(b"\n\n")
    assert events[-1] == b"" and events[-2] == b"data: [DONE]"
    chunks = []
    for ev in events[:-2]:
        assert ev.startswith(b"data: {") and b"\n" not in ev  # one data line per event
        obj = json.loads(ev[len(b"data: ") :])
        # compact JSON, UTF-8 as is: exactly what a re-encoding gives
        assert (
            ev[len(b"data: ") :]
            == json.dumps(obj, separators=(",", ":"), ensure_ascii=False).encode()
        )
        chunks.append(obj)
    rid = chunks[0]["id"]
    assert rid.startswith("chatcmpl-") and all(c["id"] == rid for c in chunks)
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert chunks[-1]["choices"][0] == {
        "index": 0,
        "delta": {},
        "logprobs": None,
        "finish_reason": "length",
    }
    full = client.chat.completions.create(
        model=str(server.model),
        messages=body["messages"],
        max_tokens=6,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks)
    assert text == full.choices[0].message.content
