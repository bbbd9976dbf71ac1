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

The prompts are W1's (random token ids) unless ``--real-text``: then they are windows of real
English and Python text found on every machine with Python, pydoc's topic help
(``pydoc_data.topics``) and the standard library's top-level modules, tokenized by the model's
tokenizer (``real_text_prompts``; deterministic for a given Python version and ``--seed``).
``--batch N`` has transformers generate its greedy continuations N prompts at a time (left
padded; several times faster on a small model); every position is then scored by transformers
on its own, unpadded, on the continuation that was generated, and both sides are fed that same
continuation.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import sysconfig
from dataclasses import dataclass
from pathlib import Path
from typing import Any

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


@dataclass
class Reference:
    """transformers float32 along its greedy continuation of each prompt."""

    logprobs: list[torch.Tensor]  # per prompt [new_tokens, vocab]: row j scores output token j
    tokens: list[list[int]]  # per prompt, the continuation every row is conditioned on


def reference(
    model_dir: Path, prompts: list[list[int]], new_tokens: int, batch: int = 1, device: str = "cpu"
) -> Reference:
    """transformers float32: its greedy continuation of each prompt (``batch`` prompts per
    ``generate``, left padded), then each prompt plus continuation scored alone, unpadded, in one
    forward: the log-probs of every output position on that context."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    hf = hf.to(device)
    pad = 0
    gens: list[list[int]] = []
    with torch.inference_mode():
        for k in range(0, len(prompts), max(batch, 1)):
            group = prompts[k : k + max(batch, 1)]
            width = max(len(p) for p in group)
            ids = torch.tensor([[pad] * (width - len(p)) + p for p in group], device=device)
            mask = torch.tensor(
                [[0] * (width - len(p)) + [1] * len(p) for p in group], device=device
            )
            gen = hf.generate(
                ids,
                attention_mask=mask,
                max_new_tokens=new_tokens,
                min_new_tokens=new_tokens,
                do_sample=False,
                eos_token_id=None,
                pad_token_id=pad,
            )
            gens += gen[:, width:].tolist()
        out = []
        for p, g in zip(prompts, gens, strict=True):
            logits = hf(torch.tensor([p + g[:-1]], device=device)).logits[0, len(p) - 1 :]
            out.append(torch.log_softmax(logits.double(), -1).cpu())
    return Reference(out, gens)


def hf_teacher_forced(
    model_dir: Path, prompts: list[list[int]], forced: list[list[int]], dtype: str, device: str
) -> list[torch.Tensor]:
    """transformers itself in ``dtype`` on the same positions: the yardstick for a dtype's
    drift (what any engine in that dtype can be expected to keep)."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=getattr(torch, dtype))
    hf = hf.eval().to(device)
    out = []
    with torch.inference_mode():
        for p, f in zip(prompts, forced, strict=True):
            logits = hf(torch.tensor([p + f[:-1]], device=device)).logits[0, len(p) - 1 :]
            out.append(torch.log_softmax(logits.double(), -1).cpu())
    return out


