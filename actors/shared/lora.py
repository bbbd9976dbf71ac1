"""LoRA adapters in PEFT's directory format (``adapter_config.json`` + ``adapter_model.safetensors``):
whether one fits the served model, checked once at the front door (``inspect``), and its
tensors read by the executor (``read_tensors``).

An adapter fits when it is a plain LoRA (no DoRA, no bias, no extra modules, one rank) of rank
at most ``--max-lora-rank`` on some of the seven linears the executor adapts, each of the shape
the served model's linear has. What does not fit is refused naming the field of
``adapter_config.json`` that says so (``r``, ``target_modules``, ``base_model_name_or_path`` for
a shape of another model...).
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from messages.common import LoraRef

CONFIG = "adapter_config.json"
WEIGHTS = "adapter_model.safetensors"
# the linears the executor adapts, as PEFT names them
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
_KEY = re.compile(
    r"^(?:base_model\.model\.)?model\.layers\.(\d+)\.(?:self_attn|mlp)\."
    r"(\w+)\.lora_([AB])(?:\.default)?\.weight$"
)
NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:/-]{0,127}$")  # a name fit for a URL's model field


class LoraError(ValueError):
    """An adapter that cannot be served: ``field`` names what is wrong (a key of
    ``adapter_config.json``, or ``lora_path`` / ``lora_name``)."""

    def __init__(self, field: str, reason: str) -> None:
        super().__init__(f"{field}: {reason}")
        self.field = field
        self.reason = reason


@dataclass(frozen=True)
class ModelDims:
    """The served model's linear shapes, from its ``config.json``."""

    hidden: int
    intermediate: int
    layers: int
    q: int  # heads * head_dim
    kv: int  # kv heads * head_dim

    @classmethod
    def of(cls, model_dir: str | Path) -> ModelDims:
        c = json.loads((Path(model_dir) / "config.json").read_text())
        c = c.get("text_config", c)
        heads = c["num_attention_heads"]
        head_dim = c.get("head_dim") or c["hidden_size"] // heads
        return cls(
            c["hidden_size"],
            c["intermediate_size"],
            c["num_hidden_layers"],
            heads * head_dim,
            c.get("num_key_value_heads", heads) * head_dim,
        )

    def shape(self, module: str) -> tuple[int, int]:
        """(out, in) of ``module``'s weight."""
        h, f = self.hidden, self.intermediate
        return {
            "q_proj": (self.q, h),
            "k_proj": (self.kv, h),
            "v_proj": (self.kv, h),
            "o_proj": (h, self.q),
            "gate_proj": (f, h),
            "up_proj": (f, h),
            "down_proj": (h, f),
        }[module]


def _config(path: Path) -> dict[str, Any]:
    if not path.is_dir():
        raise LoraError("lora_path", f"{str(path)!r} is not a directory")
    try:
        cfg = json.loads((path / CONFIG).read_text())
    except FileNotFoundError:
        raise LoraError("lora_path", f"{str(path)!r} has no {CONFIG} (a PEFT adapter)") from None
    except (OSError, ValueError) as e:
        raise LoraError("lora_path", f"{CONFIG} is not readable JSON: {e}") from None
    if not isinstance(cfg, dict):
        raise LoraError("lora_path", f"{CONFIG} is not a JSON object")
    return cfg


def _shapes(path: Path) -> dict[str, tuple[int, ...]]:
    """The tensors' shapes from the safetensors header (nothing else is read)."""
    f = path / WEIGHTS
    try:
        with f.open("rb") as fh:
            n = int.from_bytes(fh.read(8), "little")
            if not 0 < n < 100 << 20:
                raise ValueError("bad header length")
            header = json.loads(fh.read(n))
    except FileNotFoundError:
        raise LoraError("lora_path", f"{str(path)!r} has no {WEIGHTS}") from None
    except (OSError, ValueError) as e:
        raise LoraError("lora_path", f"{WEIGHTS} is not a safetensors file: {e}") from None
    return {k: tuple(v["shape"]) for k, v in header.items() if k != "__metadata__"}


def digest(path: Path) -> str:
    """What the adapter's files hold, hashed: equal digests serve equal products."""
    h = hashlib.sha256()
    for name in (CONFIG, WEIGHTS):
        with (path / name).open("rb") as f:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                h.update(chunk)
    return h.hexdigest()[:32]


