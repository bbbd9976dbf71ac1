"""docs/protocol.md stays true to the wire: every struct in messages/ is in its tables, with exactly
its fields, optional ones marked ``?``; nothing is listed that does not exist.

The doc's message tables have the message tag (or, for helper structs, the class name) in backticks
in the first column and the fields in a column headed ``fields``, each field in backticks.
"""

from __future__ import annotations

import importlib
import inspect
import pkgutil
import re
from pathlib import Path

import msgspec

import messages
from messages.common import Msg

DOC = Path(__file__).resolve().parents[2] / "docs" / "protocol.md"


def wire_structs() -> dict[str, type[msgspec.Struct]]:
    """Every struct defined in messages/, keyed by its wire tag (tagged) or class name."""
    found: dict[str, type[msgspec.Struct]] = {}
    for info in pkgutil.iter_modules(messages.__path__):
        module = importlib.import_module(f"messages.{info.name}")
        for _, cls in inspect.getmembers(module, inspect.isclass):
            if not issubclass(cls, msgspec.Struct) or cls.__module__ != module.__name__:
                continue
            if cls is Msg:
                continue  # the base of every message: no fields, no tag of its own
            tag = cls.__struct_config__.tag
            found[tag if isinstance(tag, str) else cls.__name__] = cls
    return found


def doc_rows(text: str) -> dict[str, list[tuple[str, bool]]]:
    """``{name: [(field, optional), ...]}`` from every table that has a ``fields`` column."""
    rows: dict[str, list[tuple[str, bool]]] = {}
    fields_col: int | None = None
    for line in text.splitlines():
        if not line.startswith("|"):
            fields_col = None
            continue
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if fields_col is None:
            fields_col = cells.index("fields") if "fields" in cells else -1
            continue
        if fields_col < 0 or set(cells[0]) <= {"-", ":"}:
            continue
        names = re.findall(r"`([^`]+)`", cells[0])
        if len(names) != 1:
            continue
        fields = [
            (f.rstrip("?"), f.endswith("?")) for f in re.findall(r"`([^`]+)`", cells[fields_col])
        ]
        assert names[0] not in rows, f"{names[0]!r} is listed twice in protocol.md"
        rows[names[0]] = fields
    return rows


def test_every_struct_is_documented_with_exactly_its_fields() -> None:
    structs = wire_structs()
    rows = doc_rows(DOC.read_text())
    missing = sorted(set(structs) - set(rows))
    assert not missing, f"structs in messages/ missing from docs/protocol.md: {missing}"
    problems = []
    for name, cls in structs.items():
        info = msgspec.structs.fields(cls)
        actual = {f.name: f.required for f in info}
        listed = dict(rows[name])
        for field, required in actual.items():
            if field not in listed:
                problems.append(f"{name}.{field} is not listed")
            elif listed[field] == required:
                want = "required" if required else "optional (mark it `?`)"
                problems.append(f"{name}.{field} should be {want}")
        problems += [f"{name}.{f} is listed but does not exist" for f in listed if f not in actual]
    assert not problems, "docs/protocol.md disagrees with messages/:\n" + "\n".join(problems)


def test_nothing_documented_that_does_not_exist() -> None:
    extra = sorted(set(doc_rows(DOC.read_text())) - set(wire_structs()))
    assert not extra, f"docs/protocol.md lists messages that do not exist: {extra}"


def test_the_checker_catches_drift() -> None:
    """The parser sees a missing, a wrongly optional and an invented field."""
    doc = "| message | fields |\n|---|---|\n| `ping` | `nonce`, `ghost?` |\n"
    rows = doc_rows(doc)
    assert rows == {"ping": [("nonce", False), ("ghost", True)]}
    listed = dict(rows["ping"])
    actual = {f.name: f.required for f in msgspec.structs.fields(wire_structs()["ping"])}
    assert listed["nonce"] == actual["nonce"]  # listed required, but it has a default
    assert "ghost" not in actual
