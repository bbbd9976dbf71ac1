"""The executor's allocator settings: step-sized buffers are reused, not page-faulted in anew."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

PROBE = """
import resource, sys
import torch
from gpu.model.cpu_tuning import tune_malloc
torch.set_num_threads(2)
if sys.argv[1] == "tuned":
    assert tune_malloc()
cache = torch.randn(64_000, 64)
slots = torch.randint(0, 64_000, (2 * 64 * 288,))
q = torch.randn(2, 64, 4, 64)
def step():  # a decode step's attention at batch 64: two ~4.7 MB gathers alive at once
    k = cache.index_select(0, slots).view(2, 64, 288, 64)
    v = cache.index_select(0, slots).view(2, 64, 288, 64)
    return torch.matmul(torch.softmax(torch.matmul(q, k.transpose(-1, -2)), -1), v)
for _ in range(5):
    step()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(50):
    step()
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def _faults(mode: str) -> int:
    # glibc's default adapts its mmap threshold at run time, so whether untuned buffers fault
    # varies from run to run; pinning the threshold low makes the untuned case the worst case
    # every time (each buffer a fresh mmap), and tune_malloc must override it.
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "131072"}
    out = subprocess.run(
        [sys.executable, "-c", PROBE, mode],
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
        env=env,
        cwd=Path(__file__).resolve().parents[2],
    )
    return int(out.stdout.strip())


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc mallopt is Linux-only")
def test_tuned_malloc_reuses_step_buffers():
    tuned, default = _faults("tuned"), _faults("default")
    # 50 steps x 2 gathers x ~1,150 pages: ~115k faults or more if every buffer is fresh.
    assert tuned < 2_000, f"{tuned} page faults over 50 steps with the tuned allocator"
    assert default > 50_000, f"the probe should fault without tuning, got {default}"


def _thp_mode() -> str:
    try:
        text = Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text()
    except OSError:
        return "absent"
    return text.split("[", 1)[1].split("]", 1)[0] if "[" in text else "absent"


def _vm_flags(addr: int) -> list[str]:
    """The VmFlags of this process's mapping that holds ``addr``."""
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and not head.endswith(":"):
            lo, hi = (int(x, 16) for x in head.split("-"))
            inside = lo <= addr < hi
        elif inside and line.startswith("VmFlags:"):
            return line.split()[1:]
    return []


@pytest.mark.skipif(
    _thp_mode() not in ("always", "madvise"), reason="no transparent huge pages on this kernel"
)
@pytest.mark.parametrize("advise", ["1", "0"])
def test_the_cpu_kv_pool_is_one_zeroed_pool_advised_for_huge_pages(monkeypatch, advise):
    import torch

    from gpu.model.kv_cache import PagedKVCache

    monkeypatch.setenv("MINIRT_KV_HUGE_PAGES", advise)
    cache = PagedKVCache(4, 2, 64, 1024, 16, torch.float32, torch.device("cpu"))  # 32 MiB
    assert all(t.is_contiguous() and not t.any() for t in cache.k + cache.v)
    # one pool, layers side by side and not aliased: a write to one layer shows in no other
    cache.write(1, torch.tensor([5]), torch.ones(1, 2, 64), torch.full((1, 2, 64), 2.0))
    assert [int(t.count_nonzero()) for t in cache.k] == [0, 128, 0, 0]
    assert [int(t.count_nonzero()) for t in cache.v] == [0, 128, 0, 0]
    start = cache.k[0].data_ptr()
    if advise == "1":
        assert start % (2 << 20) == 0
        assert "hg" in _vm_flags(start)  # madvise(MADV_HUGEPAGE) took: the kernel may use them
    else:
        assert "hg" not in _vm_flags(start)
