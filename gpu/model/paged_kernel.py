"""Decode attention read straight from the paged KV cache on CPU: the ``minirt::paged_decode``
operator (``gpu/csrc/paged_decode.c``, see :mod:`gpu.kernels`).

The tensor path (:func:`gpu.model.attention._decode_group`) gathers every decode's context blocks into
a fresh ``[kv_heads, B, L, head_dim]`` copy, then reads that copy twice (scores, values): three
passes over the context. This kernel reads each block where it lies, once per pass, with no copy
and no padding: per (request, KV head) it scores the group's query heads against the context,
takes the softmax and sums the values, accumulating in float32 (K/V in float32 or bfloat16).
With AVX-512 and head_dim 16/32/64/128 it runs an intrinsics body (16 positions scored at once,
a vector exp, value accumulators in registers, no integer division per position), 2-4x the
portable body's speed (docs/benchmarks/cpu-levers/README.md); elsewhere the portable body.

It runs on torch's own OpenMP runtime, so it shares torch's thread pool and thread count.
Results differ from the tensor path by float rounding only (a different summation order). CUDA
tensors or ``MINIRT_PAGED_KERNEL=0`` make :func:`usable` False, and attention uses the tensor
path.
"""

from __future__ import annotations

from typing import Any

import torch

from gpu.kernels import ops


def kernel() -> Any:
    """``torch.ops.minirt`` (see :mod:`gpu.kernels`), or None where switched off."""
    return ops()


def usable(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether :func:`decode` runs for tensors on ``device`` of ``dtype`` (else use the tensor
    path)."""
    return (
        device.type == "cpu" and dtype in (torch.float32, torch.bfloat16) and kernel() is not None
    )


def vector(dtype: torch.dtype, head_dim: int) -> bool:
    """Whether this machine's build runs the AVX-512 body for K/V of ``dtype`` and ``head_dim``."""
    lib = kernel()
    name = "paged_decode_bf16" if dtype == torch.bfloat16 else "paged_decode_f32"
    return lib is not None and bool(lib.has_vector(name, head_dim))


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
    return lib.paged_decode(q, kc, vc, tables, lens, block_size, scale, portable)
