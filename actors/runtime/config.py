"""Runtime configuration: endpoints, model, KV pool, budgets. From defaults, a TOML file, the
environment and flags, all derived from the dataclasses below.

A TOML file mirrors the dataclasses: top-level keys for ``RuntimeConfig`` and one table per
section (``[endpoints]``, ``[kv]``, ``[scheduler]``, ``[executor]``, ``[security]``). Every field
is also a command-line flag and a ``MINIRT_*`` environment variable (``options()``): the flag is
the field's name with dashes (``kv.num_blocks`` is ``--num-blocks``) unless its metadata names
another, and the variable is the flag in capitals (``MINIRT_NUM_BLOCKS``). Adding a field, or a
section (a dataclass-typed field of ``RuntimeConfig``), is all it takes to get both; its
``metadata=doc(...)`` gives the help text and, where the type does not, the allowed values.
"""

from __future__ import annotations

import dataclasses
import json
import os
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from actors.runtime.executor_config import ExecutorConfig
from actors.runtime.lora_config import LoraConfig
from actors.runtime.options import Option, doc, options_of

ACTORS = ("tokenizer", "scheduler", "kv_manager", "executor")


# The scheduler's waiting-queue policies (actors/scheduler/queue.py implements one per name).
QUEUE_POLICIES = ("fcfs", "lpm", "priority", "sjf")


def scheduler_policies() -> list[str]:
    return list(QUEUE_POLICIES)


def _endpoint(name: str) -> Any:
    return field(
        default="", metadata=doc(f"{name} endpoint (ipc:// or tcp://)", flag=f"{name}-endpoint")
    )


@dataclass
class Endpoints:
    """ZeroMQ endpoints. Empty means ``ipc://RUN_DIR/sock/NAME`` (set by ``resolve``)."""

    client: str = _endpoint("client")
    tokenizer: str = _endpoint("tokenizer")
    scheduler: str = _endpoint("scheduler")
    kv_manager: str = _endpoint("kv_manager")
    executor: str = _endpoint("executor")
    http: str = _endpoint("http")  # the HTTP actor's inbox (pings); its API is HttpConfig's

    def of(self, actor: str) -> str:
        return str(getattr(self, actor))


@dataclass
class KVConfig:
    num_blocks: int | None = field(
        default=None, metadata=doc("KV pool size in blocks (default: derived from --kv-memory)")
    )
    kv_memory: float | None = field(
        default=None, metadata=doc("KV pool: bytes if > 1, else fraction of free memory")
    )
    block_size: int = field(default=16, metadata=doc("tokens per KV block"))
    mode: Literal["full", "on_demand"] = field(
        default="on_demand",
        metadata=doc("reserve a request's blocks up front (full) or as it grows", flag="kv-mode"),
    )
    lookahead_blocks: int = field(
        default=1, metadata=doc("on_demand: blocks reserved ahead of a growing request")
    )
    victim_policy: Literal["newest", "priority"] = field(
        default="newest", metadata=doc("which running request is preempted first")
    )
    disk_dir: str = field(
        default="",
        metadata=doc(
            "prefix cache's disk tier: keep cached KV blocks as files here, across restarts",
            flag="kv-disk-dir",
        ),
    )
    disk_bytes: int = field(
        default=4 << 30,
        metadata=doc(
            "the disk tier's bound in bytes (least recently used files go)", flag="kv-disk-bytes"
        ),
    )


@dataclass
class SchedulerConfig:
    policy: str = field(
        default="fcfs", metadata=doc("admission policy", choices=scheduler_policies)
    )
    max_batch_size: int = field(default=256, metadata=doc("running requests, at most"))
    max_waiting: int = field(
        default=4096, metadata=doc("waiting requests; past this, new ones are answered overloaded")
    )
    max_preemptions: int = field(
        default=3, metadata=doc("past this, re-admit with a full reservation (no more thrash)")
    )
    max_wait_s: float = field(
        default=60.0, metadata=doc("aging bound: a request waiting longer goes first")
    )
    priority_preemption: bool = field(
        default=False, metadata=doc("priority policy: may preempt running lower-priority work")
    )
    prefix_defer_tokens: int = field(
        default=64,
        metadata=doc(
            "hold back requests sharing this many prompt tokens with one being prefilled until "
            "that prefill is done, so they hit the cache (0: off)"
        ),
    )
    metrics_port: int | None = field(
        default=None, metadata=doc("Prometheus /metrics on 127.0.0.1:PORT (0: any free port)")
    )


@dataclass
class SecurityConfig:
    curve_dir: str = field(
        default="",
        metadata=doc("CURVE keys from `minirt keys DIR`: encrypt and authenticate every socket"),
    )
    allow_remote: bool = field(
        default=False,
        metadata=doc("permit binding non-loopback tcp addresses (requires --curve-dir)"),
    )


