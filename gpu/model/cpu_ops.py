"""The float32 forward's elementwise chains as single C passes (``gpu/csrc/cpu_ops.c``, operators
of the kernel library, :mod:`gpu.kernels`): RoPE, RMSNorm, the gated MLP's SiLU-and-multiply, the
greedy argmax, the sampled draw and the KV cache write.
torch runs each as 1-8 ops; at a batch-64 decode step their dispatch and allocation is most of
the cost, and torch's bfloat16 elementwise ops widen and round at every op.

Each function returns None where it does not apply (no library, CUDA, not float32, a layout it
does not take), and the caller runs the torch expression instead. ``MINIRT_CPU_OPS=0`` turns
them off (A/B). RoPE and argmax are bit-identical to the torch expressions; RMSNorm and
SiLU-and-multiply equal them up to float rounding (a different summation order; a different
exp).
"""

from __future__ import annotations

import torch

from gpu import switched_off
from gpu.kernels import ops

_ON = not switched_off("MINIRT_CPU_OPS")


def _lib(x: torch.Tensor, dtypes: tuple[torch.dtype, ...] = (torch.float32,)):
    if not _ON or x.device.type != "cpu" or x.dtype not in dtypes:
        return None
    return ops()


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
    return lib.rope(x, cos, sin_signed, positions)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor | None:
    """``weight * (x * rsqrt(mean(x * x, -1) + eps))`` for 2-D ``x`` with contiguous rows."""
    lib = _lib(x)
    if lib is None or x.dim() != 2 or x.stride(1) != 1 or weight.dtype != torch.float32:
        return None
    return lib.rms_norm(x, weight, eps)


def argmax(logits: torch.Tensor) -> torch.Tensor | None:
    """``logits.max(-1).indices`` for 2-D float32 ``logits`` with contiguous rows: the first
    maximum of each row, or its first NaN."""
    lib = _lib(logits)
    if lib is None or logits.dim() != 2 or logits.stride(1) != 1 or logits.shape[1] == 0:
        return None
    return lib.argmax(logits)


def sample(
    logits: torch.Tensor,
    rows: torch.Tensor,
    inv_temp: torch.Tensor,
    floor: torch.Tensor,
    log_min_p: torch.Tensor,
    u: torch.Tensor,
) -> torch.Tensor | None:
    """One draw per entry of ``rows`` from ``softmax(logits[row] * inv_temp)`` restricted to
    the logits at or above ``floor`` and to probabilities at least ``exp(log_min_p)`` times the
    best's, by inverting its cumulative sum at ``u`` (``gpu/csrc/sample.c``): the first token
    whose running sum passes ``u`` times the total. 2-D float32 ``logits`` with contiguous rows;
    ``rows`` int64, ``inv_temp``/``floor``/``log_min_p`` float32, ``u`` float64."""
    lib = _lib(logits)
    if lib is None or logits.dim() != 2 or logits.stride(1) != 1 or logits.shape[1] == 0:
        return None
    return lib.sample(logits, rows, inv_temp, floor, log_min_p, u)


def topk_values(logits: torch.Tensor, rows: torch.Tensor, k: int) -> torch.Tensor | None:
    """``logits[rows].topk(k).values`` (``[len(rows), k]``, sorted descending; -inf past a row's
    finite values) in one pass per row, without copying the rows."""
    lib = _lib(logits)
    if lib is None or logits.dim() != 2 or logits.stride(1) != 1 or logits.shape[1] == 0:
        return None
    return lib.topk_values(logits, rows, k)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor | None:
    """``F.silu(gate) * up`` for ``gate_up`` = ``[rows, 2F]`` (gate first; rows may be strided,
    each row contiguous), float32 or bfloat16 (computed in float32, rounded once)."""
    lib = _lib(gate_up, (torch.float32, torch.bfloat16))
    if lib is None or gate_up.dim() != 2 or gate_up.stride(1) != 1 or gate_up.shape[1] % 2:
        return None
    return lib.silu_mul(gate_up)


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
    lib.kv_write(cache, slots, x)  # IndexError: a slot outside the cache
    return True


# the most rows :func:`rows_linear` takes: past it, each further 32 rows read every weight block
# once more and oneDNN's blocking wins (docs/benchmarks/cpu-levers/README.md)
ROWS_MAX = 64


_ROWS_DTYPES = (torch.float32, torch.bfloat16)


def pack_rows(weight: torch.Tensor) -> torch.Tensor | None:
    """``weight`` (``[N, K]``, float32 or bfloat16) copied into :func:`rows_linear`'s layout
    (blocks of 12 rows, k-major inside a block; in bfloat16 each 32-bit word a pair along k:
    ``gpu/csrc/decode_gemm.c``), or None where the kernel does not run (no library, no AVX-512 or, in
    bfloat16, no avx512_bf16 or an odd K; CUDA; another dtype)."""
    lib = _lib(weight, _ROWS_DTYPES)
    if lib is None or weight.dim() != 2:
        return None
    if weight.dtype == torch.bfloat16:
        if not lib.has_vector("rows_bf16") or weight.shape[1] % 2:
            return None
    elif not lib.has_vector("rows_f32"):
        return None
    return lib.pack_rows(weight)


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
    return lib.rows_linear(x, packed, bias, n)


def lora_add(
    y: torch.Tensor,
    x: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    slots: torch.Tensor,
    scale: torch.Tensor,
    off: torch.Tensor,
) -> bool:
    """``y[t] += scale[s] * (x[t] @ a[s].T) @ b[s]`` with ``s = slots[t]`` (-1: none), each part
    of ``off``'s columns from its own rows of ``a`` and ``b`` (``gpu/csrc/lora.c``); False
    where it does not apply (the caller runs ``gpu.lora.slots``' torch expression)."""
    lib = _lib(x, (torch.float32, torch.bfloat16))
    if lib is None or y.dtype != x.dtype or x.stride(1) != 1 or y.stride(1) != 1:
        return False
    lib.lora_add(y, x, a, b, slots, scale, off)
    return True
