"""The executor actor (actor.py, around the pure core.py, driving model_runner.py) and what it
runs: the model and its kernels (model/, kernels.py over csrc/), step planning (step/), the disk
tier's files (disk/), speculative decoding (spec/) and structured output's masks (structured/)."""

from __future__ import annotations

import functools
import os
import platform

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


def cpu_name() -> str:
    """The CPU's name, with cpuid's family and model where the name is vague ("AMD EPYC" is a
    Zen 4 at family 25, a Zen 5 at 26, with twice the float32 GEMM rate here) and whether it
    has AMX: what benchmark reports print as their machine."""
    name = cpu_field("model name") or platform.processor() or platform.machine()
    if family := cpu_field("cpu family"):
        amx = "AMX" if "amx_bf16" in cpu_field("flags").split() else "no AMX"
        name += f" (cpuid family {family} model {cpu_field('model') or '?'}, {amx})"
    return name
