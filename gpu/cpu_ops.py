"""The float32 forward's elementwise chains as single C passes (``gpu/cpu_ops.c``, built into the
paged kernel's library): RoPE, RMSNorm, the gated MLP's SiLU-and-multiply, the greedy argmax
and the KV cache write.
torch runs each as 1-8 ops; at a batch-64 decode step their dispatch and allocation is most of
the cost, and torch's bfloat16 elementwise ops widen and round at every op.

Each function returns None where it does not apply (no library, CUDA, not float32, a layout it
does not take), and the caller runs the torch expression instead. ``MINIRT_CPU_OPS=0`` turns
them off (A/B). RoPE and argmax are bit-identical to the torch expressions; RMSNorm and
SiLU-and-multiply equal them up to float rounding (a different summation order; a different
exp).
"""

from __future__ import annotations

import functools

import torch

from gpu import paged_kernel, switched_off

_ON = not switched_off("MINIRT_CPU_OPS")


def _lib(x: torch.Tensor, dtypes: tuple[torch.dtype, ...] = (torch.float32,)):
    if not _ON or x.device.type != "cpu" or x.dtype not in dtypes:
        return None
    return paged_kernel.kernel()


def rope(
    x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor, positions: torch.Tensor
) -> torch.Tensor | None:
    """``x * cos[positions] + x.roll(D / 2, -1) * sin_signed[positions]`` for ``x`` of
    ``[T, heads, D]`` (rows may be strided, each row's heads contiguous); tables ``[P, D]``."""
    lib = _lib(x)
    if lib is None or x.dim() != 3 or x.stride(2) != 1 or x.stride(1) != x.shape[2]:
        return None
    if not (cos.is_contiguous() and sin_signed.is_contiguous() and positions.dtype == torch.long):
        return None
    t, heads, d = x.shape
    out = torch.empty(t, heads, d, dtype=x.dtype)
    pos = positions.contiguous()
    with paged_kernel.named("minirt::rope"):
        lib.rope_f32(
            x.data_ptr(), x.stride(0), cos.data_ptr(), sin_signed.data_ptr(), pos.data_ptr(),
            t, heads, d, out.data_ptr(),
        )  # fmt: skip
    return out


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor | None:
    """``weight * (x * rsqrt(mean(x * x, -1) + eps))`` for 2-D ``x`` with contiguous rows."""
    lib = _lib(x)
    if lib is None or x.dim() != 2 or x.stride(1) != 1 or weight.dtype != torch.float32:
        return None
    t, n = x.shape
    out = torch.empty(t, n, dtype=x.dtype)
    w = weight.contiguous()
    with paged_kernel.named("minirt::rms_norm"):
        lib.rms_norm_f32(x.data_ptr(), x.stride(0), w.data_ptr(), t, n, eps, out.data_ptr())
    return out


def argmax(logits: torch.Tensor) -> torch.Tensor | None:
    """``logits.max(-1).indices`` for 2-D float32 ``logits`` with contiguous rows: the first
    maximum of each row, or its first NaN."""
    lib = _lib(logits)
    if lib is None or logits.dim() != 2 or logits.stride(1) != 1 or logits.shape[1] == 0:
        return None
    rows, n = logits.shape
    out = torch.empty(rows, dtype=torch.long)
    with paged_kernel.named("minirt::argmax"):
        lib.argmax_f32(logits.data_ptr(), logits.stride(0), rows, n, out.data_ptr())
    return out


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor | None:
    """``F.silu(gate) * up`` for ``gate_up`` = ``[rows, 2F]`` (gate first; rows may be strided,
    each row contiguous), float32 or bfloat16 (computed in float32, rounded once)."""
    lib = _lib(gate_up, (torch.float32, torch.bfloat16))
    if lib is None or gate_up.dim() != 2 or gate_up.stride(1) != 1 or gate_up.shape[1] % 2:
        return None
    rows, f = gate_up.shape[0], gate_up.shape[1] // 2
    out = torch.empty(rows, f, dtype=gate_up.dtype)
    fn = lib.silu_mul_f32 if gate_up.dtype == torch.float32 else lib.silu_mul_bf16
    with paged_kernel.named("minirt::silu_mul"):
        fn(gate_up.data_ptr(), gate_up.stride(0), rows, f, out.data_ptr())
    return out


