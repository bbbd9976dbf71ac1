"""``scripts/bench-lora``: what serving LoRA adapters costs, as users measure it: ``vllm bench
serve`` sends the same W1-like load (64 requests at once, 128-token prompts, 64 output tokens,
sampled at each server's default temperature) to the base model and then spread over four
adapters (``--lora-modules a b c d --lora-assignment round-robin``: 16 requests each), on one
server instance, for minirt and for vLLM's CPU server with the same adapters (rank 16 on q, k,
v, o, gate, up and down, random factors made with ``peft``), in interleaved rounds. Reports each
server's adapter/base throughput ratio per round, and minirt/vLLM with adapters."""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks.openai import WORK, free_port, minirt_server
from benchmarks.openai_report import row
from benchmarks.openai_servers import ensure_venv, run_client, vllm_server

NAMES = ("a", "b", "c", "d")


def _args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="scripts/bench-lora", description=__doc__)
    p.add_argument("--model", required=True, help="the base model's directory")
    p.add_argument("--out", default="docs/benchmarks/lora")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--servers", default="minirt,vllm")
    p.add_argument("--kv-gib", type=int, default=1)
    p.add_argument("--work", default=str(WORK))
    return p.parse_args(argv)


ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def make_adapter(
    base: Path, out: Path, r: int, seed: int, targets: list[str] | None = None, std: float = 0.05
) -> Path:
    """A PEFT adapter of rank ``r`` on ``base`` (``targets``: all seven linears by default),
    its factors random (``std``), saved in ``out``: nothing downloaded."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    cfg = LoraConfig(r=r, lora_alpha=2 * r, target_modules=targets or ALL, lora_dropout=0.0)
    peft_model = get_peft_model(model, cfg)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * std)
    peft_model.save_pretrained(out)
    return out


def make_adapters(model: Path, work: Path, rank: int) -> dict[str, Path]:
    """Rank-``rank`` adapters on all seven linears, random factors (made once)."""
    out = {}
    for i, name in enumerate(NAMES):
        path = work / "adapters" / f"{model.name}-r{rank}-{name}"
        out[name] = path
        if not (path / "adapter_model.safetensors").exists():
            make_adapter(model, path, rank, i, std=0.02)
    return out


def loads(a: argparse.Namespace, adapters: bool) -> list[str]:
    ratio = json.dumps({"input": 0.0, "output": 0.0})
    args = [
        "--num-prompts", str(a.num_prompts), "--random-input-len", str(a.input_len),
        "--random-output-len", str(a.output_len), "--random-range-ratio", ratio,
        "--request-rate", "inf", "--seed", "0",
    ]  # fmt: skip
    if adapters:
        args += ["--lora-modules", *NAMES, "--lora-assignment", "round-robin"]
    return args


def measure(a, name, url, model, client, work, first_adapters: bool) -> dict[str, Any]:
    out = work / "results"
    out.mkdir(parents=True, exist_ok=True)
    log = work / f"client-lora-{name}.log"
    warm = loads(a, True)
    warm[1] = "8"
    run_client(client, url, model, out, f"lora-{name}-warmup", warm, log)
    got = {}
    for adapters in (first_adapters, not first_adapters):
        kind = "adapters" if adapters else "base"
        print(f"{name}: {kind}", file=sys.stderr)
        got[kind] = run_client(
            client, url, model, out, f"lora-{name}-{kind}", loads(a, adapters), log
        )
    return got


def main(argv: list[str] | None = None) -> int:
    a = _args(argv)
    work = Path(a.work).absolute()
    model = Path(a.model).absolute()
    adapters = make_adapters(model, work, a.rank)
    client = ensure_venv(work / "client")
    threads = f"0-{len(os.sched_getaffinity(0)) - 1}"
    modules = [f"{n}={p}" for n, p in adapters.items()]
    lora = ["--enable-lora", "--max-loras", "4", "--max-lora-rank", str(a.rank)]
    servers = [s for s in a.servers.split(",") if s]
    rows: list[dict[str, Any]] = []
    for rnd in range(a.rounds):
        for name in servers:
            print(f"round {rnd + 1}/{a.rounds}: {name}", file=sys.stderr)
            first = rnd % 2 == 1  # alternate which load goes first
            if name == "vllm":
                py = ensure_venv(work / "vllm")
                flags = ["--dtype", "auto", "--gpu-memory-utilization", "0.25", *lora]
                flags += ["--lora-modules", *modules]
                kv = {"VLLM_CPU_KVCACHE_SPACE": str(a.kv_gib)}
                with vllm_server(
                    py, model, free_port(), work / "vllm-lora.log", threads, flags, kv
                ) as url:
                    got = measure(a, name, url, model, client, work, first)
            else:
                ns = argparse.Namespace(kv_gib=a.kv_gib, dtype="auto", minirt_flags="")
                extra = shlex.join([*lora, "--lora-modules", *modules])
                with minirt_server(ns, model, work, extra) as (url, _rt):
                    got = measure(a, name, url, model, client, work, first)
            for kind, res in got.items():
                rows.append({**row(name, res), "round": rnd + 1, "load": kind})
    write(Path(a.out), a, model, rows, argv if argv is not None else sys.argv[1:])
    return 0


def write(out: Path, a, model: Path, rows: list[dict[str, Any]], argv: list[str]) -> None:
    (out / "results").mkdir(parents=True, exist_ok=True)
    (out / "results" / "rows.json").write_text(json.dumps(rows, indent=1))
    cpuinfo = Path("/proc/cpuinfo").read_text().splitlines()
    cpu = next((ln.split(":", 1)[1].strip() for ln in cpuinfo if ln.startswith("model name")), "?")
    cols = [
        "round",
        "server",
        "load",
        "completed",
        "failed",
        "output_tok_s",
        "ttft_p50_ms",
        "tpot_p50_ms",
        "e2e_p50_ms",
    ]
    lines = [
        "# LoRA adapters: four in one batch against the base model, minirt and vLLM",
        "",
        "Regenerate with:",
        "",
        "```sh",
        "scripts/bench-lora " + shlex.join(argv),
        "```",
        "",
        f"Measured {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())} on {cpu}, "
        f"{len(os.sched_getaffinity(0))} CPUs. "
        + (__doc__ or "").split("\n\n")[0].replace("\n", " "),
        f"Model `{model.name}` at its own dtype (`--dtype auto`); adapters rank {a.rank}; "
        f"both servers `--enable-lora --max-loras 4 --max-lora-rank {a.rank}`, {a.kv_gib} GiB "
        "of KV each; vLLM as its CPU docs advise (tcmalloc, OpenMP threads bound).",
        "",
        "| " + " | ".join(cols) + " |",
        "|" + "---|" * len(cols),
    ]
    for r in rows:
        lines.append("| " + " | ".join(
            f"{r[c]:,.1f}" if isinstance(r[c], float) else str(r[c]) for c in cols
        ) + " |")  # fmt: skip
    lines += ["", "Paired within a round (throughput):", ""]
    by = {(r["round"], r["server"], r["load"]): r["output_tok_s"] for r in rows}
    for rnd in sorted({r["round"] for r in rows}):
        parts = []
        for s in ("minirt", "vllm"):
            base, lo = by.get((rnd, s, "base")), by.get((rnd, s, "adapters"))
            if base and lo:
                parts.append(f"{s} adapters/base **{lo / base:.2f}x**")
        m, v = by.get((rnd, "minirt", "adapters")), by.get((rnd, "vllm", "adapters"))
        if m and v:
            parts.append(f"with adapters minirt/vLLM **{m / v:.2f}x**")
        lines.append(f"- round {rnd}: " + ", ".join(parts))
    (out / "README.md").write_text("\n".join(lines) + "\n")
    print(f"report: {out / 'README.md'}", file=sys.stderr)


if __name__ == "__main__":
    raise SystemExit(main())
