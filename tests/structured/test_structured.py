"""Structured output through the executor core on the random-weight tiny model (which never writes
valid JSON by itself): every ``stop`` answer parses and validates, unconstrained neighbours are
untouched, preemption replays the grammar, EOS cannot end an answer early."""

from __future__ import annotations

import json
import random
import re

import jsonschema
import pytest
from transformers import AutoTokenizer

from gpu.model_runner import ExecutorInputError, ModelRunner
from messages.common import SamplingParams, StructuredOutput

SCHEMAS: list[dict] = [
    {  # enum + integer range
        "type": "object",
        "properties": {
            "color": {"enum": ["red", "green", "blue"]},
            "count": {"type": "integer", "minimum": -5, "maximum": 250},
        },
        "required": ["color", "count"],
        "additionalProperties": False,
    },
    {  # bounded strings, a boolean, an optional property
        "type": "object",
        "properties": {
            "name": {"type": "string", "minLength": 1, "maxLength": 8},
            "ok": {"type": "boolean"},
            "note": {"type": "string", "maxLength": 3},
        },
        "required": ["name", "ok"],
        "additionalProperties": False,
    },
    {  # nested objects
        "type": "object",
        "properties": {
            "user": {
                "type": "object",
                "properties": {
                    "id": {"type": "integer", "minimum": 1, "maximum": 9999},
                    "role": {"enum": ["admin", "guest", None]},
                },
                "required": ["id", "role"],
                "additionalProperties": False,
            },
            "active": {"type": "boolean"},
        },
        "required": ["user", "active"],
        "additionalProperties": False,
    },
    {  # arrays with maxItems
        "type": "object",
        "properties": {
            "tags": {
                "type": "array",
                "items": {"type": "string", "maxLength": 4},
                "minItems": 1,
                "maxItems": 3,
            },
            "scores": {
                "type": "array",
                "items": {"type": "integer", "minimum": 0, "maximum": 100},
                "maxItems": 4,
            },
        },
        "required": ["tags", "scores"],
        "additionalProperties": False,
    },
    {  # a top-level array of objects, anyOf
        "type": "array",
        "items": {
            "type": "object",
            "properties": {
                "k": {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 9}, {"const": "x"}]},
                "v": {"enum": [1, 2.5, "three", False]},
            },
            "required": ["k", "v"],
            "additionalProperties": False,
        },
        "minItems": 1,
        "maxItems": 3,
    },
]


def _sampling(i: int) -> dict:
    """A spread of sampling settings: greedy, seeded sampling with filters, a penalty."""
    return [
        {},
        {"temperature": 1.0, "seed": i},
        {"temperature": 0.8, "top_p": 0.9, "seed": i},
        {"temperature": 1.2, "top_k": 20, "seed": i},
        {"repetition_penalty": 1.3, "frequency_penalty": 0.5},
    ][i % 5]


def _prompt(i: int) -> list[int]:
    rng = random.Random(i)
    return [rng.randrange(3, 500) for _ in range(rng.randint(2, 30))]