def kv_write(cache: torch.Tensor, slots: torch.Tensor, x: torch.Tensor) -> bool:
    """``cache.index_copy_(1, slots, x.transpose(0, 1))`` for a contiguous ``cache`` of
    ``[heads, num_slots, D]`` and ``x`` of ``[n, heads, D]`` (rows and heads may be strided, each
    vector contiguous), float32 or bfloat16: an exact copy. False where it does not apply."""
    lib = _lib(x, (torch.float32, torch.bfloat16))
    if lib is None or x.dim() != 3 or x.stride(2) != 1 or cache.dtype != x.dtype:
        return False
    if not cache.is_contiguous() or cache.shape[0] != x.shape[1] or cache.shape[2] != x.shape[2]:
        return False
    if slots.dtype != torch.long or slots.dim() != 1 or slots.shape[0] != x.shape[0]:
        return False
    es = x.element_size()
    s = slots.contiguous()
    heads, num_slots, d = cache.shape
    with paged_kernel.named("minirt::kv_write"):
        bad = lib.kv_write(
            x.data_ptr(), x.stride(0) * es, x.stride(1) * es, s.data_ptr(), x.shape[0],
            heads, d * es, num_slots, cache.data_ptr(),
        )  # fmt: skip
    if bad:
        raise IndexError(f"{bad} KV slot(s) outside the cache's {num_slots} slots")
    return True


# the most rows :func:`rows_linear` takes: up to 64 it beats oneDNN's packed kernel (1.5x at 32
# rows, 1.1-1.2x at 64, on weights streamed from DRAM or L3); above, each further 32 rows read
# every weight block once more and oneDNN's blocking wins
ROWS_MAX = 64


_ROWS_DTYPES = (torch.float32, torch.bfloat16)


def pack_rows(weight: torch.Tensor) -> torch.Tensor | None:
    """``weight`` (``[N, K]``, float32 or bfloat16) copied into :func:`rows_linear`'s layout
    (blocks of 12 rows, k-major inside a block; in bfloat16 each 32-bit word a pair along k:
    ``gpu/decode_gemm.c``), or None where the kernel does not run (no library, no AVX-512 or, in
    bfloat16, no avx512_bf16 or an odd K; CUDA; another dtype)."""
    lib = _lib(weight, _ROWS_DTYPES)
    if lib is None or weight.dim() != 2:
        return None
    n, k = weight.shape
    w = weight.contiguous()
    if weight.dtype == torch.bfloat16:
        if not lib.rows_gemm_bf16_vector() or k % 2:
            return None
        out = torch.empty(lib.rows_packed_len_bf16(n, k), dtype=torch.int32)
        lib.rows_pack_bf16(w.data_ptr(), n, k, out.data_ptr())
        return out
    if not lib.rows_gemm_vector():
        return None
    out = torch.empty(lib.rows_packed_len(n, k), dtype=torch.float32)
    lib.rows_pack_f32(w.data_ptr(), n, k, out.data_ptr())
    return out


@functools.lru_cache(maxsize=1024)
def _scratch_len(lib, m: int, k: int, bf16: bool) -> int:
    """Words of the kernel's scratch for ``m`` rows of ``k`` (asked once per shape)."""
    return int(lib.rows_scratch_len_bf16(m, k) if bf16 else lib.rows_scratch_len(m, k))


def rows_linear(
    x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None, n: int
) -> torch.Tensor | None:
    """``F.linear(x, weight, bias)`` for 2-D ``x`` of 1..:data:`ROWS_MAX` rows (each row
    contiguous) against :func:`pack_rows`'s copy of the ``[n, K]`` weight, in the weight's dtype;
    equal up to float rounding (one fused multiply-add chain over K in order per output; in
    bfloat16 a float32 chain over the pairs of K, rounded to bfloat16 once)."""
    lib = _lib(x, _ROWS_DTYPES)
    m = x.shape[0]
    if lib is None or x.dim() != 2 or x.stride(1) != 1 or not 0 < m <= ROWS_MAX:
        return None
    bf16 = packed.dtype == torch.int32
    if bf16 != (x.dtype == torch.bfloat16) or (bf16 and (x.stride(0) % 2 or x.data_ptr() % 4)):
        return None
    k = x.shape[1]
    scratch = torch.empty(_scratch_len(lib, m, k, bf16), dtype=packed.dtype)
    out = torch.empty(m, n, dtype=x.dtype)
    gemm = lib.rows_gemm_bf16 if bf16 else lib.rows_gemm_f32
    with paged_kernel.named("minirt::rows_linear"):
        gemm(
            x.data_ptr(), x.stride(0), m, packed.data_ptr(),
            bias.data_ptr() if bias is not None else None, n, k, scratch.data_ptr(), out.data_ptr(),
        )  # fmt: skip
    return out
