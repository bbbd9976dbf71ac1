"""Linear layers with weights packed once for oneDNN on CPU.

``F.linear`` on CPU hands each call to MKL's sgemm, which repacks the weight matrix into its
blocked layout on every call. At decode shapes (tens of rows against a 32k x 512 LM head) that
repacking costs as much as the multiply. oneDNN can take the weight prepacked once at load
(the same thing ``torch.compile``'s CPU freezing pass does), faster than ``F.linear`` at every
row count (docs/benchmarks/README.md, the table of what changed the executor's speed).

oneDNN builds (and caches) a kernel per input shape, and a process that sees hundreds of distinct
row counts grows by gigabytes (measured: 1.6 GB after row counts 1..500 against one 2816 x 512
weight, mostly heap fragmentation around the cached kernels). So calls run on a fixed set of row
counts: inputs are cut into tiles of at most 256 rows and each tile is zero-padded up to a
power of two below 8 or a multiple of 8 above: 35 shapes per weight, at most 7 padded rows per
call. :meth:`Linear.warm_up` builds all of them at load (like CUDA graph capture in other
engines), so the first requests pay no kernel builds and RSS is flat from then on.

Decode row counts (1..64 rows) in float32 run the kernel library's own linear instead
(:func:`gpu.model.cpu_ops.rows_linear`, ``gpu/csrc/decode_gemm.c``) from a second copy of the weight laid out
for it: at those counts every weight comes from memory once per step for a few dozen
multiply-adds, and oneDNN's kernel stalls on those reads (a step costs about the memory time plus
the arithmetic time); the library's streams the copy and prefetches ahead while it computes.
The copy costs the weights' size again (1.4 GB on the 0.39B model, which runs prefill on the
packed copy); ``MINIRT_ROWS_LINEAR=0`` does without it. In bfloat16 (``--dtype bfloat16``'s MLP)
the same layout holds pairs along k for avx512_bf16's pair dot product, where the CPU has it
(``MINIRT_ROWS_BF16=0`` turns only this one off). Where the CPU has AMX (:func:`amx_bf16`)
oneDNN's bf16 kernel runs on its tiles and the row kernel wins only at the fewest rows, so bf16
linears take it there up to :data:`AMX_BF16_ROWS` rows only. Each row range's gain over oneDNN,
per CPU: docs/benchmarks/cpu-levers/README.md.

The result differs from ``F.linear`` by float rounding only (a different summation order;
~1e-6 relative in float32), which the load-time self-check bounds. CUDA, other dtypes, a torch
without the ops, a failed self-check, or ``MINIRT_PACKED_LINEAR=0`` all use plain ``F.linear``.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable

import torch
import torch.nn.functional as F

from gpu import cpu_field, switched_off
from gpu.model import cpu_ops

# The row count oneDNN is told to expect when packing; any row count works with the result.
_PACK_HINT = 64
TILE_ROWS = 256
# 1-2 float32 rows on Intel (:func:`mkl_gemv_fast`) go through MKL's gemv where the plain weight
# is kept: it reads it faster than either packed copy (docs/benchmarks/cpu-levers/README.md).
GEMV_ROWS = 2
_SUPPORTED = (torch.float32, torch.bfloat16)
# bf16 rows the row kernel takes where oneDNN has AMX tiles (see the module doc)
AMX_BF16_ROWS = 4


def bucket_rows(m: int) -> int:
    """The padded row count a tile of ``m`` rows (1 <= m <= TILE_ROWS) runs at."""
    if m <= 8:
        return 1 << (m - 1).bit_length()
    return -(-m // 8) * 8


@functools.cache
def mkl_gemv_fast() -> bool:
    """Whether MKL's gemv is the fast one-or-two-row path (:data:`GEMV_ROWS`): on Intel CPUs
    only: MKL picks its code path by CPU vendor, and on AMD it is slower than the decode-row
    kernel or oneDNN (docs/benchmarks/cpu-levers/README.md)."""
    return cpu_field("vendor_id") == "GenuineIntel"


@functools.cache
def amx_bf16() -> bool:
    """Whether the CPU has AMX's bf16 tiles, which oneDNN's bf16 kernels use."""
    return "amx_bf16" in cpu_field("flags").split()


def rows_max(dtype: torch.dtype) -> int:
    """The most rows a linear in ``dtype`` sends through its decode-row copy."""
    if dtype == torch.bfloat16 and amx_bf16():
        return AMX_BF16_ROWS
    return cpu_ops.ROWS_MAX


def rows_enabled(dtype: torch.dtype = torch.float32) -> bool:
    """Whether linears in ``dtype`` build the decode-row copy (see the module doc)."""
    if dtype == torch.bfloat16 and switched_off("MINIRT_ROWS_BF16"):
        return False
    return dtype in _SUPPORTED and not switched_off("MINIRT_ROWS_LINEAR")


def packing_enabled(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether :class:`Linear` packs weights for this device and dtype."""
    if switched_off("MINIRT_PACKED_LINEAR"):
        return False
    if device.type != "cpu" or dtype not in _SUPPORTED:
        return False
    if not torch.backends.mkldnn.is_available():
        return False
    ops = torch.ops.mkldnn
    return hasattr(ops, "_reorder_linear_weight") and hasattr(ops, "_linear_pointwise")


