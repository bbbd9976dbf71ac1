"""The executor on the device named by ``MINIRT_TEST_DEVICE`` (scripts/device-check sets it; unset,
these run on cpu, where tests/executor/test_executor.py covers the same ground, so they are skipped).

float32: the executor's greedy tokens equal transformers' on the same device, token for token,
except where transformers' own top two logits are closer than ``near_tie`` (on cuda the two run
different kernels in different reduction orders: cuBLAS, SDPA, and ours gathered; 1e-3 there,
1e-5 on cpu). bfloat16: judged by tolerance against transformers in float32 under teacher forcing
(benchmarks/quality.py), with transformers itself in bfloat16 on the same positions as the
yardstick: ours may drift no more than it, plus a margin.
"""

from __future__ import annotations

import os

import pytest
import torch
from transformers import AutoModelForCausalLM

from gpu.model.make_model import ARCHS
from gpu.model_runner import ModelRunner
from messages.common import SamplingParams
from tests.executor.test_executor import Driver, _prompts

DEVICE = os.environ.get("MINIRT_TEST_DEVICE", "")
pytestmark = [
    pytest.mark.skipif(
        not DEVICE, reason="MINIRT_TEST_DEVICE unset (scripts/device-check sets it)"
    ),
    pytest.mark.skipif(
        DEVICE.startswith("cuda") and not torch.cuda.is_available(), reason="no CUDA device"
    ),
]
NEAR_TIE = 1e-3 if DEVICE.startswith("cuda") else 1e-5
QUICK = os.environ.get("MINIRT_DEVICE_CHECK_QUICK") == "1"


def greedy_against_transformers(model_dir, prompts: list[list[int]], new_tokens: int) -> dict:
    """Our greedy tokens (mixed steps: 7-token chunks, a 40-token step budget) against
    transformers' ``generate`` in float32 on DEVICE; counts of equal requests and of near-tie
    divergences. Fails at a divergence that is not a near tie."""
    ex = ModelRunner(
        model_dir, device=DEVICE, dtype="float32", num_blocks=2000, chunk_cap=7, step_budget=40
    )
    hf = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).to(DEVICE)
    drv = Driver(ex)
    params = SamplingParams(max_tokens=new_tokens)  # both stop at the model's EOS
    for i, p in enumerate(prompts):
        drv.add(f"r{i}", p, params)
    drv.run()
    equal = ties = 0
    for i, p in enumerate(prompts):
        ours = drv.outs[f"r{i}"]
        with torch.inference_mode():
            ids = torch.tensor([p], device=DEVICE)
            ref = hf.generate(ids, max_new_tokens=new_tokens, do_sample=False)[0, len(p) :]
            ref = ref.tolist()
        if ours == ref:
            equal += 1
            continue
        j = next(k for k, (a, b) in enumerate(zip(ours, ref, strict=False)) if a != b)
        with torch.inference_mode():
            ctx = torch.tensor([p + ref[:j]], device=DEVICE)
            top2 = hf(ctx).logits[0, -1].double().topk(2).values
        gap = float(top2[0] - top2[1])
        assert gap < NEAR_TIE, f"request {i} diverged at output {j} (gap {gap:.3g}): {ours} {ref}"
        ties += 1
    assert len(drv.free) == ex.num_blocks  # every block came back
    if DEVICE.startswith("cuda"):  # its per-shape plans cost 7.3 ms a call (gpu/model_runner.py)
        assert not torch.backends.cuda.cudnn_sdp_enabled()
    return {"requests": len(prompts), "equal": equal, "near_ties": ties}


def bf16_against_transformers(model_dir, prompts: list[list[int]], new_tokens: int) -> dict:
    from benchmarks import quality

    ref = quality.reference(model_dir, prompts, new_tokens, batch=1, device=DEVICE)
    ours = quality.agreement(
        ref.logprobs,
        quality.ours_teacher_forced(model_dir, prompts, ref.tokens, "bfloat16", 2, DEVICE),
    )
    hf = quality.agreement(
        ref.logprobs,
        quality.hf_teacher_forced(model_dir, prompts, ref.tokens, "bfloat16", DEVICE),
    )
    got = {
        "positions": ours.positions,
        "top1": ours.top1_rate,
        "mean_abs_logprob_diff": ours.mean_abs_logprob_diff,
        "hf_bf16_top1": hf.top1_rate,
        "hf_bf16_mean_abs_logprob_diff": hf.mean_abs_logprob_diff,
    }
    print(f"bf16 on {DEVICE}: {got}")
    assert ours.top1_rate >= hf.top1_rate - 0.03, got
    assert ours.mean_abs_logprob_diff <= 1.5 * hf.mean_abs_logprob_diff + 0.01, got
    return got


@pytest.mark.parametrize("arch", ARCHS[:1] if QUICK else ARCHS)
def test_float32_greedy_equals_transformers(tiny_models, arch):
    got = greedy_against_transformers(tiny_models[arch], _prompts(18, 512, seed=1), 16)
    print(f"float32 on {DEVICE}, {arch}: {got}")
    assert got["near_ties"] <= 2


def test_bfloat16_drifts_no_more_than_transformers_bfloat16(tiny_models):
    bf16_against_transformers(tiny_models["qwen2"], _prompts(12, 512, seed=2), 16)


@pytest.mark.smollm2
def test_smollm2_float32_greedy_equals_transformers(smollm2):
    from benchmarks.quality import real_text_prompts

    prompts, _ = real_text_prompts(smollm2, 4 if QUICK else 16, 32, 256, seed=0)
    got = greedy_against_transformers(smollm2, prompts, 32)
    print(f"float32 on {DEVICE}, SmolLM2: {got}")
    assert got["near_ties"] <= max(1, len(prompts) // 8)


@pytest.mark.smollm2
def test_smollm2_bfloat16_drifts_no_more_than_transformers_bfloat16(smollm2):
    from benchmarks.quality import real_text_prompts

    prompts, _ = real_text_prompts(smollm2, 4 if QUICK else 16, 32, 256, seed=0)
    bf16_against_transformers(smollm2, prompts, 32)
