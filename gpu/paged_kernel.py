"""Decode attention read straight from the paged KV cache on CPU: a small C kernel, compiled with
the system's C compiler on first use and called through ctypes.

The tensor path (:func:`gpu.attention._decode_group`) gathers every decode's context blocks into
a fresh ``[kv_heads, B, L, head_dim]`` copy, then reads that copy twice (scores, values): three
passes over the context. This kernel reads each block where it lies, once per pass, with no copy
and no padding: per (request, KV head) it scores the group's query heads against the context,
takes the softmax and sums the values, accumulating in float32 (K/V in float32 or bfloat16).
Measured (one thread, thread time, min of 30, interleaved with the tensor path; load on the
machine): bench model shapes, batch 64, contexts 32..288: one layer's decode attention 2.55 ->
1.39 ms in float32, 1.98 -> 1.06 ms in bfloat16; the 0.39B model's 14/2 heads, batch 16, contexts
~2,150: 7.8 -> 5.3 ms. A whole batch-64 decode step of the bench model: 78 -> 62 ms (before the
head_dim specialization).

It is built with OpenMP against torch's own OpenMP runtime, so it shares torch's thread pool and
thread count. Results differ from the tensor path by float rounding only (a different summation
order). No C compiler, a failed build, CUDA tensors or ``MINIRT_PAGED_KERNEL=0`` leave
:func:`kernel` returning None, and attention uses the tensor path.
"""

from __future__ import annotations

import ctypes
import glob
import hashlib
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

_SOURCE = r"""
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

static inline float ld_f32(const void *p, int64_t i) { return ((const float *)p)[i]; }
static inline float ld_bf16(const void *p, int64_t i) {
    uint32_t u = ((uint32_t)((const uint16_t *)p)[i]) << 16; float f;
    __builtin_memcpy(&f, &u, 4); return f;
}
static inline void st_f32(void *p, int64_t i, float v) { ((float *)p)[i] = v; }
static inline void st_bf16(void *p, int64_t i, float v) {
    uint32_t u; __builtin_memcpy(&u, &v, 4);
    u += 0x7fffu + ((u >> 16) & 1u);  /* round to nearest even */
    ((uint16_t *)p)[i] = (uint16_t)(u >> 16);
}

/* One (request, KV head) task. Inlined into callers with a constant head_dim D (64, 128) so the
   per-position loops unroll and vectorize fully; D = d for other sizes. */
#define BODY(LD, ST, D)                                                                       \
    {                                                                                         \
        int64_t L = lens[r];                                                                  \
        /* one buffer: queries, accumulators, one K/V row, softmax sums, scores */            \
        float *qv = (float *)malloc(sizeof(float) * (2 * g * D + D + g + g * L + 1));        \
        float *acc = qv + g * D, *kv = acc + g * D, *sum = kv + D, *s = sum + g;              \
        for (int64_t j = 0; j < g; j++)                                                       \
            for (int64_t e = 0; e < D; e++) {                                                 \
                qv[j * D + e] = LD(q, (r * heads + h * g + j) * D + e) * scale;               \
                acc[j * D + e] = 0.f;                                                         \
            }                                                                                 \
        const int64_t *tab = tables + r * max_blocks;                                         \
        for (int64_t l = 0; l < L; l++) {                                                     \
            int64_t row = h * num_slots + tab[l / bs] * bs + l % bs;                          \
            for (int64_t e = 0; e < D; e++) kv[e] = LD(kc, row * D + e);                      \
            for (int64_t j = 0; j < g; j++) {                                                 \
                const float *qj = qv + j * D;                                                 \
                float t = 0.f;                                                                \
                for (int64_t e = 0; e < D; e++) t += qj[e] * kv[e];                           \
                s[j * L + l] = t;                                                             \
            }                                                                                 \
        }                                                                                     \
        for (int64_t j = 0; j < g; j++) {                                                     \
            float *sj = s + j * L, m = -INFINITY, tot = 0.f;                                  \
            for (int64_t l = 0; l < L; l++) m = sj[l] > m ? sj[l] : m;                        \
            for (int64_t l = 0; l < L; l++) { sj[l] = expf(sj[l] - m); tot += sj[l]; }        \
            sum[j] = tot;                                                                     \
        }                                                                                     \
        for (int64_t l = 0; l < L; l++) {                                                     \
            int64_t row = h * num_slots + tab[l / bs] * bs + l % bs;                          \
            for (int64_t e = 0; e < D; e++) kv[e] = LD(vc, row * D + e);                      \
            for (int64_t j = 0; j < g; j++) {                                                 \
                float p = s[j * L + l], *aj = acc + j * D;                                    \
                for (int64_t e = 0; e < D; e++) aj[e] += p * kv[e];                           \
            }                                                                                 \
        }                                                                                     \
        for (int64_t j = 0; j < g; j++) {                                                     \
            float inv = 1.f / sum[j];                                                         \
            for (int64_t e = 0; e < D; e++)                                                   \
                ST(out, (r * heads + h * g + j) * D + e, acc[j * D + e] * inv);               \
        }                                                                                     \
        free(qv);                                                                             \
    }

#define DEFINE(NAME, LD, ST)                                                                  \
void NAME(const void *q, const void *kc, const void *vc, const int64_t *tables,              \
          const int64_t *lens, int64_t n, int64_t heads, int64_t kvh, int64_t d, int64_t bs, \
          int64_t num_slots, int64_t max_blocks, float scale, void *out) {                    \
    int64_t g = heads / kvh;                                                                  \
    _Pragma("omp parallel for collapse(2) schedule(dynamic)")                                 \
    for (int64_t r = 0; r < n; r++) {                                                         \
        for (int64_t h = 0; h < kvh; h++) {                                                   \
            if (d == 64) BODY(LD, ST, 64)                                                     \
            else if (d == 128) BODY(LD, ST, 128)                                              \
            else BODY(LD, ST, d)                                                              \
        }                                                                                     \
    }                                                                                         \
}

DEFINE(paged_decode_f32, ld_f32, st_f32)
DEFINE(paged_decode_bf16, ld_bf16, st_bf16)
"""
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
    try:
        with open("/proc/cpuinfo") as f:
            lines = [ln for ln in f if ln.startswith(("model name", "flags"))][:2]
        return "".join(lines)
    except OSError:
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
        fn.argtypes += [ctypes.c_void_p]
    return lib


