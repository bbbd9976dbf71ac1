"""OpenAI's response shapes, built from the front door's messages (pure).

``Choices`` folds ``Delta`` / ``Final`` messages into per-choice state; the functions below turn
that state into ``text_completion`` / ``chat.completion`` bodies and their streaming chunks.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass, field
from typing import Any

from messages import client as cm
from minirt.http.model import NEG_INF_LOGPROB, ModelInfo
from minirt.http.openai.convert import Plan
from tokenizer_svc.agent.parse import Call, OutputParser, Parsed

FINISH = {"stop": "stop", "length": "length", "abort": "abort"}


def _lp(x: float | None) -> float:
    return NEG_INF_LOGPROB if x is None or math.isinf(x) or math.isnan(x) else x


@dataclass
class Choice:
    index: int
    prompt_index: int
    text: list[str] = field(default_factory=list)
    tokens: int = 0
    logprobs: list[tuple[int, float, list[cm.TokenLogprob]]] = field(default_factory=list)
    finish_reason: str | None = None
    usage: cm.Usage | None = None
    timings: cm.Timings | None = None
    first_token_t: float = 0.0
    prompt_tokens: int | None = None  # the front door's count (``Accepted``)
    parser: OutputParser | None = None  # chat with tools or reasoning: how to read the text
    prompt: cm.PromptLogprobs | None = None  # the prompt's logprobs (params.prompt_logprobs)
    stop_reason: str | None = None  # the stop string that ended it
    embedding: bytes = b""  # float32 values (params.pooling)

    def parsed(self, final: bool) -> Parsed:
        if self.parser is None:
            return Parsed(content="".join(self.text))
        return self.parser.parsed(final)


class Choices:
    """Every choice of one request; ``feed`` returns the new text and logprob entries."""

    def __init__(self, plan: Plan) -> None:
        self.plan = plan
        self.by_index = {c.index: Choice(c.index, c.prompt_index) for c in plan.choices}

    def feed(self, index: int, msg: Any, now: float) -> tuple[str, list]:
        ch = self.by_index[index]
        if isinstance(msg, cm.Accepted):
            ch.prompt_tokens = msg.prompt_tokens
            if msg.tool_parser or msg.reasoning_parser:
                ch.parser = OutputParser(msg.tool_parser, msg.reasoning_parser, msg.thinking)
            return "", []
        if isinstance(msg, cm.PromptLogprobs):
            ch.prompt = msg
            return "", []
        if isinstance(msg, cm.Embedding):
            ch.embedding = msg.data
            return "", []
        if self.plan.score_only and isinstance(msg, cm.Delta):
            return "", []  # max_tokens 0: the token the prefill sampled is not shown
        if isinstance(msg, cm.Delta):
            ch.text.append(msg.text)
            if ch.parser is not None:
                ch.parser.feed(msg.text)
            ch.tokens += len(msg.token_ids)
            if not ch.first_token_t and msg.token_ids:
                ch.first_token_t = now
            new = []
            if msg.logprobs is not None:
                tops = msg.top_logprobs or [[] for _ in msg.token_ids]
                new = list(zip(msg.token_ids, msg.logprobs, tops, strict=False))
                ch.logprobs.extend(new)
            return msg.text, new
        if isinstance(msg, cm.Final):
            ch.finish_reason = FINISH.get(msg.finish_reason, "stop")
            if self.plan.score_only and ch.finish_reason != "abort":
                ch.finish_reason = "length"  # max_tokens 0 reached
            ch.usage = msg.usage
            ch.timings = msg.timings
            ch.stop_reason = msg.stop_reason
            ch.prompt_tokens = msg.usage.prompt_tokens
        return "", []

    def done(self) -> bool:
        return all(c.finish_reason is not None for c in self.by_index.values())

    def accepted(self) -> bool:
        """Whether the front door took every choice (so none can still be refused)."""
        return all(c.prompt_tokens is not None for c in self.by_index.values())

    def prompt_tokens(self) -> int:
        """Each prompt counted once, however many choices share it (as OpenAI does)."""
        first: dict[int, int] = {}
        for c in self.by_index.values():
            first.setdefault(c.prompt_index, c.prompt_tokens or 0)
        return sum(first.values())

    def usage(self) -> dict[str, Any]:
        cached: dict[int, int] = {}
        for c in self.by_index.values():
            mine = c.usage.cached_tokens if c.usage else 0
            cached[c.prompt_index] = min(cached.get(c.prompt_index, mine), mine)
        completion = sum(c.tokens for c in self.by_index.values())
        return usage_dict(self.prompt_tokens(), completion, sum(cached.values()))

    def choice_usage(self, index: int) -> dict[str, Any]:
        ch = self.by_index[index]
        cached = ch.usage.cached_tokens if ch.usage else 0
        return usage_dict(ch.prompt_tokens or 0, ch.tokens, cached)


def usage_dict(prompt: int, completion: int, cached: int) -> dict[str, Any]:
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": cached},
    }


def completion_logprobs(
    model: ModelInfo, entries: list[tuple[int, float, list[cm.TokenLogprob]]], offset: int
) -> dict[str, Any]:
    """The legacy completions ``logprobs`` object; the sampled token is always in the tops."""
    tokens, lps, tops, offsets = [], [], [], []
    for tid, lp, top in entries:
        s = model.token_str(tid)
        tokens.append(s)
        lps.append(_lp(lp))
        d = {model.token_str(t.token_id): _lp(t.logprob) for t in top}
        d.setdefault(s, _lp(lp))
        tops.append(d)
        offsets.append(offset)
        offset += len(s)
    return {"tokens": tokens, "token_logprobs": lps, "top_logprobs": tops, "text_offset": offsets}


def echo_logprobs(model: ModelInfo, p: cm.PromptLogprobs | None, n: int) -> dict[str, Any]:
    """The legacy ``logprobs`` object of an echoed prompt (vLLM's): its tokens, their logprobs
    (the first one's null), each with the ``n`` most likely (and itself); offsets from 0."""
    out: dict[str, Any] = {
        "tokens": [],
        "token_logprobs": [],
        "top_logprobs": [],
        "text_offset": [],
    }
    if p is None:
        return out
    offset = 0
    for i, tid in enumerate(p.token_ids):
        s = model.token_str(tid)
        lp = p.logprobs[i]
        out["tokens"].append(s)
        out["text_offset"].append(offset)
        offset += len(s)
        if lp is None:
            out["token_logprobs"].append(None)
            out["top_logprobs"].append(None)
            continue
        out["token_logprobs"].append(_lp(lp))
        top = p.top_logprobs[i] if p.top_logprobs else []
        d = {model.token_str(t.token_id): _lp(t.logprob) for t in top[:n]}
        d.setdefault(s, _lp(lp))
        out["top_logprobs"].append(d)
    return out


def vllm_prompt_logprobs(model: ModelInfo, p: cm.PromptLogprobs | None) -> list | None:
    """vLLM's ``prompt_logprobs``: per prompt token (the first: null), the token and the most
    likely ones, by id: logprob, rank, decoded text."""
    if p is None:
        return None
    out: list[dict[str, Any] | None] = []
    for i, tid in enumerate(p.token_ids):
        lp = p.logprobs[i]
        if lp is None:
            out.append(None)
            continue
        top = p.top_logprobs[i] if p.top_logprobs else []
        d = {
            str(t.token_id): {
                "logprob": _lp(t.logprob), "rank": r + 1, "decoded_token": model.token_str(t.token_id)
            }
            for r, t in enumerate(top)
        }  # fmt: skip
        d[str(tid)] = {
            "logprob": _lp(lp),
            "rank": p.ranks[i],
            "decoded_token": model.token_str(tid),
        }
        out.append(d)
    return out


def _chat_entry(model: ModelInfo, tid: int, lp: float) -> dict[str, Any]:
    s = model.token_str(tid)
    return {"token": s, "logprob": _lp(lp), "bytes": list(s.encode("utf-8"))}


def chat_logprobs(
    model: ModelInfo, entries: list[tuple[int, float, list[cm.TokenLogprob]]]
) -> dict[str, Any]:
    content = []
    for tid, lp, top in entries:
        e = _chat_entry(model, tid, lp)
        e["top_logprobs"] = [_chat_entry(model, t.token_id, t.logprob) for t in top]
        content.append(e)
    return {"content": content, "refusal": None}


def served_as(plan: Plan, model: ModelInfo) -> str:
    """The model name an answer gives: the adapter's a request ran with (vLLM's), else the
    server's."""
    return (plan.choices[0].generate.lora if plan.choices else "") or model.served_name


def completion_body(plan: Plan, choices: Choices, model: ModelInfo, rid: str) -> dict[str, Any]:
    out = []
    for c in sorted(choices.by_index.values(), key=lambda c: c.index):
        echo = plan.echo[c.prompt_index] if plan.echo else ""
        lps = None
        if plan.logprobs is not None:
            lps = completion_logprobs(model, c.logprobs, len(echo))
            if echo:  # the prompt's entries first (vLLM's echo with logprobs)
                head = echo_logprobs(model, c.prompt, plan.logprobs)
                lps = {k: head[k] + lps[k] for k in lps}
        body = {
            "index": c.index,
            "text": echo + "".join(c.text),
            "logprobs": lps,
            "finish_reason": c.finish_reason,
        }
        if plan.prompt_logprobs is not None:
            body["prompt_logprobs"] = vllm_prompt_logprobs(model, c.prompt)
        out.append(body)
    return {
        "id": f"cmpl-{rid}",
        "object": "text_completion",
        "created": plan.created,
        "model": served_as(plan, model),
        "choices": out,
        "usage": choices.usage(),
    }


def call_id(rid: str, index: int) -> str:
    """The id of a choice's ``index``-th tool call (the same streamed or not)."""
    return f"call_{hashlib.sha256(rid.encode()).hexdigest()[:20]}{index}"


def tool_call(rid: str, index: int, call: Call) -> dict[str, Any]:
    return {
        "id": call_id(rid, index),
        "type": "function",
        "function": {"name": call.name, "arguments": call.arguments},
    }


def finish_of(c: Choice, parsed: Parsed) -> str | None:
    """``tool_calls`` for an answer that ends in calls (OpenAI's reason), else the front
    door's."""
    return "tool_calls" if parsed.calls and c.finish_reason == "stop" else c.finish_reason


def chat_message(c: Choice, cid: str) -> dict[str, Any]:
    p = c.parsed(final=True)
    message: dict[str, Any] = {"role": "assistant", "content": p.content}
    if c.parser is not None and c.parser.reasoning:
        message["reasoning_content"] = p.reasoning or None
    if p.calls:
        message["content"] = p.content or None
        message["tool_calls"] = [tool_call(cid, i, call) for i, call in enumerate(p.calls)]
    return message


def chat_body(plan: Plan, choices: Choices, model: ModelInfo, rid: str) -> dict[str, Any]:
    out = []
    for c in sorted(choices.by_index.values(), key=lambda c: c.index):
        cid = plan.choices[c.index].generate.request_id
        out.append(
            {
                "index": c.index,
                "message": chat_message(c, cid),
                "logprobs": chat_logprobs(model, c.logprobs) if plan.logprobs is not None else None,
                "finish_reason": finish_of(c, c.parsed(final=True)),
            }
        )
    body = {
        "id": f"chatcmpl-{rid}",
        "object": "chat.completion",
        "created": plan.created,
        "model": served_as(plan, model),
        "choices": out,
        "usage": choices.usage(),
    }
    if plan.prompt_logprobs is not None:  # vLLM's, on the response: the one prompt's
        body["prompt_logprobs"] = vllm_prompt_logprobs(model, choices.by_index[0].prompt)
    return body


def chunk(
    plan: Plan, model: ModelInfo, rid: str, choice: dict[str, Any] | None, usage: Any = None
) -> dict[str, Any]:
    """One streaming chunk; ``choice`` None gives the usage-only chunk (``choices: []``)."""
    chat = plan.kind == "chat"
    out: dict[str, Any] = {
        "id": f"{'chatcmpl' if chat else 'cmpl'}-{rid}",
        "object": "chat.completion.chunk" if chat else "text_completion",
        "created": plan.created,
        "model": served_as(plan, model),
        "choices": [] if choice is None else [choice],
    }
    if usage is not None:
        out["usage"] = usage
    return out


def stream_choice(
    plan: Plan,
    model: ModelInfo,
    index: int,
    text: str | None,
    entries: list,
    finish_reason: str | None,
    offset: int = 0,
    role: bool = False,
) -> dict[str, Any]:
    """The ``choices[0]`` of a chunk: a text delta (``text`` None: none) or the finish."""
    if plan.kind == "chat":
        delta: dict[str, Any] = {}
        if role:
            delta["role"] = "assistant"
        if text is not None:
            delta["content"] = text
        lps = chat_logprobs(model, entries) if plan.logprobs is not None and entries else None
        return {"index": index, "delta": delta, "logprobs": lps, "finish_reason": finish_reason}
    lps = (
        completion_logprobs(model, entries, offset)
        if plan.logprobs is not None and entries
        else None
    )
    return {"index": index, "text": text or "", "logprobs": lps, "finish_reason": finish_reason}
