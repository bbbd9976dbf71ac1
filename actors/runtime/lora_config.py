"""The LoRA section of the runtime configuration (``[lora]``, ``--enable-lora`` ...), with vLLM's
flags: which adapters are served from the start, and the bounds on them."""

from __future__ import annotations

from dataclasses import dataclass, field

from actors.runtime.options import doc


@dataclass
class LoraConfig:
    """LoRA adapters (``[lora]``), with vLLM's flags."""

    enable_lora: bool = field(
        default=False,
        metadata=doc(
            "serve LoRA adapters: --lora-modules, and POST /v1/load_lora_adapter and "
            "/v1/unload_lora_adapter at run time; a request picks one by its model name"
        ),
    )
    lora_modules: str = field(
        default="",
        metadata=doc(
            "adapters served from the start, as NAME=PATH words (PATH: a PEFT adapter's "
            "directory); with --enable-lora",
            many=True,
        ),
    )
    max_loras: int = field(default=1, metadata=doc("LoRA adapters in one step, at most"))
    max_lora_rank: int = field(default=16, metadata=doc("the highest LoRA rank served"))
    max_cpu_loras: int = field(
        default=0,
        metadata=doc(
            "LoRA adapters kept loaded in host memory, least recently used out first "
            "(0: --max-loras; never fewer; one a running request uses stays)"
        ),
    )

    def modules(self) -> list[tuple[str, str]]:
        """``--lora-modules`` as (name, path) pairs; ``ValueError`` naming a bad word."""
        out = []
        for word in self.lora_modules.split():
            name, sep, path = word.partition("=")
            if not sep or not name or not path:
                raise ValueError(f"lora_modules: {word!r} is not NAME=PATH")
            out.append((name, path))
        names = [n for n, _ in out]
        if len(set(names)) != len(names):
            raise ValueError(f"lora_modules: a name given twice in {names}")
        return out

    def check(self) -> None:
        """``ValueError`` naming the setting that cannot be served."""
        if self.max_loras < 1:
            raise ValueError("max_loras: at least 1")
        if self.max_lora_rank < 1:
            raise ValueError("max_lora_rank: at least 1")
        if self.max_cpu_loras < 0:
            raise ValueError("max_cpu_loras: at least 0")
        if self.modules() and not self.enable_lora:
            raise ValueError("lora_modules: adapters need --enable-lora")

    @property
    def resident(self) -> int:
        return max(self.max_cpu_loras, self.max_loras)
