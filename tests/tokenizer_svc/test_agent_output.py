"""Reading tool calls and reasoning out of a model's text (tokenizer_svc/agent), pure: every
format vLLM names, streamed in any pieces adding up to exactly the whole text's parse, and the
grammars that make a required call accept valid calls and nothing else."""

from __future__ import annotations

import json
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from messages.tokenizer import ChatMessage, Generate, Tool
from tokenizer_svc.agent.parse import Diff, OutputParser, Parsed
from tokenizer_svc.agent.tools import (
    ends_thinking,
    reasoning_parser_for,
    tool_parser_for,
    tools_grammar,
)


def _stream(text: str, pieces: list[int], tools: str, reasoning: str = "", opened=False):
    """What a stream sends for ``text`` cut at ``pieces``, reassembled."""
    p, d, events = OutputParser(tools, reasoning, opened), Diff(), []
    i = 0
    for n in [*pieces, len(text)]:
        p.feed(text[i : i + n])
        i += n
        events += d.step(p.parsed())
    p.feed(text[i:])
    events += d.step(p.parsed(final=True))
    out = Parsed()
    calls: dict[int, list[str]] = {}
    for ev in events:
        if ev[0] == "reasoning":
            out.reasoning += ev[1]
        elif ev[0] == "content":
            out.content += ev[1]
        elif ev[0] == "call":
            assert ev[1] not in calls  # a call starts once
            calls[ev[1]] = [ev[2], ""]
        else:
            calls[ev[1]][1] += ev[2]
    return out.reasoning, out.content, [tuple(calls[i]) for i in sorted(calls)]


def _whole(text: str, tools: str, reasoning: str = "", opened=False):
    p = OutputParser(tools, reasoning, opened)
    p.feed(text)
    r = p.parsed(final=True)
    return r.reasoning, r.content, [(c.name, c.arguments) for c in r.calls]


CASES = [
    (
        "hermes",
        'Sure.\n<tool_call>\n{"name": "get", "arguments": {"q": "a}b", "n": [1, {"x": null}]}}\n'
        '</tool_call>\n<tool_call>\n{"arguments": {}, "name": "other"}\n</tool_call>',
        ("", "Sure.", [("get", '{"q": "a}b", "n": [1, {"x": null}]}'), ("other", "{}")]),
    ),
    ("hermes", "no calls < here <tool", ("", "no calls < here <tool", [])),
    (
        "hermes",
        "<tool_call>not json</tool_call> ok",
        ("", "<tool_call>not json</tool_call> ok", []),
    ),
    ("hermes", '<tool_call>\n{"name": "f", "arguments": {"a": ', ("", "", [("f", '{"a": ')])),
    (
        "llama3_json",
        '<|python_tag|>{"name": "a", "parameters": {"q": 2}}; {"name": "b", "parameters": {}}',
        ("", "", [("a", '{"q": 2}'), ("b", "{}")]),
    ),
    ("llama3_json", "just text {", ("", "just text {", [])),
    (
        "mistral",
        'hi [TOOL_CALLS][{"name": "a", "arguments": {"q": 2}}, {"name": "b", "arguments": {}}]',
        ("", "hi", [("a", '{"q": 2}'), ("b", "{}")]),
    ),
]


@pytest.mark.parametrize(("parser", "text", "want"), CASES)
def test_formats_parse_and_stream_equal(parser, text, want):
    assert _whole(text, parser) == want
    rng = random.Random(0)
    for _ in range(20):  # any cut of the text streams the same answer
        cuts = [rng.randint(0, 4) for _ in range(len(text))]
        assert _stream(text, cuts, parser) == want


def test_reasoning_formats():
    text = "<think>\nweigh it\n</think>\n\nThe answer."
    assert _whole(text, "", "qwen3") == ("weigh it", "The answer.", [])
    assert _whole("The answer.", "", "qwen3") == ("", "The answer.", [])
    # the template opened the block (or the format starts in it): no <think> in the output
    assert _whole("weigh it</think>ok", "", "deepseek_r1") == ("weigh it", "ok", [])
    assert _whole("weigh it</think>ok", "", "qwen3", opened=True) == ("weigh it", "ok", [])
    both = '<think>call f</think>\n<tool_call>\n{"name": "f", "arguments": {}}\n</tool_call>'
    assert _whole(both, "hermes", "qwen3") == ("call f", "", [("f", "{}")])
    assert _stream(both, [1] * len(both), "hermes", "qwen3") == ("call f", "", [("f", "{}")])
    # cut by max_tokens inside the reasoning: all of it is reasoning
    assert _whole("<think>still going", "", "qwen3") == ("still going", "", [])


_PIECES = [
    "<tool_call>",
    "</tool_call>",
    "\n",
    '{"name": "f", "arguments": {"a": "x}"}}',
    '{"name": ',
    '"g"',
    ', "arguments": [',
    "<think>",
    "</think>",
    "[TOOL_CALLS]",
    "<|python_tag|>",
    "; ",
    "text",
    " ",
    "<",
    "{",
    "}",
    '"',
    "\\",
]


@settings(max_examples=300, deadline=None)
@given(
    parts=st.lists(st.sampled_from(_PIECES), max_size=14),
    cuts=st.lists(st.integers(0, 5), max_size=40),
    tools=st.sampled_from(["hermes", "llama3_json", "mistral", ""]),
    reasoning=st.sampled_from(["", "qwen3", "deepseek_r1"]),
)
def test_any_text_streams_what_it_parses_to(parts, cuts, tools, reasoning):
    """Whatever the model writes, well-formed or not, and however it arrives: the stream's
    pieces add up to the whole text's parse (nothing sent is ever taken back)."""
    text = "".join(parts)
    assert _stream(text, cuts, tools, reasoning) == _whole(text, tools, reasoning)


