"""Lean Llama-family forward (Llama, Qwen2, Qwen3, Qwen3-MoE, Mistral) over a flat, unpadded batch.

Mirrors transformers' modeling code operation by operation (RMSNorm in float32, RoPE with
``rotate_half``, SiLU-gated MLP or routed experts, gpu.model.experts) so greedy outputs match
it token for token, but fuses Q/K/V and gate/up into one matmul each and computes the LM head
only for the rows that sample.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from gpu.model import cpu_ops, paged_kernel
from gpu.model.attention import AttentionMetadata, paged_attention
from gpu.model.base import Model
from gpu.model.experts import Experts
from gpu.model.kv_cache import PagedKVCache
from gpu.model.linear import TILE_ROWS, Linear, mkl_gemv_fast, packing_enabled, warm_up_shapes
from gpu.model.loader import ModelSpec

if TYPE_CHECKING:
    from gpu.lora.slots import LoraBatch


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' RMSNorm: normalize in float32, cast back, then scale.

    For float32: one C pass where :func:`gpu.model.cpu_ops.rms_norm` applies (equal up to float
    rounding), else ``F.rms_norm`` (bit-identical).
    """
    if x.dtype == torch.float32 and weight.dtype == torch.float32:
        fused = cpu_ops.rms_norm(x, weight, eps)  # one C pass where it applies
        return fused if fused is not None else F.rms_norm(x, (x.shape[-1],), weight, eps)
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


@dataclass
class Rotary:
    """One step's rotary inputs: the ``[max_pos, D]`` cos and signed-sin tables and the rows'
    positions; the rows gathered from the tables (the torch path) once per step, on first use."""

    cos: torch.Tensor
    sin_signed: torch.Tensor
    positions: torch.Tensor

    @cached_property
    def rows(self) -> tuple[torch.Tensor, torch.Tensor]:
        p = self.positions
        return self.cos[p][:, None, :], self.sin_signed[p][:, None, :]


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """transformers' gated MLP activation ``silu(gate) * up`` of the fused gate/up output; one C
    pass where :func:`gpu.model.cpu_ops.silu_mul` applies (equal up to float rounding)."""
    fused = cpu_ops.silu_mul(gate_up)
    if fused is not None:
        return fused
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate).mul_(up)


