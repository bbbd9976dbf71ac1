"""LoRA adapters for tests, made with ``peft`` on a model directory (random factors, nothing
downloaded), and ``peft``'s own greedy outputs with them: the reference."""

from __future__ import annotations

from pathlib import Path

import torch

from benchmarks.lora import make_adapter

__all__ = ["make_adapter", "peft_greedy"]


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
