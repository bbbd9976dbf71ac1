"""``minirt bench executor``: workload W1 through the executor, transformers' static batched
``generate`` and transformers' continuous batching (``generate_batch``), in one process.

W1: 64 requests, prompt lengths uniform in [32, 256] of random ids >= 16, 64 new tokens each,
greedy, EOS ignored, seed 0, float32, 2 threads. Prints output tokens/s of each, the ratios, peak
RSS and the compute-limit percentage (the workload's matmul FLOPs at a measured GEMM rate,
divided by our wall time). ``--json PATH`` also writes the results.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import resource
import time
from pathlib import Path

import torch

DEFAULT_MODEL = Path.home() / ".cache" / "minirt" / "models" / "bench-qwen2"


def _args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="minirt bench executor", description=__doc__)
    p.add_argument("--model", type=Path, default=None, help="model dir (default: bench qwen2)")
    p.add_argument("--requests", type=int, default=64)
    p.add_argument("--min-prompt", type=int, default=32)
    p.add_argument("--max-prompt", type=int, default=256)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--chunk-cap", type=int, default=1024)
    # 2048 rather than the executor's 8192: the same speed here, and ~30% less peak RSS.
    p.add_argument("--step-budget", type=int, default=2048)
    p.add_argument("--max-batch-size", type=int, default=256)
    p.add_argument("--hf-batch", type=int, default=16)
    p.add_argument("--skip-hf", action="store_true", help="skip transformers' static batching")
    p.add_argument("--skip-cb", action="store_true", help="skip transformers' generate_batch")
    p.add_argument("--quick", action="store_true", help="8 requests, 16 new tokens (smoke test)")
    p.add_argument("--json", type=Path, default=None, help="also write results here")
    a = p.parse_args(argv)
    if a.quick:
        a.requests, a.new_tokens = 8, 16
    return a


def _peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def workload(n: int, lo: int, hi: int, vocab: int, seed: int) -> list[list[int]]:
    """``n`` prompts, lengths uniform in [lo, hi], ids uniform in [16, vocab)."""
    rng = random.Random(seed)
    return [[rng.randrange(16, vocab) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


def run_ours(ex, prompts: list[list[int]], new_tokens: int) -> tuple[float, list[list[int]], dict]:
    """Drive the executor as the KV manager would (allocate blocks on demand); return
    (seconds, outputs, step stats)."""
    from gpu.sampling import SamplingParams

    bs = ex.block_size
    free = list(range(ex.num_blocks - 1, -1, -1))
    tables: dict[str, list[int]] = {}
    outs: dict[str, list[int]] = {}
    params = SamplingParams(max_tokens=new_tokens, ignore_eos=True)
    t0, c0 = time.perf_counter(), time.process_time()
    for i, p in enumerate(prompts):
        rid = f"w{i}"
        tables[rid] = [free.pop() for _ in range(-(-len(p) // bs))]
        outs[rid] = []
        ex.add_request(rid, p, params, list(tables[rid]))
    steps = forward_s = 0.0
    while ex.has_work():
        res = ex.step()
        steps += 1
        forward_s += res.forward_s
        for o in res.outputs:
            if o.token_id is None:
                continue
            outs[o.request_id].append(o.token_id)
            if o.finish_reason is not None:
                free.extend(tables.pop(o.request_id))
                continue
            need = -(-(o.num_prompt_tokens + o.num_output_tokens) // bs) - len(tables[o.request_id])
            if need > 0:
                new = [free.pop() for _ in range(need)]
                tables[o.request_id].extend(new)
                ex.extend(o.request_id, new)
    elapsed = time.perf_counter() - t0
    stats = {
        "steps": steps,
        "forward_s": forward_s,
        "outside_forward_s": elapsed - forward_s,
        "cpu_s": time.process_time() - c0,
    }
    return elapsed, [outs[f"w{i}"] for i in range(len(prompts))], stats


def run_hf_static(
    model, prompts, new_tokens: int, batch: int, pad: int
) -> tuple[float, float, list]:
    """transformers ``generate`` on batches of ``batch`` prompts, left-padded, greedy."""
    from transformers import GenerationConfig

    cfg = GenerationConfig(
        max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, pad_token_id=pad
    )
    outs: list[list[int]] = []
    t0, c0 = time.perf_counter(), time.process_time()
    for i in range(0, len(prompts), batch):
        group = prompts[i : i + batch]
        width = max(len(p) for p in group)
        ids = torch.tensor([[pad] * (width - len(p)) + p for p in group], device=model.device)
        mask = torch.tensor(
            [[0] * (width - len(p)) + [1] * len(p) for p in group], device=model.device
        )
        with torch.inference_mode():
            out = model.generate(input_ids=ids, attention_mask=mask, generation_config=cfg)
        outs.extend(out[:, width:].tolist())
    return time.perf_counter() - t0, time.process_time() - c0, outs


def run_hf_cb(
    model, prompts, new_tokens: int, pad: int, max_tokens: int
) -> tuple[float, float, list]:
    """transformers continuous batching (``generate_batch``), greedy, its KV cache sized to the
    workload (its default sizing takes a large share of host memory on CPU)."""
    from transformers import GenerationConfig
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    page = 256
    cb_cfg = ContinuousBatchingConfig(
        page_size=page,
        num_blocks=sum(-(-(len(p) + new_tokens) // page) for p in prompts) + 8,
        max_batch_tokens=max_tokens,
    )

    cfg = GenerationConfig(
        max_new_tokens=new_tokens, do_sample=False, pad_token_id=pad, eos_token_id=None
    )
    t0, c0 = time.perf_counter(), time.process_time()
    with torch.inference_mode():
        res = model.generate_batch(
            inputs=prompts,
            generation_config=cfg,
            continuous_batching_config=cb_cfg,
            progress_bar=False,
        )
    elapsed, cpu = time.perf_counter() - t0, time.process_time() - c0
    by_id = sorted(res.values(), key=lambda r: int(str(r.request_id).rsplit("_", 1)[-1]))
    return elapsed, cpu, [list(r.generated_tokens) for r in by_id]


def gemm_rate(hidden: int, inter: int, device: torch.device, dtype: torch.dtype) -> float:
    """Best measured FLOP/s of a representative GEMM ([256, hidden] x [hidden, 2*inter]), the
    faster of ``F.linear`` and the packed linear the executor uses (see ``gpu.linear``)."""
    from gpu.linear import Linear, packing_enabled

    a = torch.randn(256, hidden, device=device, dtype=dtype)
    w = torch.randn(2 * inter, hidden, device=device, dtype=dtype)
    fns = [lambda: torch.nn.functional.linear(a, w)]
    if packing_enabled(device, dtype):
        packed = Linear(w, None, pack=True)  # its one kernel is built on the first timed call
        fns.append(lambda: packed(a))
    best = float("inf")
    for fn in fns:
        for _ in range(50):
            t = time.perf_counter()
            fn()
            if device.type == "cuda":
                torch.cuda.synchronize()
            best = min(best, time.perf_counter() - t)
    return 2 * 256 * hidden * 2 * inter / best


def workload_flops(spec, prompts: list[list[int]], new_tokens: int) -> float:
    """Matmul FLOPs the workload needs: linears for every computed token, attention scores and
    values over each token's context, the LM head once per output token."""
    h, d = spec.hidden_size, spec.head_dim
    q, kv = spec.num_heads * d, spec.num_kv_heads * d
    per_tok = 2 * (h * (q + 2 * kv) + q * h + 3 * h * spec.intermediate_size) * spec.num_layers
    total = 0.0
    for p in prompts:
        n = len(p) + new_tokens - 1  # tokens that go through the model
        total += n * per_tok
        total += 4 * q * spec.num_layers * n * (n + 1) / 2  # QK^T and PV over the causal context
        total += 2 * h * spec.vocab_size * new_tokens
    return total


