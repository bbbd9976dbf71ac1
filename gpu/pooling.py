"""Embeddings (a server started with ``--runner pooling``): a request's prompt runs through the
model as any prefill does, chunk by chunk in the mixed steps, and its final hidden states
(after the last norm) are pooled as vLLM's pooling types define them: ``last``, the prompt's
last token's; ``mean``, the mean over all its tokens (summed across its chunks, in float64).
L2-normalized unless the request says not to. The vector leaves with the step that completes
the prompt (``Pooled``), before the request's one token, which is not shown."""

from __future__ import annotations

from typing import Any

import torch

from gpu.step.batch import StepBatch
from messages.tokenizer import Pooled


def pool(model: Any, x: torch.Tensor, batch: StepBatch) -> list[Pooled]:
    """The embeddings this step completes, from ``model.trunk``'s residual stream ``x``; the
    partial sums of ``mean`` requests stay on their ``RequestState.pool``."""
    if not batch.pools:
        return []
    hidden = model.hidden(x, torch.tensor(batch.pool_rows, dtype=torch.long, device=x.device))
    out = []
    for req, start, n, done in batch.pools:
        part = hidden[start : start + n].sum(dim=0, dtype=torch.float64)
        req.pool = part if req.pool is None else req.pool + part
        if not done:
            continue
        v = req.pool / len(req.prompt) if req.params.pooling == "mean" else req.pool
        if req.params.normalize:
            v = torch.nn.functional.normalize(v, dim=0)
        out.append(Pooled(req.rid, v.to(torch.float32).cpu().numpy().astype("<f4").tobytes()))
        req.pool = None
    return out
