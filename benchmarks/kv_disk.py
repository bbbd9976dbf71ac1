"""``python -m benchmarks.kv_disk``: the prefix cache's disk tier (``--kv-disk-dir``) through the
OpenAI API, SmolLM2-135M-Instruct, float32.

Workload: 8 system prompts of about 1,000 tokens (passages of Python's own ``pydoc_data``
topics), 4 questions each: 32 chat prompts rendered with the model's template and sent to
``POST /v1/completions`` as token ids, streamed, greedy, ``max_tokens`` 16. TTFT is measured by
the client (request sent to first token received); cached tokens are the server's
``usage.prompt_tokens_details.cached_tokens``.

1. **Restart**: per round, a fresh disk directory; a cold ``minirt up`` serves the 32 prompts
   (filling the tier), is stopped, and a new ``minirt up`` on the same directory serves them
   again. Both as one burst (all 32 at once) and one at a time. Reported: median TTFT warm/cold
   (paired per round), the share of prompt tokens cached, and whether the outputs were equal.
2. **A small pool**: ``--num-blocks`` holding about 2 of the 8 prefixes, requests cycling
   through the prefixes (question 1 of each, then question 2 of each, ...), one at a time;
   pool alone vs pool + disk (rounds interleaved): cached share from the second cycle on,
   output tokens/s and median TTFT.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import time
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import httpx
import trio

from benchmarks.openai import free_port
from minirt.bench.workloads import load_tokenizer, render
from minirt.eventlog.summary import results_dir
from minirt.launch.launch import start_runtime

QUESTIONS = [
    "Summarise the passage above in two sentences.",
    "What is the main idea of this passage?",
    "List three terms the passage defines.",
    "Give one example that illustrates the passage.",
]
MAX_TOKENS = 16


def passages(tok: Any, n: int, tokens: int) -> list[str]:
    """``n`` passages of ``pydoc_data.topics`` of about ``tokens`` tokens each."""
    from pydoc_data.topics import topics

    out = []
    for name in sorted(topics):
        text = topics[name]
        ids = tok(text, add_special_tokens=False)["input_ids"]
        if len(ids) >= tokens:
            out.append(tok.decode(ids[:tokens]))
        if len(out) == n:
            return out
    raise SystemExit("not enough long pydoc topics")


def workload(tok: Any, n_sys: int, sys_tokens: int) -> list[list[list[int]]]:
    """prompts[q][s]: question ``q`` on system prompt ``s``."""
    systems = passages(tok, n_sys, sys_tokens)
    return [
        [
            render(tok, [{"role": "system", "content": s}, {"role": "user", "content": q}])
            for s in systems
        ]
        for q in QUESTIONS
    ]


async def one(client: httpx.AsyncClient, url: str, ids: list[int]) -> dict[str, Any]:
    body = {
        "prompt": ids,
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    t0 = time.perf_counter()
    ttft, text, usage = None, "", {}
    async with client.stream("POST", f"{url}/v1/completions", json=body) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            ev = json.loads(line[6:])
            if ev.get("choices") and ev["choices"][0].get("text"):
                if ttft is None:
                    ttft = time.perf_counter() - t0
                text += ev["choices"][0]["text"]
            if ev.get("usage"):
                usage = ev["usage"]
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    return {
        "ttft": ttft if ttft is not None else time.perf_counter() - t0,
        "text": text,
        "prompt": usage.get("prompt_tokens", len(ids)),
        "cached": cached,
        "out": usage.get("completion_tokens", 0),
    }


async def serve(url: str, prompts: list[list[int]], burst: bool) -> tuple[list[dict], float]:
    res: list[Any] = [None] * len(prompts)
    async with httpx.AsyncClient(timeout=600) as client:
        t0 = time.perf_counter()
        if burst:
            async with trio.open_nursery() as n:
                for i, p in enumerate(prompts):

                    async def go(i: int = i, p: list[int] = p) -> None:
                        res[i] = await one(client, url, p)

                    n.start_soon(go)
        else:
            for i, p in enumerate(prompts):
                res[i] = await one(client, url, p)
        return res, time.perf_counter() - t0


def up(stack: ExitStack, model: Path, run: Path, *flags: str) -> str:
    shutil.rmtree(run, ignore_errors=True)  # each run's events alone
    port = free_port()
    stack.enter_context(start_runtime(model, run, "--http-port", str(port), *flags, timeout=600))
    return f"http://127.0.0.1:{port}"


def summary(rows: list[dict], skip: int = 0, firsts: int = 0) -> dict[str, float]:
    """Median TTFT and cached share (from row ``skip`` on); ``firsts``: the median TTFT of
    every ``firsts``-th row too (each system prompt's first question)."""
    out = {"first_ttft_s": statistics.median(r["ttft"] for r in rows[::firsts])} if firsts else {}
    rows = rows[skip:]
    return {
        **out,
        "median_ttft_s": statistics.median(r["ttft"] for r in rows),
        "cached_share": sum(r["cached"] for r in rows) / sum(r["prompt"] for r in rows),
    }


def restart_rounds(model: Path, prompts: list[list[int]], work: Path, rounds: int) -> list[dict]:
    out = []
    for rnd in range(rounds):
        for burst in (True, False):
            disk = work / f"disk-{rnd}-{int(burst)}"
            shutil.rmtree(disk, ignore_errors=True)
            flags = ("--kv-disk-dir", str(disk))
            row: dict[str, Any] = {"round": rnd, "burst": burst}
            for phase in ("cold", "warm"):
                with ExitStack() as st:
                    url = up(st, model, work / f"run-{rnd}-{int(burst)}-{phase}", *flags)
                    res, wall = trio.run(serve, url, prompts, burst)
                row[phase] = {
                    **summary(res, 0, len(QUESTIONS)),
                    "wall_s": wall,
                    "texts": [r["text"] for r in res],
                }
            row["ratio"] = row["warm"]["median_ttft_s"] / row["cold"]["median_ttft_s"]
            row["identical"] = row["warm"].pop("texts") == row["cold"].pop("texts")
            print(json.dumps(row), flush=True)
            out.append(row)
    return out


def pool_rounds(
    model: Path, prompts: list[list[int]], work: Path, rounds: int, blocks: int
) -> list[dict]:
    out = []
    for rnd in range(rounds):
        row: dict[str, Any] = {"round": rnd}
        for mode in ("pool", "pool+disk"):
            flags: tuple[str, ...] = ("--num-blocks", str(blocks))
            if mode == "pool+disk":
                disk = work / f"pdisk-{rnd}"
                shutil.rmtree(disk, ignore_errors=True)
                flags += ("--kv-disk-dir", str(disk))
            with ExitStack() as st:
                url = up(st, model, work / f"prun-{rnd}-{mode}", *flags)
                res, wall = trio.run(serve, url, prompts, False)
            n_first = len(prompts) // len(QUESTIONS)  # the first cycle
            row[mode] = {
                **summary(res, n_first),  # from the second cycle on
                "tok_s": sum(r["out"] for r in res) / wall,
                "wall_s": wall,
                "texts": [r["text"] for r in res],
            }
        row["identical"] = row["pool"].pop("texts") == row["pool+disk"].pop("texts")
        print(json.dumps(row), flush=True)
        out.append(row)
    return out


def report(r: dict[str, Any], argv: list[str]) -> str:
    """The markdown report of ``main``'s results."""
    med = statistics.median
    cmd = " ".join(["python -m benchmarks.kv_disk", *argv])
    lines = [
        "# The prefix cache's disk tier: after a restart, and under a small pool",
        "",
        "Regenerate with:",
        "",
        "```sh",
        cmd,
        "```",
        "",
        "SmolLM2-135M-Instruct, float32, through the OpenAI API (`/v1/completions`, token-id "
        "prompts, streamed, greedy, 16 new tokens). 8 system prompts (pydoc_data topics, "
        f"{min(r['prompt_tokens'])}-{max(r['prompt_tokens'])}-token prompts) x 4 questions. TTFT "
        "measured by the client; cached share = cached prompt tokens / prompt tokens "
        "(`usage.prompt_tokens_details.cached_tokens`).",
        "",
        "## After a full restart (a new `minirt up` on the same `--kv-disk-dir`)",
        "",
        "| sending | round | cold median TTFT | warm median TTFT | warm / cold | first question "
        "of each prompt, cold / warm | cached share cold / warm | outputs identical |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for row in r["restart"]:
        c, w = row["cold"], row["warm"]
        lines.append(
            f"| {'all 32 at once' if row['burst'] else 'one at a time'} | {row['round']} "
            f"| {c['median_ttft_s'] * 1000:.0f} ms | {w['median_ttft_s'] * 1000:.0f} ms "
            f"| {row['ratio']:.3f} | {c['first_ttft_s'] * 1000:.0f} / {w['first_ttft_s'] * 1000:.0f} ms "
            f"| {c['cached_share']:.1%} / {w['cached_share']:.1%} | {row['identical']} |"
        )
    for burst in (True, False):
        rows = [x for x in r["restart"] if x["burst"] is burst]
        firsts = [x["warm"]["first_ttft_s"] / x["cold"]["first_ttft_s"] for x in rows]
        lines.append(
            f"\n{'All at once' if burst else 'One at a time'}: median warm / cold TTFT "
            f"{med(x['ratio'] for x in rows):.3f}; each prompt's first question "
            f"{med(firsts):.3f}."
        )
    lines += [
        "",
        "One at a time, three of each prompt's four questions find the prefix in the pool in "
        "both runs (the median is one of them): what the tier changes is each prompt's first "
        "question. All at once, the cold run computes the 8 prefixes in one burst and every "
        "request waits for it; the warm run reads each prefix once (the other questions wait "
        "for it, then find it in the pool), one read at a time, beside the steps.",
        "",
        "## A pool that holds about 2 of the 8 prefixes",
        "",
        f"`--num-blocks {r['pool_blocks']}`; the 32 requests one at a time, cycling through the "
        "prefixes (question 1 of each, then question 2, ...), so the pool alone has evicted a "
        "prefix before it comes back; with the disk tier it is loaded. TTFT and cached share from "
        "the second cycle on; tokens/s over the whole run.",
        "",
        "| round | pool alone: cached / median TTFT / tok/s | pool + disk: cached / median TTFT "
        "/ tok/s | TTFT ratio | tok/s ratio | outputs identical |",
        "|---|---|---|---|---|---|",
    ]
    for row in r["small_pool"]:
        a, b = row["pool"], row["pool+disk"]
        lines.append(
            f"| {row['round']} | {a['cached_share']:.1%} / {a['median_ttft_s'] * 1000:.0f} ms / "
            f"{a['tok_s']:.1f} | {b['cached_share']:.1%} / {b['median_ttft_s'] * 1000:.0f} ms / "
            f"{b['tok_s']:.1f} | {b['median_ttft_s'] / a['median_ttft_s']:.3f} "
            f"| {b['tok_s'] / a['tok_s']:.2f} | {row['identical']} |"
        )
    lines += ["", r["machine"], ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="", help="model directory (default: SmolLM2, as minirt up)")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--system-tokens", type=int, default=1000)
    p.add_argument("--pool-blocks", type=int, default=160, help="the small pool (about 2 prefixes)")
    p.add_argument("--work", default=".minirt/bench-kv-disk")
    p.add_argument("--out", default="", help="a directory for README.md (report.json: results/)")
    p.add_argument("--machine", default="", help="the machine, in words, for the report")
    args = p.parse_args(argv)
    if args.model:
        model = Path(args.model)
    else:
        from gpu.model.sources import resolve

        model = Path(resolve("", say=print).path)
    tok = load_tokenizer(model)
    grid = workload(tok, 8, args.system_tokens)
    by_prefix = [grid[q][s] for s in range(8) for q in range(len(QUESTIONS))]  # restart
    cycling = [grid[q][s] for q in range(len(QUESTIONS)) for s in range(8)]  # small pool
    work = Path(args.work).absolute()
    work.mkdir(parents=True, exist_ok=True)
    result = {
        "machine": args.machine,
        "pool_blocks": args.pool_blocks,
        "prompt_tokens": [len(x) for x in by_prefix],
        "restart": restart_rounds(model, by_prefix, work, args.rounds),
        "small_pool": pool_rounds(model, cycling, work, args.rounds, args.pool_blocks),
    }
    if args.out:
        out = Path(args.out)
        (results_dir(out) / "report.json").write_text(json.dumps(result, indent=1))
        (out / "README.md").write_text(report(result, sys.argv[1:] if argv is None else argv))
    return 0


if __name__ == "__main__":
    sys.exit(main())
