"""The kernel library's builds: ``isa`` runs a test once under each instruction-set build of the C
kernels that this CPU runs (``generic`` is the portable path every CPU has)."""

from __future__ import annotations

import pytest

from gpu import kernels

_lib = kernels.ops()
ISAS = list(_lib.isas()) if _lib is not None else []


@pytest.fixture(params=ISAS or [None])
def isa(request):
    if request.param is None:
        pytest.skip("the kernel library is switched off (MINIRT_PAGED_KERNEL=0)")
    before = _lib.use_isa(request.param)
    try:
        yield request.param
    finally:
        _lib.use_isa(before)
