"""bfloat16 on CPU (opt-in): close to transformers float32 by tolerance, not identity."""

from __future__ import annotations

import pytest
import torch

from benchmarks.executor import workload
from benchmarks.quality import compare
from gpu.model_runner import ModelRunner
from messages.common import SamplingParams


@pytest.mark.parametrize("arch", ["qwen2", "qwen3"])
def test_bf16_teacher_forced_tracks_float32_transformers(tiny_models, arch):
    """Prefill + decode through the paged cache in bf16, on transformers' fp32 greedy tokens.

    The tiny models' wide random weights make bf16 rounding flip more near-ties than a real
    model does (the bench model: 99% top-1 agreement); a wrong RoPE, norm or cache write in the
    bf16 path drops agreement far below these bounds."""
    prompts = workload(16, 8, 64, 512, seed=0)
    res = compare(tiny_models[arch], prompts, 16, "bfloat16", threads=1)
    assert res.positions == 16 * 16
    assert res.top1_rate >= 0.9, res
    assert res.mean_abs_logprob_diff < 0.08, res


def test_cpu_default_stays_float32_and_bf16_is_packed(tiny_model):
    assert ModelRunner(tiny_model, device="cpu", num_blocks=8).dtype == torch.float32
    ex = ModelRunner(tiny_model, device="cpu", dtype="bfloat16", num_blocks=64)
    # bf16 on CPU: the MLP in bf16; the attention block, its KV cache, the residual stream, the
    # norms and the (tied) LM head in fp32
    assert ex.dtype == torch.bfloat16 and ex.cache.k[0].dtype == torch.float32
    ly = ex.model.layers[0]
    assert (ly.gate_up.dtype, ly.down.dtype) == (torch.bfloat16, torch.bfloat16)
    assert (ly.qkv.dtype, ly.o.dtype, ex.model.lm_head.dtype) == (torch.float32,) * 3
    if torch.backends.mkldnn.is_available():  # every linear goes through oneDNN, prepacked
        assert all(x.packed is not None for x in (ly.qkv, ly.o, ly.gate_up, ly.down))
    ex.add_request("r", list(range(20, 60)), SamplingParams(max_tokens=8), list(range(4)))
    outs = []
    while ex.has_work():
        outs += [o.token_id for o in ex.step().outputs if o.token_id is not None]
    assert len(outs) == 8 and all(0 <= t < ex.vocab_size for t in outs)
