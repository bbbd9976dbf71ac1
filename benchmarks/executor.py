"""``minirt bench executor``: workload W1 through the executor, transformers' static batched
``generate`` and transformers' continuous batching (``generate_batch``), in one process.

W1: 64 requests, prompt lengths uniform in [32, 256] of random ids >= 16, 64 new tokens each,
greedy, EOS ignored, seed 0, float32, 2 threads. ``--sampling-cost N`` adds N rounds of the same
prompts greedy and sampled and the sampler's share of the step. Prints output tokens/s of each, the ratios, peak
RSS and the compute-limit percentage (the workload's matmul FLOPs at the GEMM rate of the path
the executor runs, see ``benchmarks.compute``, divided by our wall time); one request alone
(time per output token, time outside the forward); vLLM's CPU backend on the same prompts when
its venv exists (``benchmarks.vllm_row``). ``--profile PATH`` writes torch.profiler's op table
of our run, and vLLM's worker's (the same prompts, its own torch.profiler) to PATH-vllm;
``--json PATH`` also writes the results.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import resource
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks.vllm_row import SINGLE_RUNS
from minirt.bench.serve import DEFAULT_MODEL


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
    p.add_argument(
        "--skip-vllm", action="store_true", help="skip vLLM's CPU backend (--quick does)"
    )
    p.add_argument("--vllm-batched-tokens", type=int, default=8192)
    p.add_argument(
        "--against",
        default=None,
        help="also run the prompts through a second executor in this dtype, --rounds times "
        "alternating with ours in this process, and report the median of the paired ratios",
    )
    p.add_argument(
        "--model-impl",
        default="auto",
        choices=("auto", "native", "transformers"),
        help="our executor's model code (minirt up's flag)",
    )
    p.add_argument(
        "--against-impl",
        default=None,
        choices=("native", "transformers"),
        help="like --against, with a second executor in our dtype running this --model-impl "
        "(gpu/model/generic.py: transformers' own modeling code)",
    )
    p.add_argument("--rounds", type=int, default=3, help="with --against: paired rounds")
    p.add_argument(
        "--temperature",
        type=float,
        default=0.0,
        help="with --against/--against-impl: the paired rounds sample at this temperature "
        "(0: greedy, the same tokens on both sides)",
    )
    p.add_argument(
        "--sampling-cost",
        type=int,
        default=0,
        metavar="ROUNDS",
        help="also run the prompts greedy and sampled (temperature 1.0; --sampling-cost-params "
        "for others) in this many alternating rounds and report the sampler's share of the step",
    )
    p.add_argument(
        "--sampling-cost-params",
        default='{"temperature": 1.0}',
        help="the sampled side's SamplingParams, JSON",
    )
    p.add_argument(
        "--vocab",
        type=int,
        default=None,
        help="the bench model's body with this vocabulary (made once, cached; not with --model)",
    )
    p.add_argument("--profile", type=Path, default=None, help="write our run's op table here")
    p.add_argument("--quick", action="store_true", help="8 requests, 16 new tokens (smoke test)")
    p.add_argument("--json", type=Path, default=None, help="also write results here")
    a = p.parse_args(argv)
    if a.quick:
        a.requests, a.new_tokens, a.skip_vllm = 8, 16, True
    return a


def vllm_profile_path(ours: Path | None) -> Path | None:
    """Where vLLM's op table goes beside ours (``X.txt`` -> ``X-vllm.txt``)."""
    return None if ours is None else ours.with_name(f"{ours.stem}-vllm{ours.suffix or '.txt'}")


