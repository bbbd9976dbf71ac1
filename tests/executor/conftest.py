"""The kernel library's builds: ``isa`` runs a test once under each instruction-set build of the C
kernels that this CPU runs (``generic`` is the portable path every CPU has)."""

from __future__ import annotations

import pytest

from gpu import kernels

try:
    _lib = kernels.ops()
except kernels.KernelsNotBuilt:  # a source tree never installed (the device machine's copy)
    _lib = None
ISAS = list(_lib.isas()) if _lib is not None else []


@pytest.fixture(params=ISAS or [None])
def isa(request):
    if request.param is None:
        pytest.skip("the kernel library is switched off (MINIRT_PAGED_KERNEL=0) or not built")
    before = _lib.use_isa(request.param)
    try:
        yield request.param
    finally:
        _lib.use_isa(before)
