"""A model directory's checkpoint stored in another dtype, as the hub stores most models
(bfloat16): the benchmarks serve it at each server's default dtype, as users run a hub
checkpoint. Made once, beside the source (``<dir>-bfloat16``); the tokenizer and every other
file copied as they are."""

from __future__ import annotations

import json
import shutil
from pathlib import Path


def stored_in(model_dir: Path, dtype: str, out: Path | None = None) -> Path:
    """``model_dir`` with its weights stored in ``dtype`` and its config saying so, written to
    ``out`` (default ``<model_dir>-<dtype>``) once; ``model_dir`` itself when its config already
    names ``dtype``."""
    import torch
    from safetensors.torch import load_file, save_file

    model_dir = Path(model_dir)
    cfg = json.loads((model_dir / "config.json").read_text())
    if (cfg.get("dtype") or cfg.get("torch_dtype")) == dtype:
        return model_dir
    out = Path(out) if out is not None else model_dir.with_name(f"{model_dir.name}-{dtype}")
    if (out / "config.json").exists():
        return out
    tmp = out.with_name(out.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    for f in model_dir.iterdir():
        if f.suffix == ".safetensors":
            tensors = load_file(str(f))
            cast = {k: v.to(getattr(torch, dtype)) for k, v in tensors.items()}
            save_file(cast, str(tmp / f.name), metadata={"format": "pt"})
        elif f.is_file() and f.name != "config.json":
            shutil.copy2(f, tmp / f.name)
    cfg["dtype"] = dtype
    cfg.pop("torch_dtype", None)
    (tmp / "config.json").write_text(json.dumps(cfg, indent=2))
    tmp.rename(out)
    return out
