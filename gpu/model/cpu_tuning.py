"""Process-wide allocator settings for running the forward on CPU.

Each step allocates tens of megabytes of activations and gathered K/V and frees them again. With
glibc's defaults those buffers come from fresh ``mmap`` pages (or heap memory trimmed back to the
OS after every free), so every step pays a page fault per 4 KiB touched; in a VM that is
expensive (it tripled a decode layer's attention time: docs/benchmarks/README.md). The settings
below keep freed memory in the process for reuse (peak RSS is unchanged; RSS just does not drop
between steps).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import sys
from typing import TYPE_CHECKING

from gpu import switched_off

if TYPE_CHECKING:
    import torch

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
# Buffers up to this size come from the reusable heap; glibc caps the setting at 32 MiB on 64-bit.
MMAP_THRESHOLD = 32 << 20
TRIM_THRESHOLD = 1 << 30

_done = False


def _libc() -> ctypes.CDLL | None:
    """The C library (Linux only), or None."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    except OSError:
        return None


def tune_malloc() -> bool:
    """Raise glibc's mmap and trim thresholds once per process; True if applied.

    A no-op (False) off Linux or with a libc that has no ``mallopt`` (e.g. musl).
    """
    global _done
    if _done:
        return True
    mallopt = getattr(_libc(), "mallopt", None)
    if mallopt is None:
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    ok = mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD) == 1
    ok = mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD) == 1 and ok
    _done = ok
    return ok


_MADV_HUGEPAGE = 14
HUGE_PAGE = 2 << 20


def huge_page_zeros(numel: int, dtype: torch.dtype) -> torch.Tensor:
    """A zeroed 1-D CPU tensor of ``numel`` elements whose memory is advised for transparent huge
    pages (``madvise(MADV_HUGEPAGE)`` before the first touch, 2 MiB aligned).

    For the KV pool: decode attention reads each request's blocks where they lie, a 4 KiB page
    apiece, and with 4 KiB pages nearly every block read also misses the TLB once blocks have
    scattered (docs/benchmarks/cpu-levers/README.md). Where the kernel has no THP (or in
    ``madvise`` mode refuses) the memory is ordinary; ``MINIRT_KV_HUGE_PAGES=0`` skips the
    advice (A/B)."""
    import torch

    esize = torch.empty((), dtype=dtype).element_size()
    off_elems = HUGE_PAGE // esize
    if switched_off("MINIRT_KV_HUGE_PAGES"):
        return torch.zeros(numel, dtype=dtype)
    buf = torch.empty(numel + off_elems, dtype=dtype)
    base = buf.data_ptr()
    start = (base + HUGE_PAGE - 1) & ~(HUGE_PAGE - 1)
    out = buf[(start - base) // esize :][:numel]
    length = (numel * esize) & ~(HUGE_PAGE - 1)
    madvise = getattr(_libc(), "madvise", None)
    if madvise is not None and length:
        madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        madvise(start, length, _MADV_HUGEPAGE)  # advice only: failure changes nothing
    return out.zero_()


def bind_threads() -> tuple[list[int], list[int]]:
    """Pin each thread of torch's OpenMP pool to one of this process's CPUs, the calling thread
    (OpenMP's thread 0) to the first (``minirt.bind_threads``, as vLLM's CPU worker binds its
    threads). Returns the CPUs before, and the CPU each pool thread got (-1: refused)."""
    import os

    from gpu import kernels

    cpus = sorted(os.sched_getaffinity(0))
    return cpus, list(kernels.library().bind_threads(cpus))
