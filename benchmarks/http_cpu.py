"""What the HTTP server costs per streamed token: one minirt runtime, ``vllm bench serve`` (W1-like,
all at once) run ``--reps`` times against its OpenAI API, the CPU seconds of the ``http`` and
``tokenizer`` processes read from /proc around each run, divided by the tokens streamed. With
``--profile`` the last rep also samples the HTTP process (``--profile tokenizer``: the front door)
with py-spy (``py-spy`` on PATH or ``--py-spy``) and prints the functions that held its CPU.

To compare two commits, run it from a checkout of each, alternating (the machine drifts)::

    python -m benchmarks.http_cpu --reps 3 [--profile [tokenizer]] [--model DIR]

Prints one line per rep; writes nothing but its run directory under ``--work``.
"""

from __future__ import annotations

import argparse
import re
import shutil
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

from benchmarks.openai import WORK, _args, client_args, minirt_server
from benchmarks.openai_cost import cpu_seconds
from benchmarks.openai_servers import ensure_venv, run_client
from minirt.bench.serve import default_bench_model

OUTER = ("<frozen runpy>", "minirt/cli.py", "minirt/launch/runner.py", "trio/_core/_run.py")


def top_functions(raw: Path, n: int = 15) -> list[tuple[float, str]]:
    """Inclusive share of samples per function in py-spy's ``--format raw`` (collapsed stacks),
    less the frames every sample has (the interpreter's start, the actor's, trio's loop)."""
    incl: Counter[str] = Counter()
    total = 0
    for line in raw.read_text().splitlines():
        if not line.strip():
            continue
        stack, count = line.rsplit(" ", 1)
        total += int(count)
        for f in {re.sub(r":\d+\)", ")", f) for f in stack.split(";")}:
            if not any(x in f for x in OUTER):
                incl[f] += int(count)
    return [(100.0 * v / max(1, total), k) for k, v in incl.most_common(n)]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", help="model directory (default: the bench model)")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument(
        "--profile",
        nargs="?",
        const="http",
        choices=("http", "tokenizer"),
        help="py-spy this process (default: http) during the last rep",
    )
    p.add_argument("--py-spy", default=shutil.which("py-spy") or "py-spy")
    p.add_argument("--work", default=str(WORK))
    o = p.parse_args(argv)
    model = Path(o.model).absolute() if o.model else default_bench_model()
    shape = ["--input-len", "128", "--input-range", "0", "--output-len", "64"]
    a = _args(["--model", str(model), "--num-prompts", str(o.num_prompts), *shape])
    work = Path(o.work).absolute()
    client = ensure_venv(work / "client")
    out = work / "http-cpu"
    out.mkdir(parents=True, exist_ok=True)
    log = out / "client.log"
    with minirt_server(a, model, out) as (url, rt):
        pids = {"http": rt.pid_of("http"), "tokenizer": rt.pid_of("tokenizer")}
        run_client(client, url, model, out, "warm", client_args(a, "inf", 4), log)
        for rep in range(o.reps):
            spy = None
            if o.profile and rep == o.reps - 1:
                cmd = [o.py_spy, "record", "-p", str(pids[o.profile]), "-r", "200"]
                cmd += ["--format", "raw", "-o", str(out / f"{o.profile}.raw"), "--nonblocking"]
                spy = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
                time.sleep(1.0)  # attached before the run starts
            before = {k: cpu_seconds(v) for k, v in pids.items()}
            # a seed of its own: a rep with the last one's prompts would hit the prefix cache
            args = client_args(a, "inf", seed=1 + rep)
            res = run_client(client, url, model, out, f"w1-{rep}", args, log)
            used = {k: cpu_seconds(v) - before[k] for k, v in pids.items()}
            tokens = max(1, int(res["total_output_tokens"]))
            if spy is not None:
                spy.send_signal(2)
                spy.wait(30)
            print(
                f"rep {rep}: {res['output_throughput']:.1f} tok/s, TTFT p50 "
                f"{res['median_ttft_ms']:.0f} ms, http {1e6 * used['http'] / tokens:.1f} us/token, "
                f"tokenizer {1e6 * used['tokenizer'] / tokens:.1f} us/token",
                flush=True,
            )
    if o.profile and (raw := out / f"{o.profile}.raw").exists():
        print(f"The {o.profile} process, share of its CPU samples (inclusive):")
        for share, fn in top_functions(raw, 25):
            print(f"  {share:5.1f}%  {fn}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
