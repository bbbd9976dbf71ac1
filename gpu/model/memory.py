"""How much memory the KV pool may take: the sizing rules, one per device kind, and the readers
of device memory they use. Pure arithmetic over numbers the readers give, so the rules are unit
tested with a fake reader (``device_memory`` is the one seam). Imports torch only inside the
readers.

- **cpu**: a fifth of ``MemAvailable`` once the weights are loaded (the executor's resident
  footprint is ``WEIGHT_COPIES`` times the weight bytes: packed and decode-row copies).
- **cuda**: as vLLM's ``--gpu-memory-utilization``: this instance may use that fraction of the
  card's *total* memory for everything (weights, activations, the CUDA context, KV); the KV pool
  gets what is left, and never more than the card has free (other tenants). Sized before the
  weights load (the supervisor, which must tell the KV manager) with the weights' exact byte
  count, and checked by the executor after they load (:func:`check_fits`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

    from gpu.model.loader import ModelSpec

# cpu: the fraction of the memory left once the weights are loaded (SmolLM2-135M on a 23 GiB
# machine: ~4.2 GiB, 91k tokens of its 46 KiB/token fp32 KV; the rest stays with the OS, the
# other actors, a second replica or a test run's processes).
CPU_KV_FRACTION = 0.2
# The executor's resident bytes per weight byte as loaded: on cpu oneDNN's packed copy, the
# decode-row copy in 12-row blocks (gpu/model/linear.py) and the embedding (SmolLM2-135M in float32:
# 540 MB of weights, RSS +2.04 GB, 3.8x); on cuda the weights once (gpu/model/llama.py fuses on the
# host and moves each fused tensor once).
WEIGHT_COPIES = {"cpu": 4.0, "cuda": 1.0}
# cuda: the share of the card's total memory one instance uses unless told
# (--gpu-memory-utilization, vLLM's default); replicas sharing a card split it.
DEFAULT_GPU_MEMORY_UTILIZATION = 0.9
# cuda: bytes outside torch's allocator and the step's tensors: the CUDA context, cuBLAS and
# cuDNN workspaces, allocator fragmentation.
CUDA_OVERHEAD_BYTES = 1 << 30

MemoryReader = Callable[["torch.device"], tuple[int, int]]


def device_memory(device: torch.device) -> tuple[int, int]:
    """``(free, total)`` bytes of ``device``. cuda: through NVML where it is installed (no CUDA
    context is made, so the supervisor sizing a pool costs the card nothing), else
    ``torch.cuda.mem_get_info``; cpu: ``MemAvailable`` and ``MemTotal`` of /proc/meminfo."""
    if device.type == "cuda":
        return _cuda_memory(device)
    found: dict[str, int] = {}
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                key, _, rest = line.partition(":")
                if key in ("MemAvailable", "MemTotal"):
                    found[key] = int(rest.split()[0]) * 1024
    except OSError:
        pass
    total = found.get("MemTotal", 4 << 30)
    return found.get("MemAvailable", total), total


def _cuda_memory(device: torch.device) -> tuple[int, int]:
    import torch

    try:
        import pynvml

        pynvml.nvmlInit()
        index = torch.cuda._get_nvml_device_index(device)  # honours CUDA_VISIBLE_DEVICES
        info = pynvml.nvmlDeviceGetMemoryInfo(pynvml.nvmlDeviceGetHandleByIndex(index))
        return int(info.free), int(info.total)
    except Exception:  # no NVML (or an index it cannot map): the runtime's own reading
        free, total = torch.cuda.mem_get_info(device)
        return int(free), int(total)


def weight_bytes(spec: ModelSpec, dtype: torch.dtype) -> int:
    """Bytes of ``spec``'s parameters in ``dtype`` (norms left out)."""
    h, q, kv = spec.hidden_size, spec.num_heads * spec.head_dim, spec.num_kv_heads * spec.head_dim
    per_layer = h * (q + 2 * kv) + q * h + 3 * h * spec.intermediate_size
    sparse = len(spec.moe_layers)  # a sparse layer holds its router and experts instead
    moe = spec.experts * (h + 3 * h * spec.expert_size) - 3 * h * spec.intermediate_size
    heads = 1 if spec.tie_word_embeddings else 2
    params = spec.num_layers * per_layer + sparse * moe + heads * spec.vocab_size * h
    return params * _elem(dtype)