def inspect(name: str, lora_path: str, dims: ModelDims, max_rank: int) -> LoraRef:
    """Check the adapter at ``lora_path`` against the served model; its ``LoraRef``, or
    ``LoraError`` naming the field. Reads the config, the weights' header and (for the digest)
    the files once."""
    if not NAME.match(name):
        raise LoraError(
            "lora_name",
            f"{name!r}: 1-128 letters, digits and ._:/- , starting with a letter or digit",
        )
    path = Path(lora_path).expanduser().absolute()
    cfg = _config(path)
    if str(cfg.get("peft_type", "LORA")).upper() != "LORA":
        raise LoraError("peft_type", f"{cfg.get('peft_type')!r}: only LORA adapters are served")
    plain = (
        ("use_dora", False),
        ("bias", "none"),
        ("modules_to_save", None),
        ("fan_in_fan_out", False),
        ("lora_bias", False),
        ("use_qalora", False),
    )
    for key, off in plain:
        if cfg.get(key, off) not in (off, [], None):
            raise LoraError(key, f"{cfg[key]!r} is not supported (plain LoRA only)")
    for key in ("rank_pattern", "alpha_pattern"):
        if cfg.get(key):
            raise LoraError(key, "per-module ranks and alphas are not supported")
    r = cfg.get("r")
    if not isinstance(r, int) or r < 1:
        raise LoraError("r", f"{r!r} is not a positive rank")
    if r > max_rank:
        raise LoraError("r", f"rank {r} is above --max-lora-rank {max_rank}")
    alpha = cfg.get("lora_alpha", r)
    if not isinstance(alpha, (int, float)) or isinstance(alpha, bool):
        raise LoraError("lora_alpha", f"{alpha!r} is not a number")
    targets = cfg.get("target_modules")
    if isinstance(targets, list):
        unknown = sorted(set(targets) - set(TARGETS))
        if unknown:
            raise LoraError(
                "target_modules", f"{unknown} cannot be adapted; these can: {', '.join(TARGETS)}"
            )
    shapes = _shapes(path)
    if not shapes:
        raise LoraError("lora_path", f"{WEIGHTS} holds no tensors")
    for key, shape in shapes.items():
        m = _KEY.match(key)
        if m is None or m.group(2) not in TARGETS:
            raise LoraError(
                "target_modules", f"tensor {key!r} is not a LoRA factor of {', '.join(TARGETS)}"
            )
        layer, module, ab = int(m.group(1)), m.group(2), m.group(3)
        out, inp = dims.shape(module)
        want = (r, inp) if ab == "A" else (out, r)
        if layer >= dims.layers or shape != want:
            raise LoraError(
                "base_model_name_or_path",
                f"tensor {key!r} of shape {list(shape)} does not fit the served model "
                f"(layer {layer} of {dims.layers}, expected {list(want)}): an adapter of another "
                f"base ({cfg.get('base_model_name_or_path')!r})",
            )
    scaling = alpha / math.sqrt(r) if cfg.get("use_rslora") else alpha / r
    return LoraRef(name, str(path), digest(path), r, float(scaling))


def read_tensors(ref: LoraRef) -> dict[tuple[int, str], tuple[Any, Any]]:
    """The adapter's factors by (layer, module): ``(A [r, in], B [out, r])`` as stored.
    Raises ``LoraError`` when its files no longer hold what the front door checked."""
    from safetensors.torch import load_file

    path = Path(ref.path)
    try:
        if digest(path) != ref.digest:
            raise LoraError("lora_path", f"{ref.path!r} changed since it was loaded")
        raw = load_file(str(path / WEIGHTS))
    except OSError as e:
        raise LoraError("lora_path", f"{ref.path!r}: {e}") from None
    pairs: dict[tuple[int, str], dict[str, Any]] = {}
    for key, t in raw.items():
        m = _KEY.match(key)
        assert m is not None  # inspect() checked every key
        pairs.setdefault((int(m.group(1)), m.group(2)), {})[m.group(3)] = t
    out = {}
    for k, ab in pairs.items():
        if set(ab) != {"A", "B"}:
            raise LoraError("target_modules", f"layer {k[0]} {k[1]} has lora_{set(ab).pop()} only")
        out[k] = (ab["A"], ab["B"])
    return out
