"""The LoRA adapters the front door serves, by name: those of ``--lora-modules`` from the start,
and those a client loads or unloads at run time (``lora`` messages; the HTTP server's
``/v1/load_lora_adapter``). Each is checked against the served model once, when it is named
(``actors.shared.lora.inspect``); a request naming one carries its ``LoraRef`` on.
"""

from __future__ import annotations

from pathlib import Path

from actors.runtime.lora_config import LoraConfig
from actors.shared.lora import LoraError, ModelDims, inspect
from messages.client import LoraInfo
from messages.common import LoraRef


class Loras:
    def __init__(self, cfg: LoraConfig, model_dir: str | Path, base_name: str) -> None:
        self.enabled = cfg.enable_lora
        self.max_rank = cfg.max_lora_rank
        self.base_name = base_name
        self.dims = ModelDims.of(model_dir) if self.enabled else None
        self.by_name: dict[str, LoraRef] = {}
        for name, path in cfg.modules():
            self.check(name, path)
            self.by_name[name] = self.inspect(name, path)

    def refusal(self) -> str:
        return "this server serves no LoRA adapters (start it with --enable-lora)"

    def resolve(self, name: str) -> LoraRef | None:
        """The adapter a request names (None: ``""``, the base model); ``LoraError`` naming
        ``lora`` for a name not served."""
        if not name:
            return None
        if not self.enabled:
            raise LoraError("lora", self.refusal())
        ref = self.by_name.get(name)
        if ref is None:
            served = ", ".join(sorted(self.by_name)) or "none"
            raise LoraError("lora", f"no adapter {name!r} is loaded (served: {served})")
        return ref

    def check(self, name: str, path: str) -> None:
        """What a load must pass before its files are read (``LoraError`` naming the field)."""
        if not self.enabled:
            raise LoraError("lora_name", self.refusal())
        if not name:
            raise LoraError("lora_name", "required")
        if not path:
            raise LoraError("lora_path", "required")
        if name == self.base_name:
            raise LoraError("lora_name", f"{name!r} is the base model's name")
        if name in self.by_name:
            raise LoraError("lora_name", f"an adapter named {name!r} is already loaded")

    def inspect(self, name: str, path: str) -> LoraRef:
        """Read and check the adapter (slow: files; run it off the event loop)."""
        assert self.dims is not None
        return inspect(name, path, self.dims, self.max_rank)

    def add(self, ref: LoraRef) -> None:
        self.check(ref.name, ref.path)  # a load of the same name may have finished meanwhile
        self.by_name[ref.name] = ref

    def remove(self, name: str) -> LoraRef:
        if not self.enabled:
            raise LoraError("lora_name", self.refusal())
        ref = self.by_name.pop(name, None)
        if ref is None:
            raise LoraError("lora_name", f"no adapter {name!r} is loaded")
        return ref

    def listing(self) -> list[LoraInfo]:
        return [LoraInfo(r.name, r.path, r.rank) for r in self.by_name.values()]
