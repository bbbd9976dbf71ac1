"""Sizing the KV pool on a GPU, placing replicas on cards, and building the model without a second
copy of the weights: the arithmetic with a fake device-memory reader, so it runs without a GPU.
"""

from __future__ import annotations

import pytest
import torch

from gpu.model import loader, memory
from gpu.model.kv_cache import PagedKVCache, pool_blocks
from gpu.model.llama import LlamaFamilyModel
from minirt.launch.replicas import assign_gpus, plan, visible_gpus

GIB = 1 << 30
H200 = 141 * GIB
CUDA = torch.device("cuda")  # a descriptor only: nothing here touches a card


def fake(free: int, total: int = H200):
    return lambda device: (free, total)


def big_spec(tiny_model, layers: int, hidden: int):
    """The tiny model's spec grown to a model of ``layers`` x ``hidden`` (sizes only)."""
    from dataclasses import replace

    spec = loader.load_spec(tiny_model)
    return replace(
        spec,
        num_layers=layers,
        hidden_size=hidden,
        num_heads=hidden // 128,
        num_kv_heads=8,
        head_dim=128,
        intermediate_size=hidden * 7 // 2,
        vocab_size=128_000,
    )


def test_a_model_of_half_the_card_still_gets_a_pool(tiny_model):
    """Weights of ~65 GiB on a 141 GiB card: 90% of the card less the weights, one step's
    activations and the fixed overhead goes to KV (the old rule, 80% of free memory before the
    weights loaded, would have claimed memory the weights need)."""
    spec = big_spec(tiny_model, layers=40, hidden=8192)  # ~35B parameters
    w = memory.weight_bytes(spec, torch.bfloat16)
    assert 0.45 * H200 < w < 0.55 * H200
    kv = memory.default_kv_bytes(spec, torch.bfloat16, CUDA, reader=fake(H200 - GIB))
    act = memory.activation_bytes(spec, torch.bfloat16, 8192, 256)
    left = int(0.9 * H200) - w - act - memory.CUDA_OVERHEAD_BYTES
    assert kv == left * 40 // 41
    assert 20 * GIB < kv < 0.4 * H200
    # weights + KV + activations + overhead stay within the share asked for
    assert w + kv + act + memory.CUDA_OVERHEAD_BYTES <= 0.9 * H200


