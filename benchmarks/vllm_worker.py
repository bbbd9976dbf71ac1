"""Runs inside vLLM's own venv (``benchmarks/vllm_row.py`` starts it): stdlib and vllm only, no minirt.

Reads a JSON job (argv[1]): the engine's settings and a list of runs, each a list of token-id
prompts and ``max_tokens``; loads ``vllm.LLM`` once, warms it up, then times each run's
``LLM.generate`` (greedy, EOS ignored, no detokenization). Writes the results as JSON (argv[2]).
With ``score`` set instead (a list of token-id sequences), it scores each sequence under teacher
forcing: the rank and logprob, at every position, of the token the sequence has there
(``prompt_logprobs``).
With ``profile_dir`` set, a run marked ``profile`` is first run once more under vLLM's torch
profiler (untimed), which writes the worker's op table into that directory.
"""

from __future__ import annotations

import json
import os
import sys
import time


def _rss_mb() -> tuple[float, list[str]]:
    """Resident memory of this process and its descendants (vLLM's engine core), now, and the
    processes counted. torch inductor's compile-worker pool is left out: idle helpers that exist
    only because vLLM compiles its graphs, and not a serving process."""
    try:
        import psutil
    except ImportError:
        return 0.0, []
    me = psutil.Process()
    total, names = me.memory_info().rss, [me.name()]
    for ch in me.children(recursive=True):
        try:
            cmd = " ".join(ch.cmdline())
            if "_inductor" in cmd or "compile_worker" in cmd:
                continue
            total += ch.memory_info().rss
            names.append(ch.name())
        except psutil.Error:
            pass
    return total / 2**20, names


def main(job_path: str, out_path: str) -> int:
    with open(job_path) as f:
        job = json.load(f)
    # run as a script: its own folder (benchmarks) must not shadow installed packages
    here = os.path.dirname(os.path.abspath(__file__))
    sys.path[:] = [x for x in sys.path if os.path.abspath(x or ".") != here]
    from vllm import LLM, SamplingParams

    t0 = time.perf_counter()
    llm = LLM(
        model=job["model"],
        dtype=job["dtype"],
        block_size=job["block_size"],
        max_model_len=job["max_model_len"],
        max_num_seqs=job["max_num_seqs"],
        max_num_batched_tokens=job["max_num_batched_tokens"],
        # scoring returns prompt logprobs, which vLLM decodes with the model's tokenizer
        skip_tokenizer_init=not job.get("score"),
        enable_prefix_caching=bool(job.get("prefix_caching", False)),
        seed=0,
        # torch.profiler in the worker (CPU ops), its op table written on stop_profile
        **(
            {
                "profiler_config": {
                    "profiler": "torch",
                    "torch_profiler_dir": job["profile_dir"],
                    "torch_profiler_with_stack": False,
                }
            }
            if job.get("profile_dir")
            else {}
        ),
    )
    load_s = time.perf_counter() - t0

    def generate(prompts: list[list[int]], max_tokens: int) -> tuple[float, list[list[int]]]:
        params = SamplingParams(
            temperature=0.0, max_tokens=max_tokens, ignore_eos=True, detokenize=False
        )
        inputs = [{"prompt_token_ids": p} for p in prompts]
        t = time.perf_counter()
        outs = llm.generate(inputs, params, use_tqdm=False)  # type: ignore[arg-type]
        return time.perf_counter() - t, [list(o.outputs[0].token_ids) for o in outs]

    generate([list(range(16, 48))] * 4, 4)  # warm-up: compile and first-call costs
    if job.get("score"):  # teacher forcing: each sequence's own tokens, scored by its prefill
        params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=1, detokenize=False)
        outs = llm.generate(
            [{"prompt_token_ids": q} for q in job["score"]],
            params,
            use_tqdm=False,  # type: ignore[arg-type]
        )
        scored = []
        for q, o in zip(job["score"], outs, strict=True):
            rows = o.prompt_logprobs or []  # position i: the distribution that predicted q[i]
            scored.append(
                [
                    [row[t].rank, row[t].logprob] if row else None
                    for t, row in zip(q, rows, strict=False)
                ]
            )
        with open(out_path, "w") as f:
            json.dump({"load_s": load_s, "scored": scored}, f)
        return 0
    results = []
    peak, procs = _rss_mb()
    for run in job["runs"]:
        if run.get("profile") and job.get("profile_dir"):  # an extra, untimed run, profiled
            llm.start_profile()
            generate(run["prompts"], run["max_tokens"])
            llm.stop_profile()
        secs, outs = generate(run["prompts"], run["max_tokens"])
        rss, names = _rss_mb()
        if rss > peak:
            peak, procs = rss, names
        results.append({"seconds": secs, "outputs": outs if run.get("keep_outputs") else None})
    with open(out_path, "w") as f:
        json.dump(
            {
                "load_s": load_s,
                "rss_mb": peak,
                "rss_processes": procs,
                "runs": results,
                # what its processes preloaded (tcmalloc from vllm_row.vllm_env, libgomp from vLLM)
                "ld_preload": os.environ.get("LD_PRELOAD", ""),
            },
            f,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2]))
