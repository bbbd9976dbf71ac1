"""LoRA on the bfloat16 path (the executor's own, in process): a prompt's logprobs under each
adapter track transformers + ``PeftModel`` in float32 by tolerance, as the base model's do, and
the float32 path's to float rounding."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from actors.shared.lora import ModelDims, inspect
from gpu.lora.cache import load_adapter
from gpu.model.loader import fast_bfloat16
from gpu.model_runner import ModelRunner
from messages.common import SamplingParams
from tests.support.lora import make_adapter

TEXT = (
    "Rivers carry water from the mountains to the sea, and along the way they shape valleys, "
    "feed lakes and carry the soil that farmers need."
)


def peft_logprobs(base, adapter, ids: list[int]) -> torch.Tensor:
    from peft import PeftModel

    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32).eval()
    if adapter is not None:
        model = PeftModel.from_pretrained(model, adapter).eval()
    with torch.no_grad():
        lp = torch.log_softmax(model(torch.tensor([ids])).logits[0], -1)
    return lp[torch.arange(len(ids) - 1), torch.tensor(ids[1:])]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_adapters_prompt_logprobs_track_peft(smollm2, tmp_path, dtype):
    if dtype == "bfloat16" and not fast_bfloat16(torch.device("cpu")):
        pytest.skip("this CPU computes no bfloat16 natively: the attention runs in float32")
    ids = list(AutoTokenizer.from_pretrained(smollm2)(TEXT)["input_ids"])
    paths = [make_adapter(smollm2, tmp_path / f"r{r}", r, r) for r in (8, 16)]
    refs = [inspect(p.name, str(p), ModelDims.of(smollm2), 16) for p in paths]
    ex = ModelRunner(smollm2, dtype=dtype, num_blocks=64, max_loras=2, max_lora_rank=16)
    resident = {r.digest: load_adapter(r).result for r in refs}
    ex.adapter = resident.get
    runs = [None, *refs]
    for k, ref in enumerate(runs):  # the base and both adapters in the same steps
        params = SamplingParams(max_tokens=1, prompt_logprobs=0, lora=ref)
        ex.add_request(f"q{k}", ids, params, list(range(4 * k, 4 * k + 4)))
    got: dict[str, list[float]] = {}
    while ex.has_work():
        for p in ex.step().prompt:
            got.setdefault(p.request_id, []).extend(p.logprobs)
    base = peft_logprobs(smollm2, None, ids)
    tol = (1e-4, 1e-3) if dtype == "float32" else (0.06, 0.25)  # (mean, max) |diff|
    for k, ref in enumerate(runs):
        want = peft_logprobs(smollm2, ref.path if ref else None, ids)
        diff = (torch.tensor(got[f"q{k}"]) - want).abs()
        assert diff.mean() < tol[0] and diff.max() < tol[1], (ref, diff.mean(), diff.max())
        if ref is not None:  # the adapter moves logprobs far more than the dtype does
            assert (want - base).abs().mean() > 5 * tol[0]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_kernel_and_the_masked_matmuls_give_each_row_its_own_product(dtype):
    """``lora_add`` (one C pass) and the torch expression it stands in for, against each row's
    product computed alone: rows of four slots and of none, three parts of a fused linear."""
    from gpu.lora.slots import LoraBatch, _Stack
    from gpu.model import cpu_ops

    gen = torch.Generator().manual_seed(0)
    s, r, k, outs, t = 4, 8, 64, [48, 16, 16], 37
    st = _Stack(k, outs, s, r, dtype, torch.device("cpu"))
    st.a.copy_(torch.randn(st.a.shape, generator=gen) * 0.1)  # factors of LoRA's scale
    for p in range(3):  # each part's B reaches only its columns
        lo, hi = int(st.off[p]), int(st.off[p + 1])
        st.b[:, p * r : (p + 1) * r, lo:hi] = (torch.randn(s, r, hi - lo, generator=gen) * 0.1).to(
            dtype
        )
    x = torch.randn(t, k, generator=gen).to(dtype)
    y0 = torch.randn(t, sum(outs), generator=gen).to(dtype)
    rows = torch.randint(-1, s, (t,), generator=gen)
    scale = torch.tensor([0.5, 1.0, 2.0, 0.25])
    want = y0.float().clone()
    for i in range(t):
        if rows[i] >= 0:
            a, b = st.a[rows[i]].float(), st.b[rows[i]].float()
            want[i] += ((a @ x[i].float()) * scale[rows[i]]) @ b
    tol = 1e-5 if dtype == torch.float32 else 1e-2  # relative: bfloat16 rounds the outputs

    def err(y: torch.Tensor) -> float:
        return ((y.float() - want).abs() / (1 + want.abs())).max().item()

    class Slots:  # what LoraBatch reads of its LoraSlots
        stacks = [{"qkv": st}]
        device = torch.device("cpu")

    Slots.s, Slots.scale = s, scale.tolist()
    batch = LoraBatch(Slots(), rows, 4)  # type: ignore[arg-type]
    y = y0.clone()
    if cpu_ops.lora_add(y, x, st.a, st.b, rows, scale, st.off):
        assert err(y) < tol
    y = y0.clone()
    h = x @ st.a.view(s * 3 * r, -1).T  # the fallback, as LoraBatch.add runs it
    h.mul_(batch.mask(3 * r).to(h.dtype))
    y += h @ st.b.view(s * 3 * r, -1)
    assert err(y) < tol * 4
    assert torch.equal(y[rows < 0], y0[rows < 0])  # the base model's rows untouched
