"""A step's flat batch, as lists: the rows' tokens and positions, which rows get logits, and
which request (at which output past its next) each logit row samples (``build``, pure; the
executor turns it into tensors and attention metadata); and a sampled token's way out
(``emit``: the request's outputs, its ends).

Row order, as ``gpu/model/attention.py`` wants it: the plain decodes (one row each), then the spans
(``(block table, start, rows)``: each speculating decode's last token and drafts, then each
prefill chunk). A speculating decode is attended as a chunk that starts at its ``computed``.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from gpu.requests import RequestState, TokenOutput

if TYPE_CHECKING:
    from gpu.request_table import RequestTable
    from gpu.structured.engine import StructuredEngine

_NONE: list[int] = []  # no drafts (shared, never mutated)


@dataclass
class StepBatch:
    """The step's rows: token ids and positions, the attention's decode rows (``plain``) and
    spans, the logit rows and what each samples."""

    ids: list[int] = field(default_factory=list)
    pos: list[int] = field(default_factory=list)
    plain: list[RequestState] = field(default_factory=list)  # decodes without drafts
    spans: list[tuple[list[int], int, int]] = field(default_factory=list)
    logit_rows: list[int] = field(default_factory=list)
    samplers: list[RequestState] = field(default_factory=list)  # one per logit row
    offsets: list[int] = field(default_factory=list)  # the row's output index past the next
    # (request, its first logit row, its drafts): each request that samples, in row order
    runs: list[tuple[RequestState, int, list[int]]] = field(default_factory=list)
    # prompt logprobs: the rows whose logits score prompt tokens (after ``logit_rows``), and per
    # request (request, its first prompt token scored, where its rows start there, how many)
    score_rows: list[int] = field(default_factory=list)
    scored: list[tuple[RequestState, int, int, int]] = field(default_factory=list)
    # embeddings: the rows whose final hidden states are pooled, and per request (request, where
    # its rows start there, how many, whether this step completes its prompt)
    pool_rows: list[int] = field(default_factory=list)
    pools: list[tuple[RequestState, int, int, bool]] = field(default_factory=list)
    # each request's rows, in row order: (request, how many) (a LoRA adapter's rows)
    owners: list[tuple[RequestState, int]] = field(default_factory=list)


def build(
    decodes: list[RequestState],
    chunks: list[tuple[RequestState, int]],
    drafts: dict[str, list[int]],
) -> StepBatch:
    plain = [r for r in decodes if r.rid not in drafts] if drafts else list(decodes)
    b = StepBatch(
        [r.out[-1] for r in plain],
        [r.computed for r in plain],
        plain,
        samplers=list(plain),
        offsets=[0] * len(plain),
        runs=[(r, i, _NONE) for i, r in enumerate(plain)],
        owners=[(r, 1) for r in plain],
    )
    for req in decodes if drafts else ():
        if (d := drafts.get(req.rid)) is not None:
            b.runs.append((req, len(b.samplers), d))
            b.ids += [req.out[-1], *d]
            b.pos.extend(range(req.computed, req.computed + len(d) + 1))
            b.samplers += [req] * (len(d) + 1)
            b.offsets += range(len(d) + 1)
            b.spans.append((req.table, req.computed, len(d) + 1))
            b.owners.append((req, len(d) + 1))
    b.logit_rows = list(range(len(b.samplers)))
    row = len(b.samplers)
    for req, c in chunks:
        s = req.computed
        b.ids.extend(req.prompt[s : s + c])
        b.pos.extend(range(s, s + c))
        b.spans.append((req.table, s, c))
        b.owners.append((req, c))
        if req.params.prompt_logprobs is not None:
            # row p scores prompt token p + 1, up to the client's prompt's last (not outputs
            # of an earlier attempt; the last row predicts an output)
            end = min(s + c, len(req.prompt) - req.prior - 1)
            if end > s:
                b.scored.append((req, s + 1, len(b.score_rows), end - s))
                b.score_rows.extend(range(row, row + end - s))
        if (pooling := req.params.pooling) is not None:
            done = s + c == len(req.prompt)
            rows = range(row, row + c) if pooling == "mean" else range(row + c - done, row + c)
            b.pools.append((req, len(b.pool_rows), len(rows), done))
            b.pool_rows.extend(rows)
        row += c
        if s + c == len(req.prompt):
            b.runs.append((req, len(b.samplers), _NONE))
            b.logit_rows.append(row - 1)
            b.samplers.append(req)
            b.offsets.append(0)
    return b


def prefilled(chunks: list[tuple[RequestState, int]]) -> list[TokenOutput]:
    """Apply a step's prefill chunks to their requests: a progress output for each whose
    prompt is not complete yet (a completed one samples, ``emit``)."""
    out = []
    for req, c in chunks:
        req.computed += c
        if req.computed < len(req.prompt):
            n_prompt = len(req.prompt) - req.prior
            out.append(TokenOutput(req.rid, None, None, None, None, False, n_prompt, req.prior))
    return out


def emit(
    requests: RequestTable,
    structured: StructuredEngine,
    max_model_len: int,
    req: RequestState,
    tok: int,
    lp: float | None,
    top: list | None,
    outputs: list[TokenOutput],
    failed: list[tuple[str, str, str]],
) -> float:
    """Append ``tok`` to ``req``'s outputs and check its ends (grammar, stop ids, length): an
    ended request leaves ``requests``, one that fails goes to ``failed`` without output.
    Returns the grammar's seconds."""
    first = not req.out
    req.out.append(tok)
    if req.procs is not None:
        req.procs.observe(tok)
    if req.ngram is not None:
        req.ngram.extend((tok,))
    n_out = req.prior + len(req.out)
    finish, mask_s = None, 0.0
    if req.grammar is not None:
        tm = time.perf_counter()
        finish, error = structured.finish(req, tok)
        mask_s = time.perf_counter() - tm
        if error is not None:
            requests.abort(req.rid)
            failed.append((req.rid, "structured", error))
            return mask_s
    elif tok in req.stop:
        finish = "stop"
    if finish is None and (
        n_out >= req.params.max_tokens or len(req.prompt) + len(req.out) >= max_model_len
    ):
        finish = "length"
    if finish is not None:
        requests.abort(req.rid)
    elif first:
        requests.decodes(req)
    n_prompt = len(req.prompt) - req.prior
    outputs.append(TokenOutput(req.rid, tok, lp, top, finish, first, n_prompt, n_out))
    return mask_s
