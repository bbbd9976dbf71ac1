"""Prompt logprobs (vLLM's ``prompt_logprobs``, what ``echo`` with ``logprobs`` and evaluation
harnesses read) on SmolLM2: scored in the prefill's chunks, equal to transformers' float32
log-softmax, with ranks and the most likely tokens, complete across chunk boundaries."""

from __future__ import annotations

import torch
import trio
from transformers import AutoModelForCausalLM, AutoTokenizer

from messages import client as cm
from minirt.client import open_client
from tests.support.runtime import start_runtime

TEXT = (
    "The committee met on a Tuesday to review the budget. After a long discussion about the "
    "roads, the schools and the library, they agreed to meet again in the spring."
)


def test_prompt_logprobs_equal_transformers_across_chunks(smollm2, tmp_path):
    tok = AutoTokenizer.from_pretrained(smollm2)
    ids = tok(TEXT)["input_ids"]
    assert len(ids) > 2 * 16  # three chunks of 16
    model = AutoModelForCausalLM.from_pretrained(smollm2, dtype=torch.float32)
    with torch.no_grad():
        ref = torch.log_softmax(model(torch.tensor([ids])).logits[0, :-1].float(), dim=-1)
    want = [ref[i, ids[i + 1]].item() for i in range(len(ids) - 1)]

    async def ask(rt) -> list:
        async with open_client(rt.endpoint) as client:
            with trio.fail_after(60):
                stream = client.stream(
                    prompt_ids=ids, max_tokens=2, temperature=0, prompt_logprobs=3
                )
                return [m async for m in stream]

    flags = ("--dtype", "float32", "--chunk-cap", "16", "--budget-policy", "fixed")
    with start_runtime(smollm2, tmp_path / "run", *flags) as rt:
        msgs = trio.run(ask, rt)
        prefills = [e for e in rt.events("executor.step") if e["prefill_tokens"]]
    assert len(prefills) >= 3  # chunked (a chunk of the next token, at most, rides along)
    kinds = [type(m) for m in msgs]
    assert kinds.index(cm.PromptLogprobs) < kinds.index(cm.Delta)  # before the first token
    [p] = [m for m in msgs if isinstance(m, cm.PromptLogprobs)]
    assert p.token_ids == ids and p.logprobs[0] is None and p.ranks[0] is None
    assert len(p.logprobs) == len(ids)
    assert max(abs(a - b) for a, b in zip(p.logprobs[1:], want, strict=True)) < 1e-4
    for i in range(1, len(ids)):
        row = ref[i - 1]
        assert p.ranks[i] == int((row > row[ids[i]]).sum()) + 1
        best = row.topk(3).indices.tolist()
        assert [t.token_id for t in p.top_logprobs[i]] == best
    assert sum(len(m.token_ids) for m in msgs if isinstance(m, cm.Delta)) == 2
