"""A mixture-of-experts MLP (Qwen3-MoE's sparse block) over a flat batch of rows: the router's
softmax picks each row's top-k experts (their weights renormalized where the config says), and
each expert that any row picked runs once, on all of its rows together; the products add into
the rows weighted, in expert order, as transformers adds them."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from gpu.model.linear import Linear


def config_fields(cfg: Any) -> dict[str, Any]:
    """gpu.model.loader.ModelSpec's expert fields from a Qwen3-MoE config (none for a dense
    one): a layer is sparse unless listed in ``mlp_only_layers`` or off the
    ``decoder_sparse_step`` beat, as transformers builds it."""
    if not cfg.num_experts:
        return {}
    only = set(getattr(cfg, "mlp_only_layers", None) or [])
    step = int(cfg.decoder_sparse_step)
    return {
        "experts": int(cfg.num_experts),
        "experts_per_token": int(cfg.num_experts_per_tok),
        "norm_topk_prob": bool(cfg.norm_topk_prob),
        "expert_size": int(cfg.moe_intermediate_size),
        "moe_layers": tuple(
            i for i in range(cfg.num_hidden_layers) if i not in only and (i + 1) % step == 0
        ),
    }


class Experts:
    """One sparse layer's router and experts (gate/up fused, down), taken out of ``w``."""

    def __init__(
        self,
        w: dict[str, torch.Tensor],
        prefix: str,
        experts: int,
        top_k: int,
        renormalize: bool,
        device: torch.device,
        dtype: torch.dtype,
        pack: bool,
        act: Callable[[torch.Tensor], torch.Tensor],
    ) -> None:
        m = prefix + "mlp."
        self.router = w.pop(m + "gate.weight").to(device=device, dtype=dtype)  # [E, hidden]
        self.top_k, self.renormalize, self.act = top_k, renormalize, act
        self.gate_up: list[Linear] = []
        self.down: list[Linear] = []
        for e in range(experts):
            q = f"{m}experts.{e}."
            gu = torch.cat([w.pop(q + "gate_proj.weight"), w.pop(q + "up_proj.weight")])
            self.gate_up.append(Linear(gu.to(device=device, dtype=dtype), None, pack))
            down = w.pop(q + "down_proj.weight").to(device=device, dtype=dtype)
            self.down.append(Linear(down, None, pack))

    def linears(self) -> list[Linear]:
        return [*self.gate_up, *self.down]

    def __call__(self, h: torch.Tensor) -> torch.Tensor:
        """``h`` ``[rows, hidden]`` (normed) -> the layer's MLP output ``[rows, hidden]``."""
        logits = F.linear(h, self.router)
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
        top_w, top_i = torch.topk(probs, self.top_k, dim=-1)
        if self.renormalize:
            top_w = top_w / top_w.sum(dim=-1, keepdim=True)
        top_w = top_w.to(logits.dtype)
        # the (row, slot) picks grouped by expert: one gather and one matmul pair per expert hit
        picks = top_i.reshape(-1)
        order = torch.argsort(picks, stable=True)
        rows = order // self.top_k
        weights = top_w.reshape(-1)[order, None]
        out = torch.zeros_like(h)
        start = 0
        for e, n in enumerate(torch.bincount(picks, minlength=len(self.down)).tolist()):
            if n:
                r = rows[start : start + n]
                y = self.down[e](self.act(self.gate_up[e](h[r])))
                out.index_add_(0, r, y * weights[start : start + n])
            start += n
        return out
