"""Flags and MINIRT_* variables come from the config dataclasses: each parses into its field,
the names compose and scripts use keep working, and bad values are refused naming the field."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import pytest

from actors.runtime import config
from actors.runtime.config import RuntimeConfig, options
from actors.runtime.options import Option, doc, options_of
from actors.scheduler.queue import POLICIES
from minirt.cli import build_parser, config_from_args

# Every flag and variable that existed before they were derived (compose.yaml, the Dockerfile,
# scripts, docs): renaming a field must not break them.
LEGACY_FLAGS = {
    "--model": "model",
    "--run-dir": "run_dir",
    "--num-blocks": "kv.num_blocks",
    "--kv-memory": "kv.kv_memory",
    "--block-size": "kv.block_size",
    "--kv-mode": "kv.mode",
    "--policy": "scheduler.policy",
    "--max-batch-size": "scheduler.max_batch_size",
    "--max-waiting": "scheduler.max_waiting",
    "--max-wait-s": "scheduler.max_wait_s",
    "--priority-preemption": "scheduler.priority_preemption",
    "--metrics-port": "scheduler.metrics_port",
    "--chunk-cap": "executor.chunk_cap",
    "--step-budget": "executor.step_budget",
    "--long-prefill-threshold": "executor.long_prefill_threshold",
    "--max-long-prefills": "executor.max_long_prefills",
    "--prefill-first": "executor.decode_first",
    "--device": "executor.device",
    "--dtype": "executor.dtype",
    "--threads": "executor.threads",
    "--curve-dir": "security.curve_dir",
    "--allow-remote": "security.allow_remote",
    **{f"--{n.replace('_', '-')}-endpoint": f"endpoints.{n}" for n in ("client", *config.ACTORS)},
}
LEGACY_ENV = {
    "MINIRT_MODEL": "model",
    "MINIRT_RUN_DIR": "run_dir",
    "MINIRT_NUM_BLOCKS": "kv.num_blocks",
    "MINIRT_KV_MODE": "kv.mode",
    "MINIRT_BLOCK_SIZE": "kv.block_size",
    "MINIRT_CURVE_DIR": "security.curve_dir",
    **{f"MINIRT_{n.upper()}_ENDPOINT": f"endpoints.{n}" for n in ("client", *config.ACTORS)},
}


@pytest.fixture(autouse=True)
def no_minirt_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for opt in options():
        monkeypatch.delenv(opt.env, raising=False)


def get(cfg: RuntimeConfig, key: str) -> Any:
    obj: Any = cfg
    for part in key.split("."):
        obj = getattr(obj, part)
    return obj


def sample(opt: Option, i: int) -> tuple[str, Any]:
    """A valid value for ``opt`` that differs from its default: (as text, as parsed)."""
    if opt.choices:
        value: Any = next(c for c in opt.choices if c != opt.default)
    elif opt.type is bool:
        value = not opt.default
    elif opt.type is int:
        value = 100_000 + i
    elif opt.type is float:
        value = 0.25 + i
    else:
        value = f"value-{i}"
    text = ("1" if value else "0") if opt.type is bool else str(value)
    return text, value


def up(*argv: str) -> RuntimeConfig:
    return config_from_args(build_parser().parse_args(["up", *argv]))


def test_every_field_is_a_flag_that_parses_into_it():
    for i, opt in enumerate(options()):
        text, value = sample(opt, i)
        if opt.type is bool:
            argv = [f"--{opt.flag}" if value else f"--no-{opt.flag}"]
        else:
            argv = [f"--{opt.flag}", text]
        cfg = up(*argv)
        assert get(cfg, opt.key) == value, (argv, opt.key)
        assert get(RuntimeConfig(), opt.key) != value  # the flag, not the default, set it


def test_every_field_is_a_minirt_variable_and_flags_win_over_it():
    env = {}
    for i, opt in enumerate(options()):
        text, value = sample(opt, i)
        env[opt.env] = text
        assert get(config.load(environ={opt.env: text}), opt.key) == value, opt.env
    cfg = config.load(environ=env)
    for i, opt in enumerate(options()):
        assert get(cfg, opt.key) == sample(opt, i)[1], opt.env
    # precedence: defaults < file < environment < flags
    flags = config.load(environ={"MINIRT_BLOCK_SIZE": "32"}, overrides={"kv": {"block_size": 8}})
    assert flags.kv.block_size == 8
    assert config.load(environ={"MINIRT_BLOCK_SIZE": ""}).kv.block_size == 16  # empty: unset


def test_the_flags_and_variables_in_use_before_keep_their_meaning():
    for flag, key in LEGACY_FLAGS.items():
        opt = next(o for o in options() if o.key == key)
        if opt.type is bool:
            expected = flag != "--prefill-first"  # the one flag that turns its field off
            assert get(up(flag), key) is expected, flag
        else:
            text, value = sample(opt, 3)
            assert get(up(flag, text), key) == value, flag
    for name, key in LEGACY_ENV.items():
        opt = next(o for o in options() if o.key == key)
        text, value = sample(opt, 5)
        assert get(config.load(environ={name: text}), key) == value, name
    compose = {"MINIRT_NUM_BLOCKS": "1024", "MINIRT_KV_MODE": "full", "MINIRT_BLOCK_SIZE": "16"}
    kv = config.load(environ=compose).kv
    assert (kv.num_blocks, kv.mode, kv.block_size) == (1024, "full", 16)


def test_policy_takes_only_the_schedulers_policies(capsys, tmp_path):
    [policy] = [o for o in options() if o.key == "scheduler.policy"]
    assert sorted(policy.choices or ()) == sorted(POLICIES)  # one list: the scheduler's
    for name in POLICIES:
        assert up("--policy", name).scheduler.policy == name
    with pytest.raises(SystemExit) as exit:
        up("--policy", "bogus")
    assert exit.value.code == 2
    err = capsys.readouterr().err
    assert "--policy: invalid choice: 'bogus'" in err and all(p in err for p in POLICIES)
    with pytest.raises(
        ValueError, match=r"MINIRT_POLICY \(scheduler.policy\): 'bogus' is not one of: fcfs"
    ):
        config.load(environ={"MINIRT_POLICY": "bogus"})
    toml = tmp_path / "minirt.toml"
    toml.write_text('[scheduler]\npolicy = "bogus"\n')
    with pytest.raises(ValueError, match=r"config scheduler.policy: 'bogus' is not one of"):
        config.load(toml)


def test_bad_values_are_refused_naming_the_field(tmp_path):
    with pytest.raises(ValueError, match=r"MINIRT_NUM_BLOCKS \(kv.num_blocks\): 'many' is not"):
        config.load(environ={"MINIRT_NUM_BLOCKS": "many"})
    with pytest.raises(ValueError, match=r"MINIRT_ALLOW_REMOTE \(security.allow_remote\)"):
        config.load(environ={"MINIRT_ALLOW_REMOTE": "perhaps"})
    toml = tmp_path / "minirt.toml"
    toml.write_text('[kv]\nblock_size = "big"\n')
    with pytest.raises(ValueError, match=r"config kv.block_size: expected int, got 'big'"):
        config.load(toml)
    toml.write_text("[kv]\nbogus = 1\n")
    with pytest.raises(ValueError, match=r"unknown config key kv.'bogus'"):
        config.load(toml)


@dataclass
class Http:
    host: str = field(default="127.0.0.1", metadata=doc("address to serve on"))
    port: int = field(default=8000, metadata=doc("port", flag="http-port"))
    api_key: str | None = None


@dataclass
class WithHttp:
    model: str = ""
    http: Http = field(default_factory=Http)


@dataclass
class Clash:
    http: Http = field(default_factory=Http)
    http_port: int = 0


def test_a_new_section_needs_only_its_dataclass():
    opts = {o.key: o for o in options_of(WithHttp)}
    assert [(o.flag, o.env) for o in opts.values()] == [
        ("model", "MINIRT_MODEL"),
        ("host", "MINIRT_HOST"),
        ("http-port", "MINIRT_HTTP_PORT"),
        ("api-key", "MINIRT_API_KEY"),
    ]
    assert opts["http.port"].parse("8080", "MINIRT_HTTP_PORT") == 8080
    assert opts["http.api_key"].optional and opts["http.host"].help == "address to serve on"
    with pytest.raises(ValueError, match=r"http.port and http_port both claim 'http-port'"):
        options_of(Clash)
