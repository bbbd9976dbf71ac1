"""The transformers model path (``--model-impl transformers``): the model's own modeling code runs
the forward; attention is ours, registered in transformers' attention interface under "minirt",
reading and writing minirt's paged KV cache over the flat, unpadded step (decodes and prefill
chunks of many requests in one row of tokens, each at its own positions).

transformers builds no mask for an attention implementation it has no mask function for, so
each layer's attention gets its rows' positions from the step (``AttentionMetadata.segments``)
and applies the mask itself: causal, the layer's sliding window where transformers passes one,
its logit soft-cap where it passes one. Layers with neither go through the native path's paged
attention (gpu.model.attention, the C kernel on CPU); the others through :func:`masked`, the
eager computation transformers' own ``eager_attention_forward`` does, over the cached context.
"""

from __future__ import annotations

import contextvars
import copy
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

import torch

from gpu.model import paged_kernel
from gpu.model.attention import AttentionMetadata, paged_attention
from gpu.model.base import Model
from gpu.model.kv_cache import PagedKVCache
from gpu.model.linear import Linear, packing_enabled, warm_up_shapes
from gpu.model.loader import ModelSpec, UnsupportedModelError

NAME = "minirt"
# Keyword arguments of an attention call that change nothing here (training, eager's outputs,
# the layouts of other backends) besides those read below.
_IGNORED = frozenset(
    {"dropout", "position_ids", "is_causal", "output_attentions", "cache_position", "use_cache"}
)


@dataclass
class _Step:
    """What a forward's attention calls share: the step's metadata and the cache."""

    meta: AttentionMetadata
    cache: PagedKVCache
    longest: int  # the longest context a row of the step attends to
    seen: list[int]  # layer indices attended, in order (the start's check)
    context: dict[int | None, list[Gather]] = field(default_factory=dict)  # by window

    def gathers(self, window: int | None, device: torch.device) -> list[Gather]:
        if window not in self.context:
            self.context[window] = gathers(self.meta.segments, self.cache, window, device)
        return self.context[window]


_STEP: contextvars.ContextVar[_Step] = contextvars.ContextVar("minirt_step")


@dataclass
class Gather:
    """One segment's context for one window: the flat cache rows of its keys (every K/V head)
    and the mask of which keys each of its queries sees."""

    row: int
    length: int
    idx: torch.Tensor  # [kv_heads * n] rows of cache.flat_k[layer]
    keep: torch.Tensor  # [length, n] bool


