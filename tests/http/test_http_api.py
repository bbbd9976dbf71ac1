"""The OpenAI-compatible HTTP API against a real `minirt up`, driven by the official `openai`
package and checked against transformers: greedy text, chat template, usage, logprobs, n, stop
strings, seeds, echo, sampling fields, request ids and the service endpoints."""

from __future__ import annotations

import httpx
import pytest

from tests.support.http_server import (
    MAX_NEW,
    PROMPT,
    hf_chat_ids,
    hf_logprobs,
    random_ids,
)
from tests.support.runtime import hf_greedy, poll_until

pytest_plugins = ("tests.support.http_fixture",)  # one runtime (server, client, tok) for this
# module and its sibling


def test_greedy_completion_equals_transformers(server, client, tok):
    ids = tok(PROMPT)["input_ids"]
    [ref] = hf_greedy(server.model, [ids], MAX_NEW)
    out = client.completions.create(
        model=str(server.model), prompt=PROMPT, max_tokens=MAX_NEW, temperature=0
    )
    assert out.object == "text_completion" and out.model == str(server.model)
    [choice] = out.choices
    assert choice.text == tok.decode(ref, skip_special_tokens=True)
    assert choice.finish_reason == ("length" if len(ref) == MAX_NEW else "stop")
    assert out.usage.prompt_tokens == len(ids)
    assert out.usage.completion_tokens == len(ref)
    assert out.usage.total_tokens == len(ids) + len(ref)
    assert out.usage.prompt_tokens_details.cached_tokens == 0
    # the model may be named by its directory's name too; token ids are a prompt as well
    again = client.completions.create(
        model=server.model.name, prompt=ids, max_tokens=MAX_NEW, temperature=0
    )
    assert again.choices[0].text == choice.text


def test_greedy_chat_equals_transformers_chat_template(server, client, tok):
    messages = [
        {"role": "system", "content": "be brief"},
        {
            "role": "user",
            "content": [{"type": "text", "text": "hello"}, {"type": "text", "text": "world"}],
        },
    ]
    ids = hf_chat_ids(server.model, [messages[0], {"role": "user", "content": "hello\nworld"}])
    [ref] = hf_greedy(server.model, [ids], MAX_NEW)
    out = client.chat.completions.create(
        model=str(server.model), messages=messages, max_tokens=MAX_NEW, temperature=0
    )
    assert out.object == "chat.completion"
    [choice] = out.choices
    assert choice.message.role == "assistant"
    assert choice.message.content == tok.decode(ref, skip_special_tokens=True)
    assert out.usage.prompt_tokens == len(ids)
    assert out.usage.completion_tokens == len(ref)
    # max_completion_tokens is the newer spelling of max_tokens
    newer = client.chat.completions.create(
        model=str(server.model), messages=messages, max_completion_tokens=MAX_NEW, temperature=0
    )
    assert newer.choices[0].message.content == choice.message.content


def test_logprobs_match_transformers_log_softmax(server, client, tok):
    ids = tok(PROMPT)["input_ids"]
    out = client.completions.create(
        model=str(server.model),
        prompt=ids,
        max_tokens=8,
        temperature=0,
        logprobs=3,
        extra_body={"ignore_eos": True},
    )
    lp = out.choices[0].logprobs
    [gen] = hf_greedy(server.model, [ids], 8, ignore_eos=True)
    ref = hf_logprobs(server.model, ids, gen)
    assert len(lp.token_logprobs) == 8
    for i, t in enumerate(gen):
        assert abs(lp.token_logprobs[i] - ref[i][t]) < 1e-4, i
        assert lp.tokens[i] == tok.decode([t])
        assert 1 <= len(lp.top_logprobs[i]) <= 4
    assert lp.text_offset[0] == 0

    messages = [{"role": "user", "content": "hello there"}]
    chat_ids = hf_chat_ids(server.model, messages)
    [cgen] = hf_greedy(server.model, [chat_ids], 6, ignore_eos=True)
    cref = hf_logprobs(server.model, chat_ids, cgen)
    chat = client.chat.completions.create(
        model=str(server.model),
        messages=messages,
        max_tokens=6,
        temperature=0,
        logprobs=True,
        top_logprobs=2,
        extra_body={"ignore_eos": True},
    )
    content = chat.choices[0].logprobs.content
    assert len(content) == 6
    for i, entry in enumerate(content):
        assert abs(entry.logprob - cref[i][cgen[i]]) < 1e-4
        best = sorted(cref[i], reverse=True)[:2]
        # within 1e-4, as above (rounding both sides to 4 places flips on a boundary)
        assert len(entry.top_logprobs) == 2
        assert all(abs(t.logprob - b) < 1e-4 for t, b in zip(entry.top_logprobs, best, strict=True))
        assert entry.bytes == list(entry.token.encode())


