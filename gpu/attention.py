"""Paged attention over a flat, unpadded batch mixing single-token decodes and prefill chunks.

Row order of the flat batch: all decodes first (one row each), then each prefill chunk's rows.
Decodes are attended together: their context slots are gathered from the cache into
``[kv_heads, B, L, head_dim]`` (L = longest context rounded up to a block, a mask hides the
tail) and two batched matmuls compute all of them. Each prefill chunk runs one
``scaled_dot_product_attention``: a chunk with no cached context attends to its own K/V with a
causal mask (no gather); a chunk that starts mid-prompt gathers its whole context from the cache
and uses a causal mask offset by its start.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from gpu.kv_cache import PagedKVCache


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
class AttentionMetadata:
    """Everything attention needs for one step, built once and shared by all layers."""

    slot_mapping: torch.Tensor  # [T] int64: cache slot written by each row
    num_decodes: int
    decode_slots: torch.Tensor | None  # [kv_heads * B * L] int64: flat cache rows of each context
    decode_bias: torch.Tensor | None  # [1, B, 1, L] float: 0 where attended, -inf on padding
    decode_len: int
    prefills: list[PrefillChunk]


def build_metadata(
    decodes: list[tuple[list[int], int]],
    prefills: list[tuple[list[int], int, int]],
    cache: PagedKVCache,
    dtype: torch.dtype,
    device: torch.device,
) -> AttentionMetadata:
    """Slot mapping and per-path index tensors for one step; pure (reads the lists only).

    ``decodes``: ``(block_table, position)`` per decode row. ``prefills``: ``(block_table, start,
    length)`` per chunk. Tables must cover the positions (the executor checks before calling).
    Gather indices address ``cache.flat_k[layer]`` (``[kv_heads * num_slots, head_dim]``).
    """
    bs = cache.block_size
    heads = torch.arange(cache.num_kv_heads, dtype=torch.long)[:, None] * cache.num_slots

    def rows(slots: torch.Tensor) -> torch.Tensor:
        return (heads + slots[None, :]).reshape(-1).to(device)

    slots: list[int] = [t[p // bs] * bs + p % bs for t, p in decodes]
    dec_slots = dec_bias = None
    dec_len = 0
    if decodes:
        nblk = max(p for _, p in decodes) // bs + 1
        dec_len = nblk * bs
        table = torch.tensor([(t[:nblk] + [0] * nblk)[:nblk] for t, _ in decodes], dtype=torch.long)
        offs = torch.arange(bs, dtype=torch.long)
        dec_slots = rows((table[:, :, None] * bs + offs).reshape(-1))
        ctx = torch.tensor([p + 1 for _, p in decodes], dtype=torch.long)
        pad = torch.arange(dec_len)[None, :] >= ctx[:, None]
        bias = torch.zeros(pad.shape, dtype=dtype).masked_fill_(pad, float("-inf"))
        dec_bias = bias[None, :, None, :].to(device)
    chunks: list[PrefillChunk] = []
    row = len(decodes)
    parts = [torch.tensor(slots, dtype=torch.long)] if slots else []
    for table, start, length in prefills:
        end = start + length
        nblk = (end + bs - 1) // bs
        blk = torch.tensor(table[:nblk], dtype=torch.long)
        ctx_slots = (blk[:, None] * bs + torch.arange(bs)).reshape(-1)[:end]
        parts.append(ctx_slots[start:])
        if start == 0:
            chunks.append(PrefillChunk(row, length, 0, None, None))
        else:
            q_pos = torch.arange(start, end)[:, None]
            mask = torch.arange(end)[None, :] <= q_pos
            chunks.append(PrefillChunk(row, length, start, rows(ctx_slots), mask.to(device)))
        row += length
    slot_mapping = torch.cat(parts).to(device) if parts else torch.empty(0, dtype=torch.long)
    return AttentionMetadata(slot_mapping, len(decodes), dec_slots, dec_bias, dec_len, chunks)


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
    if nd:
        length = meta.decode_len
        qd = q[:nd].view(nd, kv_heads, group, d).transpose(0, 1)  # [kvh, B, g, d]
        kd = kc.index_select(0, meta.decode_slots).view(kv_heads, nd, length, d)
        vd = vc.index_select(0, meta.decode_slots).view(kv_heads, nd, length, d)
        scores = torch.matmul(qd, kd.transpose(-1, -2)).mul_(scale).add_(meta.decode_bias)
        probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
        parts.append(torch.matmul(probs, vd).transpose(0, 1).reshape(nd, heads, d))
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
            if group > 1:  # sdpa with a mask and enable_gqa falls back to slow paths; expand
                kp = kp.repeat_interleave(group, dim=1)
                vp = vp.repeat_interleave(group, dim=1)
            o = F.scaled_dot_product_attention(qp, kp, vp, attn_mask=ch.mask, scale=scale)
        parts.append(o[0].transpose(0, 1))  # sdpa on cpu returns this layout contiguous
    out = parts[0] if len(parts) == 1 else torch.cat(parts)
    return out.reshape(num_tokens, heads * d)
