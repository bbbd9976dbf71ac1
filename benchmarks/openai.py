"""``scripts/bench-openai``: minirt's OpenAI API and vLLM's OpenAI server side by side, driven by
one established client (``vllm bench serve``) on the same model and the same workloads, in
interleaved rounds (each round starts each server afresh, one after the other), with paired
ratios per round; plus what the HTTP layer costs (the same workload through minirt's ZeroMQ
client and through its HTTP API, same run). Writes README.md and its PNGs to ``--out``, the JSON
to ``--out``'s ``results/``.

Workloads (``--dataset-name random``, the model directory as tokenizer, ``--ignore-eos``; sampling
as the client sends it: by default no temperature, so both servers sample at their default 1.0,
as users' runs do; ``--sampling '--temperature 0'`` for greedy):
W1-like (64 requests, prompts 32..256 tokens, 64 output tokens, all at once) and a Poisson rate
sweep of the same requests, with goodput (``vllm bench serve --goodput``: requests meeting the
TTFT and TPOT objectives). Both servers get the same KV bytes (``--kv-gib``) and serve at their
default dtype (``--dtype auto``: the checkpoint's; ``--stored-in bfloat16`` serves a copy of the
checkpoint stored in bfloat16, as the hub stores most models); vLLM runs as its CPU docs advise
(tcmalloc preloaded, OpenMP threads bound). ``--variant`` adds minirt servers
with other flags (e.g. the fixed step budget). Run it on a quiet machine; ``--quick`` is a smoke
test.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import socket
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from benchmarks.openai_report import write_report
from benchmarks.openai_servers import ensure_venv, run_client, vllm_server, wait_health
from minirt.bench.serve import default_bench_model

WORK = Path(".minirt/bench-openai")


def _args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="scripts/bench-openai", description=__doc__)
    p.add_argument("--model", help="model directory (default: the bench model)")
    p.add_argument("--out", default="docs/benchmarks/openai", help="report directory")
    p.add_argument("--servers", default="minirt,vllm", help="which servers, in this order")
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--input-len", type=int, default=144, help="mean prompt length")
    p.add_argument(
        "--input-range", type=float, default=0.78, help="prompts uniform in len*(1 -/+ this)"
    )
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--sweep", default="2,4,8", help="request rates (req/s); empty: none")
    p.add_argument(
        "--sampling",
        default="",
        help="the client's sampling flags, e.g. '--temperature 0' (greedy) or '--temperature 0.7 "
        "--top-p 0.9 --top-k 50'; default none: each server samples at its default 1.0",
    )
    p.add_argument(
        "--dtype",
        default="auto",
        help="both servers' --dtype (auto: the checkpoint's, each server's default)",
    )
    p.add_argument(
        "--stored-in",
        default=None,
        choices=("bfloat16", "float32"),
        help="serve a copy of the model stored in this dtype (benchmarks/checkpoints.py)",
    )
    p.add_argument("--minirt-flags", default="", help="extra `minirt up` flags")
    p.add_argument(
        "--vllm-flags",
        default="--gpu-memory-utilization 0.25",
        help="extra vLLM server flags (on CPU the memory fraction is of the machine's memory)",
    )
    p.add_argument("--no-http-cost", action="store_true", help="skip the ZMQ vs HTTP runs")
    p.add_argument("--rounds", type=int, default=2, help="interleaved rounds of every server")
    p.add_argument(
        "--variant",
        action="append",
        default=[],
        metavar="NAME=FLAGS",
        help="another minirt server with these extra flags (after --minirt-flags), e.g. "
        "'minirt-fixed=--budget-policy fixed'",
    )
    p.add_argument(
        "--kv-gib", type=int, default=1, help="KV cache of each server, GiB (the same bytes)"
    )
    p.add_argument(
        "--goodput",
        default="ttft:2000 tpot:100",
        help="service-level objectives of the goodput column (vllm bench serve --goodput)",
    )
    p.add_argument("--work", default=str(WORK), help="venvs, run dirs and logs go here")
    p.add_argument(
        "--quick", action="store_true", help="smoke test: 4 prompts, 16 tokens, one rate"
    )
    a = p.parse_args(argv)
    if a.quick:
        a.num_prompts, a.output_len, a.sweep = 4, 16, "4"
    if a.rounds < 1:
        p.error("--rounds must be >= 1")
    for v in a.variant:
        if "=" not in v or not v.split("=", 1)[0]:
            p.error(f"--variant {v!r}: want NAME=FLAGS")
    return a


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def client_args(a: argparse.Namespace, rate: str, n: int | None = None, seed: int = 0) -> list[str]:
    ratio = json.dumps({"input": a.input_range, "output": 0.0})
    return [
        "--num-prompts", str(n or a.num_prompts), "--random-input-len", str(a.input_len),
        "--random-output-len", str(a.output_len), "--random-range-ratio", ratio,
        "--request-rate", rate, "--seed", str(seed), "--goodput", *a.goodput.split(),
        *shlex.split(a.sampling),
    ]  # fmt: skip


@contextmanager
def minirt_server(
    a: argparse.Namespace, model: Path, work: Path, extra: str = ""
) -> Iterator[tuple[str, Any]]:
    from minirt.launch.launch import start_runtime

    port = free_port()
    kv = str(a.kv_gib << 30)
    flags = ["--http-port", str(port), "--kv-memory", kv, "--dtype", a.dtype]
    flags += shlex.split(a.minirt_flags)
    flags += shlex.split(extra)
    run = work / f"run-minirt-{int(time.time())}"
    with start_runtime(model, run, *flags, timeout=600) as rt:
        url = f"http://127.0.0.1:{port}"
        wait_health(url, rt.proc, 120, run / "logs" / "http.log")
        yield url, rt


def run_server(
    a: argparse.Namespace, name: str, url: str, model: Path, client: Path, work: Path
) -> dict[str, Any]:
    """Warm-up, W1, then the sweep, against one server."""
    out = work / "results"
    out.mkdir(parents=True, exist_ok=True)
    log = work / f"client-{name}.log"
    print(f"{name}: warm-up", file=sys.stderr)
    run_client(client, url, model, out, f"{name}-warmup", client_args(a, "inf", 4), log)
    print(f"{name}: W1 ({a.num_prompts} requests at once)", file=sys.stderr)
    res: dict[str, Any] = {
        "w1": run_client(client, url, model, out, f"{name}-w1", client_args(a, "inf"), log),
        "sweep": {},
    }
    for rate in [r for r in a.sweep.split(",") if r]:
        print(f"{name}: {rate} req/s", file=sys.stderr)
        res["sweep"][rate] = run_client(
            client, url, model, out, f"{name}-rate{rate}", client_args(a, rate), log
        )
    return res


def main(argv: list[str] | None = None) -> int:
    a = _args(argv)
    work = Path(a.work).absolute()
    work.mkdir(parents=True, exist_ok=True)
    model = Path(a.model).absolute() if a.model else default_bench_model()
    if a.stored_in:
        from benchmarks.checkpoints import stored_in

        model = stored_in(model, a.stored_in)
    variants = dict(v.split("=", 1) for v in a.variant)
    servers = [s for s in a.servers.split(",") if s]
    servers[1:1] = [v for v in variants if v not in servers]  # after minirt, before vLLM
    for name in servers:
        if name not in ("minirt", "vllm") and name not in variants:
            raise SystemExit(f"--servers: unknown server {name!r} (minirt, vllm, a --variant)")
    client = ensure_venv(work / "client")
    results: dict[str, Any] = {name: {"rounds": []} for name in servers}
    cost: list[dict[str, Any]] = []
    threads = f"0-{len(os.sched_getaffinity(0)) - 1}"
    for rnd in range(a.rounds):
        for name in servers:
            print(f"round {rnd + 1}/{a.rounds}: {name}", file=sys.stderr)
            if name == "vllm":
                py = ensure_venv(work / "vllm")
                log = work / "vllm-server.log"
                flags = ["--dtype", a.dtype, *shlex.split(a.vllm_flags)]
                kv = {"VLLM_CPU_KVCACHE_SPACE": str(a.kv_gib)}
                with vllm_server(py, model, free_port(), log, threads, flags, kv) as url:
                    got = run_server(a, name, url, model, client, work)
            else:
                with minirt_server(a, model, work, variants.get(name, "")) as (url, rt):
                    got = run_server(a, name, url, model, client, work)
                    if name == "minirt" and rnd == 0 and not a.no_http_cost:
                        cost = http_cost(a, model, url, rt)
            results[name]["rounds"].append(got)
    command = "scripts/bench-openai " + " ".join(shlex.quote(x) for x in (argv or sys.argv[1:]))
    path = write_report(Path(a.out), command.strip(), a, model, results, cost)
    print(f"report: {path}", file=sys.stderr)
    return 0


def http_cost(a: argparse.Namespace, model: Path, url: str, rt: Any) -> list[dict[str, Any]]:
    from benchmarks.openai_cost import measure
    from minirt.bench.workloads import w1

    vocab = int(json.loads((model / "config.json").read_text())["vocab_size"])
    jobs = w1(vocab, seed=0, n=a.num_prompts, new_tokens=a.output_len)
    pids = {n: rt.pid_of(n) for n in ("http", "tokenizer", "executor")}
    print("http cost: the same W1 jobs through ZMQ, HTTP, ZMQ", file=sys.stderr)
    return measure(rt.endpoint, url, str(model), jobs, pids, vocab)


if __name__ == "__main__":
    raise SystemExit(main())