def test_n_choices_share_the_prompt_and_have_their_own_seeds(server, client):
    [ids] = random_ids(1, 100, 100, seed=21)
    kw = dict(model=str(server.model), prompt=ids, max_tokens=8, temperature=1.0)
    raw = client.completions.with_raw_response.create(
        n=2, seed=11, extra_headers={"X-Request-Id": "n-two"}, **kw
    )
    out = raw.parse()
    assert [c.index for c in out.choices] == [0, 1]
    alone = [client.completions.create(seed=s, **kw).choices[0].text for s in (11, 12)]
    assert [c.text for c in out.choices] == alone
    assert out.usage.prompt_tokens == len(ids)  # the shared prompt counts once
    cached = [
        e["cached_tokens"]
        for i in (0, 1)
        for e in server.rt.events("prefix.matched", request_id=f"n-two-{i}")
    ]
    assert max(cached) >= 64, cached  # the second choice reused the first one's prompt blocks


def test_stop_string_ends_the_text_before_it(server, client):
    kw = dict(model=str(server.model), prompt=PROMPT, max_tokens=24, temperature=0)
    full = client.completions.create(extra_body={"ignore_eos": True}, **kw).choices[0].text
    stop = full[len(full) // 2 : len(full) // 2 + 3]
    if not stop.strip():
        pytest.skip("generated text has no usable stop string")
    out = client.completions.create(
        stop=[stop, "never-seen-xyz"], extra_body={"ignore_eos": True}, **kw
    )
    assert out.choices[0].text == full[: full.index(stop)]
    assert out.choices[0].finish_reason == "stop"
    streamed = client.completions.create(
        stop=stop, stream=True, extra_body={"ignore_eos": True}, **kw
    )
    parts = list(streamed)
    assert "".join(p.choices[0].text for p in parts) == out.choices[0].text
    assert parts[-1].choices[0].finish_reason == "stop"


def test_same_seed_gives_the_same_text(server, client):
    kw = dict(
        model=str(server.model), prompt=PROMPT, max_tokens=16, temperature=1.0, top_p=0.9, seed=1234
    )
    a = client.completions.create(**kw).choices[0].text
    b = client.completions.create(**kw).choices[0].text
    assert a == b and a


def test_echo_and_a_batch_of_prompts(server, client, tok):
    a, b = random_ids(2, 5, 9, seed=9)
    out = client.completions.create(
        model=str(server.model), prompt=[a, b], max_tokens=4, temperature=0, echo=True
    )
    assert [c.index for c in out.choices] == [0, 1]
    for c, ids in zip(out.choices, (a, b), strict=True):
        assert c.text.startswith(tok.decode(ids, skip_special_tokens=True))
    assert out.usage.prompt_tokens == len(a) + len(b)
    texts = client.completions.create(
        model=str(server.model), prompt=[PROMPT, "hello world"], max_tokens=4, temperature=0
    )
    assert len(texts.choices) == 2


def test_request_id_is_echoed_and_traced(server, client):
    raw = client.completions.with_raw_response.create(
        model=str(server.model),
        prompt=PROMPT,
        max_tokens=2,
        extra_headers={"X-Request-Id": "trace-me-7"},
        extra_body={"ignore_eos": True},  # both tokens, whatever the random model samples
    )
    assert raw.headers["x-request-id"] == "trace-me-7"
    assert raw.parse().id == "cmpl-trace-me-7"
    rt = server.rt
    assert rt.events("http.request", request_id="trace-me-7")
    # logged once the last byte is sent: may land just after the client has the body
    [resp] = poll_until(lambda: rt.events("http.response", request_id="trace-me-7"))
    assert resp["status"] == 200 and resp["completion_tokens"] == 2
    # `minirt trace trace-me-7` shows the HTTP leg beside the actors' decisions
    want = {"http", "tokenizer", "scheduler", "executor"}
    actors = poll_until(
        lambda: want <= (got := {e["actor"] for e in rt.events(request_id="trace-me-7")}) and got,
        what=f"events of {want} for trace-me-7",
    )
    assert actors, {e["actor"] for e in rt.events(request_id="trace-me-7")}
    plain = httpx.get(server.url + "/v1/models")
    assert len(plain.headers["x-request-id"]) == 32


def test_service_endpoints(server, client, tok):
    [card] = client.models.list().data
    assert card.id == str(server.model)
    assert httpx.get(server.url + "/version").json()["version"]
    r = httpx.post(server.url + "/tokenize", json={"prompt": PROMPT})
    assert r.json()["tokens"] == tok(PROMPT)["input_ids"] and r.json()["max_model_len"] == 1024
    msgs = [{"role": "user", "content": "hi"}]
    r = httpx.post(server.url + "/tokenize", json={"messages": msgs})
    assert r.json()["tokens"] == hf_chat_ids(server.model, msgs)
    r = httpx.post(server.url + "/detokenize", json={"tokens": tok(PROMPT)["input_ids"]})
    assert r.json() == {"prompt": PROMPT}
    health = httpx.get(server.url + "/health")
    assert health.status_code == 200 and health.json()["status"] == "ok"
    metrics = httpx.get(server.url + "/metrics").text
    for name in (
        "vllm:num_requests_running",
        "vllm:num_requests_waiting",
        "vllm:kv_cache_usage_perc",
        "vllm:prefix_cache_queries_total",
        "vllm:prefix_cache_hits_total",
        "vllm:time_to_first_token_seconds_bucket",
        "vllm:e2e_request_latency_seconds_count",
        "minirt:http_requests_total",
    ):
        assert name in metrics, name


def test_logit_bias_and_min_tokens_reach_the_sampler(server, client, tok):
    forced = client.completions.create(
        model=str(server.model),
        prompt=PROMPT,
        max_tokens=5,
        temperature=0,
        logit_bias={"77": 100},
        logprobs=0,
    )
    assert forced.choices[0].logprobs.tokens == [tok.decode([77])] * 5
    ids = tok(PROMPT)["input_ids"]
    [greedy] = hf_greedy(server.model, [ids], 1)
    kw = dict(model=str(server.model), prompt=ids, max_tokens=8, temperature=0)
    stopped = client.completions.create(extra_body={"stop_token_ids": greedy}, **kw)
    assert stopped.usage.completion_tokens == 1 and stopped.choices[0].finish_reason == "stop"
    held = client.completions.create(extra_body={"stop_token_ids": greedy, "min_tokens": 4}, **kw)
    assert held.usage.completion_tokens >= 4


def test_allowed_token_ids_and_bad_words_reach_the_sampler(server, client, tok):
    import torch
    from transformers import AutoModelForCausalLM

    from tokenizer_svc.requests import bad_words_ids

    allowed = [77, 78, 301]
    only = client.completions.create(
        model=str(server.model), prompt=PROMPT, max_tokens=12, temperature=1.0, seed=3,
        logprobs=0, extra_body={"allowed_token_ids": allowed},
    )  # fmt: skip
    assert set(only.choices[0].logprobs.tokens) <= {tok.decode([t]) for t in allowed}
    # bad words, greedy: a token of the free answer, banned (as text), against transformers
    ids = tok(PROMPT)["input_ids"]
    [free] = hf_greedy(server.model, [ids], 8)
    # (a token whose text tokenizes back to it: not a piece of a UTF-8 character)
    word = next(w for t in free if [t] in bad_words_ids(tok, [w := tok.decode([t])]))
    banned = bad_words_ids(tok, [word])
    model = AutoModelForCausalLM.from_pretrained(server.model, dtype=torch.float32)
    with torch.no_grad():
        ref = model.generate(
            torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
            max_new_tokens=8, do_sample=False, bad_words_ids=banned,
        )[0, len(ids):].tolist()  # fmt: skip
    got = client.completions.create(
        model=str(server.model), prompt=ids, max_tokens=8, temperature=0,
        extra_body={"bad_words": [word]},
    )  # fmt: skip
    assert got.choices[0].text != tok.decode(free, skip_special_tokens=True)
    assert got.choices[0].text == tok.decode(ref, skip_special_tokens=True)


def test_echo_with_logprobs_scores_the_prompt_as_transformers_does(server, client, tok):
    """What lm-evaluation-harness sends for a loglikelihood: the prompt echoed with its
    tokens' logprobs (the first one's null), nothing generated (max_tokens 0)."""
    ids = tok(PROMPT + " and then another one")["input_ids"]
    rows = hf_logprobs(server.model, ids[:1], ids[1:])
    want = [rows[i][ids[i + 1]] for i in range(len(ids) - 1)]
    kw = dict(model=str(server.model), prompt=ids, echo=True, logprobs=2, temperature=0)
    out = client.completions.create(max_tokens=0, **kw)
    [c] = out.choices
    lp = c.logprobs
    assert c.text == tok.decode(ids) and c.finish_reason == "length"
    assert out.usage.completion_tokens == 0 and out.usage.prompt_tokens == len(ids)
    assert lp.tokens == [tok.decode([t]) for t in ids]
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert max(abs(a - b) for a, b in zip(lp.token_logprobs[1:], want, strict=True)) < 1e-4
    for i in range(1, len(ids)):  # each position's two most likely, and the token itself
        best = sorted(range(len(rows[i - 1])), key=lambda t: -rows[i - 1][t])[:2]
        assert set(lp.top_logprobs[i]) == {tok.decode([t]) for t in best + [ids[i]]}
    # again: the prompt is not taken from the prefix cache (its logprobs are computed)
    again = client.completions.create(max_tokens=0, **kw)
    assert again.choices[0].logprobs.token_logprobs == lp.token_logprobs
    assert again.usage.prompt_tokens_details.cached_tokens == 0
    # with generation: the prompt's entries, then the generated tokens'
    gen = client.completions.create(max_tokens=3, **{**kw, "logprobs": 0})
    glp = gen.choices[0].logprobs
    assert len(glp.tokens) == len(ids) + 3 and glp.token_logprobs[: len(ids)] == lp.token_logprobs
    assert gen.usage.completion_tokens == 3
    # vLLM's prompt_logprobs field: by token id, with the rank
    raw = client.completions.create(
        model=str(server.model), prompt=ids, max_tokens=1, temperature=0,
        extra_body={"prompt_logprobs": 0},
    )  # fmt: skip
    pl = raw.choices[0].model_extra["prompt_logprobs"]
    assert pl[0] is None and len(pl) == len(ids)
    for i in range(1, len(ids)):
        entry = pl[i][str(ids[i])]
        assert abs(entry["logprob"] - want[i - 1]) < 1e-4
        assert entry["rank"] == 1 + sum(v > rows[i - 1][ids[i]] for v in rows[i - 1])
    chat = client.chat.completions.create(
        model=str(server.model), messages=[{"role": "user", "content": "hi"}], max_tokens=1,
        extra_body={"prompt_logprobs": 1},
    )  # fmt: skip
    cpl = chat.model_extra["prompt_logprobs"]
    assert cpl[0] is None and len(cpl) == chat.usage.prompt_tokens


def test_repetition_penalty_equals_transformers(server, client, tok):
    import torch
    from transformers import AutoModelForCausalLM

    ids = tok(PROMPT)["input_ids"]
    model = AutoModelForCausalLM.from_pretrained(server.model, dtype=torch.float32)
    with torch.no_grad():
        out = model.generate(
            torch.tensor([ids]),
            attention_mask=torch.ones(1, len(ids), dtype=torch.long),
            max_new_tokens=10,
            do_sample=False,
            repetition_penalty=1.5,
            eos_token_id=None,
        )
    ref = out[0, len(ids) :].tolist()
    got = client.completions.create(
        model=str(server.model),
        prompt=ids,
        max_tokens=10,
        temperature=0,
        extra_body={"repetition_penalty": 1.5, "ignore_eos": True},
    )
    assert got.choices[0].text == tok.decode(ref, skip_special_tokens=True)