def _window(text: str, rng: random.Random, want: int, tok: Any) -> list[int] | None:
    """``want`` tokens of ``text`` from a random line start, or None if it is too short."""
    starts = [0] + [i + 1 for i, c in enumerate(text) if c == "\n" and i + 1 < len(text)]
    start = rng.choice(starts[: max(1, len(starts) * 3 // 4)])  # leave room after the start
    ids = tok(text[start : start + 12 * want], add_special_tokens=False)["input_ids"]
    return list(ids[:want]) if len(ids) >= want else None


def real_text_prompts(
    model_dir: Path, n: int, lo: int, hi: int, seed: int
) -> tuple[list[list[int]], list[str]]:
    """``n`` prompts of real text, lengths uniform in [lo, hi] tokens of the model's tokenizer
    (no special tokens), and where each came from. Even ones: pydoc's help on a topic
    (``pydoc_data.topics``, English prose with code); odd ones: a top-level module of the
    standard library (Python source). Each is a window starting on a line boundary; topics, files
    and windows are drawn by ``random.Random(seed)`` from sorted lists, so the selection depends
    only on the seed and the Python version (its stdlib's text)."""
    from pydoc_data.topics import topics

    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model_dir))
    rng = random.Random(seed)
    names = sorted(topics)
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(f for f in stdlib.glob("*.py") if f.stat().st_size > 4096)
    prompts: list[list[int]] = []
    sources: list[str] = []
    while len(prompts) < n:
        want = rng.randint(lo, hi)
        if len(prompts) % 2 == 0:
            name = rng.choice(names)
            where, text = f"pydoc_data.topics[{name!r}]", topics[name]
        else:
            f = rng.choice(files)
            where, text = f"stdlib/{f.name}", f.read_text(encoding="utf-8", errors="replace")
        ids = _window(text, rng, want, tok)
        if ids is not None:
            prompts.append(ids)
            sources.append(where)
    return prompts, sources


def ours_teacher_forced(
    model_dir: Path,
    prompts: list[list[int]],
    forced: list[list[int]],
    dtype: str,
    threads: int,
    device: str | None = None,
) -> list[torch.Tensor]:
    """Per prompt: our log-probs ``[len(forced), vocab]``, prefilling the prompt then decoding the
    forced tokens (all requests batched in each decode step)."""
    from gpu.model_runner import ModelRunner

    bs = 16
    blocks = sum(-(-(len(p) + len(f)) // bs) for p, f in zip(prompts, forced, strict=True))
    ex = ModelRunner(
        model_dir,
        dtype=dtype,
        num_blocks=blocks + 1,
        block_size=bs,
        threads=threads,
        device=device,
    )
    from gpu.model.attention import build_metadata

    tables, nxt = [], 0
    for p, f in zip(prompts, forced, strict=True):
        n = -(-(len(p) + len(f)) // bs)
        tables.append(list(range(nxt, nxt + n)))
        nxt += n
    rows: list[list[torch.Tensor]] = [[] for _ in prompts]

    def forward(ids: list[int], pos: list[int], meta, logit_rows: list[int]) -> torch.Tensor:
        dev = ex.device
        lg = ex.model.forward(
            torch.tensor(ids, device=dev),
            torch.tensor(pos, device=dev),
            meta,
            ex.cache,
            torch.tensor(logit_rows, device=dev),
        )
        return torch.log_softmax(lg.double(), -1).cpu()

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
    model_dir: Path,
    prompts: list[list[int]],
    ref: Reference,
    dtype: str,
    threads: int,
    device: str | None = None,
) -> Agreement:
    ours = ours_teacher_forced(model_dir, prompts, ref.tokens, dtype, threads, device)
    return agreement(ref.logprobs, ours)


def vllm_agreement(
    model_dir: Path, prompts: list[list[int]], ref: Reference, dtype: str
) -> Agreement | str:
    """vLLM's CPU backend in ``dtype`` on the same positions: each prompt followed by
    transformers' greedy tokens, scored in one prefill (``prompt_logprobs``), so every position
    is judged on the same context as ours; or why it was skipped."""
    from benchmarks import vllm_row

    forced = ref.tokens
    got = vllm_row.score(
        model_dir, [p + f for p, f in zip(prompts, forced, strict=True)], dtype=dtype
    )
    if isinstance(got, vllm_row.Skipped):
        return got.reason
    n = eq = 0
    diffs: list[float] = []
    for p, f, r, rows in zip(prompts, forced, ref.logprobs, got, strict=True):
        for k, tok in enumerate(f):
            entry = rows[len(p) + k]
            assert entry is not None
            rank, lp = entry
            n += 1
            eq += int(rank == 1)
            diffs.append(abs(lp - float(r[k, tok])))
    d = torch.tensor(diffs)
    return Agreement(n, eq, float(d.mean()), float(d.max()))


def _row(out: dict, prefix: str, label: str, got: Agreement) -> None:
    """Another judge's agreement on the same positions: into ``out`` under ``prefix``, printed."""
    out[prefix + "top1_equal_rate"] = got.top1_rate
    out[prefix + "mean_abs_logprob_diff"] = got.mean_abs_logprob_diff
    out[prefix + "max_abs_logprob_diff"] = got.max_abs_logprob_diff
    print(
        f"{label}: top-1 equal {100 * got.top1_rate:.2f}%, mean |logprob diff| "
        f"{got.mean_abs_logprob_diff:.4f} (max {got.max_abs_logprob_diff:.3f})"
    )


def main(argv: list[str]) -> int:
    from benchmarks.executor import DEFAULT_MODEL, workload
    from gpu.model.loader import load_spec

    p = argparse.ArgumentParser(prog="minirt bench quality", description=__doc__)
    p.add_argument("--model", type=Path, default=DEFAULT_MODEL)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--requests", type=int, default=64)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--device", default="cpu", help="both sides on this device (cpu, cuda)")
    p.add_argument(
        "--hf-row",
        action="store_true",
        help="also judge transformers itself in --dtype on the same positions (the yardstick)",
    )
    p.add_argument("--json", type=Path, default=None)
    p.add_argument("--skip-vllm", action="store_true", help="skip vLLM's row")
    p.add_argument(
        "--real-text",
        action="store_true",
        help="prompts of real text (pydoc topics, stdlib sources) instead of W1's random ids",
    )
    p.add_argument("--min-prompt", type=int, default=32)
    p.add_argument("--max-prompt", type=int, default=256)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--batch", type=int, default=1, help="prompts per transformers generate (left padded)"
    )
    a = p.parse_args(argv)
    torch.set_num_threads(a.threads)
    spec = load_spec(a.model)
    lo, hi = a.min_prompt, a.max_prompt
    sources: list[str] = []
    if a.real_text:
        prompts, sources = real_text_prompts(a.model, a.requests, lo, hi, a.seed)
    else:
        prompts = workload(a.requests, lo, hi, spec.vocab_size, a.seed)  # W1's prompts
    ref = reference(a.model, prompts, a.new_tokens, a.batch, a.device)
    res = compare_ref(a.model, prompts, ref, a.dtype, a.threads, a.device)
    out: dict[str, object] = {
        "model": str(a.model),
        "dtype": a.dtype,
        "device": a.device,
        "requests": a.requests,
        "prompts": "real text" if a.real_text else "W1 (random token ids)",
        "prompt_tokens": sum(len(x) for x in prompts),
        "new_tokens": a.new_tokens,
        "seed": a.seed,
        "positions": res.positions,
        "top1_equal_rate": res.top1_rate,
        "mean_abs_logprob_diff": res.mean_abs_logprob_diff,
        "max_abs_logprob_diff": res.max_abs_logprob_diff,
    }
    if a.real_text:
        out["python"] = sys.version.split()[0]
        out["sources"] = sources
    print(
        f"{a.dtype} vs transformers float32, teacher forced, {res.positions} positions: top-1 "
        f"equal {100 * res.top1_rate:.2f}%, mean |logprob diff| {res.mean_abs_logprob_diff:.4f} "
        f"(max {res.max_abs_logprob_diff:.3f})"
    )
    if a.hf_row:
        h = agreement(
            ref.logprobs, hf_teacher_forced(a.model, prompts, ref.tokens, a.dtype, a.device)
        )
        _row(out, "hf_", f"transformers {a.dtype}, same positions", h)
    if not a.skip_vllm:
        v = vllm_agreement(a.model, prompts, ref, a.dtype)
        if isinstance(v, str):
            print(f"vllm: skipped: {v[:300]}")
            out["vllm_skipped"] = v
        else:
            _row(out, "vllm_", f"vLLM {a.dtype} (its prefill, prompt_logprobs), same positions", v)
    if a.json is not None:
        a.json.write_text(json.dumps(out, indent=2))
    return 0
