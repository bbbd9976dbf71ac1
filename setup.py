"""Builds minirt's CPU kernels (gpu/csrc) into ``gpu/_kernels.so``, a library of torch operators
(``torch.ops.minirt.*``), as part of the install: ``make install`` (``pip install
--no-build-isolation -e .``), the Docker image and the GPU image all run this. A missing compiler
or a failed build fails the install, naming what is missing (the runtime never falls back to
slower code because a build went wrong).

The C kernels are compiled once per instruction set, each build's symbols prefixed, so that one
library runs on any x86-64 CPU and uses the best build it can (gpu/csrc/ops.cpp picks at run
time): ``generic`` (x86-64, also the only build elsewhere), ``v3`` (AVX2 + FMA), ``v4``
(AVX-512) and ``v4bf16`` (AVX-512 with avx512_bf16). All are built with OpenMP against torch's
own OpenMP runtime: one thread pool, torch's thread count. Everything else is in pyproject.toml.
"""

from __future__ import annotations

import glob
import os
import platform
import re
import shutil
import subprocess
from pathlib import Path

from setuptools import setup

try:
    import torch
    from torch.utils.cpp_extension import BuildExtension, CppExtension
except ImportError as e:  # pip's isolated build env has no torch: say how to install instead
    raise SystemExit(
        "minirt builds its kernels against the installed torch: install torch first, then minirt "
        "with `pip install --no-build-isolation ...` (`make install` does both)"
    ) from e

HERE = Path(__file__).resolve().parent
CSRC = Path("gpu") / "csrc"
C_SOURCE = "kernels.c"  # includes paged_decode.c, cpu_ops.c, sample.c and decode_gemm.c
# Not -ffast-math: a shared object linked with it runs crtfastmath's constructor on load, which
# turns on flush-to-zero / denormals-are-zero for the whole process. These give the vectorized
# reductions without that.
C_FLAGS = ["-O3", "-fPIC", "-fopenmp", "-fno-math-errno", "-fno-trapping-math"]
C_FLAGS += ["-fno-signed-zeros", "-fassociative-math", "-std=gnu11"]
X86 = platform.machine().lower() in ("x86_64", "amd64")
# name -> the instruction set flags of that build
VARIANTS = {"generic": ["-march=x86-64", "-mtune=generic"] if X86 else []}
if X86:
    VARIANTS["v3"] = ["-march=x86-64-v3", "-mtune=generic"]
    VARIANTS["v4"] = ["-march=x86-64-v4", "-mtune=generic"]
    VARIANTS["v4bf16"] = ["-march=x86-64-v4", "-mavx512bf16", "-mtune=generic"]


def _symbols() -> list[str]:
    """The kernels' entry points, as gpu/csrc/kernels.h lists them."""
    text = (HERE / CSRC / "kernels.h").read_text()
    return re.findall(r"X\([^,]+,\s*(\w+),", text)


def _torch_gomp() -> str:
    libs = sorted(glob.glob(os.path.join(os.path.dirname(torch.__file__), "lib", "libgomp*.so*")))
    if not libs:
        raise SystemExit(
            "minirt: torch's bundled OpenMP runtime (torch/lib/libgomp*.so*) not found"
        )
    return libs[0]


class BuildKernels(BuildExtension):
    """torch's extension build, with the C kernels compiled first, once per instruction set."""

    def build_extension(self, ext):
        cc = os.environ.get("CC", "cc")
        if shutil.which(cc) is None:
            raise SystemExit(f"minirt: no C compiler ({cc}) to build the kernels in gpu/csrc")
        out = Path(self.build_temp) / "kernels"
        out.mkdir(parents=True, exist_ok=True)
        objects = []
        for name, isa in VARIANTS.items():
            renames = [f"-D{s}=minirt_{name}_{s}" for s in _symbols()]
            obj = out / f"kernels.{name}.o"
            src = HERE / CSRC / C_SOURCE
            cmd = [cc, *C_FLAGS, *isa, *renames, "-c", str(src), "-o", str(obj)]
            print(f"minirt: building the C kernels for {name} ({' '.join(isa)})", flush=True)
            subprocess.run(cmd, check=True)
            objects.append(str(obj))
        ext.extra_objects = [*ext.extra_objects, *objects]
        super().build_extension(ext)


gomp = _torch_gomp()
setup(
    ext_modules=[
        CppExtension(
            "gpu._kernels",
            [str(CSRC / "ops.cpp")],
            extra_compile_args=["-O2", "-fopenmp", *(["-DMINIRT_X86_VARIANTS"] if X86 else [])],
            extra_link_args=[gomp, f"-Wl,-rpath,{os.path.dirname(gomp)}", "-lm"],
        )
    ],
    cmdclass={"build_ext": BuildKernels.with_options(use_ninja=False)},
)
