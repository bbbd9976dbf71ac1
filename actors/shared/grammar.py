"""A wire ``StructuredOutput`` as an llguidance grammar, compiled once per distinct constraint.

No torch here: the front door uses this module to refuse, before queuing, a constraint the engine
cannot compile (a bad schema, a keyword llguidance does not implement, an invalid regex or
grammar), and the executor to build each request's matcher. Both keep a :class:`GrammarCache`:
bounded (LRU), keyed by the constraint's canonical text (a JSON Schema with sorted keys and no
spaces), holding failures too, so a bad schema sent again costs a dictionary lookup. A compiled
entry is a matcher at its start state that each request copies (``deep_copy``: microseconds).

JSON output has bounded whitespace whatever the schema says (the options are overrides, so a
schema's ``x-guidance`` cannot turn it back on): ``compact`` allows none between tokens,
``spaces`` exactly one after ``,`` and ``:``, ``flexible`` up to ``MAX_FLEXIBLE_WHITESPACE``
characters at each place. A JSON Schema keyword llguidance does not implement is an error
(``lenient`` off), never silently ignored, so a finished answer always validates.
"""

from __future__ import annotations

import hashlib
import json
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from messages.common import (
    MAX_FLEXIBLE_WHITESPACE,
    StructuredOutput,
    canonical_json,
    validate_structured,
)

DEFAULT_CAPACITY = 256
_MAX_REASON = 400