def rope(x: torch.Tensor, rot: Rotary) -> torch.Tensor:
    """``x * cos + rotate_half(x) * sin`` with ``rotate_half(x) * sin`` computed as
    ``roll(x) * sin_signed`` (``sin_signed`` = sin with its first half negated): bit-identical,
    fewer ops; in one C pass where :func:`gpu.model.cpu_ops.rope` applies (also bit-identical)."""
    fused = cpu_ops.rope(x, rot.cos, rot.sin_signed, rot.positions)
    if fused is not None:
        return fused
    c, s = rot.rows
    return x * c + x.roll(x.shape[-1] // 2, dims=-1) * s


# Plain float32 layer weights kept for lone decodes (gpu.model.linear.GEMV_ROWS) up to this size:
# bigger ones stream from DRAM, where the decode-row copy reads as fast
# (docs/benchmarks/cpu-levers/README.md)
PLAIN_COPY_BUDGET = 512 << 20


class _Layer:
    """One decoder layer's weights: the norms in ``norm_dt``, the attention block's linears as
    loaded, the MLP's cast to ``mlp_dt``; each linear packed where its dtype is packed on
    ``device``."""

    def __init__(
        self,
        w: dict[str, torch.Tensor],
        p: str,
        device: torch.device,
        plain: bool,
        mlp_dt: torch.dtype,
        norm_dt: torch.dtype,
        moe: ModelSpec | None = None,
    ) -> None:
        def pack(dt: torch.dtype) -> bool:
            return packing_enabled(device, dt)

        def take(name: str, dt: torch.dtype | None = None) -> torch.Tensor:
            return w.pop(name).to(device=device, dtype=dt)

        def fused(names: list[str], dt: torch.dtype | None = None) -> torch.Tensor:
            # joined where the tensors are (the host), then moved once; the parts are dropped
            return torch.cat([w.pop(n) for n in names]).to(device=device, dtype=dt)

        a = p + "self_attn."
        self.ln_in = take(p + "input_layernorm.weight", norm_dt)
        self.ln_post = take(p + "post_attention_layernorm.weight", norm_dt)
        bias_names = [a + n + "_proj.bias" for n in "qkv"]
        qkv_b = fused(bias_names) if all(n in w for n in bias_names) else None
        qkv = fused([a + n + "_proj.weight" for n in "qkv"])
        self.qkv = Linear(qkv, qkv_b, pack(qkv.dtype), plain)
        o = take(a + "o_proj.weight")
        o_b = take(a + "o_proj.bias") if a + "o_proj.bias" in w else None
        self.o = Linear(o, o_b, pack(o.dtype), plain)
        self.q_norm = take(a + "q_norm.weight") if a + "q_norm.weight" in w else None
        self.k_norm = take(a + "k_norm.weight") if a + "k_norm.weight" in w else None
        self.experts: Experts | None = None
        if moe is not None:  # a sparse layer: router and experts instead of one MLP
            self.experts = Experts(
                w, p, moe.experts, moe.experts_per_token, moe.norm_topk_prob, device, mlp_dt,
                pack(mlp_dt), silu_mul,
            )  # fmt: skip
            return
        m = p + "mlp."
        if any(m + n + "_proj.bias" in w for n in ("gate", "up", "down")):
            raise ValueError("MLP biases are not supported")
        gate_up = fused([m + "gate_proj.weight", m + "up_proj.weight"], mlp_dt)
        self.gate_up = Linear(gate_up, None, pack(mlp_dt), plain)
        self.down = Linear(take(m + "down_proj.weight", mlp_dt), None, pack(mlp_dt), plain)

    def linears(self) -> list[Linear]:
        mlp = self.experts.linears() if self.experts is not None else [self.gate_up, self.down]
        return [self.qkv, self.o, *mlp]


class LlamaFamilyModel(Model):
    """Weights plus a functional forward; holds no per-request state."""

    def __init__(
        self,
        spec: ModelSpec,
        weights: dict[str, torch.Tensor],
        device: torch.device,
        dtype: torch.dtype | None = None,
    ):
        """``weights`` as :func:`gpu.model.loader.load_weights` gave them, in
        :func:`gpu.model.loader.attention_dtype` of ``dtype`` (the model's dtype; default: the
        weights'), on any device: each is moved to ``device`` as its layer is built, fused
        ones after fusing, and taken out of ``weights`` (consumed), so at most one layer's
        tensors exist twice at a time."""
        self.spec = spec
        self.embed = weights.pop("model.embed_tokens.weight").to(device)
        dtype = dtype or self.embed.dtype
        # the attention block runs in the weights' dtype (float32 for bfloat16 on a CPU without
        # native bfloat16, see gpu.model.loader.attention_dtype), the MLP in ``dtype``
        self.attn_dtype, self.mlp_dtype = self.embed.dtype, dtype
        # bfloat16: the residual stream, the norms, RoPE and the LM head stay float32 (rounded
        # to bfloat16 once, where a linear or the KV cache takes them): a bfloat16 head alone cost
        # 0.8-0.9 points of top-1 agreement with float32, below vLLM's all-bfloat16
        # (docs/benchmarks/bf16-quality-q05)
        self.mixed = dtype == torch.bfloat16
        norm_dt = torch.float32 if self.mixed else dtype
        self.norm = weights.pop("model.norm.weight").to(device=device, dtype=norm_dt)
        head = weights.pop("lm_head.weight", None)
        if spec.tie_word_embeddings:
            head = self.embed  # transformers ties the head to the embedding, whatever is stored
        elif head is None:
            # transformers would start such a head from random weights
            raise ValueError("tie_word_embeddings is false but the weights hold no lm_head.weight")
        head = head.to(device=device, dtype=norm_dt)  # the embedding itself where it already is
        # tied: the embedding keeps the plain weight resident anyway, so lone decodes use it
        self.lm_head = Linear(
            head, None, packing_enabled(device, head.dtype), keep_plain=head is self.embed
        )
        layer_bytes = sum(
            t.numel() * t.element_size()
            for n, t in weights.items()
            if n.startswith("model.layers.")
        )
        plain = layer_bytes <= PLAIN_COPY_BUDGET and mkl_gemv_fast()
        self.layers = [
            _Layer(
                weights, f"model.layers.{i}.", device, plain, dtype, norm_dt,
                spec if i in spec.moe_layers else None,
            )
            for i in range(spec.num_layers)
        ]  # fmt: skip
        self.q_size = spec.num_heads * spec.head_dim
        self.kv_size = spec.num_kv_heads * spec.head_dim
        self.scale = spec.head_dim**-0.5
        self.cos, self.sin = self._rope_table(device, norm_dt)
        half = spec.head_dim // 2
        self.sin_signed = torch.cat((-self.sin[:, :half], self.sin[:, half:]), dim=-1)

    def _rope_table(self, device: torch.device, dtype: torch.dtype):
        """cos/sin for positions ``[0, max_model_len)``, each the value transformers' rotary
        embedding gives that position when it generates (docs/models.md):

        - "default": ``rope_theta ** (-2i / head_dim)``, as the models' own default function;
        - "linear", "llama3", "yarn", "proportional": frequencies and ``attention_factor``
          (yarn's, the cos/sin scale) from transformers' own ``ROPE_INIT_FUNCTIONS``, computed
          on the CPU as transformers does at init; they do not depend on the sequence length;
        - "dynamic": the same function at init (``seq_len`` = ``max_position_embeddings``, where
          its NTK base is ``rope_theta`` itself); transformers recomputes only once a forward call
          passes ``max_position_embeddings``, which ``max_model_len`` never does;
        - "longrope": the short factors, with the attention factor; transformers switches a whole
          forward call to the long factors once it passes ``original_max_position_embeddings``,
          and :func:`gpu.model.loader.load_spec` caps ``max_model_len`` there.
        """
        from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

        spec = self.spec
        cfg = spec.hf_config
        rp = getattr(cfg, "rope_parameters", None) or {}
        rope_type = rp.get("rope_type", "default")
        if rope_type == "default":
            dim = spec.head_dim
            inv = 1.0 / (rp["rope_theta"] ** (torch.arange(0, dim, 2, dtype=torch.float) / dim))
            scaling = 1.0
        elif rope_type in ROPE_INIT_FUNCTIONS:
            inv, scaling = ROPE_INIT_FUNCTIONS[rope_type](cfg)  # on the CPU, as at HF's init
        else:
            raise ValueError(f"rope_parameters.rope_type {rope_type!r} is not supported")
        # the lengths past which transformers changes the frequencies (gpu.model.loader._length_caps)
        limit = {
            "dynamic": cfg.max_position_embeddings,
            "longrope": rp.get("original_max_position_embeddings"),
        }.get(rope_type)
        if limit is not None and spec.max_model_len > limit:
            raise ValueError(
                f"rope_type {rope_type!r} is exact up to {limit} positions, "
                f"not max_model_len {spec.max_model_len}"
            )
        if inv.numel() * 2 != spec.head_dim:
            raise ValueError(
                f"rope_type {rope_type!r} gave {inv.numel()} frequencies for head_dim {spec.head_dim}"
            )
        pos = torch.arange(spec.max_model_len, dtype=torch.int64).float()
        freqs = pos[:, None] * inv.to(torch.float32).cpu()[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos() * scaling, emb.sin() * scaling
        return cos.to(device=device, dtype=dtype), sin.to(device=device, dtype=dtype)

    @torch.inference_mode()
    def warm_up(self) -> None:
        """Build every packed linear's kernels now (see :mod:`gpu.model.linear`); a no-op unpacked.

        Kernels are cached by shape, so one linear per distinct shape is enough. On CPU this also
        builds (or loads) the paged decode-attention kernel, so the first step does not."""
        if self.embed.device.type == "cpu":
            paged_kernel.kernel()
        warm_up_shapes([self.lm_head] + [x for ly in self.layers for x in ly.linears()])

    @torch.inference_mode()
    def logits(self, x: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """Float32 logits of ``rows`` of ``trunk``'s residual stream ``x``."""
        h = rms_norm(x[rows], self.norm, self.spec.rms_norm_eps).to(self.lm_head.dtype)
        return self.lm_head(h).float()

    @torch.inference_mode()
    def hidden(self, x: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """The final hidden states (after the last norm: what the head reads) of ``rows`` of
        ``trunk``'s residual stream ``x``, in float32: what embeddings pool."""
        return rms_norm(x[rows], self.norm, self.spec.rms_norm_eps).float()

    @torch.inference_mode()
    def trunk(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        cache: PagedKVCache,
        lora: LoraBatch | None = None,
    ) -> torch.Tensor:
        """Run ``[T]`` tokens at ``positions`` through every layer, writing their K/V into
        ``cache``: the residual stream ``[T, hidden]`` after the last layer. ``lora``: the
        rows' LoRA adapters (``gpu/lora/slots.py``), whose products add into each linear's."""
        spec = self.spec
        eps = spec.rms_norm_eps
        t = input_ids.shape[0]
        d = spec.head_dim
        nh, nkv = spec.num_heads, spec.num_kv_heads
        x = F.embedding(input_ids, self.embed)
        if self.mixed:
            x = x.float()  # the residual stream
        lo = self.mlp_dtype
        rot = Rotary(self.cos, self.sin_signed, positions)
        tile = TILE_ROWS if x.device.type == "cpu" else max(t, 1)
        for i, ly in enumerate(self.layers):
            h = rms_norm(x, ly.ln_in, eps).to(self.attn_dtype)
            qkv = ly.qkv(h)
            if lora is not None:
                lora.add(i, "qkv", h, qkv, slice(None))
            qkv = qkv.view(t, nh + 2 * nkv, d)
            v = qkv[:, nh + nkv :]
            if ly.q_norm is None:  # rotate q and k together
                qk = rope(qkv[:, : nh + nkv].to(rot.cos.dtype), rot).to(qkv.dtype)
                q, k = qk[:, :nh], qk[:, nh:]
            else:
                qn = rms_norm(qkv[:, :nh], ly.q_norm, eps).to(rot.cos.dtype)
                q = rope(qn, rot).to(qkv.dtype)
                assert ly.k_norm is not None  # Qwen3 has both norms or neither
                kn = rms_norm(qkv[:, nh : nh + nkv], ly.k_norm, eps).to(rot.cos.dtype)
                k = rope(kn, rot).to(qkv.dtype)
            attn = paged_attention(q, k, v, cache, i, meta, self.scale)
            # Row tiles from here to the layer's end, on CPU of TILE_ROWS: the linears tile there
            # anyway (same kernels, same rounding), so the outputs add into x in place instead
            # of being concatenated, and each tile's [rows, 2 * ffn] intermediate stays in
            # cache. On a GPU one tile: smaller GEMMs would only leave its SMs idle.
            for r in range(0, t, tile):
                xs = x[r : r + tile]  # a view: the adds below write into x
                if lora is None:
                    xs += ly.o(attn[r : r + tile])
                    if ly.experts is not None:
                        xs += ly.experts(rms_norm(xs, ly.ln_post, eps).to(lo))
                        continue
                    xs += ly.down(silu_mul(ly.gate_up(rms_norm(xs, ly.ln_post, eps).to(lo))))
                    continue
                rows = slice(r, r + tile)
                a = attn[rows]
                y = ly.o(a)
                lora.add(i, "o", a, y, rows)
                xs += y
                n = rms_norm(xs, ly.ln_post, eps).to(lo)
                gu = ly.gate_up(n)
                lora.add(i, "gate_up", n, gu, rows)
                g = silu_mul(gu)
                y = ly.down(g)
                lora.add(i, "down", g, y, rows)
                xs += y
        return x