def kernel() -> ctypes.CDLL | None:
    """The compiled library (built once per machine, loaded once per process), or None."""
    global _lib, _tried
    if not _tried:
        _tried = True
        if os.environ.get("MINIRT_PAGED_KERNEL", "1").lower() not in ("0", "false", "no", "off"):
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


def decode(
    q: torch.Tensor,
    kc: torch.Tensor,
    vc: torch.Tensor,
    tables: torch.Tensor,
    lens: torch.Tensor,
    block_size: int,
    scale: float,
) -> torch.Tensor:
    """Attention of ``q`` (``[n, heads, d]``) over each row's first ``lens[r]`` cache slots,
    found through ``tables`` (``[n, max_blocks]`` int64 block ids) in ``kc``/``vc``
    (``[kv_heads, num_slots, d]``, one layer of the cache). Returns ``[n, heads, d]``."""
    lib = kernel()
    assert lib is not None
    n, heads, d = q.shape
    kvh, num_slots, _ = kc.shape
    q = q.contiguous()
    out = torch.empty_like(q)
    fn = lib.paged_decode_f32 if q.dtype == torch.float32 else lib.paged_decode_bf16
    with torch.profiler.record_function("minirt::paged_decode"):  # named in torch.profiler
        fn(
            q.data_ptr(), kc.data_ptr(), vc.data_ptr(), tables.data_ptr(), lens.data_ptr(),
            n, heads, kvh, d, block_size, num_slots, tables.shape[1], scale, out.data_ptr(),
        )  # fmt: skip
    return out
