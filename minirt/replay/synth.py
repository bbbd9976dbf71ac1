"""A synthetic event log in a real run's format, for replay tests and the replay's speed check:
Poisson arrivals, W1-like prompts (some sharing a system prompt), output lengths drawn per
request, and ``executor.step`` events whose times follow a known linear law plus noise (so a fit
can be checked against the truth). Only what a replay reads is written: the config events,
each request's ``client.received`` / ``request.queued`` / ``request.finished`` /
``client.completed``, and the steps."""

from __future__ import annotations

import random
from typing import Any

from actors.shared.blockhash import chain_hashes

# the law the synthetic steps follow (seconds)
TRUE_STEP = {
    "intercept": 0.004,
    "prefill_tokens": 2.0e-4,
    "decode_tokens": 6.0e-4,
    "prefill_chunks": 3.0e-4,
    "decode_ctx": 1.0e-6,
    "prefill_ctx": 2.0e-8,
}


def _config(
    num_blocks: int, max_batch_size: int, block_size: int, t: float
) -> list[dict[str, Any]]:
    base = {"level": "info", "ts": t}
    return [
        {
            **base,
            "actor": "scheduler",
            "event": "scheduler.config",
            "policy": "fcfs",
            "max_batch_size": max_batch_size,
            "max_waiting": 1 << 20,
            "max_preemptions": 3,
            "max_wait_s": 60.0,
            "priority_preemption": False,
            "prefix_defer_tokens": 64,
            "metrics_port": None,
            "kv_mode": "on_demand",
            "block_size": block_size,
        },
        {
            **base,
            "actor": "kv_manager",
            "event": "kv.config",
            "num_blocks": num_blocks,
            "block_size": block_size,
            "mode": "on_demand",
            "lookahead_blocks": 1,
        },
        {
            **base,
            "actor": "executor",
            "event": "executor.config",
            "num_blocks": num_blocks,
            "block_size": block_size,
            "step_budget": 2048,
            "chunk_cap": 512,
            "max_batch_size": max_batch_size,
            "long_prefill_threshold": 0,
            "max_long_prefills": 1,
            "decode_first": True,
        },
    ]


def synthetic_log(
    n: int = 10_000,
    rate: float = 12.0,
    seed: int = 0,
    num_blocks: int = 4096,
    max_batch_size: int = 64,
    block_size: int = 16,
    shared: float = 0.3,
    steps: int = 2000,
    aborts: int = 0,
) -> list[dict[str, Any]]:
    """``n`` requests arriving at ``rate``/s; a fraction ``shared`` start with one of 8 system
    prompts of 128 tokens. With ``aborts`` = k, every k-th request is cancelled 0.05 s after it
    arrived and the one after it ends on a stop string after 3 tokens. Returns the events,
    time-ordered."""
    rng = random.Random(seed)
    t0 = 1_800_000_000.0
    events = _config(num_blocks, max_batch_size, block_size, t0 - 1)
    systems = [[rng.randrange(16, 32000) for _ in range(128)] for _ in range(8)]
    t = t0
    for i in range(n):
        t += rng.expovariate(rate)
        head = systems[rng.randrange(8)] if rng.random() < shared else []
        prompt = head + [rng.randrange(16, 32000) for _ in range(rng.randint(32, 256))]
        out = rng.randint(8, 64)
        rid = f"s{i}"
        kind = "length"
        if aborts and i % aborts == 0:
            kind = "cancel"
        elif aborts and i % aborts == 1:
            kind, out = "stop", max(out, 8)
        events += [
            {"actor": "tokenizer", "event": "client.received", "request_id": rid, "ts": t},
            {
                "actor": "scheduler",
                "event": "request.queued",
                "request_id": rid,
                "prompt_tokens": len(prompt),
                "max_tokens": out,
                "priority": 0,
                "block_hashes": chain_hashes(prompt, block_size),
                "ts": t + 0.0005,
            },
        ]
        if kind == "length":
            ends = {"actor": "scheduler", "event": "request.finished", "output_tokens": out}
            ends["finish_reason"] = "length"
        else:
            ends = {"actor": "scheduler", "event": "request.aborted"}
            ends["reason"] = "cancel" if kind == "cancel" else "stop_string"
        delivered = {"length": out, "cancel": 1, "stop": 3}[kind]
        events += [
            {**ends, "request_id": rid, "ts": t + (0.05 if kind == "cancel" else 1.0)},
            {
                "actor": "tokenizer",
                "event": "client.completed",
                "request_id": rid,
                "finish_reason": {"length": "length", "cancel": "abort", "stop": "stop"}[kind],
                "usage": {"prompt_tokens": len(prompt), "completion_tokens": delivered},
                "timings": {"queue_s": 0.0, "ttft_s": 0.1, "tpot_s": 0.02, "total_s": 1.0},
                "ts": t + 1.0,
            },
        ]
        if kind == "cancel":
            ev = {"actor": "tokenizer", "event": "client.aborted", "reason": "cancel"}
            events.append({**ev, "request_id": rid, "ts": t + 0.05})
    for s in range(steps):
        pre = rng.choice([0, 0, rng.randint(1, 2048)])
        dec = rng.randint(0 if pre else 1, max_batch_size)
        chunks = rng.randint(1, 4) if pre else 0
        dctx = dec * rng.randint(32, 400)
        pctx = pre * (pre // max(chunks, 1) + rng.randint(0, 600)) if pre else 0
        x = {"prefill_tokens": pre, "decode_tokens": dec, "prefill_chunks": chunks}
        x.update(decode_ctx=dctx, prefill_ctx=pctx)
        law = TRUE_STEP["intercept"] + sum(TRUE_STEP[k] * v for k, v in x.items())
        events.append(
            {
                "actor": "executor",
                "event": "executor.step",
                "step": s + 1,
                "requests": dec + chunks,
                "prefill_tokens": pre,
                "decode_tokens": dec,
                "skipped": 0,
                "forward_s": law,
                "step_s": law * rng.uniform(0.95, 1.05),
                "control_s": 0.0,
                "decode_ctx": dctx,
                "prefill_ctx": pctx,
                "ts": t0 + s * 0.001,
            }
        )
    events.sort(key=lambda e: e["ts"])
    return events