def _peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def workload(n: int, lo: int, hi: int, vocab: int, seed: int) -> list[list[int]]:
    """``n`` prompts, lengths uniform in [lo, hi], ids uniform in [16, vocab)."""
    rng = random.Random(seed)
    return [[rng.randrange(16, vocab) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


def run_ours(
    ex, prompts: list[list[int]], new_tokens: int, sampling: dict | None = None
) -> tuple[float, list[list[int]], dict]:
    """Drive the executor as the KV manager would (allocate blocks on demand); return
    (seconds, outputs, step stats). ``sampling``: SamplingParams fields (default greedy)."""
    from messages.common import SamplingParams

    bs = ex.block_size
    free = list(range(ex.num_blocks - 1, -1, -1))
    tables: dict[str, list[int]] = {}
    outs: dict[str, list[int]] = {}
    params = SamplingParams(max_tokens=new_tokens, ignore_eos=True, **(sampling or {}))
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


def run_single(ex, prompt: list[int], new_tokens: int) -> dict:
    """One request alone: ms per output token after the first, and per step outside the forward,
    from the fastest of :data:`SINGLE_RUNS` runs (a run of ~1 s on a shared machine reads up to
    ~15% slow at random)."""
    run_ours(ex, [prompt], 2)  # warm the shapes
    secs, _, st = min(
        (run_ours(ex, [prompt], new_tokens) for _ in range(SINGLE_RUNS)), key=lambda r: r[0]
    )
    return {
        "single_tpot_ms": 1e3 * secs / max(1, new_tokens),
        "single_outside_forward_ms_per_step": 1e3 * st["outside_forward_s"] / max(1, st["steps"]),
        "single_wall_s": secs,
    }


def sampling_cost(
    ex, prompts: list[list[int]], new_tokens: int, rounds: int, sampled: dict
) -> dict:
    """``--sampling-cost``: the prompts greedy then sampled, ``rounds`` times on one executor;
    per run its wall time, steps and the time spent in the sampler (``sample_rows``: logits
    processors, filters and the draw; greedy: the argmax)."""
    import gpu.model_runner as runner

    real = runner.sample_rows
    spent = [0.0]

    def timed(*args, **kw):
        t = time.perf_counter()
        out = real(*args, **kw)
        spent[0] += time.perf_counter() - t
        return out

    runner.sample_rows = timed  # type: ignore[assignment]
    per: list[dict[str, Any]] = []
    try:
        for _ in range(max(1, rounds)):
            rnd: dict[str, Any] = {}
            for name, params in (("greedy", {}), ("sampled", sampled)):
                spent[0] = 0.0
                secs, _, stats = run_ours(ex, prompts, new_tokens, params)
                rnd[name] = {
                    "s": secs,
                    "steps": stats["steps"],
                    "step_ms": 1e3 * secs / stats["steps"],
                    "sampler_ms_per_step": 1e3 * spent[0] / stats["steps"],
                    "sampler_share": spent[0] / secs,
                }
            rnd["sampled_over_greedy"] = rnd["sampled"]["s"] / rnd["greedy"]["s"]
            per.append(rnd)
    finally:
        runner.sample_rows = real  # type: ignore[assignment]
    return {
        "sampled_params": sampled,
        "rounds": per,
        "median_sampler_share": statistics.median(r["sampled"]["sampler_share"] for r in per),
        "median_sampled_over_greedy": statistics.median(r["sampled_over_greedy"] for r in per),
    }


def paired_rounds(
    ex, other, prompts: list[list[int]], new_tokens: int, rounds: int, temperature: float = 0.0
) -> dict:
    """``--against``: ``rounds`` rounds of the prompts through ``ex`` then ``other`` (both
    warmed), each round's tok/s and ratio, and the median ratio. One run on these shared machines
    moves 10-30% minutes apart; a ratio of runs seconds apart, its median over rounds, is what
    says how the two compare."""
    per = []
    sampling = {"temperature": temperature} if temperature else None
    for _ in range(max(1, rounds)):
        ours, _, _ = run_ours(ex, prompts, new_tokens, sampling)
        theirs, outs, _ = run_ours(other, prompts, new_tokens, sampling)
        n = sum(len(o) for o in outs)
        per.append({"tok_s": n / ours, "against_tok_s": n / theirs, "ratio": theirs / ours})
    return {"rounds": per, "median_ratio": statistics.median(r["ratio"] for r in per)}


def main(argv: list[str]) -> int:
    a = _args(list(argv))
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    torch.set_num_threads(a.threads)
    model_dir = a.model
    if model_dir is None:
        model_dir = DEFAULT_MODEL
        over = None
        if a.vocab:
            model_dir = model_dir.with_name(f"{model_dir.name}-vocab{a.vocab}")
            over = {"vocab_size": a.vocab}
        if not (model_dir / "config.json").exists():
            from gpu.model.make_model import make_model

            make_model("qwen2", "bench", model_dir, config_overrides=over)
    from benchmarks import compute
    from gpu.model.loader import load_spec
    from gpu.model_runner import ModelRunner

    spec = load_spec(model_dir)
    prompts = workload(a.requests, a.min_prompt, a.max_prompt, spec.vocab_size, a.seed)
    blocks = sum(-(-(len(p) + a.new_tokens) // 16) for p in prompts) + 64

    def warmed(dtype: str, impl: str = "auto") -> ModelRunner:
        ex = ModelRunner(
            model_dir,
            model_impl=impl,
            dtype=dtype,
            device=a.device,
            num_blocks=blocks,
            chunk_cap=a.chunk_cap,
            step_budget=a.step_budget,
            max_batch_size=a.max_batch_size,
            threads=a.threads,
        )
        run_ours(ex, workload(4, 16, 64, spec.vocab_size, 99), 4)  # warm-up
        return ex

    ex = warmed(a.dtype, a.model_impl)
    rate_before = compute.gemm_rate(ex)
    prof = None
    if a.profile is not None:
        from torch.profiler import ProfilerActivity, profile

        acts = [ProfilerActivity.CPU]
        if ex.device.type == "cuda":
            acts.append(ProfilerActivity.CUDA)
        prof = profile(activities=acts)
        prof.__enter__()
    ours_s, ours_out, stats = run_ours(ex, prompts, a.new_tokens)
    if prof is not None:
        prof.__exit__(None, None, None)
        compute.write_profile(prof, a.profile, f"minirt bench executor {' '.join(argv)}")
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
    res.update(run_single(ex, prompts[0], a.new_tokens))
    print(
        f"one alone:  {res['single_tpot_ms']:.2f} ms per output token, "
        f"{res['single_outside_forward_ms_per_step']:.2f} ms per step outside the forward"
    )
    if a.sampling_cost:
        sampled = json.loads(a.sampling_cost_params)
        cost = sampling_cost(ex, prompts, a.new_tokens, a.sampling_cost, sampled)
        res["sampling_cost"] = cost
        for k, r in enumerate(cost["rounds"], 1):
            g, s_ = r["greedy"], r["sampled"]
            print(
                f"sampling:   round {k}: step {g['step_ms']:.1f} ms greedy, {s_['step_ms']:.1f} ms "
                f"sampled ({r['sampled_over_greedy']:.3f}x); sampler {g['sampler_ms_per_step']:.2f}"
                f" / {s_['sampler_ms_per_step']:.2f} ms per step = {100 * s_['sampler_share']:.1f}%"
                " of the sampled step"
            )
        print(
            f"sampling:   {json.dumps(sampled)}: median sampler share "
            f"{100 * cost['median_sampler_share']:.1f}%, sampled/greedy wall "
            f"{cost['median_sampled_over_greedy']:.3f}x over {a.sampling_cost} rounds"
        )
    if a.against or a.against_impl:
        name = a.against or f"--model-impl {a.against_impl}"
        other = warmed(a.against or a.dtype, a.against_impl or "auto")
        res["against"] = {
            "dtype": a.against or a.dtype,
            "model_impl": a.against_impl or "auto",
            "temperature": a.temperature,
            **paired_rounds(ex, other, prompts, a.new_tokens, a.rounds, a.temperature),
        }
        del other
        for k, r in enumerate(res["against"]["rounds"], 1):
            print(
                f"vs {name}: round {k}: {r['tok_s']:.1f} vs {r['against_tok_s']:.1f} tok/s "
                f"= {r['ratio']:.2f}x"
            )
        print(
            f"vs {name}: median of {a.rounds} paired rounds {res['against']['median_ratio']:.2f}x"
        )
    # best of before and after our run: a shared machine makes any single reading low
    rate = max(rate_before, compute.gemm_rate(ex))
    res["gemm_path"] = compute.gemm_path(ex)
    dev, dt = ex.device, ex.dtype
    del ex  # free our weights and KV before loading anyone else's
    flops = compute.workload_flops(spec, prompts, a.new_tokens)
    res["gemm_gflops"] = rate / 1e9
    res["workload_gflop"] = flops / 1e9
    res["compute_limit_pct"] = 100.0 * (flops / rate) / ours_s
    print(
        f"compute:    {flops / 1e9:.1f} GFLOP at {rate / 1e9:.1f} GFLOP/s ({res['gemm_path']}, "
        f"the executor's GEMM) = {flops / rate:.2f}s floor -> "
        f"{res['compute_limit_pct']:.1f}% of compute limit"
    )
    if not a.skip_vllm and dev.type == "cpu":
        from benchmarks.vllm_row import bench_row

        theirs = vllm_profile_path(a.profile)
        res.update(
            bench_row(
                model_dir,
                prompts,
                a.new_tokens,
                ours_out,
                res["ours_tok_s"],
                dtype=a.dtype,
                max_model_len=spec.max_model_len,
                max_num_batched_tokens=a.vllm_batched_tokens,
                profile=theirs,
            )
        )
        if theirs is not None and theirs.exists():
            head = f"minirt bench executor {' '.join(argv)}: vLLM's worker, the same prompts"
            theirs.write_text(
                f"{head} (one untimed run under its torch profiler)\n\n{theirs.read_text()}"
            )
            print(f"profiles:   ours {a.profile}, vLLM's worker {theirs}")
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
