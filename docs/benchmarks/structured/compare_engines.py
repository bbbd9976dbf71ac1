"""The measurement behind minirt's grammar-engine choice: xgrammar vs llguidance on this machine.

Not part of minirt (it needs both engines; minirt depends on one). Run from the repository root:

    .venv/bin/pip install --no-deps xgrammar apache-tvm-ffi llguidance
    .venv/bin/python docs/benchmarks/structured/compare_engines.py --tokenizer DIR [--vocab 32000]

For each engine: the tokenizer set-up, the compile time of each schema (cold, no cache), and, at
batch 64 (64 matchers over the schemas, decoding greedily from random logits; a finished row
restarts), per step: the wall and CPU time (all threads) to fill the 64 rows of the token bitmask
and to advance the 64 matchers by one token (the bitmask is applied with xgrammar's CPU kernel for
both, not timed: any engine's mask can be applied the same way). Every finished answer is
checked with ``json.loads`` and ``jsonschema``. Timings are medians and minima over the steps
(the minimum is the figure least disturbed by other processes on a shared machine).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

SCHEMAS: dict[str, dict] = {
    "enum+int": {
        "type": "object",
        "properties": {
            "color": {"enum": ["red", "green", "blue"]},
            "n": {"type": "integer", "minimum": 0, "maximum": 99},
        },
        "required": ["color", "n"],
        "additionalProperties": False,
    },
    "strings": {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 12},
            "city": {"type": "string", "minLength": 1, "maxLength": 8},
        },
        "required": ["name", "city"],
        "additionalProperties": False,
    },
    "nested": {
        "type": "object",
        "properties": {
            "user": {
                "type": "object",
                "properties": {
                    "id": {"type": "integer", "minimum": 1, "maximum": 10000},
                    "tags": {
                        "type": "array",
                        "items": {"type": "string", "maxLength": 5},
                        "maxItems": 3,
                    },
                },
                "required": ["id", "tags"],
                "additionalProperties": False,
            },
            "ok": {"type": "boolean"},
        },
        "required": ["user", "ok"],
        "additionalProperties": False,
    },
    "array": {
        "type": "array",
        "items": {
            "type": "object",
            "properties": {"k": {"enum": ["a", "b", "c"]}, "v": {"type": "number"}},
            "required": ["k", "v"],
            "additionalProperties": False,
        },
        "minItems": 1,
        "maxItems": 4,
    },
    "wide": {
        "type": "object",
        "properties": {f"f{i}": {"type": "integer", "minimum": 0, "maximum": 9} for i in range(16)},
        "required": [f"f{i}" for i in range(16)],
        "additionalProperties": False,
    },
}


class XGrammar:
    name = "xgrammar"

    def __init__(self, tok, vocab: int) -> None:
        import xgrammar as xgr

        self.xgr = xgr
        self.info = xgr.TokenizerInfo.from_huggingface(tok, vocab_size=vocab)
        self.batch = xgr.BatchGrammarMatcher(max_threads=2)

    def compile(self, schema: dict):
        comp = self.xgr.GrammarCompiler(self.info, max_threads=2, cache_enabled=False)
        return comp.compile_json_schema(
            json.dumps(schema), any_whitespace=False, separators=(",", ":")
        )

    def matcher(self, compiled):
        return self.xgr.GrammarMatcher(compiled, terminate_without_stop_token=True)

    def fill(self, matchers, bitmask) -> None:
        self.batch.batch_fill_next_token_bitmask(matchers, bitmask)

    def advance(self, matchers, tokens) -> None:
        for m, t in zip(matchers, tokens, strict=True):
            assert m.accept_token(t)

    def done(self, m) -> bool:
        return m.is_terminated()


class LLGuidance:
    name = "llguidance"

    def __init__(self, tok, vocab: int) -> None:
        import llguidance
        import llguidance.hf

        self.llg = llguidance
        self.tok = llguidance.hf.from_tokenizer(tok, n_vocab=vocab)
        self.ex = llguidance.LLExecutor(num_threads=2)

    def compile(self, schema: dict):
        grm = self.llg.LLMatcher.grammar_from_json_schema(
            schema, defaults={"whitespace_flexible": False}
        )
        m = self.llg.LLMatcher(self.tok, grm)  # compiling = building the first matcher
        assert not m.is_error(), m.get_error()
        return grm

    def matcher(self, compiled):
        return self.llg.LLMatcher(self.tok, compiled)

    def fill(self, matchers, bitmask) -> None:
        self.ex.unsafe_compute_mask_ptr(
            [(m, i) for i, m in enumerate(matchers)],
            bitmask.data_ptr(),
            bitmask.shape[1] * 4,
            bitmask.shape[0],
        )

    def advance(self, matchers, tokens) -> None:
        for m, t in zip(matchers, tokens, strict=True):
            assert m.consume_token(t), m.get_error()

    def done(self, m) -> bool:
        return m.is_stopped()


def measure(engine, tok, vocab: int, batch: int, steps: int) -> dict:
    import jsonschema
    import xgrammar as xgr

    compile_ms = {}
    compiled = {}
    for name, schema in SCHEMAS.items():
        t = time.perf_counter()
        compiled[name] = engine.compile(schema)
        compile_ms[name] = round((time.perf_counter() - t) * 1e3, 2)
    names = [list(SCHEMAS)[i % len(SCHEMAS)] for i in range(batch)]
    matchers = [engine.matcher(compiled[n]) for n in names]
    outs: list[list[int]] = [[] for _ in range(batch)]
    bitmask = xgr.allocate_token_bitmask(batch, vocab)
    gen = torch.Generator().manual_seed(0)
    fill_s, fill_cpu, adv_s, adv_cpu = [], [], [], []
    valid = 0
    invalid: list[str] = []
    for _ in range(steps):
        logits = torch.randn(batch, vocab, generator=gen)
        t0, c0 = time.perf_counter(), time.process_time()
        engine.fill(matchers, bitmask)
        fill_s.append(time.perf_counter() - t0)
        fill_cpu.append(time.process_time() - c0)
        xgr.apply_token_bitmask_inplace(logits, bitmask)
        tokens = logits.argmax(dim=-1).tolist()
        t0, c0 = time.perf_counter(), time.process_time()
        engine.advance(matchers, tokens)
        adv_s.append(time.perf_counter() - t0)
        adv_cpu.append(time.process_time() - c0)
        for i, t in enumerate(tokens):
            outs[i].append(t)
            if engine.done(matchers[i]):  # restart the row: keeps the batch at 64 live rows
                text = tok.decode(outs[i], skip_special_tokens=True)
                try:
                    jsonschema.validate(json.loads(text), SCHEMAS[names[i]])
                    valid += 1
                except (ValueError, jsonschema.ValidationError):
                    invalid.append(text)
                matchers[i] = engine.matcher(compiled[names[i]])
                outs[i] = []

    def ms(xs: list[float]) -> dict:
        return {"p50": round(statistics.median(xs) * 1e3, 3), "min": round(min(xs) * 1e3, 3)}

    return {
        "compile_ms": compile_ms,
        "fill_ms": ms(fill_s),
        "fill_cpu_ms": ms(fill_cpu),
        "advance_ms": ms(adv_s),
        "advance_cpu_ms": ms(adv_cpu),
        "answers_valid": valid,
        "answers_invalid": invalid,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--tokenizer", required=True)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--steps", type=int, default=200)
    a = p.parse_args()
    from transformers import AutoTokenizer

    torch.set_num_threads(2)
    tok = AutoTokenizer.from_pretrained(a.tokenizer)
    results = {}
    for cls in (XGrammar, LLGuidance):
        t = time.perf_counter()
        engine = cls(tok, a.vocab)
        setup = round((time.perf_counter() - t) * 1e3, 1)
        results[cls.name] = {
            "tokenizer_setup_ms": setup,
            **measure(engine, tok, a.vocab, a.batch, a.steps),
        }
    print(
        json.dumps(
            {"tokenizer": a.tokenizer, "vocab": a.vocab, "batch": a.batch, **results}, indent=1
        )
    )


if __name__ == "__main__":
    main()