def test_pool_never_takes_what_other_tenants_hold(tiny_model):
    spec = loader.load_spec(tiny_model)
    alone = memory.default_kv_bytes(spec, torch.bfloat16, CUDA, reader=fake(H200))
    crowded = memory.default_kv_bytes(spec, torch.bfloat16, CUDA, reader=fake(20 * GIB))
    assert crowded < 20 * GIB - memory.CUDA_OVERHEAD_BYTES < alone
    # a full card: no pool, and pool_blocks says so rather than allocating blocks that won't fit
    assert memory.default_kv_bytes(spec, torch.bfloat16, CUDA, reader=fake(GIB // 2)) == 0


def test_replicas_sharing_a_card_split_it(tiny_model):
    spec = big_spec(tiny_model, layers=32, hidden=4096)  # an 8B-class shape
    cards = assign_gpus(3, ["0", "1"], 0.9)
    assert cards == [("0", 0.45), ("1", 0.9), ("0", 0.45)]
    one = memory.default_kv_bytes(spec, torch.bfloat16, CUDA, utilization=0.45, reader=fake(H200))
    w = memory.weight_bytes(spec, torch.bfloat16)
    act = memory.activation_bytes(spec, torch.bfloat16, 8192, 256)
    # both replicas on card 0 sized their pools before either loaded: together they fit
    assert 2 * (one + w + act + memory.CUDA_OVERHEAD_BYTES) <= 0.9 * H200
    assert assign_gpus(2, [], 0.9) == [(None, None), (None, None)]
    with pytest.raises(ValueError, match="gpu-memory-utilization"):
        assign_gpus(2, ["0"], 1.5)


def test_plan_gives_each_replica_its_card(tmp_path, monkeypatch):
    spec = plan(3, tmp_path, cpus=[0, 1], gpus=["2", "5"], gpu_memory_utilization=0.8)
    envs = [r.env({}) for r in spec.replicas]
    assert [e["CUDA_VISIBLE_DEVICES"] for e in envs] == ["2", "5", "2"]
    argvs = [r.argv([], "python") for r in spec.replicas]
    shares = [a[a.index("--gpu-memory-utilization") + 1] for a in argvs]
    assert shares == ["0.4", "0.8", "0.4"]
    cpu = plan(2, tmp_path, cpus=[0, 1])
    assert all("CUDA_VISIBLE_DEVICES" not in r.env({}) for r in cpu.replicas)
    assert all("--gpu-memory-utilization" not in r.argv([], "python") for r in cpu.replicas)
    # which cards: --gpus wins; --device cpu means none; else CUDA_VISIBLE_DEVICES
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,4")
    assert visible_gpus(None, "0, 1") == ["0", "1"]
    assert visible_gpus("cpu") == []
    assert visible_gpus(None) == ["3", "4"]
    assert visible_gpus("cuda") == ["3", "4"]


def test_executor_refuses_a_pool_that_does_not_fit_after_the_weights(tiny_model):
    spec = loader.load_spec(tiny_model)
    with pytest.raises(ValueError, match=r"KV pool \(2\.00 GiB\).*1\.00 GiB free on cuda"):
        memory.check_fits(
            2 * GIB, spec, torch.bfloat16, CUDA, step_tokens=64, batch_rows=4, reader=fake(GIB)
        )
    memory.check_fits(  # fits: no error
        GIB // 2, spec, torch.bfloat16, CUDA, step_tokens=64, batch_rows=4, reader=fake(GIB)
    )
    memory.check_fits(
        64 * GIB, spec, torch.float32, torch.device("cpu"), step_tokens=1, batch_rows=1
    )


def test_pool_blocks_on_cuda_follows_the_utilization(tiny_model, monkeypatch):
    spec = loader.load_spec(tiny_model)
    monkeypatch.setattr(memory, "device_memory", fake(H200))
    per = PagedKVCache.bytes_per_block(
        spec.num_layers, spec.num_kv_heads, spec.head_dim, 16, torch.bfloat16
    )
    half = pool_blocks(spec, torch.bfloat16, CUDA, 16, utilization=0.45)
    full = pool_blocks(spec, torch.bfloat16, CUDA, 16, utilization=0.9)
    assert half * per < 0.45 * H200 and full > 1.9 * half
    # capped by what the batch can use, as on cpu
    assert pool_blocks(spec, torch.bfloat16, CUDA, 16, max_tokens=1600) == 100


def test_the_model_takes_the_weights_over_one_layer_at_a_time(tiny_model):
    """The model consumes the weights it is given (each layer's tensors leave the dict as that
    layer is built) and every tensor it keeps lives on its device: built on the ``meta`` device
    from host weights, nothing stays behind on the host (on a GPU: the fused copies are made on
    the host and moved once, never beside the originals on the card)."""
    spec = loader.load_spec(tiny_model)
    weights = loader.load_weights(
        tiny_model, torch.float32, loader.HOST, tied=spec.tie_word_embeddings
    )
    assert any(k.startswith("model.layers.") for k in weights)
    model = LlamaFamilyModel(spec, weights, torch.device("meta"), torch.float32)
    assert not [k for k in weights if k.startswith("model.")], "weights left unconsumed"
    kept = [model.embed, model.norm, model.cos, model.sin, model.lm_head.weight]
    for ly in model.layers:
        kept += [
            ly.ln_in,
            ly.ln_post,
            ly.qkv.weight,
            ly.o.weight,
            ly.gate_up.weight,
            ly.down.weight,
        ]
    assert kept and all(t.device.type == "meta" for t in kept if t is not None)