def gathers(
    segments: list[tuple[int, int, int, list[int]]],
    cache: PagedKVCache,
    window: int | None,
    device: torch.device,
) -> list[Gather]:
    """Each segment's :class:`Gather`: keys from ``max(0, start - window + 1)`` (0 without a
    window) up to its last query, kept causally and within the window (a query at i sees keys j
    with i - j < window). The same for every layer of a window: built once per step."""
    bs = cache.block_size
    head_rows = torch.arange(cache.num_kv_heads)[:, None] * cache.num_slots
    out = []
    for row, start, length, table in segments:
        end = start + length
        pos = torch.arange(0 if window is None else max(0, start - window + 1), end)
        slots = torch.tensor(table, dtype=torch.long)[pos // bs] * bs + pos % bs
        qpos = torch.arange(start, end)[:, None]
        keep = pos[None, :] <= qpos
        if window is not None:
            keep &= qpos - pos[None, :] < window
        idx = (head_rows + slots[None, :]).reshape(-1)
        out.append(Gather(row, length, idx.to(device), keep.to(device)))
    return out


def masked(
    q: torch.Tensor,
    cache: PagedKVCache,
    layer: int,
    context: list[Gather],
    scale: float,
    softcap: float | None,
) -> torch.Tensor:
    """Attention of ``q`` (``[T, heads, d]``) over each segment's cached ``context``, as
    transformers' eager attention computes it: scores scaled, soft-capped (``tanh(s / cap) *
    cap``), masked (:func:`gathers`), softmax in float32. Returns ``[T, heads, d]``."""
    t, heads, d = q.shape
    kvh = cache.num_kv_heads
    group = heads // kvh
    kc, vc = cache.flat_k[layer], cache.flat_v[layer]
    out = q.new_empty(t, heads, d)
    for g in context:
        n = g.keep.shape[1]
        k = kc.index_select(0, g.idx).view(kvh, 1, n, d)
        v = vc.index_select(0, g.idx).view(kvh, 1, n, d)
        rows = slice(g.row, g.row + g.length)
        qs = q[rows].view(g.length, kvh, group, d).permute(1, 2, 0, 3)
        s = torch.matmul(qs, k.transpose(-1, -2)) * scale  # [kvh, group, length, n]
        if softcap is not None:
            s = torch.tanh(s / softcap) * softcap
        s = s.masked_fill(~g.keep, float("-inf"))
        p = torch.softmax(s, dim=-1, dtype=torch.float32).to(q.dtype)
        out[rows] = torch.matmul(p, v).permute(2, 0, 1, 3).reshape(g.length, heads, d)
    return out


def attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    sliding_window: int | None = None,
    softcap: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers' attention-function signature: ``query`` ``[1, heads, T, d]``, ``key`` and
    ``value`` ``[1, kv_heads, T, d]`` (rotated); writes K/V into the step's cache at the layer's
    index and returns ``[1, T, heads, d]``."""
    step = _STEP.get()
    if kwargs.get("is_causal") is False or getattr(module, "is_causal", True) is False:
        raise UnsupportedModelError(
            f"{type(module).__name__} attends bidirectionally (causal attention only)"
        )
    if attention_mask is not None:  # built by the model itself (ALiBi, prefix-LM, ...): unread
        raise UnsupportedModelError(
            f"{type(module).__name__} is given a mask of its model's own making, which the "
            "minirt attention function does not read (it masks from the step's positions)"
        )
    unknown = {k for k, v in kwargs.items() if v is not None and k not in _IGNORED}
    if unknown:  # e.g. attention sinks (s_aux): maths this function does not do
        raise UnsupportedModelError(
            f"{type(module).__name__} passes {', '.join(sorted(unknown))} to attention, "
            "which the minirt attention function does not compute"
        )
    cache = step.cache
    _, heads, t, d = query.shape
    if key.shape[1] != cache.num_kv_heads or key.shape[-1] != d or value.shape[-1] != d:
        raise UnsupportedModelError(
            f"{type(module).__name__}: keys/values of {key.shape[1]} heads x {key.shape[-1]}/"
            f"{value.shape[-1]} dims, the cache holds {cache.num_kv_heads} x {d}"
        )
    layer = int(module.__dict__.get("layer_idx", -1))  # none: the start's check refuses it
    step.seen.append(layer)
    q = query[0].transpose(0, 1).contiguous()  # [T, heads, d]
    k = key[0].transpose(0, 1).contiguous()
    v = value[0].transpose(0, 1).contiguous()
    scale = float(scaling) if scaling is not None else d**-0.5
    window = None if sliding_window is None or sliding_window >= step.longest else sliding_window
    if window is None and softcap is None:
        out = paged_attention(q, k, v, cache, layer, step.meta, scale)
    else:
        cache.write(layer, step.meta.slot_mapping, k, v)
        out = masked(q, cache, layer, step.gathers(window, q.device), scale, softcap)
    return out.view(1, t, heads, d), None


def register() -> None:
    """Register :func:`attention` as transformers' "minirt" attention implementation (once)."""
    from transformers import AttentionInterface

    AttentionInterface.register(NAME, attention)


class _Given(torch.nn.Module):
    """Stands in for the base model inside a copy of the causal-LM module, so that the model's own
    head (its LM head and whatever follows: soft-capping, logit scales) reads given hidden
    states."""

    def __init__(self) -> None:
        super().__init__()
        self.hidden: torch.Tensor | None = None

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        # the mixture-of-experts output (a superset): heads of MoE models read its router_logits
        from transformers.modeling_outputs import MoeModelOutputWithPast

        return MoeModelOutputWithPast(last_hidden_state=self.hidden)


class _Packed(torch.nn.Module):
    """An ``nn.Linear`` replaced by the native path's linear (gpu.model.linear: oneDNN's packed
    weights, the decode-row kernel for few rows), for inputs of any leading shape."""

    def __init__(self, lin: Linear) -> None:
        super().__init__()
        self.lin = lin

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.lin(x.reshape(-1, x.shape[-1]))
        return y.view(*x.shape[:-1], y.shape[-1])


def pack_linears(model: torch.nn.Module, device: torch.device, dtype: torch.dtype) -> list[Linear]:
    """Swap every ``nn.Linear`` of ``model`` in ``dtype`` for :class:`_Packed` where the native
    path packs that dtype on ``device``; returns the new linears (none where it does not)."""
    if not packing_enabled(device, dtype):
        return []
    out = []
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is torch.nn.Linear and child.weight.dtype == dtype:
                bias = child.bias.detach() if child.bias is not None else None
                lin = Linear(child.weight.detach(), bias, True)
                setattr(parent, name, _Packed(lin))
                out.append(lin)
    return out


class TransformersModel(Model):
    """A causal LM run by transformers' modeling code over the paged cache, with the native
    model's interface (``trunk``, ``logits``, ``hidden``, ``forward``, ``warm_up``)."""

    def __init__(
        self, spec: ModelSpec, model_dir: str | Path, dtype: torch.dtype, device: torch.device
    ) -> None:
        from transformers import AutoModelForCausalLM

        register()
        self.spec = spec
        hf = AutoModelForCausalLM.from_pretrained(
            str(model_dir), dtype=dtype, attn_implementation=NAME
        )
        self.hf = cast(Any, hf).to(device).eval()
        self.device, self.dtype = device, dtype
        self.attn_dtype = self.mlp_dtype = dtype
        # the linears as the native path runs them (experts' stacked weights stay as they are)
        self.linears = pack_linears(self.hf, device, dtype)
        prefix = hf.base_model_prefix
        self.base = getattr(hf, prefix)
        # the head: the model's own module with the base swapped for given hidden states
        self.given = _Given()
        head = copy.copy(hf)
        head._modules = dict(hf._modules)
        setattr(head, prefix, self.given)
        self.head = head
        self._check(device)

    @torch.inference_mode()
    def _check(self, device: torch.device) -> None:
        """One token through every layer: each must attend through :func:`attention`, once, in
        layer order (a model whose attention is its own code, or shares one layer's KV with
        another, is refused here)."""
        from gpu.model.attention import build_metadata

        cache = PagedKVCache(
            self.spec.num_layers, self.spec.num_kv_heads, self.spec.head_dim, 1, 1,
            self.dtype, device,
        )  # fmt: skip
        meta = build_metadata([], [([0], 0, 1)], cache, self.dtype, device)
        one = torch.zeros(1, dtype=torch.long, device=device)
        step = _Step(meta, cache, 1, [])
        token = _STEP.set(step)
        try:
            self.base(input_ids=one[None], position_ids=one[None], use_cache=False)
        finally:
            _STEP.reset(token)
        if step.seen != list(range(self.spec.num_layers)):
            raise UnsupportedModelError(
                f"{type(self.hf).__name__}: its layers attended {step.seen} through transformers' "
                f"attention interface, not each of its {self.spec.num_layers} layers once"
            )

    def warm_up(self) -> None:
        """Build (or load) the paged decode-attention kernel and each packed linear's kernels
        (one per distinct shape) now, so the first step does not."""
        if self.device.type == "cpu":
            paged_kernel.kernel()
        warm_up_shapes(self.linears)

    @torch.inference_mode()
    def trunk(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        cache: PagedKVCache,
        lora: Any = None,
    ) -> torch.Tensor:
        """The model's base over ``[T]`` tokens at ``positions``, writing their K/V into
        ``cache``: its final hidden states ``[T, hidden]`` (after its last norm)."""
        if lora is not None:
            raise ValueError("LoRA adapters are served on the native model path only")
        longest = max((s + n for _, s, n, _ in meta.segments), default=0)
        token = _STEP.set(_Step(meta, cache, longest, []))
        try:
            out = self.base(
                input_ids=input_ids[None], position_ids=positions[None], use_cache=False
            )
        finally:
            _STEP.reset(token)
        return out.last_hidden_state[0]

    @torch.inference_mode()
    def logits(self, x: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """Float32 logits of ``rows`` of ``trunk``'s output, through the model's own head."""
        self.given.hidden = x[rows][None]
        try:
            ids = torch.zeros(1, rows.numel(), dtype=torch.long, device=x.device)
            out = self.head(input_ids=ids, use_cache=False, logits_to_keep=0)
        finally:
            self.given.hidden = None
        return out.logits[0].float()

    @torch.inference_mode()
    def hidden(self, x: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """The final hidden states of ``rows`` in float32: what embeddings pool."""
        return x[rows].float()
