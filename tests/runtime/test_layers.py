"""The floors hold: no import points up a floor or sideways between actors, and no two files
import each other, directly or around a circle (docs/architecture.md, *Floors*).

Every import counts: at the top of a file, inside a function, or under ``TYPE_CHECKING``.
"""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

# Lowest first. A file may import its own unit and any unit on a lower floor, nothing else:
# the actors on floor 3 talk to each other only through messages/.
FLOORS: dict[str, int] = {
    "messages": 0,
    "actors.runtime": 1,
    "actors.shared": 2,
    "actors.scheduler": 3,
    "actors.kv": 3,
    "gpu": 3,
    "tokenizer_svc": 3,
    "minirt": 4,
    "benchmarks": 5,
}
PACKAGES = ("messages", "actors", "gpu", "tokenizer_svc", "minirt", "benchmarks")


def modules(root: Path) -> dict[str, Path]:
    """Every module of the checked packages under ``root``, by dotted name."""
    out = {}
    for pkg in PACKAGES:
        for path in (root / pkg).rglob("*.py"):
            name = ".".join(path.relative_to(root).with_suffix("").parts)
            out[name.removesuffix(".__init__")] = path
    return out


def unit(module: str) -> str:
    """The unit a module belongs to: a sub-package of ``actors``, else its top package."""
    parts = module.split(".")
    if parts[0] == "actors":
        return ".".join(parts[:2]) if len(parts) > 1 else "actors.runtime"
    return parts[0]


def imports(root: Path) -> dict[str, set[str]]:
    """module -> the project modules it imports (``from P import m`` names module ``P.m``)."""
    mods = modules(root)
    edges: dict[str, set[str]] = defaultdict(set)
    for name, path in mods.items():
        is_pkg = path.name == "__init__.py"
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    pkg = name.split(".")[: len(name.split(".")) - node.level + is_pkg]
                    base = ".".join([*pkg, base] if base else pkg)
                targets = [f"{base}.{a.name}" for a in node.names]
            for t in targets:
                while t and t not in mods:
                    t = t.rpartition(".")[0]
                if t and t != name:
                    edges[name].add(t)
    return edges


def upward(edges: dict[str, set[str]]) -> list[str]:
    """Imports that reach a unit on the same or a higher floor than the importer's own."""
    bad = []
    for src, dsts in sorted(edges.items()):
        for dst in sorted(dsts):
            a, b = unit(src), unit(dst)
            if a != b and FLOORS[b] >= FLOORS[a]:
                bad.append(f"{src} ({a}, floor {FLOORS[a]}) -> {dst} ({b}, floor {FLOORS[b]})")
    return bad


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The import circles: strongly connected components of more than one file (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in edges.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return found


def test_every_package_is_on_a_floor():
    assert {unit(m) for m in modules(ROOT)} <= set(FLOORS)


def test_no_import_points_up_or_sideways():
    assert upward(imports(ROOT)) == []


def test_no_import_cycles():
    assert cycles(imports(ROOT)) == []


def _tree(root: Path, files: dict[str, str]) -> None:
    for pkg in PACKAGES:
        (root / pkg).mkdir()
        (root / pkg / "__init__.py").write_text("")
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


def test_the_check_catches_an_upward_import_and_a_cycle(tmp_path):
    _tree(
        tmp_path,
        {
            "actors/runtime/__init__.py": "",
            "actors/runtime/actor.py": "from messages import codec\n",
            "messages/codec.py": "",
            # the wire reaching up into an actor: the kind of arrow the floors forbid
            "messages/common.py": "def f():\n    from gpu.core import X\n",
            "gpu/core.py": "from gpu import step\nfrom tokenizer_svc import core\n",
            "gpu/step.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
            "    from gpu.core import Core\n",
            "tokenizer_svc/core.py": "",
        },
    )
    edges = imports(tmp_path)
    assert upward(edges) == [
        "gpu.core (gpu, floor 3) -> tokenizer_svc.core (tokenizer_svc, floor 3)",
        "messages.common (messages, floor 0) -> gpu.core (gpu, floor 3)",
    ]
    assert cycles(edges) == [["gpu.core", "gpu.step"]]
    assert "messages.codec" in edges["actors.runtime.actor"]
