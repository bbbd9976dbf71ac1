"""``minirt bench quality``: our forward in a given dtype against transformers in float32, under
teacher forcing, on W1's prompts.

transformers (float32) generates each reference greedily; then our model, in ``--dtype``
(default bfloat16), prefills each prompt and decodes the *reference* tokens one step at a time
through the paged KV cache (batched over all requests, the executor's decode path), so every
position is judged on the same context. Reported: the share of positions whose top-1 token equals
transformers' (target >= 97% for bfloat16), and the mean |logprob difference| of transformers'
token (``|log p_ours(t) - log p_hf(t)|`` with ``t`` transformers' greedy token). vLLM's CPU
backend in the same dtype is judged on the same positions (its venv, as the other vLLM rows;
``--skip-vllm`` leaves it out). ``--json PATH`` also writes the results.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass
from pathlib import Path

import torch


@dataclass
class Agreement:
    positions: int
    top1_equal: int
    mean_abs_logprob_diff: float
    max_abs_logprob_diff: float

    @property
    def top1_rate(self) -> float:
        return self.top1_equal / self.positions if self.positions else 0.0


def reference(model_dir: Path, prompts: list[list[int]], new_tokens: int) -> list[torch.Tensor]:
    """Per prompt: transformers float32 log-probs ``[new_tokens, vocab]`` along its own greedy
    continuation (row j scores output token j)."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    out = []
    with torch.inference_mode():
        for p in prompts:
            ids = torch.tensor([p])
            gen = hf.generate(
                ids,
                max_new_tokens=new_tokens,
                min_new_tokens=new_tokens,
                do_sample=False,
                eos_token_id=None,
                pad_token_id=0,
            )
            logits = hf(gen[:, :-1]).logits[0, len(p) - 1 :].double()
            out.append(torch.log_softmax(logits, -1))
    return out


