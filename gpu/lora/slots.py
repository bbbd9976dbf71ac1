"""The step's LoRA products: ``--max-loras`` slots of adapter factors per fused linear, and one
pass over a step's rows, whatever adapter each row runs with (vLLM's punica kernels' idea).

For each of a layer's fused linears (``qkv``, ``o``, ``gate_up``, ``down``) the slots' factors
sit stacked (``_Stack``: ``S`` slots of rank ``R`` = ``--max-lora-rank``, a smaller rank
zero-padded, each part of a fused linear in its own rows). A step gives each row its adapter's
slot (``-1``: the base model) and, after each linear, adds every row's own product
``B(A(x)) * scaling`` (PEFT's) into the linear's output: on CPU one C pass over the rows, each
reading only its own slot's factors (``gpu/csrc/lora.c``); elsewhere two matmuls over all the
slots, each row's columns kept by a one-hot mask. No loop over adapters or requests in Python,
no weights merged; a row never meets another adapter's factors.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from actors.shared.lora import ModelDims
from gpu.model import cpu_ops

# the model's fused linears and the PEFT modules each holds, in their column order
FUSED = {
    "qkv": ("q_proj", "k_proj", "v_proj"),
    "o": ("o_proj",),
    "gate_up": ("gate_proj", "up_proj"),
    "down": ("down_proj",),
}


@dataclass
class Adapter:
    """An adapter's factors, resident in host memory: by (layer, module) ``(A [r, in],
    B [out, r])``; ``key`` its digest."""

    key: str
    name: str
    rank: int
    scaling: float
    factors: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]

    def nbytes(self) -> int:
        return sum(a.nbytes + b.nbytes for a, b in self.factors.values())


class _Stack:
    """One fused linear of one layer, every slot's factors: ``a [S, P * R, in]`` (part p's A
    in rows ``p * R ..``), ``b [S, P * R, out]`` (part p's B in the same rows, reaching only
    its columns ``off[p] .. off[p + 1]``), zero past an adapter's rank."""

    def __init__(self, inp: int, outs: list[int], s: int, r: int, dt, device) -> None:
        p = len(outs)
        self.a = torch.zeros(s, p * r, inp, dtype=dt, device=device)
        self.b = torch.zeros(s, p * r, sum(outs), dtype=dt, device=device)
        self.off = torch.tensor([sum(outs[:i]) for i in range(p + 1)], dtype=torch.long)


class LoraBatch:
    """One step's rows: each row's slot (``-1``: the base model), and the slots' scales."""

    def __init__(self, slots: LoraSlots, rows: torch.Tensor, adapters: int) -> None:
        self.slots = slots
        self.rows = rows  # [T] int64
        self.adapters = adapters  # how many the step's rows use
        self.scale = torch.tensor(slots.scale, dtype=torch.float32)
        self._mask: torch.Tensor | None = None

    def add(self, layer: int, linear: str, x: torch.Tensor, y: torch.Tensor, rows: slice) -> None:
        """Add the LoRA products of ``x`` (the linear's inputs: rows ``rows`` of the step) into
        ``y`` (its outputs for them), in place: one C pass where it applies
        (:func:`gpu.model.cpu_ops.lora_add`), else two matmuls over every slot, each row's
        columns kept by its one-hot mask."""
        st = self.slots.stacks[layer][linear]
        if cpu_ops.lora_add(y, x, st.a, st.b, self.rows[rows], self.scale, st.off):
            return
        s, pr = st.a.shape[0], st.a.shape[1]
        h = x.to(st.a.dtype) @ st.a.view(s * pr, -1).T  # [t, S * PR]
        h.mul_(self.mask(pr)[rows].to(h.dtype))
        y += (h @ st.b.view(s * pr, -1)).to(y.dtype)

    def mask(self, pr: int) -> torch.Tensor:
        """``[T, S * pr]``: each row's slot's scale over that slot's columns, else 0."""
        if self._mask is None or self._mask.shape[1] != self.slots.s * pr:
            s = self.slots.s
            onehot = self.rows[:, None] == torch.arange(s)
            m = (onehot * self.scale).repeat_interleave(pr, dim=1)
            self._mask = m.to(self.slots.device)
        return self._mask


