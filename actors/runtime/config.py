"""Runtime configuration: endpoints, model, KV pool, budgets. From defaults, a TOML file and flags.

A TOML file mirrors the dataclass: top-level keys for ``RuntimeConfig`` and tables ``[endpoints]``,
``[kv]``, ``[scheduler]``, ``[executor]`` for the sub-configs.
"""

from __future__ import annotations

import dataclasses
import json
import os
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

ACTORS = ("tokenizer", "scheduler", "kv_manager", "executor")


@dataclass
class Endpoints:
    """ZeroMQ endpoints. Empty means ``ipc://RUN_DIR/sock/NAME`` (set by ``resolve``)."""

    client: str = ""
    tokenizer: str = ""
    scheduler: str = ""
    kv_manager: str = ""
    executor: str = ""

    def of(self, actor: str) -> str:
        return str(getattr(self, actor))


@dataclass
class KVConfig:
    num_blocks: int | None = None  # None: derive from kv_memory
    kv_memory: float | None = None  # bytes if > 1, else fraction of free memory; None: default
    block_size: int = 16
    mode: Literal["full", "on_demand"] = "on_demand"
    lookahead_blocks: int = 1
    victim_policy: Literal["newest", "priority"] = "newest"


@dataclass
class SchedulerConfig:
    policy: str = "fcfs"  # fcfs | priority | sjf | lpm
    max_batch_size: int = 256
    max_waiting: int = 4096  # past this, new requests are answered "overloaded" at once
    max_preemptions: int = 3  # past this, re-admit with a full reservation (no more thrash)
    max_wait_s: float = 60.0  # aging: a request waiting longer goes first, whatever the policy
    priority_preemption: bool = False  # priority policy: may preempt running lower-priority work
    prefix_defer_tokens: int = 64  # hold back requests sharing this many prompt tokens with one
    # being prefilled until that prefill is done, so they hit the cache (0: off)
    metrics_port: int | None = None  # Prometheus /metrics on 127.0.0.1:PORT (0: any free port)


@dataclass
class ExecutorConfig:
    chunk_cap: int = 1024  # max prefill tokens per request per step
    step_budget: int = 8192  # max tokens (prefill + decode) per step
    long_prefill_threshold: int = 0  # prompts longer than this are "long" (0: no limit)
    max_long_prefills: int = 1  # long prompts prefilling in the same step, at most
    decode_first: bool = True  # schedule decodes before prefill chunks in each step
    dtype: str | None = None
    device: str | None = None
    threads: int | None = None


@dataclass
class SecurityConfig:
    curve_dir: str = ""  # CURVE keys from `minirt keys DIR`: encrypt and authenticate every socket
    allow_remote: bool = False  # permit binding non-loopback tcp addresses (requires curve_dir)


@dataclass
class RuntimeConfig:
    model: str = ""
    run_dir: str = ".minirt"
    endpoints: Endpoints = field(default_factory=Endpoints)
    kv: KVConfig = field(default_factory=KVConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    executor: ExecutorConfig = field(default_factory=ExecutorConfig)
    security: SecurityConfig = field(default_factory=SecurityConfig)
    max_msg_size: int = 64 * 1024 * 1024
    heartbeat_s: float = 0.5

    def resolve(self) -> RuntimeConfig:
        """Fill empty endpoints with ipc sockets under the run dir; make the run dir absolute."""
        self.run_dir = str(Path(self.run_dir).absolute())
        sock = Path(self.run_dir) / "sock"
        for name in ("client", *ACTORS):
            if not getattr(self.endpoints, name):
                setattr(self.endpoints, name, f"ipc://{sock / name}")
        return self

    def curve_keys(self) -> Any:
        """The CURVE key set (``actors.runtime.security.CurveKeys``) or None when CURVE is off."""
        if not self.security.curve_dir:
            return None
        from actors.runtime.security import CurveKeys

        return CurveKeys.load(self.security.curve_dir)

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), indent=2)

    def save(self, path: str | Path) -> None:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(self.to_json())


def _merge(obj: Any, data: dict[str, Any], where: str) -> None:
    names = {f.name: f for f in dataclasses.fields(obj)}
    for key, value in data.items():
        if key not in names:
            raise ValueError(f"unknown config key {where}{key!r}; known: {sorted(names)}")
        current = getattr(obj, key)
        if dataclasses.is_dataclass(current):
            if not isinstance(value, dict):
                raise ValueError(f"config key {where}{key!r} must be a table")
            _merge(current, value, f"{where}{key}.")
        else:
            setattr(obj, key, value)


ENV_PREFIX = "MINIRT_"


def env_overrides(environ: dict[str, str] | None = None) -> dict[str, Any]:
    """Settings from the environment (how compose configures each container):
    ``MINIRT_MODEL``, ``MINIRT_RUN_DIR``, ``MINIRT_NUM_BLOCKS``, ``MINIRT_KV_MODE``,
    ``MINIRT_BLOCK_SIZE`` and ``MINIRT_<ACTOR>_ENDPOINT`` for client, tokenizer, scheduler,
    kv_manager and executor."""
    env = os.environ if environ is None else environ
    out: dict[str, Any] = {}
    if env.get("MINIRT_MODEL"):
        out["model"] = env["MINIRT_MODEL"]
    if env.get("MINIRT_RUN_DIR"):
        out["run_dir"] = env["MINIRT_RUN_DIR"]
    kv: dict[str, Any] = {}
    if env.get("MINIRT_NUM_BLOCKS"):
        kv["num_blocks"] = int(env["MINIRT_NUM_BLOCKS"])
    if env.get("MINIRT_KV_MODE"):
        kv["mode"] = env["MINIRT_KV_MODE"]
    if env.get("MINIRT_BLOCK_SIZE"):
        kv["block_size"] = int(env["MINIRT_BLOCK_SIZE"])
    if kv:
        out["kv"] = kv
    if env.get("MINIRT_CURVE_DIR"):
        out["security"] = {"curve_dir": env["MINIRT_CURVE_DIR"]}
    eps = {
        n: env[f"MINIRT_{n.upper()}_ENDPOINT"]
        for n in ("client", *ACTORS)
        if env.get(f"MINIRT_{n.upper()}_ENDPOINT")
    }
    if eps:
        out["endpoints"] = eps
    return out


def load(path: str | Path | None = None, overrides: dict[str, Any] | None = None) -> RuntimeConfig:
    """Defaults, then the TOML (or JSON) file at ``path``, then ``MINIRT_*`` environment
    variables, then ``overrides`` (nested dict, from command-line flags)."""
    cfg = RuntimeConfig()
    if path is not None:
        text = Path(path).read_text()
        data = json.loads(text) if str(path).endswith(".json") else tomllib.loads(text)
        _merge(cfg, data, "")
    env = env_overrides()
    if env:
        _merge(cfg, env, "")
    if overrides:
        _merge(cfg, overrides, "")
    return cfg
