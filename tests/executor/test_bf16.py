"""bfloat16 on CPU (a bfloat16 checkpoint's default, or --dtype bfloat16): close to transformers
float32 by tolerance, not identity."""

from __future__ import annotations

import pytest
import torch

from benchmarks.checkpoints import stored_in
from benchmarks.executor import workload
from benchmarks.quality import compare
from gpu.model.loader import fast_bfloat16
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


def _generates(ex: ModelRunner) -> None:
    ex.add_request("r", list(range(20, 60)), SamplingParams(max_tokens=8), list(range(4)))
    outs = []
    while ex.has_work():
        outs += [o.token_id for o in ex.step().outputs if o.token_id is not None]
    assert len(outs) == 8 and all(0 <= t < ex.vocab_size for t in outs)


def test_default_dtype_is_the_checkpoints(tiny_model, tmp_path):
    """--dtype auto, as vLLM's: a float32 checkpoint in float32; a bfloat16 one in bfloat16
    where the CPU computes it natively (avx512_bf16 or AMX), else float32, saying why."""
    ex = ModelRunner(tiny_model, device="cpu", num_blocks=8)
    assert ex.dtype == torch.float32 and ex.dtype_reason == "the checkpoint's"
    bf = stored_in(tiny_model, "bfloat16", tmp_path / "bf16")
    ex = ModelRunner(bf, device="cpu", num_blocks=8)
    if fast_bfloat16(torch.device("cpu")):
        assert ex.dtype == torch.bfloat16 and ex.kv_dtype == torch.bfloat16
        assert ex.dtype_reason.startswith("the checkpoint's (bfloat16), computed natively")
    else:
        assert ex.dtype == torch.float32 and "neither avx512_bf16 nor AMX" in ex.dtype_reason
    assert ModelRunner(bf, device="cpu", dtype="float32", num_blocks=8).dtype == torch.float32


def test_bf16_runs_end_to_end_where_the_cpu_has_it(tiny_model):
    ex = ModelRunner(tiny_model, device="cpu", dtype="bfloat16", num_blocks=64)
    ly = ex.model.layers[0]
    assert ex.dtype == torch.bfloat16
    assert (ly.gate_up.dtype, ly.down.dtype) == (torch.bfloat16, torch.bfloat16)
    # the residual stream, the norms and the LM head stay float32 (gpu/model/llama.py)
    assert ly.ln_in.dtype == ex.model.norm.dtype == ex.model.lm_head.dtype == torch.float32
    if fast_bfloat16(torch.device("cpu")):
        # as vLLM runs it: the attention projections and the KV cache (half the bytes per
        # token) in bfloat16
        assert ex.cache.k[0].dtype == torch.bfloat16
        assert (ly.qkv.dtype, ly.o.dtype) == (torch.bfloat16,) * 2
        f32 = ModelRunner(tiny_model, device="cpu", dtype="float32", num_blocks=64)
        assert ex.kv_bytes * 2 == f32.kv_bytes
    else:  # only the MLP, whose packed kernels need no avx512_bf16 to be right
        assert ex.cache.k[0].dtype == torch.float32
        assert (ly.qkv.dtype, ly.o.dtype) == (torch.float32,) * 2
    if torch.backends.mkldnn.is_available():  # every linear goes through oneDNN, prepacked
        assert all(x.packed is not None for x in (ly.qkv, ly.o, ly.gate_up, ly.down))
    _generates(ex)