class LoraSlots:
    """``max_loras`` slots of stacked factors for every layer, an adapter per slot; a step's
    adapters are put in slots (``assign``: those already there stay, the others replace the
    slots used longest ago) and its rows' masks built (``batch``)."""

    def __init__(
        self,
        dims: ModelDims,
        max_loras: int,
        max_rank: int,
        attn_dtype: torch.dtype,
        mlp_dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        self.s, self.r = max_loras, max_rank
        self.device = device
        h, f, q, kv = dims.hidden, dims.intermediate, dims.q, dims.kv
        shapes = {
            "qkv": (h, [q, kv, kv], attn_dtype),
            "o": (q, [h], attn_dtype),
            "gate_up": (h, [f, f], mlp_dtype),
            "down": (f, [h], mlp_dtype),
        }
        self.stacks = [
            {n: _Stack(i, o, self.s, self.r, dt, device) for n, (i, o, dt) in shapes.items()}
            for _ in range(dims.layers)
        ]
        self.owner: list[str | None] = [None] * self.s
        self.scale = [0.0] * self.s
        self.used = [0] * self.s  # the step each slot last served
        self.clock = 0
        self.writes = 0  # adapters written into a slot so far

    def assign(self, adapters: list[Adapter]) -> dict[str, int]:
        """Slots for the step's distinct ``adapters`` (at most ``max_loras``)."""
        assert len(adapters) <= self.s
        self.clock += 1
        where = {k: i for i, k in enumerate(self.owner) if k is not None}
        keep = {a.key for a in adapters}
        out: dict[str, int] = {}
        for a in adapters:
            i = where.get(a.key)
            if i is None:
                i = min(
                    (j for j in range(self.s) if self.owner[j] not in keep),
                    key=lambda j: (self.owner[j] is not None, self.used[j]),
                )
                self._write(i, a)
            out[a.key] = i
            self.used[i] = self.clock
        return out

    def _write(self, i: int, a: Adapter) -> None:
        for layer, stacks in enumerate(self.stacks):
            for name, st in stacks.items():
                st.a[i].zero_()
                st.b[i].zero_()
                for p, module in enumerate(FUSED[name]):
                    ab = a.factors.get((layer, module))
                    if ab is not None:
                        fa, fb = ab  # [r, in], [out, r]
                        lo, hi = int(st.off[p]), int(st.off[p + 1])
                        st.a[i, p * self.r : p * self.r + a.rank].copy_(fa)
                        st.b[i, p * self.r : p * self.r + a.rank, lo:hi].copy_(fb.t())
        self.owner[i] = a.key
        self.scale[i] = a.scaling
        self.writes += 1

    @classmethod
    def of(cls, model: Any, max_loras: int, max_rank: int, device: torch.device) -> LoraSlots:
        """Slots shaped for ``model`` (``gpu.model.llama.LlamaFamilyModel``): its linears'
        shapes, the attention's and the MLP's dtypes."""
        sp = model.spec
        dims = ModelDims(
            sp.hidden_size,
            sp.intermediate_size,
            sp.num_layers,
            sp.num_heads * sp.head_dim,
            sp.num_kv_heads * sp.head_dim,
        )
        return cls(dims, max_loras, max_rank, model.attn_dtype, model.mlp_dtype, device)

    def rows(self, owners: list[tuple[Any, int]]) -> LoraBatch | None:
        """The step whose rows belong to ``owners`` (request, rows) in order, each request
        with its adapter (``RequestState.lora``) put in a slot; None when no row uses one."""
        adapters = {r.lora.key: r.lora for r, _ in owners if r.lora is not None}
        if not adapters:
            return None
        slot = self.assign(list(adapters.values()))
        per = torch.tensor([slot[r.lora.key] if r.lora is not None else -1 for r, _ in owners])
        return self.batch(
            per.repeat_interleave(torch.tensor([n for _, n in owners])), len(adapters)
        )

    def batch(self, row_slots: torch.Tensor, adapters: int) -> LoraBatch:
        """The step whose row ``t`` runs with slot ``row_slots[t]`` (-1: none), ``adapters`` of
        them in use."""
        return LoraBatch(self, row_slots.to(torch.long).contiguous(), adapters)