def run(
    ex: ModelRunner, reqs: dict[str, tuple[list[int], SamplingParams]], steps: list | None = None
):
    """Run ``reqs`` together; ``{rid: (tokens, finish, logprobs, tops)}``."""
    nxt = 0
    outs: dict[str, tuple[list[int], list, list, list]] = {}
    finish: dict[str, str] = {}
    for rid, (prompt, params) in reqs.items():
        n = -(-(len(prompt) + params.max_tokens) // ex.block_size)
        ex.add_request(rid, prompt, params, list(range(nxt, nxt + n)))
        nxt += n
        outs[rid] = ([], [], [], [])
    while ex.has_work():
        res = ex.step()
        assert not res.failed, res.failed
        if steps is not None:
            steps.append(res)
        for o in res.outputs:
            if o.token_id is not None:
                toks, _, lps, tops = outs[o.request_id]
                toks.append(o.token_id)
                lps.append(o.logprob)
                tops.append(o.top_logprobs)
            if o.finish_reason:
                finish[o.request_id] = o.finish_reason
    return {rid: (t, finish[rid], lp, tp) for rid, (t, _, lp, tp) in outs.items()}


@pytest.fixture(scope="module")
def ex(tiny_model):
    return ModelRunner(tiny_model, num_blocks=4096, threads=2)


@pytest.fixture(scope="module")
def tok(tiny_model):
    return AutoTokenizer.from_pretrained(tiny_model)


def text(tok, ids: list[int]) -> str:
    return tok.decode(ids, skip_special_tokens=True)


def test_100_bounded_schemas_parse_and_validate(ex, tok):
    reqs = {
        f"j{i}": (
            _prompt(i),
            SamplingParams(
                max_tokens=256,
                structured=StructuredOutput(json_schema=SCHEMAS[i % len(SCHEMAS)]),
                **_sampling(i // len(SCHEMAS)),
            ),
        )
        for i in range(100)
    }
    steps: list = []
    got = run(ex, reqs, steps)
    for i in range(100):
        ids, finish, _, _ = got[f"j{i}"]
        assert finish == "stop", (i, text(tok, ids))
        value = json.loads(text(tok, ids))
        jsonschema.validate(value, SCHEMAS[i % len(SCHEMAS)])
    # compact by default: no whitespace outside strings
    for ids, _, _, _ in got.values():
        assert not re.search(r"\s", re.sub(r'"(?:[^"\\]|\\.)*"', "", text(tok, ids)))
    assert max(s.num_constrained for s in steps) == 100
    assert sum(s.mask_s for s in steps) > 0


def test_regex_choice_grammar_and_json_object(ex, tok):
    regexes = [r"[a-z]{2,6}-[0-9]{3}", r"(yes|no|maybe)!", r"[0-9]{4}-[01][0-9]-[0-3][0-9]"]
    choices = ["apple pie", "banana", 'cherry "quoted"', "日本"]
    gbnf = 'root ::= "(" [0-9]{1,3} ("," [0-9]{1,3})* ")"'
    quote, brace = tok.convert_tokens_to_ids('"'), tok.convert_tokens_to_ids("}")
    reqs: dict[str, tuple[list[int], SamplingParams]] = {}
    for i in range(12):
        s = _sampling(i)
        reqs[f"r{i}"] = (
            _prompt(i),
            SamplingParams(max_tokens=64, structured=StructuredOutput(regex=regexes[i % 3]), **s),
        )
        reqs[f"c{i}"] = (
            _prompt(50 + i),
            SamplingParams(max_tokens=64, structured=StructuredOutput(choice=choices), **s),
        )
        reqs[f"g{i}"] = (
            _prompt(90 + i),
            SamplingParams(
                max_tokens=64,
                structured=StructuredOutput(grammar=gbnf),
                logit_bias={tok.convert_tokens_to_ids(")"): 4.0},
                **s,
            ),
        )
        # any JSON object: a random model rarely closes a free string, so favour `"` and `}`
        reqs[f"o{i}"] = (
            _prompt(70 + i),
            SamplingParams(
                max_tokens=64,
                structured=StructuredOutput(json_object=True),
                logit_bias={quote: 6.0, brace: 6.0},
                **s,
            ),
        )
    got = run(ex, reqs)
    for i in range(12):
        r = text(tok, got[f"r{i}"][0])
        assert got[f"r{i}"][1] == "stop" and re.fullmatch(regexes[i % 3], r), r
        c = text(tok, got[f"c{i}"][0])
        assert got[f"c{i}"][1] == "stop" and c in choices, c
        g = text(tok, got[f"g{i}"][0])
        assert got[f"g{i}"][1] == "stop" and re.fullmatch(r"\([0-9]{1,3}(,[0-9]{1,3})*\)", g), g
        o = text(tok, got[f"o{i}"][0])
        assert got[f"o{i}"][1] == "stop" and isinstance(json.loads(o), dict), o


def test_mixed_batch_leaves_unconstrained_requests_exact(ex):
    free = {
        f"u{i}": (
            _prompt(200 + i),
            SamplingParams(max_tokens=24, logprobs=3, ignore_eos=i % 2 == 0, **_sampling(i)),
        )
        for i in range(10)
    }
    alone = run(ex, free)
    constrained = {
        f"s{i}": (
            _prompt(300 + i),
            SamplingParams(
                max_tokens=40,
                structured=StructuredOutput(json_schema=SCHEMAS[i % 5]),
                **_sampling(i),
            ),
        )
        for i in range(10)
    }
    mixed: dict = {}
    for i in range(10):  # interleaved, so constrained and free rows alternate in the batch
        mixed[f"u{i}"], mixed[f"s{i}"] = free[f"u{i}"], constrained[f"s{i}"]
    steps: list = []
    together = run(ex, mixed, steps)
    for rid in free:
        assert together[rid] == alone[rid], rid
    assert any(0 < s.num_constrained < s.num_requests for s in steps), "never a mixed batch"


def test_logprobs_are_of_the_raw_distribution(ex, tok):
    prompt = _prompt(7)
    free = run(ex, {"f": (prompt, SamplingParams(max_tokens=1, logprobs=5))})["f"]
    so = StructuredOutput(choice=["zzz"])
    constrained = run(ex, {"c": (prompt, SamplingParams(max_tokens=8, logprobs=5, structured=so))})[
        "c"
    ]
    assert text(tok, constrained[0]) == "zzz"
    assert constrained[3][0] == free[3][0]  # the same top 5 as without the constraint


def test_preempted_request_replays_its_grammar(ex, tok):
    prompt = _prompt(11)
    params = SamplingParams(
        max_tokens=200, temperature=1.0, seed=5, structured=StructuredOutput(json_schema=SCHEMAS[3])
    )
    full = run(ex, {"a": (prompt, params)})["a"][0]
    ex.add_request("a", prompt, params, list(range(20)))
    got: list[int] = []
    while len(got) < 6:
        got += [o.token_id for o in ex.step().outputs if o.token_id is not None]
    assert ex.abort("a")
    ex.add_request("a", prompt + got, params, list(range(20, 40)), prior_output_tokens=len(got))
    while ex.has_work():
        for o in ex.step().outputs:
            got.append(o.token_id)
            last = o
    assert got == full and last.finish_reason == "stop"
    jsonschema.validate(json.loads(text(tok, got)), SCHEMAS[3])
    # earlier outputs the grammar does not accept: refused, nothing kept
    bad = tok("zz")["input_ids"]
    with pytest.raises(ExecutorInputError) as info:
        ex.add_request("b", prompt + bad, params, list(range(20)), prior_output_tokens=len(bad))
    assert info.value.field == "prior_output_tokens"
    assert ex.num_requests() == 0


def test_eos_and_stop_ids_cannot_end_an_answer_early(ex, tok):
    eos = ex.eos_token_ids
    a_id = tok.convert_tokens_to_ids("a")
    boost = {t: 100.0 for t in eos}
    so = StructuredOutput(json_schema=SCHEMAS[2])
    got = run(
        ex,
        {
            # EOS pushed to the top of every step: it still waits for the grammar to accept
            "e": (_prompt(1), SamplingParams(max_tokens=200, logit_bias=boost, structured=so)),
            # a stop id the grammar takes as text (not accepting after it) does not stop
            "s": (
                _prompt(2),
                SamplingParams(
                    max_tokens=40,
                    stop_token_ids=[a_id],
                    logit_bias={a_id: 100.0},
                    structured=StructuredOutput(regex="a+b"),
                ),
            ),
            # the grammar accepts and could go on: EOS may end it, unless ignore_eos / min_tokens
            "x": (
                _prompt(3),
                SamplingParams(
                    max_tokens=12, logit_bias=boost, structured=StructuredOutput(regex="(ab)+")
                ),
            ),
            "i": (
                _prompt(3),
                SamplingParams(
                    max_tokens=12,
                    logit_bias=boost,
                    ignore_eos=True,
                    structured=StructuredOutput(regex="(ab)+"),
                ),
            ),
            "m": (
                _prompt(3),
                SamplingParams(
                    max_tokens=12,
                    logit_bias=boost,
                    min_tokens=6,
                    structured=StructuredOutput(regex="(ab)+"),
                ),
            ),
        },
    )
    ids, finish, _, _ = got["e"]
    assert finish == "stop"
    jsonschema.validate(json.loads(text(tok, ids)), SCHEMAS[2])
    ids, finish, _, _ = got["s"]
    assert finish == "length" and set(ids) == {a_id}  # 40 a's, never stopped on "a"
    ids, finish, _, _ = got["x"]
    assert finish == "stop" and ids[-1] in eos and re.fullmatch("(ab)+", text(tok, ids))
    ids, finish, _, _ = got["i"]
    assert finish == "length" and not set(ids) & set(eos)
    ids, finish, _, _ = got["m"]
    assert finish == "stop" and ids[-1] in eos and len(ids) >= 7


def test_max_tokens_still_ends_with_length(ex, tok):
    so = StructuredOutput(
        json_schema={
            "type": "object",
            "properties": {"s": {"type": "string", "minLength": 50}},
            "required": ["s"],
        }
    )
    ids, finish, _, _ = run(ex, {"t": (_prompt(4), SamplingParams(max_tokens=8, structured=so))})[
        "t"
    ]
    assert finish == "length" and len(ids) == 8
    assert text(tok, ids).startswith('{"s":"')  # cut short: not JSON, and not called a stop


@pytest.mark.parametrize(
    ("structured", "field", "reason"),
    [
        (
            StructuredOutput(json_schema={"type": "string", "not": {"const": "a"}}),
            "structured.json_schema",
            "not",
        ),
        (
            StructuredOutput(json_schema={"type": "integer", "minimum": 5, "maximum": 1}),
            "structured.json_schema",
            "minimum",
        ),
        (StructuredOutput(json_schema={"type": "objekt"}), "structured.json_schema", "objekt"),
        (
            StructuredOutput(json_schema={"type": "string", "format": "no-such-format"}),
            "structured.json_schema",
            "format",
        ),
        (StructuredOutput(regex="a(b"), "structured.regex", "unclosed"),
        (StructuredOutput(grammar="root ::= ("), "structured.grammar", ""),
        (StructuredOutput(grammar="start: undefined_rule"), "structured.grammar", "undefined_rule"),
        (StructuredOutput(regex="a", choice=["a"]), "structured", "exactly one"),
        (StructuredOutput(), "structured", "exactly one"),
        (StructuredOutput(choice=["a", ""]), "structured.choice", "non-empty"),
        (StructuredOutput(regex="a", whitespace="spaces"), "structured.whitespace", "json_schema"),
    ],
)
def test_bad_constraints_are_refused_naming_the_field(ex, structured, field, reason):
    params = SamplingParams(max_tokens=8, structured=structured)
    with pytest.raises(ExecutorInputError) as info:
        ex.add_request("bad", [1, 2, 3], params, [0])
    assert info.value.field == field and reason in info.value.reason, info.value
    assert ex.num_requests() == 0
    # and it keeps serving
    ok = run(
        ex,
        {
            "ok": (
                [1, 2, 3],
                SamplingParams(max_tokens=4, structured=StructuredOutput(choice=["x"])),
            )
        },
    )
    assert ok["ok"][1] == "stop"
