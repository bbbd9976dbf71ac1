"""The executor's side of minirt: the model, its kernels and the executor actor."""

from __future__ import annotations

import functools
import os

from actors.runtime.options import FALSE


def switched_off(var: str) -> bool:
    """Whether the on-by-default switch ``var`` (an environment variable such as
    ``MINIRT_PACKED_LINEAR``, for A/B runs) is set off."""
    return os.environ.get(var, "1").lower() in FALSE


@functools.cache
def cpu_field(name: str) -> str:
    """The first ``name: value`` line's value in /proc/cpuinfo (``vendor_id``, ``model name``,
    ``flags``), or "" where there is none (not Linux, no such field)."""
    try:
        with open("/proc/cpuinfo") as f:
            for ln in f:
                key, _, value = ln.partition(":")
                if key.strip() == name:
                    return value.strip()
    except OSError:
        pass
    return ""
