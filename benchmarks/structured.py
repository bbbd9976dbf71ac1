"""``minirt bench structured``: the cost of constrained decoding at batch 64, constrained vs
unconstrained tokens/s in the same run, through the executor (no actors).

Workload: ``--requests`` (64) prompts of ``--min-prompt``..``--max-prompt`` random ids, greedy,
``--new-tokens`` (64) each. The *free* run has no constraint (EOS ignored); the *constrained*
run gives every request one of four JSON Schemas (nested objects, arrays, enums, bounded
integers and strings) too long to be finished within the token budget, so both runs generate
the same number of tokens at the same batch size and differ only by the grammar work; *mixed*
constrains half of them. Runs alternate (``--repeats`` rounds) and each figure is the median.
The constraints are compiled (and timed, cold) before, as the goal is the cost "once the schema
is compiled".

The bench model's own tokenizer has 4,096 tokens (its vocabulary is 32,000 ids); token masks
cost more on a full vocabulary, so by default the model is paired with a 32,000-token BPE
tokenizer trained here on a synthetic corpus (cached under ~/.cache/minirt); ``--own-tokenizer``
keeps the model's. ``--json PATH`` writes the results, ``--out DIR`` a Markdown report too
(``DIR/README.md``, the results in ``DIR/results/report.json``).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.executor import DEFAULT_MODEL, workload
from minirt.eventlog.summary import results_dir

TOKENIZER_32K = Path.home() / ".cache" / "minirt" / "tokenizers" / "bpe-32k"


def _item(props: dict, n: int) -> dict:
    return {"type": "array", "items": _obj(props), "minItems": n, "maxItems": n + 8}


def _obj(props: dict) -> dict:
    return {
        "type": "object",
        "properties": props,
        "required": list(props),
        "additionalProperties": False,
    }


SCHEMAS: dict[str, dict] = {
    "records": _item(
        {
            "id": {"type": "integer", "minimum": 0, "maximum": 99999},
            "name": {"type": "string", "minLength": 2, "maxLength": 12},
            "color": {"enum": ["red", "green", "blue", "cyan"]},
        },
        24,
    ),
    "nested": _item(
        {
            "user": _obj({"id": {"type": "integer", "minimum": 1}, "admin": {"type": "boolean"}}),
            "tags": {"type": "array", "items": {"type": "string", "maxLength": 5}, "maxItems": 3},
        },
        24,
    ),
    "wide": _obj(
        {f"field_{i}": {"type": "integer", "minimum": 0, "maximum": 999} for i in range(64)}
    ),
    "text": _obj(
        {"title": {"type": "string", "minLength": 400, "maxLength": 600}, "n": {"type": "integer"}}
    ),
}


def _args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="minirt bench structured", description=__doc__)
    p.add_argument("--model", type=Path, default=None, help="model dir (default: bench qwen2)")
    p.add_argument("--own-tokenizer", action="store_true", help="use the model's tokenizer")
    p.add_argument("--requests", type=int, default=64)
    p.add_argument("--min-prompt", type=int, default=32)
    p.add_argument("--max-prompt", type=int, default=256)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quick", action="store_true", help="8 requests, 8 new tokens, 1 round")
    p.add_argument("--json", type=Path, default=None)
    p.add_argument("--out", type=Path, default=None, help="report directory (README.md)")
    a = p.parse_args(argv)
    if a.quick:
        a.requests, a.new_tokens, a.repeats = 8, 8, 1
    return a


def synthetic_tokenizer(out: Path = TOKENIZER_32K, vocab: int = 32000) -> Path:
    """A byte-level BPE tokenizer of ``vocab`` tokens trained on random syllable words, numbers
    and punctuation (about 20 s once; cached)."""
    if (out / "tokenizer.json").exists():
        return out
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    rng = random.Random(0)
    cons = "b c d f g h j k l m n p r s t v w z ch sh th st tr pl qu".split()
    vows = "a e i o u ai ea ou io y".split()
    lex = [
        "".join(rng.choice(cons) + rng.choice(vows) for _ in range(rng.randint(1, 4)))
        for _ in range(60000)
    ]

    def line() -> str:
        words = [
            rng.choice(lex) if rng.random() < 0.9 else str(rng.randint(0, 10 ** rng.randint(1, 6)))
            for _ in range(rng.randint(5, 30))
        ]
        if rng.random() < 0.3:
            words = [w.capitalize() for w in words]
        return " ".join(words) + rng.choice(".,!?:;\"'{}[]()")

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab,
        special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator((line() for _ in range(120000)), trainer=trainer)
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>").save_pretrained(
        str(out)
    )
    return out


def with_tokenizer(model_dir: Path, tokenizer_dir: Path, into: Path) -> Path:
    """A model directory of links: ``model_dir``'s weights and config, ``tokenizer_dir``'s
    tokenizer."""
    for src in model_dir.iterdir():
        if not src.name.startswith(
            ("tokenizer", "special_tokens", "chat_template", "vocab", "merges")
        ):
            (into / src.name).symlink_to(src.resolve())
    for src in tokenizer_dir.iterdir():
        if src.is_file():
            (into / src.name).symlink_to(src.resolve())
    return into


def run(ex, prompts: list[list[int]], new_tokens: int, constrained: list) -> dict:
    """All requests at once (blocks for prompt + outputs up front); tokens, time, per-step stats."""
    from messages.common import SamplingParams, StructuredOutput

    nxt = 0
    for i, p in enumerate(prompts):
        so = constrained[i]
        params = SamplingParams(
            max_tokens=new_tokens,
            ignore_eos=so is None,
            structured=None if so is None else StructuredOutput(json_schema=so),
        )
        n = -(-(len(p) + new_tokens) // ex.block_size)
        ex.add_request(f"b{i}", p, params, list(range(nxt, nxt + n)))
        nxt += n
    tokens, finish, mask, decode_steps = 0, {}, [], []
    t0, c0 = time.perf_counter(), time.process_time()
    while ex.has_work():
        res = ex.step()
        assert not res.failed, res.failed
        tokens += sum(o.token_id is not None for o in res.outputs)
        finish.update({o.request_id: o.finish_reason for o in res.outputs if o.finish_reason})
        if res.num_prefill_tokens == 0:
            decode_steps.append(res.step_s)
            mask.append(res.mask_s)
    secs, cpu = time.perf_counter() - t0, time.process_time() - c0
    return {
        "tokens": tokens,
        "seconds": secs,
        "tok_s": tokens / secs,
        "cpu_ms_per_token": 1e3 * cpu / tokens,
        "decode_step_ms": 1e3 * statistics.median(decode_steps) if decode_steps else 0.0,
        "mask_ms": 1e3 * statistics.median(mask) if mask else 0.0,
        "all_length": all(f == "length" for f in finish.values()),
    }


def main(argv: list[str]) -> int:
    a = _args(list(argv))
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    torch.set_num_threads(a.threads)
    model_dir = a.model or DEFAULT_MODEL
    if a.model is None and not (model_dir / "config.json").exists():
        from gpu.model.make_model import make_model

        make_model("qwen2", "bench", model_dir)
    from transformers import AutoTokenizer

    from actors.shared.grammar import GrammarCache
    from gpu.model.loader import load_spec
    from gpu.model_runner import ModelRunner
    from messages.common import StructuredOutput

    with tempfile.TemporaryDirectory() as tmp:
        tok_dir = model_dir if a.own_tokenizer else synthetic_tokenizer()
        served = model_dir if a.own_tokenizer else with_tokenizer(model_dir, tok_dir, Path(tmp))
        spec = load_spec(served)
        prompts = workload(a.requests, a.min_prompt, a.max_prompt, spec.vocab_size, a.seed)
        blocks = sum(-(-(len(p) + a.new_tokens) // 16) for p in prompts) + 16
        ex = ModelRunner(served, num_blocks=blocks, step_budget=2048, threads=a.threads)
        schemas = list(SCHEMAS.values())
        llg_tok = ex.structured.cache.tokenizer()  # built once, not part of a compile
        cold = GrammarCache(lambda: llg_tok)
        compile_ms = {}
        for name, s in SCHEMAS.items():
            t = time.perf_counter()
            cold.compile(StructuredOutput(json_schema=s))
            compile_ms[name] = 1e3 * (time.perf_counter() - t)
            ex.structured.compile(StructuredOutput(json_schema=s))
        modes: dict[str, list[dict | None]] = {
            "free": [None] * a.requests,
            "constrained": [schemas[i % len(schemas)] for i in range(a.requests)],
            "mixed": [schemas[i % len(schemas)] if i % 2 else None for i in range(a.requests)],
        }
        for m in modes.values():  # warm-up: every shape and every grammar's first masks
            run(ex, prompts, 4, m)
        rounds: dict[str, list[dict]] = {m: [] for m in modes}
        for _ in range(a.repeats):
            for name, m in modes.items():
                rounds[name].append(run(ex, prompts, a.new_tokens, m))
    res: dict = {
        "model": str(model_dir),
        "tokenizer": str(tok_dir),
        "tokenizer_tokens": len(AutoTokenizer.from_pretrained(tok_dir)),
        "vocab_size": spec.vocab_size,
        "requests": a.requests,
        "new_tokens": a.new_tokens,
        "threads": a.threads,
        "repeats": a.repeats,
        "compile_ms_cold": {k: round(v, 2) for k, v in compile_ms.items()},
        "cache_hits": ex.structured.cache.hits,
        "cache_misses": ex.structured.cache.misses,
    }
    for name, rs in rounds.items():
        keys = ("tok_s", "cpu_ms_per_token", "decode_step_ms", "mask_ms")
        res[name] = {k: statistics.median(r[k] for r in rs) for k in keys}
        res[name]["all_length"] = all(r["all_length"] for r in rs)
        res[name]["tokens"] = rs[0]["tokens"]
    for name in ("constrained", "mixed"):
        res[name]["cost_pct"] = 100.0 * (1 - res[name]["tok_s"] / res["free"]["tok_s"])
        free_cpu = res["free"]["cpu_ms_per_token"]
        res[name]["cpu_cost_pct"] = 100.0 * (res[name]["cpu_ms_per_token"] / free_cpu - 1)
    for name in modes:
        r = res[name]
        cost = (
            f", cost {r['cost_pct']:.1f}% (CPU time {r['cpu_cost_pct']:+.1f}%)"
            if "cost_pct" in r
            else ""
        )
        print(
            f"{name:12s} {r['tok_s']:8.1f} tok/s  {r['cpu_ms_per_token']:.2f} CPU ms/token  "
            f"decode step {r['decode_step_ms']:6.2f} ms  mask {r['mask_ms']:5.2f} ms/step{cost}"
        )
    print(f"compile (cold, ms): {res['compile_ms_cold']}")
    if a.json is not None:
        a.json.write_text(json.dumps(res, indent=2))
    if a.out is not None:
        (results_dir(a.out) / "report.json").write_text(json.dumps(res, indent=2))
        (a.out / "README.md").write_text(report(res, " ".join(["minirt bench structured", *argv])))
    return 0


def report(res: dict, command: str) -> str:
    rows = [
        f"| {m} | {res[m]['tok_s']:.1f} | {res[m].get('cost_pct', 0.0):.1f}% | "
        f"{res[m]['cpu_ms_per_token']:.2f} | {res[m].get('cpu_cost_pct', 0.0):+.1f}% | "
        f"{res[m]['decode_step_ms']:.2f} | {res[m]['mask_ms']:.2f} |"
        for m in ("free", "constrained", "mixed")
    ]
    compiles = ", ".join(f"{k} {v:.1f} ms" for k, v in res["compile_ms_cold"].items())
    return "\n".join(
        [
            "# Structured output: the cost of token masks at batch 64",
            "",
            f"`{command}`: {res['requests']} requests, {res['new_tokens']} tokens each, greedy, "
            f"{res['threads']} threads, median of {res['repeats']} alternating rounds; "
            f"tokenizer of {res['tokenizer_tokens']} tokens over a vocabulary of "
            f"{res['vocab_size']} ids. Constrained: every request has a JSON Schema "
            "(4 distinct, compiled beforehand); mixed: every other one.",
            "",
            "| run | tok/s | cost | CPU ms/token | CPU cost | decode step (ms) | mask work "
            "in the step (ms) |",
            "|---|---|---|---|---|---|---|",
            *rows,
            "",
            f"Cold compile: {compiles}. Every constrained answer ran to max_tokens: "
            f"{res['constrained']['all_length']}.",
            "",
        ]
    )
