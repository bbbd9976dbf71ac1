"""The executor's side of minirt: the model, its kernels and the executor actor."""

from __future__ import annotations

import os

from actors.runtime.options import FALSE


def switched_off(var: str) -> bool:
    """Whether the on-by-default switch ``var`` (an environment variable such as
    ``MINIRT_PACKED_LINEAR``, for A/B runs) is set off."""
    return os.environ.get(var, "1").lower() in FALSE
