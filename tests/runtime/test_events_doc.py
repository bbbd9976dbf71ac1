"""docs/events.md lists every event the product emits, each name belongs to one actor, and every
emit site names its event with a literal string (so ``grep`` finds every emitter)."""

from __future__ import annotations

import ast
import re
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "events.md"
LEVELS = {"debug", "info", "warning", "error", "exception", "critical"}

# Which actor owns the events emitted by code under each path (longest prefix wins).
OWNERS = {
    "actors/runtime/": "every actor",
    "minirt/launch/runner.py": "every actor",
    "minirt/launch/": "supervisor",
    "actors/scheduler/": "scheduler",
    "actors/kv/": "kv_manager",
    "gpu/": "executor",
    "minirt/http/": "http",
    "tokenizer_svc/": "tokenizer",
    "minirt/replay/": "replay",
}


def owner_of(path: str) -> str | None:
    best = max((p for p in OWNERS if path.startswith(p)), key=len, default=None)
    return OWNERS[best] if best else None


def emit_sites() -> tuple[dict[str, set[str]], list[str]]:
    """``({event: {owner}}, [non-literal sites])`` for every logger call in product code."""
    events: dict[str, set[str]] = defaultdict(set)
    bad: list[str] = []
    for file in sorted(ROOT.glob("*/**/*.py")):
        rel = file.relative_to(ROOT).as_posix()
        owner = owner_of(rel)
        if owner is None:
            continue
        for node in ast.walk(ast.parse(file.read_text(), rel)):
            if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)):
                continue
            target = node.func.value
            logger = target.attr if isinstance(target, ast.Attribute) else getattr(target, "id", "")
            if node.func.attr not in LEVELS or "log" not in str(logger).lower() or not node.args:
                continue
            first = node.args[0]
            if isinstance(first, ast.Constant) and isinstance(first.value, str):
                events[first.value].add(owner)
            else:
                bad.append(f"{rel}:{node.lineno}")
    return events, bad


def doc_events() -> dict[str, str]:
    """``{event: actor}`` from the tables of docs/events.md (columns: event, actor, ...)."""
    out: dict[str, str] = {}
    for line in DOC.read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if not line.startswith("|") or len(cells) < 2:
            continue
        name = re.fullmatch(r"`([a-z_.]+)`", cells[0])
        if name:
            assert name.group(1) not in out, f"{name.group(1)} listed twice in docs/events.md"
            out[name.group(1)] = cells[1]
    return out


def test_every_emit_site_uses_a_literal_name() -> None:
    _, bad = emit_sites()
    assert not bad, f"event names must be string literals at: {bad}"


def test_each_event_belongs_to_one_actor() -> None:
    events, _ = emit_sites()
    shared = {name: sorted(owners) for name, owners in events.items() if len(owners) > 1}
    assert not shared, f"events emitted by more than one actor: {shared}"


def test_docs_list_exactly_the_emitted_events() -> None:
    events, _ = emit_sites()
    doc = doc_events()
    missing = sorted(set(events) - set(doc))
    assert not missing, f"events missing from docs/events.md: {missing}"
    stale = sorted(set(doc) - set(events))
    assert not stale, f"docs/events.md lists events nothing emits: {stale}"
    wrong = {n: (doc[n], sorted(o)) for n, o in events.items() if doc[n] not in o}
    assert not wrong, f"docs/events.md names the wrong actor: {wrong}"