def ours_teacher_forced(
    model_dir: Path, prompts: list[list[int]], forced: list[list[int]], dtype: str, threads: int
) -> list[torch.Tensor]:
    """Per prompt: our log-probs ``[len(forced), vocab]``, prefilling the prompt then decoding the
    forced tokens (all requests batched in each decode step)."""
    from gpu.executor import Executor

    bs = 16
    blocks = sum(-(-(len(p) + len(f)) // bs) for p, f in zip(prompts, forced, strict=True))
    ex = Executor(model_dir, dtype=dtype, num_blocks=blocks + 1, block_size=bs, threads=threads)
    from gpu.attention import build_metadata

    tables, nxt = [], 0
    for p, f in zip(prompts, forced, strict=True):
        n = -(-(len(p) + len(f)) // bs)
        tables.append(list(range(nxt, nxt + n)))
        nxt += n
    rows: list[list[torch.Tensor]] = [[] for _ in prompts]

    def forward(ids: list[int], pos: list[int], meta, logit_rows: list[int]) -> torch.Tensor:
        lg = ex.model.forward(
            torch.tensor(ids), torch.tensor(pos), meta, ex.cache, torch.tensor(logit_rows)
        )
        return torch.log_softmax(lg.double(), -1)

    for i, p in enumerate(prompts):  # prefill, one request per forward
        meta = build_metadata([], [(tables[i], 0, len(p))], ex.cache, ex.kv_dtype, ex.device)
        rows[i].append(forward(p, list(range(len(p))), meta, [len(p) - 1])[0])
    for j in range(max(len(f) for f in forced) - 1):  # decode the forced tokens
        live = [i for i, f in enumerate(forced) if j + 1 < len(f)]
        dec = [(tables[i], len(prompts[i]) + j) for i in live]
        meta = build_metadata(dec, [], ex.cache, ex.kv_dtype, ex.device)
        lp = forward(
            [forced[i][j] for i in live], [q for _, q in dec], meta, list(range(len(live)))
        )
        for r, i in enumerate(live):
            rows[i].append(lp[r])
    return [torch.stack(r) for r in rows]


def agreement(ref: list[torch.Tensor], ours: list[torch.Tensor]) -> Agreement:
    """Top-1 agreement and |logprob| difference of the reference's greedy token, over all
    positions."""
    n = eq = 0
    diffs = []
    for r, o in zip(ref, ours, strict=True):
        tok = r.argmax(-1)
        eq += int((o.argmax(-1) == tok).sum())
        n += tok.numel()
        diffs.append((o.gather(-1, tok[:, None]) - r.gather(-1, tok[:, None])).abs().flatten())
    d = torch.cat(diffs)
    return Agreement(n, eq, float(d.mean()), float(d.max()))


def compare(
    model_dir: Path, prompts: list[list[int]], new_tokens: int, dtype: str, threads: int = 2
) -> Agreement:
    return compare_ref(
        model_dir, prompts, reference(model_dir, prompts, new_tokens), dtype, threads
    )


def compare_ref(
    model_dir: Path, prompts: list[list[int]], ref: list[torch.Tensor], dtype: str, threads: int
) -> Agreement:
    forced = [r.argmax(-1).tolist() for r in ref]
    return agreement(ref, ours_teacher_forced(model_dir, prompts, forced, dtype, threads))


def vllm_agreement(
    model_dir: Path, prompts: list[list[int]], ref: list[torch.Tensor], dtype: str
) -> Agreement | str:
    """vLLM's CPU backend in ``dtype`` on the same positions: each prompt followed by
    transformers' greedy tokens, scored in one prefill (``prompt_logprobs``), so every position
    is judged on the same context as ours; or why it was skipped."""
    from actors.bench import vllm_row

    forced = [r.argmax(-1).tolist() for r in ref]
    got = vllm_row.score(
        model_dir, [p + f for p, f in zip(prompts, forced, strict=True)], dtype=dtype
    )
    if isinstance(got, vllm_row.Skipped):
        return got.reason
    n = eq = 0
    diffs: list[float] = []
    for p, f, r, rows in zip(prompts, forced, ref, got, strict=True):
        for k, tok in enumerate(f):
            entry = rows[len(p) + k]
            assert entry is not None
            rank, lp = entry
            n += 1
            eq += int(rank == 1)
            diffs.append(abs(lp - float(r[k, tok])))
    d = torch.tensor(diffs)
    return Agreement(n, eq, float(d.mean()), float(d.max()))


def main(argv: list[str]) -> int:
    from actors.bench.executor import DEFAULT_MODEL, workload
    from gpu.loader import load_spec

    p = argparse.ArgumentParser(prog="minirt bench quality", description=__doc__)
    p.add_argument("--model", type=Path, default=DEFAULT_MODEL)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--requests", type=int, default=64)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--json", type=Path, default=None)
    p.add_argument("--skip-vllm", action="store_true", help="skip vLLM's row")
    a = p.parse_args(argv)
    torch.set_num_threads(a.threads)
    spec = load_spec(a.model)
    prompts = workload(a.requests, 32, 256, spec.vocab_size, 0)  # W1's prompts
    ref = reference(a.model, prompts, a.new_tokens)
    res = compare_ref(a.model, prompts, ref, a.dtype, a.threads)
    out: dict[str, object] = {
        "model": str(a.model),
        "dtype": a.dtype,
        "requests": a.requests,
        "positions": res.positions,
        "top1_equal_rate": res.top1_rate,
        "mean_abs_logprob_diff": res.mean_abs_logprob_diff,
        "max_abs_logprob_diff": res.max_abs_logprob_diff,
    }
    print(
        f"{a.dtype} vs transformers float32, teacher forced, {res.positions} positions: top-1 "
        f"equal {100 * res.top1_rate:.2f}%, mean |logprob diff| {res.mean_abs_logprob_diff:.4f} "
        f"(max {res.max_abs_logprob_diff:.3f})"
    )
    if not a.skip_vllm:
        v = vllm_agreement(a.model, prompts, ref, a.dtype)
        if isinstance(v, str):
            print(f"vllm: skipped: {v[:300]}")
            out["vllm_skipped"] = v
        else:
            out.update(
                vllm_top1_equal_rate=v.top1_rate,
                vllm_mean_abs_logprob_diff=v.mean_abs_logprob_diff,
                vllm_max_abs_logprob_diff=v.max_abs_logprob_diff,
            )
            print(
                f"vLLM {a.dtype} (its prefill, prompt_logprobs), same positions: top-1 equal "
                f"{100 * v.top1_rate:.2f}%, mean |logprob diff| {v.mean_abs_logprob_diff:.4f} "
                f"(max {v.max_abs_logprob_diff:.3f})"
            )
    if a.json is not None:
        a.json.write_text(json.dumps(out, indent=2))
    return 0