def activation_bytes(spec: ModelSpec, dtype: torch.dtype, step_tokens: int, batch_rows: int) -> int:
    """The most one step's tensors take on the device, counted generously: per token the
    residual stream (float32), the normed input, qkv, attention output and the MLP's
    ``[2 * ffn]`` and ``[ffn]`` intermediates, twice over (the allocator keeps freed blocks);
    and the logits of every row that samples, in float32, twice (the logits and their
    softmax)."""
    q, kv = spec.num_heads * spec.head_dim, spec.num_kv_heads * spec.head_dim
    per_token = 4 * spec.hidden_size + _elem(dtype) * (
        spec.hidden_size + q + 2 * kv + q + 3 * spec.intermediate_size
    )
    return 2 * step_tokens * per_token + 2 * batch_rows * spec.vocab_size * 4


def cuda_kv_bytes(
    *,
    free: int,
    total: int,
    used_by_us: int,
    weights_to_load: int,
    activations: int,
    utilization: float,
    num_layers: int,
) -> int:
    """The KV budget on a card: ``utilization`` of ``total``, less what this process holds
    (``used_by_us``), the weights still to load, one step's activations and the fixed overhead;
    at most what the card has ``free`` less the same. A decode step gathers one layer's context
    at most (gpu/model/attention.py's tensor path), so a ``1/num_layers`` share of the pool is kept
    for that gather too."""
    if not 0.0 < utilization <= 1.0:
        raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {utilization}")
    need = weights_to_load + activations + CUDA_OVERHEAD_BYTES
    mine = int(total * utilization) - used_by_us - need
    card = free - need
    left = min(mine, card)
    return max(0, left * num_layers // (num_layers + 1))


def default_kv_bytes(
    spec: ModelSpec,
    dtype: torch.dtype,
    device: torch.device,
    *,
    utilization: float = DEFAULT_GPU_MEMORY_UTILIZATION,
    step_tokens: int = 8192,
    batch_rows: int = 256,
    reader: MemoryReader | None = None,
    loaded: bool = False,
) -> int:
    """The default KV budget for ``spec`` (see the module doc): before its weights load (the
    supervisor: their expected footprint is taken off), or with ``loaded`` in the process that
    holds them (on cuda: what torch's allocator holds counts as used, nothing is left to load;
    on cpu the rule stays the supervisor's, so that both give the same pool)."""
    import torch

    kind = "cuda" if device.type == "cuda" else "cpu"
    loaded = loaded and kind == "cuda"
    weights = 0 if loaded else int(weight_bytes(spec, dtype) * WEIGHT_COPIES[kind])
    if loaded:
        torch.cuda.empty_cache()
    free, total = (reader or device_memory)(device)
    if kind == "cpu":
        return max(0, int((free - weights) * CPU_KV_FRACTION))
    return cuda_kv_bytes(
        free=free,
        total=total,
        used_by_us=torch.cuda.memory_reserved(device) if loaded else 0,
        weights_to_load=weights,
        activations=activation_bytes(spec, dtype, step_tokens, batch_rows),
        utilization=utilization,
        num_layers=spec.num_layers,
    )


def check_fits(
    kv_bytes: int,
    spec: ModelSpec,
    dtype: torch.dtype,
    device: torch.device,
    *,
    step_tokens: int,
    batch_rows: int,
    reader: MemoryReader | None = None,
) -> None:
    """After the weights load (cuda): refuse a pool of ``kv_bytes`` that would not leave one
    step's activations on the card, naming the numbers and the flags that change them. A
    no-op elsewhere (host memory overcommits; the OS is the judge)."""
    if device.type != "cuda":
        return
    free, _ = (reader or device_memory)(device)
    need = kv_bytes + activation_bytes(spec, dtype, step_tokens, batch_rows)
    if need > free:
        gib = 1 << 30
        raise ValueError(
            f"the KV pool ({kv_bytes / gib:.2f} GiB) and one step's activations "
            f"({(need - kv_bytes) / gib:.2f} GiB) do not fit in the {free / gib:.2f} GiB free on "
            f"{device} once the weights are loaded; lower --num-blocks/--kv-memory or "
            "--gpu-memory-utilization, or --step-budget"
        )


def _elem(dtype: torch.dtype) -> int:
    import torch

    return torch.empty((), dtype=dtype).element_size()