@dataclass
class HttpConfig:
    """The OpenAI-compatible HTTP API (the ``http`` actor, minirt/http/)."""

    port: int = field(
        default=8000, metadata=doc("OpenAI API port (0: no HTTP server)", flag="http-port")
    )
    host: str = field(
        default="127.0.0.1",
        metadata=doc(
            "OpenAI API address; beyond loopback needs --allow-remote and --api-key",
            flag="http-host",
        ),
    )
    api_key: str = field(
        default="",
        metadata=doc("require `Authorization: Bearer KEY` on every HTTP request but /health"),
    )
    served_model_name: str = field(
        default="", metadata=doc("the model's name in the API (default: --model as given)")
    )
    keep_alive_s: float = field(
        default=5.0,
        metadata=doc(
            "close a connection with no request in progress after this many seconds, one "
            "still sending its request headers included",
            flag="http-keep-alive-s",
        ),
    )
    body_timeout_s: float = field(
        default=30.0,
        metadata=doc(
            "a request body must arrive whole within this many seconds (else 408)",
            flag="http-body-timeout-s",
        ),
    )
    responses_max_count: int = field(
        default=1000,
        metadata=doc(
            "stored /v1/responses kept at most (in the run directory; the oldest dropped first)"
        ),
    )
    responses_max_bytes: int = field(
        default=64 * 1024 * 1024,
        metadata=doc("bytes of stored /v1/responses kept at most (the oldest dropped first)"),
    )
    max_connections: int = field(
        default=1024,
        metadata=doc(
            "open connections at most; a connection past it is answered 503 and closed "
            "(0: no limit)",
            flag="http-max-connections",
        ),
    )


