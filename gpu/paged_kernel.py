"""Decode attention read straight from the paged KV cache on CPU: a small C kernel
(``gpu/paged_decode.c``), compiled with the system's C compiler on first use and called through
ctypes.

The tensor path (:func:`gpu.attention._decode_group`) gathers every decode's context blocks into
a fresh ``[kv_heads, B, L, head_dim]`` copy, then reads that copy twice (scores, values): three
passes over the context. This kernel reads each block where it lies, once per pass, with no copy
and no padding: per (request, KV head) it scores the group's query heads against the context,
takes the softmax and sums the values, accumulating in float32 (K/V in float32 or bfloat16).
With AVX-512 and head_dim 16/32/64/128 it runs an intrinsics body (16 positions scored at once,
a vector exp, value accumulators in registers, no integer division per position); elsewhere a
portable body. Measured here (2 threads, one layer, bench model shapes, batch 64): 8 prompts of
768 shared + 64 own tokens, 3.8-4.1 ms (portable) -> 0.92-0.96 ms; contexts of 180, unshared,
0.9 -> 0.4 ms (memory-bound there).

It is built with OpenMP against torch's own OpenMP runtime, so it shares torch's thread pool and
thread count. Results differ from the tensor path by float rounding only (a different summation
order). No C compiler, a failed build, CUDA tensors or ``MINIRT_PAGED_KERNEL=0`` leave
:func:`kernel` returning None, and attention uses the tensor path.
"""

from __future__ import annotations

import contextlib
import ctypes
import glob
import hashlib
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

from gpu import cpu_field, switched_off

# one library: the decode attention, the fused elementwise ops of gpu.cpu_ops and the
# decode-sized linears of gpu.linear
_SOURCE = "\n".join(
    (Path(__file__).parent / f).read_text()
    for f in ("paged_decode.c", "cpu_ops.c", "decode_gemm.c")
)
# Not -ffast-math: a shared object linked with it runs crtfastmath's constructor on load, which
# turns on flush-to-zero / denormals-are-zero for the whole process (every later float op in
# torch and Python changes). These flags give the vectorized reductions without that.
_FLAGS = [
    "-O3",
    "-march=native",
    "-fno-math-errno",
    "-fno-trapping-math",
    "-fno-signed-zeros",
    "-fassociative-math",
    "-fopenmp",
    "-shared",
    "-fPIC",
]
_lib: ctypes.CDLL | None = None
_tried = False


def _torch_gomp() -> str | None:
    """torch's bundled OpenMP runtime, to link against (one thread pool, not two)."""
    libs = sorted(glob.glob(os.path.join(os.path.dirname(torch.__file__), "lib", "libgomp*.so*")))
    return libs[0] if libs else None


def _cpu_id() -> str:
    """The CPU's model name and feature flags (Linux), else the platform's processor string."""
    cpu = cpu_field("model name") + cpu_field("flags")
    if cpu:
        return cpu
    import platform

    return platform.processor() + platform.machine()


