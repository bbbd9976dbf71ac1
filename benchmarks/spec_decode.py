"""``python -m benchmarks.spec_decode``: speculative decoding (n-gram prompt lookup) against the
same server without it, and vLLM's CPU server (which has none), through the OpenAI API.

Two minirt servers run side by side (one with ``--speculative-config``, one without; an idle
one costs nothing) and are measured in interleaved rounds; vLLM's server runs after them, once.
Every request is ``POST /v1/completions`` with the prompt as token ids (the model's chat
template, rendered here, so every server gets the same ids), greedy, its own EOS.

Workloads (SmolLM2-135M-Instruct by default):

- ``grounded``: answers that copy their input: code edits of standard-library functions
  (``minirt.bench.workloads.code_edit``) and passages of ``pydoc_data.topics`` to quote back.
- ``free``: free chat (questions written here, answers not in the prompt).
- ``mixed``: both at once.
- ``json``: structured output that copies its input: each ``pydoc_data`` passage asked back as a
  JSON object (``response_format`` with a JSON schema: a ``topic`` and the ``quote``), so the
  drafts are cut to what the grammar accepts and verified under its masks. Batches below 16.

At batch ``b`` a workload's requests run ``b`` at a time. Reports output tokens/s, the paired
ratio per round (with/without), the acceptance (``vllm:spec_decode_*`` from ``/metrics``) and
whether the outputs were identical.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import statistics
import sys
import time
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import httpx
import trio

from benchmarks.http_load import TextJob, complete
from benchmarks.openai import free_port
from minirt.bench.workloads import code_edit, load_tokenizer, render
from minirt.eventlog.summary import results_dir

SPEC = {  # vLLM's documented example
    "method": "ngram",
    "num_speculative_tokens": 4,
    "prompt_lookup_max": 4,
    "prompt_lookup_min": 1,
}
FREE = [
    "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    "What are three good habits for staying healthy during winter? Explain each.",
    "Explain how a rainbow forms, as you would to a ten-year-old.",
    "Suggest a plan for a weekend trip to the mountains, day by day.",
    "Why do cats purr? Give a few possible reasons.",
    "Describe the life cycle of a butterfly.",
    "Give me five ideas for a birthday party for a seven-year-old.",
    "What is the difference between weather and climate?",
    "Write a poem about the sea at night.",
    "How does a bicycle stay upright when it moves?",
    "List some tips for learning a new language quickly.",
    "What makes bread rise? Explain the role of yeast.",
    "Write a letter to a friend describing your new city.",
    "Explain what a volcano is and why it erupts.",
    "Describe a perfect morning routine.",
    "What should I pack for a week at the beach?",
]


JSON_ASK = (
    'Return a JSON object with the topic of the passage below in "topic" and the passage '
    'itself, word for word, in "quote".\n\n'
)
QUOTE_ASK = "Quote the following passage back exactly, word for word:\n\n"
JSON_FORMAT = {
    "type": "json_schema",
    "json_schema": {
        "name": "quote",
        "schema": {
            "type": "object",
            "properties": {"topic": {"type": "string"}, "quote": {"type": "string"}},
            "required": ["topic", "quote"],
            "additionalProperties": False,
        },
    },
}
EXTRA: dict[str, dict[str, Any]] = {"json": {"response_format": JSON_FORMAT}}


def _quotes(tok: Any, n: int, seed: int, ask: str = QUOTE_ASK) -> list[list[int]]:
    from pydoc_data.topics import topics

    rng = random.Random(seed)
    keys = sorted(topics)
    rng.shuffle(keys)
    out = []
    for key in keys:
        words = topics[key].split()
        if len(words) < 220:
            continue
        start = rng.randrange(0, len(words) - 200)
        text = " ".join(words[start : start + 150])
        out.append(render(tok, [{"role": "user", "content": ask + text}]))
        if len(out) == n:
            break
    return out


def workloads(tok: Any, seed: int = 0) -> dict[str, list[list[int]]]:
    code = [j.prompt for j in code_edit(tok, seed=seed, n=8)]
    grounded = [p for pair in zip(code, _quotes(tok, 8, seed), strict=True) for p in pair]
    free = [render(tok, [{"role": "user", "content": q}]) for q in FREE]
    mixed = [p for pair in zip(grounded, free, strict=True) for p in pair]
    json_ = _quotes(tok, 8, seed + 1, JSON_ASK)
    return {"grounded": grounded, "free": free, "mixed": mixed, "json": json_}


async def run_batch(
    url: str,
    model: str,
    prompts: list[list[int]],
    batch: int,
    max_tokens: int,
    extra: dict[str, Any] | None = None,
    temperature: float = 0.0,
) -> dict[str, Any]:
    """The prompts ``batch`` at a time, streamed (``benchmarks.http_load.complete``); output
    tokens/s over the whole run, the median TPOT (a request's time from its first token to its
    last over its tokens after the first) and the outputs. ``extra``: more fields of every
    request's body (``response_format``); ``temperature`` above 0: sampled, prompt ``i`` with
    seed ``i`` (so both servers draw the same tokens)."""
    limit = trio.CapacityLimiter(batch)
    recs: list[Any] = [None] * len(prompts)
    t0 = time.perf_counter()
    async with httpx.AsyncClient(trust_env=False) as client:

        async def one(i: int) -> None:
            async with limit:
                job = TextJob(f"r{i}", 0, prompts[i])
                body = dict(extra or {})
                if temperature > 0:
                    body.update(temperature=temperature, seed=i)
                recs[i] = await complete(
                    client, url, job, model=model, max_tokens=max_tokens, t0=t0, extra=body
                )

        async with trio.open_nursery() as nursery:
            for i in range(len(prompts)):
                nursery.start_soon(one, i)
    wall = time.perf_counter() - t0
    if failed := [r for r in recs if r.error]:
        raise RuntimeError(f"{len(failed)} requests failed, the first: {failed[0].error}")
    tokens = sum(r.completion_tokens for r in recs)
    tpots = [t for r in recs if (t := r.summary()["tpot_s"]) is not None]
    return {
        "tok_s": tokens / wall,
        "tokens": tokens,
        "wall_s": wall,
        "tpot_ms": statistics.median(tpots) * 1e3 if tpots else None,
        "texts": [r.text for r in recs],
    }


def spec_counters(url: str) -> dict[str, float]:
    text = httpx.get(url + "/metrics", timeout=10).text
    out = {}
    for name in ("num_drafts", "num_draft_tokens", "num_accepted_tokens"):
        m = re.search(rf"^vllm:spec_decode_{name}_total ([0-9.e+]+)$", text, re.M)
        out[name] = float(m.group(1)) if m else 0.0
    return out


def machine() -> str:
    """The CPU this ran on, as the reports name it (the machines differ between sessions)."""
    info: dict[str, str] = {}
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        key, _, value = line.partition(":")
        info.setdefault(key.strip(), value.strip())
    flags = info.get("flags", "").split()
    has = [f for f in ("avx512f", "avx512_bf16", "amx_tile") if f in flags]
    return (
        f"{info.get('model name', '?')}, cpuid family {info.get('cpu family', '?')} model "
        f"{info.get('model', '?')}, {len(os.sched_getaffinity(0))} vCPUs, {' '.join(has) or 'no AVX-512'}"
    )


def explorations(run: Path) -> int:
    """How many times a request explored (``spec_explore``) in the server's steps so far."""
    n = 0
    log = run / "logs" / "executor.log"
    if log.exists():
        for line in log.read_text().splitlines():
            if '"spec_explore": ["' in line:
                n += len(json.loads(line).get("spec_explore", ()))
    return n


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.spec_decode", description=__doc__)
    p.add_argument("--model", help="model directory (default: SmolLM2-135M-Instruct)")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--batches", default="1,4,16,32")
    p.add_argument("--max-tokens", type=int, default=192)
    p.add_argument("--spec", default=json.dumps(SPEC), help="--speculative-config to compare")
    p.add_argument(
        "--temperature", type=float, default=0.0,
        help="sample at this temperature, request i seeded with i (default 0: greedy)",
    )  # fmt: skip
    p.add_argument("--dtype", default="float32", help="both servers' --dtype")
    p.add_argument("--workloads", help="only these workloads (comma-separated)")
    p.add_argument("--vllm", action="store_true", help="also vLLM's CPU server at batch 1")
    p.add_argument("--work", default=".minirt/bench-spec")
    p.add_argument("--out", default="docs/benchmarks/spec-decode")
    a = p.parse_args(argv)
    from benchmarks.openai_servers import wait_health
    from minirt.launch.launch import start_runtime

    if a.model:
        model = Path(a.model).absolute()
    else:
        from gpu.model.sources import resolve

        model = Path(resolve("").path)
    tok = load_tokenizer(model)
    loads = workloads(tok)
    work = Path(a.work).absolute()
    batches = [int(b) for b in a.batches.split(",")]

    def kinds(b: int) -> list[str]:
        ks = (
            ["grounded", "free", "json"]
            if b < 16
            else ["grounded", "free"]
            if b < 32
            else ["mixed"]
        )
        return [k for k in ks if not a.workloads or k in a.workloads.split(",")]

    plan = [(b, w) for b in batches for w in kinds(b)]
    results: dict[str, Any] = {
        "model": str(model), "spec": json.loads(a.spec), "dtype": a.dtype,
        "temperature": a.temperature, "runs": [], "machine": machine(),
        "started": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
    }  # fmt: skip
    with ExitStack() as stack:
        urls, runs = {}, {}
        for name, extra in (("spec", ["--speculative-config", a.spec]), ("base", [])):
            port = free_port()
            run = work / f"run-{name}-{int(time.time())}"
            rt = stack.enter_context(
                start_runtime(
                    model, run, "--http-port", str(port), "--dtype", a.dtype, *extra, timeout=600
                )
            )
            urls[name] = f"http://127.0.0.1:{port}"
            runs[name] = run
            wait_health(urls[name], rt.proc, 300, run / "logs" / "http.log")
        for url in urls.values():  # warm-up
            trio.run(run_batch, url, str(model), loads["free"][:2], 2, 16)
        for rnd in range(a.rounds):
            for b, w in plan:
                prompts = loads[w][: max(8, 2 * b)]
                order = ("spec", "base") if rnd % 2 == 0 else ("base", "spec")
                row: dict[str, Any] = {"round": rnd, "batch": b, "workload": w}
                for name in order:
                    before = spec_counters(urls[name])
                    explored = explorations(runs[name])
                    got = trio.run(
                        run_batch, urls[name], str(model), prompts, b, a.max_tokens,
                        EXTRA.get(w), a.temperature,
                    )  # fmt: skip
                    after = spec_counters(urls[name])
                    row[name] = {k: v for k, v in got.items() if k != "texts"}
                    row[name]["texts"] = got["texts"]
                    if name == "spec":
                        row["accepted"] = (
                            after["num_accepted_tokens"] - before["num_accepted_tokens"]
                        )
                        row["drafted"] = after["num_draft_tokens"] - before["num_draft_tokens"]
                        row["explored"] = explorations(runs[name]) - explored
                row["ratio"] = row["spec"]["tok_s"] / row["base"]["tok_s"]
                row["identical"] = row["spec"]["texts"] == row["base"]["texts"]
                print(
                    f"round {rnd} b={b} {w}: spec {row['spec']['tok_s']:.1f} tok/s, base "
                    f"{row['base']['tok_s']:.1f}, ratio {row['ratio']:.2f}, accepted "
                    f"{row['accepted']:.0f}/{row['drafted']:.0f}, identical {row['identical']}",
                    file=sys.stderr,
                )
                results["runs"].append(row)
    if a.vllm:
        results["vllm"] = vllm_batch1(model, loads, work, a.max_tokens, a.dtype, a.temperature)
    results["ended"] = time.strftime("%H:%M UTC", time.gmtime())
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    for row in results["runs"]:
        for name in ("spec", "base"):
            row[name].pop("texts")
    (results_dir(out) / "report.json").write_text(json.dumps(results, indent=1))
    (out / "README.md").write_text(report(results, argv if argv is not None else sys.argv[1:]))
    return 0


