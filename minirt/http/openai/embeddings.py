"""``POST /v1/embeddings`` (OpenAI's shape) on a server started with ``--runner pooling``.

Each input is one front-door request whose ``params.pooling`` asks for its final hidden states
pooled (``--pooler-config``: last token or mean, normalized unless the request's ``normalize``
says not): it is scheduled, batched and chunked like any prefill, and ends with it
(``gpu/pooling.py``). The answer keeps the inputs' order; ``encoding_format: base64`` sends each
vector's float32 bytes (little-endian), as OpenAI's client asks by default."""

from __future__ import annotations

import base64
from array import array
from typing import Any

from messages.common import SamplingParams
from messages.tokenizer import Generate
from minirt.http.errors import invalid
from minirt.http.model import ModelInfo
from minirt.http.openai.convert import MAX_CHOICES, ChoiceSpec, Plan
from minirt.http.openai.schemas import EMBED_NOT_IMPLEMENTED, EmbeddingRequest, refused_fields
from minirt.http.openai.shapes import Choices


def plan_embedding(
    req: EmbeddingRequest, model: ModelInfo, rid: str, pooler: tuple[str, bool]
) -> Plan:
    model.check_model(req.model)
    for name in refused_fields(req, EMBED_NOT_IMPLEMENTED):
        raise invalid(name, f"{name}: {EMBED_NOT_IMPLEMENTED[name][1]}")
    if req.dimensions is not None:
        raise invalid(
            "dimensions", "dimensions: not supported (the embedding has the model's hidden size)"
        )
    raw = req.input
    items: list[Any]
    if isinstance(raw, str) or (raw and all(isinstance(t, int) for t in raw)):
        items = [raw]
    else:
        items = list(raw)
    if not items:
        raise invalid("input", "input: must not be empty")
    if len(items) > MAX_CHOICES:
        raise invalid("input", f"input: at most {MAX_CHOICES} inputs in one request")
    kind, normalize = pooler
    params = SamplingParams(
        max_tokens=1,
        temperature=0.0,
        pooling=kind,
        normalize=normalize if req.normalize is None else req.normalize,
        priority=req.priority,
    )
    choices = []
    for i, it in enumerate(items):
        prompt: dict[str, Any] = (
            {"prompt": it, "add_special_tokens": req.add_special_tokens}
            if isinstance(it, str)
            else {"prompt_ids": list(it)}
        )
        where = "input" if len(items) == 1 else f"input[{i}]"
        gen = Generate(
            params=params,
            request_id=rid if len(items) == 1 else f"{rid}-{i}",
            lora=model.lora_of(req.model),
            **prompt,
        )
        choices.append(ChoiceSpec(i, i, gen, where))
    return Plan(
        kind="embedding",
        num_prompts=len(items),
        choices=choices,
        score_only=True,
        encoding_format=req.encoding_format,
    )


def embedding_body(plan: Plan, choices: Choices, model: ModelInfo, rid: str) -> dict[str, Any]:
    data = []
    for i in sorted(choices.by_index):
        raw = choices.by_index[i].embedding
        vector: Any = (
            base64.b64encode(raw).decode()
            if plan.encoding_format == "base64"
            else array("f", raw).tolist()
        )
        data.append({"object": "embedding", "index": i, "embedding": vector})
    n = choices.prompt_tokens()
    return {
        "id": f"embd-{rid}",
        "object": "list",
        "created": plan.created,
        "model": model.served_name,
        "data": data,
        "usage": {"prompt_tokens": n, "total_tokens": n},
    }