@dataclass
class RuntimeConfig:
    model: str = field(
        default="",
        metadata=doc(
            "a Hugging Face model directory, a .gguf file or a hub id org/name[@revision] from "
            "the local HF cache; default: SmolLM2-135M-Instruct (fetched once)"
        ),
    )
    max_model_len: int | None = field(
        default=None,
        metadata=doc(
            "longest request, prompt plus output, in tokens (default: the model's context, "
            "capped by what the KV pool holds)"
        ),
    )
    run_dir: str = field(default=".minirt", metadata=doc("sockets, events and logs go here"))
    replica: str = field(
        default="",
        metadata=doc(
            "this instance's name among replicas: every event carries it (set by --replicas)"
        ),
    )
    tool_call_parser: Literal["auto", "hermes", "llama3_json", "mistral"] = field(
        default="auto",
        metadata=doc(
            "how tool calls are written in the model's output (vLLM's names); auto: chosen "
            "from the chat template (hermes when it shows none)"
        ),
    )
    reasoning_parser: Literal["auto", "qwen3", "deepseek_r1", "none"] = field(
        default="auto",
        metadata=doc(
            "how reasoning is marked in the output (<think>...</think>); auto: qwen3 when the "
            "chat template knows <think>, else none"
        ),
    )
    runner: Literal["generate", "pooling"] = field(
        default="generate",
        metadata=doc(
            "what the model serves (vLLM's --runner): generate, text; pooling, embeddings "
            "(POST /v1/embeddings) and nothing else"
        ),
    )
    pooler_config: str = field(
        default="",
        metadata=doc(
            'with --runner pooling, vLLM\'s JSON: {"pooling_type": "LAST" or "MEAN", '
            '"normalize": true or false} (default: LAST, normalized, as vLLM\'s for a causal LM)'
        ),
    )
    endpoints: Endpoints = field(default_factory=Endpoints)
    kv: KVConfig = field(default_factory=KVConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    executor: ExecutorConfig = field(default_factory=ExecutorConfig)
    lora: LoraConfig = field(default_factory=LoraConfig)
    security: SecurityConfig = field(default_factory=SecurityConfig)
    http: HttpConfig = field(default_factory=HttpConfig)
    max_msg_size: int = field(default=64 * 1024 * 1024, metadata=doc("largest frame, in bytes"))
    heartbeat_s: float = field(
        default=0.5,
        metadata=doc(
            "ping peers this often; 3 silent heartbeats make a peer suspect (requests wait), "
            "its process's exit makes it dead"
        ),
    )
    wedged_after_s: float = field(
        default=300.0,
        metadata=doc(
            "minirt up: an actor that answers no ping for this long is killed and restarted "
            "(0: never)"
        ),
    )
    actor_nice: int = field(
        default=0,
        metadata=doc(
            "niceness of every actor but the executor (scheduler, KV manager, front door, HTTP "
            "server): the executor's threads go first when they compete for the cores (0: equal)"
        ),
    )

    def pooler(self) -> tuple[str, bool]:
        """``--pooler-config``: the pooling type (``SamplingParams.pooling``) and whether
        embeddings are normalized; raises ``ValueError`` naming the key."""
        try:
            given = json.loads(self.pooler_config) if self.pooler_config.strip() else {}
        except json.JSONDecodeError as e:
            raise ValueError(f"pooler_config: not JSON ({e})") from None
        if not isinstance(given, dict):
            raise ValueError("pooler_config: expected a JSON object")
        unknown = sorted(set(given) - {"pooling_type", "normalize"})
        if unknown:
            raise ValueError(
                f"pooler_config: unknown keys {unknown}; known: pooling_type, normalize"
            )
        kind = str(given.get("pooling_type", "LAST")).lower()
        if kind not in ("last", "mean"):
            raise ValueError(f"pooler_config.pooling_type: {kind.upper()!r} is not LAST or MEAN")
        normalize = given.get("normalize", True)
        if not isinstance(normalize, bool):
            raise ValueError(f"pooler_config.normalize: expected true or false, got {normalize!r}")
        return kind, normalize

    def resolve(self) -> RuntimeConfig:
        """Fill empty endpoints with ipc sockets under the run dir; make the run dir absolute."""
        self.run_dir = str(Path(self.run_dir).absolute())
        sock = Path(self.run_dir) / "sock"
        for name in ("client", *ACTORS, "http"):
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
        """Write the config whole or not at all: a child reading it meanwhile sees the old file
        or the new one, never a part (a temporary file renamed into place)."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        tmp.write_text(self.to_json())
        os.replace(tmp, path)


def options() -> list[Option]:
    """Every setting of ``RuntimeConfig``, with its flag and environment name."""
    return options_of(RuntimeConfig)


def _merge(obj: Any, data: dict[str, Any], where: str, by_key: dict[str, Option]) -> None:
    names = {f.name: f for f in dataclasses.fields(obj)}
    for key, value in data.items():
        if key not in names:
            raise ValueError(f"unknown config key {where}{key!r}; known: {sorted(names)}")
        current = getattr(obj, key)
        if dataclasses.is_dataclass(current):
            if not isinstance(value, dict):
                raise ValueError(f"config key {where}{key!r} must be a table")
            _merge(current, value, f"{where}{key}.", by_key)
        else:
            by_key[f"{where}{key}"].check(value)
            setattr(obj, key, value)


def without_settings(environ: dict[str, str]) -> dict[str, str]:
    """``environ`` less the ``MINIRT_*`` variables that are settings (``MINIRT_REPLICA`` kept: it
    labels events): what ``minirt up`` hands its children, whose settings are the config it
    resolved and wrote; a variable read again there would undo that (``--model`` given, a stale
    ``MINIRT_MODEL`` in the shell)."""
    settings = {opt.env for opt in options()} - {"MINIRT_REPLICA"}
    return {k: v for k, v in environ.items() if k not in settings}


def settings_in_env(environ: dict[str, str] | None = None) -> list[str]:
    """The ``MINIRT_*`` settings variables set (non-empty) in ``environ``."""
    env = os.environ if environ is None else environ
    return sorted(opt.env for opt in options() if env.get(opt.env))


def env_overrides(environ: dict[str, str] | None = None) -> dict[str, Any]:
    """Settings from ``MINIRT_*`` environment variables (how compose configures each container),
    as a nested dict; an empty variable counts as unset."""
    env = os.environ if environ is None else environ
    out: dict[str, Any] = {}
    for opt in options():
        text = env.get(opt.env, "")
        if text:
            opt.put(out, opt.parse(text, opt.env))
    return out


def load(
    path: str | Path | None = None,
    overrides: dict[str, Any] | None = None,
    environ: dict[str, str] | None = None,
) -> RuntimeConfig:
    """Defaults, then the TOML (or JSON) file at ``path``, then ``MINIRT_*`` environment
    variables (of ``environ``, default ``os.environ``), then ``overrides`` (nested dict, from
    command-line flags). A value of the wrong type or not among a field's choices raises
    ``ValueError`` naming the field."""
    cfg = RuntimeConfig()
    by_key = {opt.key: opt for opt in options()}
    if path is not None:
        text = Path(path).read_text()
        data = json.loads(text) if str(path).endswith(".json") else tomllib.loads(text)
        _merge(cfg, data, "", by_key)
    env = env_overrides(environ)
    if env:
        _merge(cfg, env, "", by_key)
    if overrides:
        _merge(cfg, overrides, "", by_key)
    return cfg