def vllm_batch1(
    model: Path,
    loads: dict[str, list[list[int]]],
    work: Path,
    max_tokens: int,
    dtype: str = "float32",
    temperature: float = 0.0,
) -> dict[str, Any]:
    from benchmarks.openai_servers import ensure_venv, vllm_server

    py = ensure_venv(Path(".minirt/bench-openai/vllm").absolute())
    threads = f"0-{len(os.sched_getaffinity(0)) - 1}"
    out = {}
    flags = ["--gpu-memory-utilization", "0.25", "--max-model-len", "2048", "--dtype", dtype]
    with vllm_server(py, model, free_port(), work / "vllm.log", threads, flags) as url:
        trio.run(run_batch, url, str(model), loads["free"][:2], 2, 16)
        for w in ("grounded", "free"):
            got = trio.run(
                run_batch, url, str(model), loads[w][:8], 1, max_tokens, None, temperature
            )
            out[w] = {k: v for k, v in got.items() if k != "texts"}
            print(f"vllm b=1 {w}: {got['tok_s']:.1f} tok/s", file=sys.stderr)
    return out


def report(r: dict[str, Any], argv: list[str]) -> str:
    lines = [
        "# Speculative decoding (n-gram prompt lookup): with and without, and vLLM",
        "",
        "Regenerate with:",
        "",
        "```sh",
        "python -m benchmarks.spec_decode " + " ".join(argv),
        "```",
        "",
        f"Model `{Path(r['model']).name}`, {r.get('dtype', 'float32')}, `--speculative-config"
        f" '{json.dumps(r['spec'])}'`. Output tokens/s of each batch run ({_sampling(r)}, OpenAI"
        " completions with token-id prompts);"
        " the ratio is with / without, paired per round (the two servers alternate first); TPOT:"
        " the median over the requests of a request's time from its first streamed token to its"
        " last over its tokens after the first (median of the rounds).",
        "",
        f"Machine: {r.get('machine', '?')}; {r.get('started', '?')} to {r.get('ended', '?')}, nothing"
        " else running.",
        "",
        "| batch | workload | with (tok/s) | without (tok/s) | ratio per round | median ratio | TPOT with / without (ms) | accepted / drafted | explorations | outputs identical |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    keys = sorted({(x["batch"], x["workload"]) for x in r["runs"]})
    for b, w in keys:
        rows = [x for x in r["runs"] if (x["batch"], x["workload"]) == (b, w)]
        ratios = [x["ratio"] for x in rows]
        acc = sum(x["accepted"] for x in rows)
        dr = sum(x["drafted"] for x in rows)
        lines.append(
            f"| {b} | {w} | {statistics.median(x['spec']['tok_s'] for x in rows):.1f} | "
            f"{statistics.median(x['base']['tok_s'] for x in rows):.1f} | "
            f"{', '.join(f'{q:.2f}' for q in ratios)} | {statistics.median(ratios):.2f} | "
            f"{_tpot(rows, 'spec')} / {_tpot(rows, 'base')} | "
            f"{acc:.0f} / {dr:.0f} ({acc / dr if dr else 0:.0%}) | "
            f"{sum(x.get('explored', 0) for x in rows)} | {all(x['identical'] for x in rows)} |"
        )
    if "vllm" in r:
        lines += [
            "",
            f"vLLM CPU 0.32.0 (no speculative decoding on CPU), batch 1, the same prompts,"
            f" {r.get('dtype', 'float32')}, {_sampling(r)}:",
            "",
        ]
        lines += [
            "| workload | vLLM (tok/s) | minirt with (tok/s) | minirt with / vLLM | TPOT vLLM / minirt with (ms) |",
            "|---|---|---|---|---|",
        ]
        for w, v in r["vllm"].items():
            mine = statistics.median(
                x["spec"]["tok_s"] for x in r["runs"] if (x["batch"], x["workload"]) == (1, w)
            )
            rows = [x for x in r["runs"] if (x["batch"], x["workload"]) == (1, w)]
            vt = f"{v['tpot_ms']:.1f}" if v.get("tpot_ms") is not None else "-"
            lines.append(
                f"| {w} | {v['tok_s']:.1f} | {mine:.1f} | {mine / v['tok_s']:.2f} | "
                f"{vt} / {_tpot(rows, 'spec')} |"
            )
    return "\n".join(lines) + "\n"


def _sampling(r: dict[str, Any]) -> str:
    t = r.get("temperature", 0.0)
    return f"sampled at temperature {t}, request i seeded with i" if t else "greedy"


def _tpot(rows: list[dict[str, Any]], name: str) -> str:
    got = [x[name]["tpot_ms"] for x in rows if x[name].get("tpot_ms") is not None]
    return f"{statistics.median(got):.1f}" if got else "-"


if __name__ == "__main__":
    raise SystemExit(main())
