"""LoRA adapters for tests, made with ``peft`` on a model directory (random factors, nothing
downloaded), and ``peft``'s own greedy outputs with them: the reference."""

from __future__ import annotations

from pathlib import Path

import torch

ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def make_adapter(
    base: Path, out: Path, r: int, seed: int, targets: list[str] | None = None, alpha: int = 0
) -> Path:
    """A PEFT adapter of rank ``r`` on ``base`` with random (not zero) factors, saved in
    ``out``."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    cfg = LoraConfig(
        r=r,
        lora_alpha=alpha or 2 * r,
        target_modules=targets or ALL,
        lora_dropout=0.0,
        init_lora_weights=False,
    )
    peft_model = get_peft_model(model, cfg)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.05)
    peft_model.save_pretrained(out)
    return out


def peft_greedy(base: Path, adapter: Path | None, prompts: list[list[int]], n: int) -> list:
    """Each prompt alone through transformers (+ ``PeftModel`` with ``adapter``), greedy, in
    float32: its first ``n`` new tokens."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32).eval()
    if adapter is not None:
        model = PeftModel.from_pretrained(model, adapter).eval()
    out = []
    with torch.no_grad():
        for ids in prompts:
            past, new = None, []  # greedy past any EOS, as ignore_eos
            step = torch.tensor([ids])
            for _ in range(n):
                o = model(step, past_key_values=past, use_cache=True)
                past = o.past_key_values
                new.append(int(o.logits[0, -1].argmax()))
                step = torch.tensor([[new[-1]]])
            out.append(new)
    return out