def main(argv: list[str]) -> int:
    a = _args(list(argv))
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    torch.set_num_threads(a.threads)
    model_dir = a.model
    if model_dir is None:
        model_dir = DEFAULT_MODEL
        if not (model_dir / "config.json").exists():
            from gpu.make_model import make_model

            make_model("qwen2", "bench", model_dir)
    from gpu.executor import Executor
    from gpu.loader import load_spec

    spec = load_spec(model_dir)
    prompts = workload(a.requests, a.min_prompt, a.max_prompt, spec.vocab_size, a.seed)
    blocks = sum(-(-(len(p) + a.new_tokens) // 16) for p in prompts) + 64
    ex = Executor(
        model_dir,
        dtype=a.dtype,
        device=a.device,
        num_blocks=blocks,
        chunk_cap=a.chunk_cap,
        step_budget=a.step_budget,
        max_batch_size=a.max_batch_size,
        threads=a.threads,
    )
    run_ours(ex, workload(4, 16, 64, spec.vocab_size, 99), 4)  # warm-up
    rate_before = gemm_rate(spec.hidden_size, spec.intermediate_size, ex.device, ex.dtype)
    ours_s, ours_out, stats = run_ours(ex, prompts, a.new_tokens)
    n_out = sum(len(o) for o in ours_out)
    res: dict = {
        "model": str(model_dir),
        "requests": a.requests,
        "new_tokens": a.new_tokens,
        "threads": a.threads,
        "step_budget": a.step_budget,
        "chunk_cap": a.chunk_cap,
        "num_blocks": ex.num_blocks,
        "device": str(ex.device),
        "dtype": str(ex.dtype).removeprefix("torch."),
        "ours_s": ours_s,
        "ours_tok_s": n_out / ours_s,
        "ours_steps": stats["steps"],
        "ours_outside_forward_s": stats["outside_forward_s"],
        "ours_cpu_s": stats["cpu_s"],
        "peak_rss_ours_mb": _peak_rss_mb(),
    }
    print(
        f"ours:       {n_out} tokens in {ours_s:.2f}s = {res['ours_tok_s']:.1f} tok/s "
        f"({stats['steps']:.0f} steps, {stats['outside_forward_s']:.2f}s outside forward, "
        f"{stats['cpu_s']:.1f}s CPU time)"
    )
    dev, dt = ex.device, ex.dtype
    del ex  # free our weights and KV before loading transformers' copy
    # best of before and after our run: a shared machine makes any single reading low
    rate = max(rate_before, gemm_rate(spec.hidden_size, spec.intermediate_size, dev, dt))
    flops = workload_flops(spec, prompts, a.new_tokens)
    res["gemm_gflops"] = rate / 1e9
    res["workload_gflop"] = flops / 1e9
    res["compute_limit_pct"] = 100.0 * (flops / rate) / ours_s
    print(
        f"compute:    {flops / 1e9:.1f} GFLOP at {rate / 1e9:.1f} GFLOP/s measured GEMM = "
        f"{flops / rate:.2f}s floor -> {res['compute_limit_pct']:.1f}% of compute limit"
    )
    pad = int(spec.hf_config.pad_token_id or 0)
    if not (a.skip_hf and a.skip_cb):
        from transformers import AutoModelForCausalLM

        hf = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=dt)
        hf = hf.to(dev).eval()  # type: ignore[arg-type]
    if not a.skip_hf:
        run_hf_static(hf, prompts[:2], 2, a.hf_batch, pad)  # warm-up
        hf_s, hf_cpu, hf_out = run_hf_static(hf, prompts, a.new_tokens, a.hf_batch, pad)
        res["hf_static_cpu_s"] = hf_cpu
        n = sum(len(o) for o in hf_out)
        res["hf_static_tok_s"] = n / hf_s
        res["ratio_vs_hf_static"] = res["ours_tok_s"] / res["hf_static_tok_s"]
        same = sum(x == y for x, y in zip(ours_out, hf_out, strict=True))
        res["identical_to_hf_static"] = same
        print(
            f"hf static:  {n} tokens in {hf_s:.2f}s = {res['hf_static_tok_s']:.1f} tok/s "
            f"({hf_cpu:.1f}s CPU time) -> ours is {res['ratio_vs_hf_static']:.2f}x "
            f"({same}/{len(prompts)} outputs identical)"
        )
    if not a.skip_cb:
        try:
            cb_s, cb_cpu, cb_out = run_hf_cb(hf, prompts, a.new_tokens, pad, a.step_budget)
            res["hf_cb_cpu_s"] = cb_cpu
            n = sum(len(o) for o in cb_out)
            res["hf_cb_tok_s"] = n / cb_s
            res["ratio_vs_hf_cb"] = res["ours_tok_s"] / res["hf_cb_tok_s"]
            print(
                f"hf cb:      {n} tokens in {cb_s:.2f}s = {res['hf_cb_tok_s']:.1f} tok/s "
                f"({cb_cpu:.1f}s CPU time) -> ours is {res['ratio_vs_hf_cb']:.2f}x"
            )
        except Exception as e:  # report, don't crash: generate_batch support varies by version
            res["hf_cb_error"] = f"{type(e).__name__}: {e}"
            print(f"hf cb:      failed: {res['hf_cb_error']}")
    res["peak_rss_mb"] = _peak_rss_mb()
    print(
        f"peak RSS:   {res['peak_rss_ours_mb']:.0f} MB after ours, {res['peak_rss_mb']:.0f} MB at end"
    )
    if a.json is not None:
        a.json.write_text(json.dumps(res, indent=2))
    return 0
