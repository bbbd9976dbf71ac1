"""Paged attention over a flat, unpadded batch mixing single-token decodes and prefill chunks.

Row order of the flat batch: all decodes first (one row each), then each prefill chunk's rows.
On CPU, decodes run through :mod:`gpu.model.paged_kernel`, which reads the context blocks in place,
and so do prefill rows: each row is attended as a decode at its own position, over its causal
prefix in the cache (``MINIRT_PAGED_PREFILL=0`` sends them through SDPA as below). That beats
SDPA's CPU flash attention (docs/benchmarks/cpu-levers/README.md), needs no gather of a chunk's
cached context, and a row's result no longer depends on where its chunk starts. Elsewhere (or without a C compiler)
decodes are attended in a few groups of similar context length (see :func:`group_by_length`): each group's context blocks are gathered from the cache into ``[kv_heads, B, L, head_dim]``
(L = the group's longest context rounded up to a block, a mask hides the tail) and two batched
matmuls compute the whole group. Grouping bounds the padding: one group for contexts of 100 and
300 tokens would gather and multiply 50% padding. Each prefill chunk runs one
``scaled_dot_product_attention``: a chunk with no cached context attends to its own K/V with a
causal mask (no gather); a chunk that starts mid-prompt gathers its whole context from the cache
and uses a causal mask offset by its start (query heads share K/V heads through ``enable_gqa``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from gpu import switched_off
from gpu.model import paged_kernel
from gpu.model.kv_cache import PagedKVCache


@dataclass
class PrefillChunk:
    """Rows ``[row, row + length)`` of the flat batch: prompt positions ``[start, start + length)``."""

    row: int
    length: int
    start: int
    ctx_slots: (
        torch.Tensor | None
    )  # [kv_heads * (start + length)] flat cache rows; None if start == 0
    mask: torch.Tensor | None  # [length, start + length] bool, True = attend; None if start == 0


@dataclass
class DecodeGroup:
    """Decode rows attended together, all padded to ``length`` context slots."""

    rows: torch.Tensor | None  # [n] int64 decode rows of the group; None = all rows, in order
    blocks: torch.Tensor  # [kv_heads * n * L / block_size] int64 rows of cache.block_k views
    bias: torch.Tensor  # [1, n, 1, L] float: 0 where attended, -inf on padding
    length: int


@dataclass
class AttentionMetadata:
    """Everything attention needs for one step, built once and shared by all layers.

    Decodes take one of two paths: ``kernel_tables``/``kernel_lens`` set, the CPU kernel of
    :mod:`gpu.model.paged_kernel` (no gathers, no padding; ``decode_groups`` is then empty), else the
    tensor path over ``decode_groups``. With ``prefill_kernel`` the kernel's tables and lengths
    cover every row of the step (the prefill rows after the decodes) and ``prefills`` only
    locate the chunks (no gather indices or masks)."""

    slot_mapping: torch.Tensor  # [T] int64: cache slot written by each row
    num_decodes: int
    decode_groups: list[DecodeGroup]
    prefills: list[PrefillChunk]
    kernel_tables: torch.Tensor | None = None  # [kernel rows, max_blocks] int64 block ids
    kernel_lens: torch.Tensor | None = None  # [kernel rows] int64 context lengths
    prefill_kernel: bool = False  # the prefill rows are kernel rows too
    # (first row, first position, rows, block table) per decode and per chunk, in row order:
    # what attention with per-layer masks reads (gpu.model.generic)
    segments: list[tuple[int, int, int, list[int]]] = field(default_factory=list)


# Cost model for grouping decodes, in gathered blocks: a group costs its rows times its padded
# block count, plus a fixed cost for the extra kernel launches (measured on CPU: one group's fixed
# cost is about that of gathering and multiplying 64 blocks of context).
GROUP_COST_BLOCKS = 64
_MAX_CANDIDATES = 48
# The most block-table entries (rows x blocks, int64) a step's kernel rows may take with the
# prefill rows among them: 32 MB, e.g. 8,192 rows at contexts up to 8,192 tokens of 16-slot blocks.
KERNEL_TABLE_MAX = 1 << 22


def group_by_length(nblocks: list[int], group_cost: int = GROUP_COST_BLOCKS) -> list[list[int]]:
    """Partition row indices into groups of similar block counts, minimizing
    ``sum(len(group) * max block count in group) + group_cost * number of groups``.

    Pure; exact over the distinct block counts (at most 48 candidate boundaries, coarser above).
    Groups come out shortest first; rows inside a group keep ascending order.
    """
    if not nblocks:
        return []
    order = sorted(range(len(nblocks)), key=nblocks.__getitem__)
    vals = sorted(set(nblocks))
    if len(vals) > _MAX_CANDIDATES:  # keep evenly spaced boundaries (the maximum always)
        step = len(vals) / _MAX_CANDIDATES
        vals = sorted(
            {vals[min(len(vals) - 1, int((i + 1) * step) - 1)] for i in range(_MAX_CANDIDATES)}
        )
        vals[-1] = max(nblocks)
    # count[j]: rows with block count <= vals[j]
    count, i = [], 0
    for v in vals:
        while i < len(order) and nblocks[order[i]] <= v:
            i += 1
        count.append(i)
    best = [0.0] + [float("inf")] * len(vals)  # best[j]: cost of rows up to vals[j-1]
    cut = [0] * (len(vals) + 1)
    for j in range(1, len(vals) + 1):
        for k in range(j):
            c = best[k] + (count[j - 1] - (count[k - 1] if k else 0)) * vals[j - 1] + group_cost
            if c < best[j]:
                best[j], cut[j] = c, k
    bounds, j = [], len(vals)
    while j > 0:
        bounds.append((cut[j], j))
        j = cut[j]
    groups = []
    for k, j in reversed(bounds):
        lo, hi = (count[k - 1] if k else 0), count[j - 1]
        if hi > lo:
            groups.append(sorted(order[lo:hi]))
    return groups


def build_metadata(
    decodes: list[tuple[list[int], int]],
    prefills: list[tuple[list[int], int, int]],
    cache: PagedKVCache,
    dtype: torch.dtype,
    device: torch.device,
    group_cost: int = GROUP_COST_BLOCKS,
    decode_kernel: bool | None = None,
    prefill_kernel: bool | None = None,
) -> AttentionMetadata:
    """Slot mapping and per-path index tensors for one step; pure (reads the lists only).

    ``decodes``: ``(block_table, position)`` per decode row. ``prefills``: ``(block_table, start,
    length)`` per chunk. Tables must cover the positions (the executor checks before calling).
    Prefill gather indices address ``cache.flat_k[layer]`` (``[kv_heads * num_slots,
    head_dim]``); decode ones address ``cache.block_k[layer]`` (one row per block and head).
    ``group_cost``: see :func:`group_by_length`. ``decode_kernel``: decodes through
    :mod:`gpu.model.paged_kernel` (None: wherever it runs); ``prefill_kernel``: prefill rows too (None:
    with the decodes, unless ``MINIRT_PAGED_PREFILL`` is off; never when their per-row tables
    would pass :data:`KERNEL_TABLE_MAX` entries).
    """
    bs = cache.block_size
    heads = torch.arange(cache.num_kv_heads, dtype=torch.long)[:, None]

    def rows(slots: torch.Tensor) -> torch.Tensor:
        return (heads * cache.num_slots + slots[None, :]).reshape(-1).to(device)

    slots: list[int] = [t[p // bs] * bs + p % bs for t, p in decodes]
    groups: list[DecodeGroup] = []
    if decode_kernel is None:
        decode_kernel = paged_kernel.usable(device, dtype)
    if prefill_kernel is None:
        prefill_kernel = not switched_off("MINIRT_PAGED_PREFILL")
    tables = lens = None
    if decode_kernel and (decodes or prefills):
        ends = [p for _, p in decodes]
        width = max(ends + [s + n - 1 for _, s, n in prefills]) // bs + 1
        # a table row per prefill row: bounded (very long contexts take SDPA's path instead)
        rows_in = len(decodes) + sum(n for *_, n in prefills)
        prefill_kernel = bool(prefills and prefill_kernel and rows_in * width <= KERNEL_TABLE_MAX)
        if not prefill_kernel and decodes:
            width = max(ends) // bs + 1
        tabs = [
            torch.tensor([(t[: p // bs + 1] + [0] * width)[:width] for t, p in decodes])
        ] if decodes else []  # fmt: skip
        lens_parts = [torch.tensor([p + 1 for p in ends])] if decodes else []
        for ptable, start, length in prefills if prefill_kernel else []:
            nblk = (start + length - 1) // bs + 1
            trow = torch.zeros(width, dtype=torch.long)
            trow[:nblk] = torch.tensor(ptable[:nblk])
            tabs.append(trow.expand(length, width))  # one table for the chunk's rows
            lens_parts.append(torch.arange(start + 1, start + length + 1))
        if tabs:
            tables, lens = torch.cat(tabs), torch.cat(lens_parts)
    else:
        prefill_kernel = False
    members = (
        [] if decode_kernel else group_by_length([p // bs + 1 for _, p in decodes], group_cost)
    )
    in_order = len(members) == 1  # one group: rows need no selecting or scattering
    for member in members:
        nblk = max(decodes[r][1] for r in member) // bs + 1
        gtable = torch.tensor(
            [(decodes[r][0][:nblk] + [0] * nblk)[:nblk] for r in member], dtype=torch.long
        )
        blocks = (heads[:, :, None] * cache.num_blocks + gtable[None]).reshape(-1).to(device)
        ctx = torch.tensor([decodes[r][1] + 1 for r in member], dtype=torch.long)
        pad = torch.arange(nblk * bs)[None, :] >= ctx[:, None]
        bias = torch.zeros(pad.shape, dtype=dtype).masked_fill_(pad, float("-inf"))
        sel = None if in_order else torch.tensor(member, dtype=torch.long, device=device)
        groups.append(DecodeGroup(sel, blocks, bias[None, :, None, :].to(device), nblk * bs))
    chunks: list[PrefillChunk] = []
    row = len(decodes)
    parts = [torch.tensor(slots, dtype=torch.long)] if slots else []
    for ptable, start, length in prefills:
        end = start + length
        nblk = (end + bs - 1) // bs
        blk = torch.tensor(ptable[:nblk], dtype=torch.long)
        ctx_slots = (blk[:, None] * bs + torch.arange(bs)).reshape(-1)[:end]
        parts.append(ctx_slots[start:])
        if start == 0 or prefill_kernel:
            chunks.append(PrefillChunk(row, length, 0, None, None))
        else:
            q_pos = torch.arange(start, end)[:, None]
            mask = torch.arange(end)[None, :] <= q_pos
            chunks.append(PrefillChunk(row, length, start, rows(ctx_slots), mask.to(device)))
        row += length
    slot_mapping = torch.cat(parts).to(device) if parts else torch.empty(0, dtype=torch.long)
    segments = [(i, p, 1, t) for i, (t, p) in enumerate(decodes)]
    row = len(decodes)
    for ptable, start, length in prefills:
        segments.append((row, start, length, ptable))
        row += length
    return AttentionMetadata(
        slot_mapping, len(decodes), groups, chunks, tables, lens, prefill_kernel, segments
    )


def _decode_group(
    q: torch.Tensor,
    kb: torch.Tensor,
    vb: torch.Tensor,
    kv_heads: int,
    g: DecodeGroup,
    scale: float,
) -> torch.Tensor:
    """Attention of decode queries ``q`` (``[n, heads, d]``) over group ``g``'s contexts, whose
    blocks are gathered from ``kb``/``vb`` (``cache.block_k[layer]`` and the V twin)."""
    n, heads, d = q.shape
    qd = q.view(n, kv_heads, heads // kv_heads, d).transpose(0, 1)  # [kvh, n, g, d]
    kd = kb.index_select(0, g.blocks).view(kv_heads, n, g.length, d)
    vd = vb.index_select(0, g.blocks).view(kv_heads, n, g.length, d)
    scores = torch.matmul(qd, kd.transpose(-1, -2)).mul_(scale).add_(g.bias)
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    return torch.matmul(probs, vd).transpose(0, 1).reshape(n, heads, d)


def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cache: PagedKVCache,
    layer: int,
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    """Write ``k``/``v`` (``[T, kv_heads, d]``) into the cache, attend ``q`` (``[T, heads, d]``).

    Mutates the cache of ``layer`` at ``meta.slot_mapping``; returns ``[T, heads * d]``.
    """
    num_tokens, heads, d = q.shape
    kv_heads = k.shape[1]
    group = heads // kv_heads
    cache.write(layer, meta.slot_mapping, k, v)
    kc, vc = cache.flat_k[layer], cache.flat_v[layer]
    parts: list[torch.Tensor] = []  # [rows, heads, d] pieces in row order
    nd = meta.num_decodes
    if meta.kernel_tables is not None:
        assert meta.kernel_lens is not None
        kd, vd = kc.view(kv_heads, -1, d), vc.view(kv_heads, -1, d)
        tables, lens, bs = meta.kernel_tables, meta.kernel_lens, cache.block_size
        if meta.prefill_kernel:  # every row, in row order
            return paged_kernel.decode(q, kd, vd, tables, lens, bs, scale).view(num_tokens, -1)
        parts.append(paged_kernel.decode(q[:nd], kd, vd, tables, lens, bs, scale))
    elif nd:
        kb, vb = cache.block_k[layer], cache.block_v[layer]
        groups = meta.decode_groups
        if len(groups) == 1:
            parts.append(_decode_group(q[:nd], kb, vb, kv_heads, groups[0], scale))
        else:
            qd, out = q[:nd], q.new_empty(nd, heads, d)
            for g in groups:
                assert g.rows is not None
                qg = qd.index_select(0, g.rows)
                out.index_copy_(0, g.rows, _decode_group(qg, kb, vb, kv_heads, g, scale))
            parts.append(out)
    for ch in meta.prefills:
        rows = slice(ch.row, ch.row + ch.length)
        qp = q[rows].transpose(0, 1).unsqueeze(0)  # [1, h, c, d]
        if ch.ctx_slots is None:
            kp = k[rows].transpose(0, 1).unsqueeze(0)
            vp = v[rows].transpose(0, 1).unsqueeze(0)
            o = F.scaled_dot_product_attention(
                qp, kp, vp, is_causal=True, scale=scale, enable_gqa=group > 1
            )
        else:
            kp = kc.index_select(0, ch.ctx_slots).view(1, kv_heads, -1, d)
            vp = vc.index_select(0, ch.ctx_slots).view(1, kv_heads, -1, d)
            # enable_gqa over repeating K/V: same output, 3.5x faster (docs/benchmarks/README.md)
            o = F.scaled_dot_product_attention(
                qp, kp, vp, attn_mask=ch.mask, scale=scale, enable_gqa=group > 1
            )
        parts.append(o[0].transpose(0, 1))  # sdpa on cpu returns this layout contiguous
    out = parts[0] if len(parts) == 1 else torch.cat(parts)
    return out.reshape(num_tokens, heads * d)