def _build() -> ctypes.CDLL | None:
    cc = shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc")
    if cc is None:
        return None
    gomp = _torch_gomp()
    link = [gomp, f"-Wl,-rpath,{os.path.dirname(gomp)}"] if gomp else []
    # -march=native: the build is only valid on this CPU model, so the key names it too (a home
    # directory shared between machines must not hand one machine another's instructions)
    key_src = _SOURCE + " ".join(_FLAGS + link) + cc + _cpu_id()
    key = hashlib.sha256(key_src.encode()).hexdigest()[:16]
    cache = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "minirt" / "kernels"
    so = cache / f"paged_decode_{key}.so"
    if not so.exists():
        cache.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=cache) as d:
            src, tmp = Path(d) / "k.c", Path(d) / "k.so"
            src.write_text(_SOURCE)
            proc = subprocess.run(
                [cc, *_FLAGS, str(src), "-o", str(tmp), *link, "-lm"], capture_output=True
            )
            if proc.returncode != 0:
                return None
            os.replace(tmp, so)  # atomic: concurrent builders never load a partial file
    lib = ctypes.CDLL(str(so))
    for name in ("paged_decode_f32", "paged_decode_bf16"):
        fn = getattr(lib, name)
        fn.restype = None
        fn.argtypes = [ctypes.c_void_p] * 5 + [ctypes.c_int64] * 7 + [ctypes.c_float]
        fn.argtypes += [ctypes.c_void_p, ctypes.c_int64]
    lib.paged_decode_vector.restype = ctypes.c_int64
    lib.paged_decode_vector.argtypes = [ctypes.c_int64, ctypes.c_int64]
    p, i64 = ctypes.c_void_p, ctypes.c_int64
    lib.rope_f32.restype = lib.rms_norm_f32.restype = None
    lib.rope_f32.argtypes = [p, i64, p, p, p, i64, i64, i64, p]
    lib.rms_norm_f32.argtypes = [p, i64, p, i64, i64, ctypes.c_float, p]
    lib.argmax_f32.restype = None
    lib.argmax_f32.argtypes = [p, i64, i64, i64, p]
    lib.kv_write.restype = i64
    lib.kv_write.argtypes = [p, i64, i64, p, i64, i64, i64, i64, p]
    for name in ("silu_mul_f32", "silu_mul_bf16"):
        fn = getattr(lib, name)
        fn.restype = None
        fn.argtypes = [p, i64, i64, i64, p]
    lib.rows_packed_len.restype = lib.rows_scratch_len.restype = i64
    lib.rows_packed_len.argtypes = lib.rows_scratch_len.argtypes = [i64, i64]
    lib.rows_pack_f32.restype = lib.rows_gemm_f32.restype = None
    lib.rows_pack_f32.argtypes = [p, i64, i64, p]
    lib.rows_gemm_f32.argtypes = [p, i64, i64, p, p, i64, i64, p, p]
    lib.rows_gemm_vector.restype = lib.rows_gemm_bf16_vector.restype = ctypes.c_int
    lib.rows_gemm_vector.argtypes = lib.rows_gemm_bf16_vector.argtypes = []
    lib.rows_packed_len_bf16.restype = lib.rows_scratch_len_bf16.restype = i64
    lib.rows_packed_len_bf16.argtypes = lib.rows_scratch_len_bf16.argtypes = [i64, i64]
    lib.rows_pack_bf16.restype = lib.rows_gemm_bf16.restype = None
    lib.rows_pack_bf16.argtypes = [p, i64, i64, p]
    lib.rows_gemm_bf16.argtypes = [p, i64, i64, p, p, i64, i64, p, p]
    return lib


def named(name: str) -> contextlib.AbstractContextManager[object]:
    """A C call's name in torch.profiler's op table (its time is otherwise no op's: ctypes calls
    are invisible to the profiler); a no-op context while no profiler runs, so hot paths pay
    next to nothing for it."""
    if torch.autograd._profiler_enabled():
        return torch.profiler.record_function(name)
    return contextlib.nullcontext()


def kernel() -> ctypes.CDLL | None:
    """The compiled library (built once per machine, loaded once per process), or None."""
    global _lib, _tried
    if not _tried:
        _tried = True
        if not switched_off("MINIRT_PAGED_KERNEL"):
            try:
                _lib = _build()
            except OSError:
                _lib = None
    return _lib


def usable(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether :func:`decode` runs for tensors on ``device`` of ``dtype`` (else use the tensor
    path)."""
    return (
        device.type == "cpu" and dtype in (torch.float32, torch.bfloat16) and kernel() is not None
    )


def vector(dtype: torch.dtype, head_dim: int) -> bool:
    """Whether this machine's build runs the AVX-512 body for K/V of ``dtype`` and ``head_dim``."""
    lib = kernel()
    return lib is not None and bool(lib.paged_decode_vector(dtype == torch.bfloat16, head_dim))


def decode(
    q: torch.Tensor,
    kc: torch.Tensor,
    vc: torch.Tensor,
    tables: torch.Tensor,
    lens: torch.Tensor,
    block_size: int,
    scale: float,
    portable: bool = False,
) -> torch.Tensor:
    """Attention of ``q`` (``[n, heads, d]``) over each row's first ``lens[r]`` cache slots,
    found through ``tables`` (``[n, max_blocks]`` int64 block ids) in ``kc``/``vc``
    (``[kv_heads, num_slots, d]``, one layer of the cache). Returns ``[n, heads, d]``.
    ``portable`` runs the portable body even where the vector one exists (tests, A/B)."""
    lib = kernel()
    assert lib is not None
    n, heads, d = q.shape
    kvh, num_slots, _ = kc.shape
    q = q.contiguous()
    out = torch.empty_like(q)
    fn = lib.paged_decode_f32 if q.dtype == torch.float32 else lib.paged_decode_bf16
    with named("minirt::paged_decode"):
        fn(
            q.data_ptr(), kc.data_ptr(), vc.data_ptr(), tables.data_ptr(), lens.data_ptr(),
            n, heads, kvh, d, block_size, num_slots, tables.shape[1], scale, out.data_ptr(),
            int(portable),
        )  # fmt: skip
    return out