class Linear:
    """``y = x @ weight.T + bias`` for 2-D ``x``; the weight is packed at construction when
    :func:`packing_enabled`, after which the unpacked weight is not kept (``weight`` is None)
    unless ``keep_plain`` where :func:`mkl_gemv_fast`: then calls of at most :data:`GEMV_ROWS`
    rows in float32 use it through ``F.linear`` (see :data:`GEMV_ROWS`). Packed float32 weights
    and bfloat16 ones also get the decode-row copy (``rows``) where the kernel library runs and
    :func:`rows_enabled`: calls of at most ``rows_max`` rows (:func:`rows_max`) that the plain
    weight does not take use it."""

    def __init__(
        self, weight: torch.Tensor, bias: torch.Tensor | None, pack: bool, keep_plain: bool = False
    ) -> None:
        self.bias = bias
        self.dtype = weight.dtype
        self.out_features, self.in_features = weight.shape
        self.packed: torch.Tensor | None = None
        self.weight: torch.Tensor | None = weight
        self.gemv_rows = 0
        self.rows: torch.Tensor | None = None
        self.rows_max = rows_max(weight.dtype)
        if pack:
            self.packed = _pack_checked(weight, bias)
            if self.packed is not None:
                if rows_enabled(weight.dtype):
                    self.rows = cpu_ops.pack_rows(weight)
                if keep_plain and weight.dtype == torch.float32 and mkl_gemv_fast():
                    self.gemv_rows = GEMV_ROWS
                else:
                    self.weight = None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        m = x.shape[0]
        if self.rows is not None and self.gemv_rows < m <= self.rows_max:
            out = cpu_ops.rows_linear(x, self.rows, self.bias, self.out_features)
            if out is not None:
                return out
        if self.packed is None or 0 < m <= self.gemv_rows:
            assert self.weight is not None  # kept unpacked, or kept plain for the gemv rows
            return F.linear(x, self.weight, self.bias)
        if m <= TILE_ROWS:
            return self._tile(x)
        # one preallocated output, 6x faster than cat's own (docs/benchmarks/cpu-levers/README.md)
        out = x.new_empty(m, self.out_features)
        tiles = [self._tile(x[i : i + TILE_ROWS]) for i in range(0, m, TILE_ROWS)]
        return torch.cat(tiles, out=out)

    def warm_up(self) -> None:
        """Build oneDNN's kernel for every tile shape now rather than on first use."""
        if self.packed is None:
            return
        for m in sorted({bucket_rows(m) for m in range(1, TILE_ROWS + 1)}):
            self._tile(torch.zeros(m, self.in_features, dtype=self.dtype))

    def _tile(self, x: torch.Tensor) -> torch.Tensor:
        m = x.shape[0]
        b = bucket_rows(m) if m else 1
        if b != m:
            x = torch.cat([x, x.new_zeros(b - m, x.shape[1])])
        out = torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")
        return out if b == m else out[:m]


def warm_up_shapes(linears: Iterable[Linear]) -> None:
    """:meth:`Linear.warm_up` once per distinct shape (kernels are cached by shape)."""
    seen = set()
    for lin in linears:
        key = (lin.in_features, lin.out_features, lin.bias is not None)
        if key not in seen:
            seen.add(key)
            lin.warm_up()


def _pack_checked(weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor | None:
    """The packed weight, or None if packing fails or disagrees with ``F.linear`` beyond
    rounding on a probe input."""
    try:
        packed = torch.ops.mkldnn._reorder_linear_weight(weight, _PACK_HINT)
        gen = torch.Generator().manual_seed(0)
        probe = torch.randn(3, weight.shape[1], generator=gen).to(weight.dtype)
        got = torch.ops.mkldnn._linear_pointwise(probe, packed, bias, "none", [], "").float()
    except (RuntimeError, NotImplementedError):
        return None
    want = F.linear(probe, weight, bias).float()
    tol = 1e-4 if weight.dtype == torch.float32 else 3e-2
    if not torch.allclose(got, want, rtol=tol, atol=tol * float(want.abs().max().clamp(min=1.0))):
        return None
    return packed
