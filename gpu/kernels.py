"""minirt's CPU kernels as torch operators, ``torch.ops.minirt.*`` (``gpu/csrc``): built by the
install into ``gpu/_kernels*.so`` (``setup.py``), loaded here once per process.

Each op checks its arguments (dtype, shape, layout; errors name the argument) and is named in
torch.profiler's tables by itself (``minirt::paged_decode``, ``minirt::rope``, ...). The library
carries one build of the C kernels per instruction set and runs the best this CPU has
(``isa()``: ``v4bf16`` on the project's Zen 4, ``generic`` on any x86-64 or other CPU);
``MINIRT_KERNEL_ISA`` or ``use_isa`` picks another, for tests and A/B.

``MINIRT_PAGED_KERNEL=0`` keeps every caller on its torch expression (A/B): :func:`ops` is then
None. A library that is missing (a source tree that was never installed) is an error that says
how to build it, never a silent fallback to slower code.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import torch

from gpu import switched_off


class KernelsNotBuilt(RuntimeError):
    pass


@functools.cache
def library() -> Any:
    """``torch.ops.minirt``, loaded once (whatever the A/B switches say)."""
    found = sorted(Path(__file__).parent.glob("_kernels*.so"))
    if not found:
        raise KernelsNotBuilt(
            f"minirt's CPU kernels are not built (no _kernels*.so in {Path(__file__).parent}): "
            "install minirt with `make install` (pip install --no-build-isolation -e .), which "
            "compiles gpu/csrc, or set MINIRT_PAGED_KERNEL=0 to run torch's ops instead"
        )
    torch.ops.load_library(str(found[-1]))
    return torch.ops.minirt


def ops() -> Any:
    """``torch.ops.minirt`` (the library loaded on first use), or None where switched off."""
    if switched_off("MINIRT_PAGED_KERNEL"):
        return None
    return library()


def isa() -> str | None:
    """The instruction set of the kernel build that runs (None: switched off)."""
    lib = ops()
    return None if lib is None else str(lib.isa())
