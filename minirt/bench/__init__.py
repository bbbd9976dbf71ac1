"""``minirt bench serve``: drive a running runtime with a workload and write a report directory.

The developer benchmarks (executor, kv, transport, scheduler, scaling, quality, structured,
scale-out, replay, the vLLM and transformers rows) live in the checkout's top-level
``benchmarks/``, which is not installed: ``minirt bench MODE`` runs them from a source checkout.
"""

from __future__ import annotations

import importlib
import sys
from pathlib import Path
from types import ModuleType

CHECKOUT = Path(__file__).resolve().parents[2]


def developer_benchmark(name: str) -> ModuleType:
    """``benchmarks.NAME`` of the source checkout this package runs from (an editable install,
    as ``make install`` makes); a clear error where minirt was installed without one."""
    if not (CHECKOUT / "benchmarks" / f"{name}.py").exists():
        raise SystemExit(
            f"minirt: benchmark {name!r} lives in a source checkout's benchmarks/ folder, which an "
            f"installed package does not carry (looked in {CHECKOUT / 'benchmarks'}); run it from "
            "a clone of minirt installed with `make install` (pip install -e)"
        )
    if str(CHECKOUT) not in sys.path:
        sys.path.append(str(CHECKOUT))
    return importlib.import_module(f"benchmarks.{name}")