_JSON_OPTIONS: dict[str, dict[str, Any]] = {
    "compact": {"whitespace_flexible": False, "item_separator": ",", "key_separator": ":"},
    "spaces": {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "},
    "flexible": {
        "whitespace_flexible": True,
        "whitespace_pattern": rf"[\x20\x0A\x0D\x09]{{0,{MAX_FLEXIBLE_WHITESPACE}}}",
        "item_separator": ",",
        "key_separator": ":",
    },
}


class GrammarError(ValueError):
    """A constraint that cannot be compiled; ``field`` is relative to the params
    (``structured.json_schema``), ``reason`` the engine's message."""

    def __init__(self, field: str, reason: str) -> None:
        super().__init__(f"{field}: {reason}")
        self.field = field
        self.reason = reason


@dataclass(frozen=True)
class Constraint:
    """A constraint in canonical form: equal constraints have equal keys."""

    kind: str  # json_schema | json_object | regex | choice | grammar
    text: str
    whitespace: str

    @property
    def key(self) -> str:
        return f"{self.kind}\x00{self.whitespace}\x00{self.text}"

    @property
    def digest(self) -> str:
        """A short hash naming the constraint in events."""
        return hashlib.sha256(self.key.encode()).hexdigest()[:16]

    @property
    def field(self) -> str:
        return f"structured.{self.kind}"


def constraint_of(s: StructuredOutput) -> Constraint:
    """The canonical form of ``s``; raises GrammarError for a malformed one."""
    bad = validate_structured(s)
    if bad is not None:
        raise GrammarError(*bad)
    kind = s.kinds()[0]
    if kind == "json_schema":
        text = canonical_json(s.json_schema)
    elif kind == "choice":
        text = canonical_json(s.choice)
    elif kind == "json_object":
        text = ""
    else:
        text = str(getattr(s, kind))
    return Constraint(kind, text, s.whitespace)


def grammar_of(c: Constraint) -> str:
    """The llguidance grammar (its JSON text) of ``c``; raises GrammarError for text that does
    not even parse. Whether it compiles is known only with a tokenizer (``GrammarCache``)."""
    import llguidance

    m = llguidance.LLMatcher
    opts = json_options(c.whitespace)
    try:
        if c.kind == "json_schema":
            return m.grammar_from_json_schema(c.text, overrides=opts)  # type: ignore[arg-type]
        if c.kind == "json_object":
            return m.grammar_from_json_schema('{"type":"object"}', overrides=opts)  # type: ignore[arg-type]
        if c.kind == "regex":
            return m.grammar_from_regex(c.text)
        if c.kind == "choice":
            options = json.loads(c.text)
            return m.grammar_from_lark(
                "start: " + " | ".join(json.dumps(o, ensure_ascii=False) for o in options)
            )
        from llguidance.gbnf_to_lark import any_to_lark

        return m.grammar_from_lark(any_to_lark(c.text))
    except Exception as e:  # the converters raise ValueError and assorted parse errors
        raise GrammarError(c.field, _short(str(e))) from None


def json_options(whitespace: str) -> dict[str, Any]:
    """llguidance's JSON-schema options for a whitespace style (compact, spaces, flexible):
    separators as the style writes them, and the schema enforced strictly (never lenient)."""
    return {**_JSON_OPTIONS[whitespace], "lenient": False}


def _short(reason: str) -> str:
    lines = [ln.strip() for ln in reason.strip().splitlines() if ln.strip()]
    text = "; ".join(lines) or "invalid"
    return text if len(text) <= _MAX_REASON else text[: _MAX_REASON - 3] + "..."


def hf_llg_tokenizer(hf_tokenizer: Any, vocab_size: int, eos_ids: list[int]) -> Any:
    """An llguidance tokenizer over the model's whole vocabulary (ids the tokenizer lacks are
    never allowed), ending on any of ``eos_ids``. About 0.5 s on a 32k vocabulary."""
    import llguidance.hf
    from transformers import PreTrainedTokenizerFast

    if not isinstance(hf_tokenizer, PreTrainedTokenizerFast):
        raise GrammarError("structured", "structured output needs a fast (Rust) tokenizer")
    return llguidance.hf.from_tokenizer(hf_tokenizer, n_vocab=vocab_size, eos_token=eos_ids)


@dataclass
class Compiled:
    """A compiled constraint: a matcher at its start state, copied for each request, and the
    llguidance grammar (JSON text) it was built from, which the front door forwards."""

    constraint: Constraint
    template: Any  # llguidance.LLMatcher, never advanced
    compile_s: float
    grammar: str = ""

    def matcher(self) -> Any:
        return self.template.deep_copy()


class GrammarCache:
    """Compiled constraints, at most ``capacity`` (least recently used dropped first),
    failures included. Thread-safe: the executor compiles in a worker thread.

    Two ways in: ``compile`` (the front door: a client's constraint, validated, converted and
    built) and ``build`` (the executor: a grammar the front door compiled, built into a matcher
    over the same tokenizer and trusted; it is never validated or converted again)."""

    def __init__(self, tokenizer: Callable[[], Any], capacity: int = DEFAULT_CAPACITY) -> None:
        if capacity < 1:
            raise ValueError("capacity must be >= 1")
        self._make_tokenizer = tokenizer
        self._tokenizer: Any = None
        self.capacity = capacity
        self._lru: OrderedDict[str, Compiled | GrammarError] = OrderedDict()
        self._lock = threading.Lock()
        self.hits = 0
        self.misses = 0

    def __len__(self) -> int:
        return len(self._lru)

    def tokenizer(self) -> Any:
        with self._lock:
            if self._tokenizer is None:
                self._tokenizer = self._make_tokenizer()
            return self._tokenizer

    def compile(self, s: StructuredOutput) -> tuple[Compiled, bool]:
        """``(compiled, cache_hit)``; raises GrammarError naming the field (a malformed
        constraint, or one the engine cannot compile)."""
        c = constraint_of(s)
        return self._result(c, self._get(c), lambda: self._compile(c))

    def built(self, kind: str, grammar: str) -> Compiled | GrammarError | None:
        """``build``'s cached answer, if any (counts a hit)."""
        return self._get(compiled_grammar(kind, grammar))

    def build(self, kind: str, grammar: str) -> tuple[Compiled, bool]:
        """``(compiled, cache_hit)`` for ``grammar``, llguidance's grammar text as ``compile``
        made it (``Compiled.grammar``) for a constraint of ``kind``."""
        c = compiled_grammar(kind, grammar)
        return self._result(c, self._get(c), lambda: self._build(c, grammar, time.perf_counter()))

    def _get(self, c: Constraint) -> Compiled | GrammarError | None:
        with self._lock:
            found = self._lru.get(c.key)
            if found is not None:
                self._lru.move_to_end(c.key)
                self.hits += 1
        return found

    def _result(
        self,
        c: Constraint,
        found: Compiled | GrammarError | None,
        make: Callable[[], Compiled | GrammarError],
    ) -> tuple[Compiled, bool]:
        hit = found is not None
        if found is None:
            found = make()
            with self._lock:
                self.misses += 1
                self._lru[c.key] = found
                while len(self._lru) > self.capacity:
                    self._lru.popitem(last=False)
        if isinstance(found, GrammarError):
            raise found
        return found, hit

    def _compile(self, c: Constraint) -> Compiled | GrammarError:
        t0 = time.perf_counter()
        try:
            grammar = grammar_of(c)
        except GrammarError as e:
            return e
        return self._build(c, grammar, t0)

    def _build(self, c: Constraint, grammar: str, t0: float) -> Compiled | GrammarError:
        import llguidance

        tok = self.tokenizer()
        try:
            matcher = llguidance.LLMatcher(tok, grammar, log_level=0)
        except Exception as e:  # documented not to raise for a bad grammar; never crash on one
            return GrammarError(c.field, _short(str(e)))
        if matcher.is_error():
            return GrammarError(c.field, _short(matcher.get_error()))
        return Compiled(c, matcher, time.perf_counter() - t0, grammar)


def compiled_grammar(kind: str, grammar: str) -> Constraint:
    """The constraint a front-door-compiled ``grammar`` stands for (its key: the text)."""
    return Constraint(kind, grammar, "compiled")