def test_formats_chosen_from_the_template():
    assert tool_parser_for("... <tool_call> ...", "auto") == "hermes"
    assert tool_parser_for("... [TOOL_CALLS] ...", "auto") == "mistral"
    assert tool_parser_for("... <|python_tag|> ...", "auto") == "llama3_json"
    assert tool_parser_for("plain chatml", "auto") == "hermes"
    assert tool_parser_for("... <tool_call> ...", "mistral") == "mistral"
    assert reasoning_parser_for("{% if x %}<think>{% endif %}", "auto") == "qwen3"
    assert reasoning_parser_for("chatml", "auto") == ""
    assert reasoning_parser_for("<think>", "none") == ""
    assert ends_thinking("<|im_start|>assistant\n<think>\n")
    assert not ends_thinking("<|im_start|>assistant\n<think>\n\n</think>\n\n")


_TOOLS = [
    Tool(
        name="f",
        parameters={
            "type": "object",
            "properties": {"a": {"type": "integer"}},
            "required": ["a"],
            "additionalProperties": False,
        },
    ),
    Tool(name="g"),
]
_ONE = {
    "hermes": ('<tool_call>\n{"name": "f", "arguments": {"a": 3}}\n</tool_call>', "\n"),
    "llama3_json": ('{"name": "f", "parameters": {"a": 3}}', "; "),
    "mistral": ('{"name": "f", "arguments": {"a": 3}}', ", "),
}


def _accepts(lark: str, text: str, tok) -> bool:
    import llguidance

    m = llguidance.LLMatcher(tok, llguidance.LLMatcher.grammar_from_lark(lark))
    assert not m.is_error(), m.get_error()
    ids = tok.tokenize_str(text)
    return m.try_consume_tokens(ids) == len(ids) and m.is_accepting()


@pytest.fixture(scope="module")
def llg_tokenizer(tiny_model):
    import llguidance.hf
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model)
    return llguidance.hf.from_tokenizer(tok, n_vocab=512, eos_token=[tok.eos_token_id])


@pytest.mark.parametrize("parser", ["hermes", "llama3_json", "mistral"])
def test_required_grammar_accepts_valid_calls_only(parser, llg_tokenizer):
    one, sep = _ONE[parser]
    wrap = (lambda s: "[TOOL_CALLS][" + s + "]") if parser == "mistral" else (lambda s: s)
    msg = Generate(messages=[ChatMessage(role="user", content="x")], tools=_TOOLS)
    required = tools_grammar(_with(msg, tool_choice="required"), parser)
    assert required is not None
    assert _accepts(required, wrap(one), llg_tokenizer)
    assert _accepts(required, wrap(one + sep + one), llg_tokenizer)  # parallel calls
    assert not _accepts(required, wrap(one.replace('"f"', '"h"')), llg_tokenizer)  # no such tool
    assert not _accepts(required, wrap(one.replace("3", '"3"')), llg_tokenizer)  # schema
    assert not _accepts(required, "I will not call", llg_tokenizer)
    single = tools_grammar(_with(msg, tool_choice="required", parallel_tool_calls=False), parser)
    assert single is not None and not _accepts(single, wrap(one + sep + one), llg_tokenizer)
    named = tools_grammar(_with(msg, tool_choice="g"), parser)
    assert named is not None and not _accepts(named, wrap(one), llg_tokenizer)
    assert tools_grammar(_with(msg, tool_choice="auto"), parser) is None


def _with(msg: Generate, **changes) -> Generate:
    import msgspec

    return msgspec.structs.replace(msg, **changes)


def test_arguments_are_the_models_json_text():
    """A call's arguments are the JSON text as written (valid JSON once the call is whole)."""
    text = '<tool_call>\n{"name": "f", "arguments": {"a": [1, 2], "b": "\\"}"}}\n</tool_call>'
    [(name, args)] = _whole(text, "hermes")[2]
    assert name == "f"
    assert json.loads(args) == {"a": [1, 2], "b": '"}'}


def test_front_door_reading_follows_flags_and_template(tiny_model):
    """``--tool-call-parser`` / ``--reasoning-parser`` override the template's formats; a
    template that opens ``<think>`` in the prompt makes the output start in reasoning; a
    required call becomes the request's grammar, compiled once at the front door."""
    from transformers import AutoTokenizer

    from tokenizer_svc.agent.tools import Reading
    from tokenizer_svc.requests import Parsers, Prompts, check_request

    tok = AutoTokenizer.from_pretrained(tiny_model)
    msg = Generate(
        messages=[ChatMessage(role="user", content="x")], tools=_TOOLS, tool_choice="required"
    )
    got = check_request(msg, tok, 512, 1024, Prompts(), Parsers("llama3_json", "auto"))
    assert got.reading == Reading("llama3_json", "", False)
    assert got.grammar and got.params.structured is not None
    assert '\\"parameters\\": ' in (got.params.structured.grammar or "")
    plain = check_request(_with(msg, tool_choice="auto"), tok, 512, 1024, Prompts())
    assert plain.reading == Reading("hermes", "", False) and not plain.grammar
    tok.chat_template = (
        "{% for m in messages %}{{ m.content }}{% endfor %}<|im_start|>assistant\n<think>\n"
    )
    opened = check_request(_with(msg, tools=[], tool_choice="auto"), tok, 512, 1024, Prompts())
    assert opened.reading == Reading("", "qwen3", True)
    off = check_request(
        _with(msg, tools=[], tool_choice="auto"), tok, 512, 1024, Prompts(), Parsers("auto", "none")
    )
    assert off.reading == Reading()
