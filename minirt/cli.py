"""minirt: an actor-based LLM serving runtime. `minirt up` serves a model on the OpenAI API and
over ZeroMQ; the other verbs talk to a running runtime, read its event log, or benchmark it.
`minirt VERB --help` tells more of each."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from typing import Any

Handler = Callable[[argparse.Namespace], int]
_COMMANDS: dict[str, tuple[Callable[[argparse.ArgumentParser], None], Handler, str]] = {}
# how ``minirt --help`` lists the verbs: serving first, then using a runtime, then tools
ORDER = ("up", "generate", "events", "trace", "replay", "bench", "ping", "actor", "keys")


def command(name: str, setup: Callable[[argparse.ArgumentParser], None], help: str):
    """Register ``fn`` as the handler of subcommand ``name``; ``setup`` adds its arguments,
    ``help`` is its line in ``minirt --help``."""

    def register(fn: Handler) -> Handler:
        _COMMANDS[name] = (setup, fn, help)
        return fn

    return register


def _make_model_args(p: argparse.ArgumentParser) -> None:
    from gpu.model.families import FAMILIES
    from gpu.model.make_model import ARCHS, SIZES

    p.add_argument(
        "--arch",
        choices=[*ARCHS, *FAMILIES],
        default="qwen2",
        help="a native family, or (tiny only) one served by the transformers path",
    )
    p.add_argument("--size", choices=SIZES, default="tiny")
    p.add_argument("--out", required=True, help="directory to write the model into")
    p.add_argument("--seed", type=int, default=0)


@command(
    "make-model",
    _make_model_args,
    "write a small random-weight model (a transformers directory) for tests and demos",
)
def _make_model(args: argparse.Namespace) -> int:
    from gpu.model.make_model import make_model

    path = make_model(args.arch, args.size, args.out, seed=args.seed)
    print(path)
    return 0


_BENCH_MODES = {  # serve ships with the package; the others run from a checkout's benchmarks/
    "serve": "serve",  # a workload through a running runtime, with a report
    "executor": "executor",  # W1 through the executor alone vs transformers
    "kv": "kv",  # KV manager admit/evict micro-benchmark
    "transport": "transport",  # messages/s and round-trip latency between processes
    "scheduler": "scheduler",  # one scheduling decision vs queue size
    "scale-out": "scale_out",  # W2 through the router to replicas vs one instance
    "replay": "replay",  # replay's acceptance report (records real runs)
    "scaling": "scaling",  # decode speed vs batch size and context, minirt and vLLM
    "quality": "quality",  # bf16 vs transformers fp32 under teacher forcing
    "structured": "structured",  # constrained vs free tok/s at batch 64
}


def _bench_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("mode", choices=sorted(_BENCH_MODES), help="what to benchmark")
    p.add_argument("rest", nargs=argparse.REMAINDER, help="options of that mode (--help)")


@command(
    "bench",
    _bench_args,
    "benchmark a running runtime (serve) or one part of it (executor, kv, scheduler, ...)",
)
def _bench(args: argparse.Namespace) -> int:
    if args.mode == "serve":
        from minirt.bench import serve as module
    else:
        from minirt.bench import developer_benchmark

        module = developer_benchmark(_BENCH_MODES[args.mode])
    return int(module.main(args.rest) or 0)


_METAVARS = {int: "N", float: "X"}


def _config_args(p: argparse.ArgumentParser) -> None:
    """One flag per setting of ``RuntimeConfig`` (see ``actors.runtime.options``); each is also
    the ``MINIRT_*`` environment variable named in its help."""
    from actors.runtime.config import options

    p.add_argument("--config", help="TOML (or JSON) config file")
    for opt in options():
        default = "" if opt.default in (None, "") else f"; default {opt.default}"
        help = f"{opt.help} [{opt.env}{default}]"
        if opt.type is bool:
            p.add_argument(
                f"--{opt.flag}", dest=opt.dest, action=argparse.BooleanOptionalAction, help=help
            )
            if opt.off_flag:
                p.add_argument(
                    f"--{opt.off_flag}",
                    dest=opt.dest,
                    action="store_const",
                    const=False,
                    help=opt.off_help,
                )
        elif opt.many:
            p.add_argument(
                f"--{opt.flag}",
                dest=opt.dest,
                nargs="+",
                action=_JoinWords,
                metavar=opt.flag.split("-")[-1].upper(),
                help=help,
            )
        else:
            p.add_argument(
                f"--{opt.flag}",
                dest=opt.dest,
                type=opt.type,
                choices=opt.choices,
                metavar=None
                if opt.choices
                else _METAVARS.get(opt.type, opt.flag.split("-")[-1].upper()),
                help=help,
            )


class _JoinWords(argparse.Action):
    """A flag of one or more words, stored as one string (``doc(many=True)``)."""

    def __call__(self, parser: Any, namespace: Any, values: Any, option_string: Any = None) -> None:
        setattr(namespace, self.dest, " ".join(values))


def config_from_args(args: argparse.Namespace) -> Any:
    """Defaults, then ``--config``, then ``MINIRT_*`` variables, then the flags given."""
    from actors.runtime import config

    overrides: dict[str, Any] = {}
    for opt in config.options():
        value = getattr(args, opt.dest, None)
        if value is not None:
            opt.put(overrides, value)
    return config.load(args.config, overrides)


def _up_args(p: argparse.ArgumentParser) -> None:
    from minirt.launch.replicas import add_cluster_args

    _config_args(p)
    add_cluster_args(p)


@command(
    "up",
    _up_args,
    "serve a model: start the actors, the HTTP server (OpenAI API) and the dashboard",
)
def _up(args: argparse.Namespace) -> int:
    import os

    import trio

    from actors.runtime.events import configure
    from minirt.launch.supervisor import prepare, run_up

    cfg = config_from_args(args)
    if args.replicas:  # N instances behind the router (docs/scale-out.md)
        from minirt.launch.cluster import up_cluster

        return up_cluster(args, _config_args, cfg)
    if getattr(args, "gpus", None):  # one instance: its cards, as its actors will see them
        os.environ["CUDA_VISIBLE_DEVICES"] = args.gpus
    if cfg.replica:  # every actor of this instance labels its events with the replica's name
        os.environ["MINIRT_REPLICA"] = cfg.replica
    try:
        path = prepare(cfg)
    except ValueError as e:  # a model not found, refused or too big for the pool: say which
        print(f"minirt up: {e}", file=sys.stderr)
        return 2
    configure("supervisor", cfg.run_dir, stdout=False, replica=cfg.replica)
    tokens = int(cfg.kv.num_blocks or 0) * cfg.kv.block_size
    print(
        f"minirt: model {cfg.http.served_model_name} ({cfg.model}), run dir {cfg.run_dir}, "
        f"KV pool {cfg.kv.num_blocks} blocks = {tokens:,} tokens, max_model_len "
        f"{cfg.max_model_len:,}\nminirt: dtype {served_dtype(cfg)}\nminirt: {model_path(cfg)}",
        file=sys.stderr,
        flush=True,
    )
    if not trio.run(run_up, cfg, path):  # stopped before every actor answered
        print("minirt up: interrupted during start-up", file=sys.stderr)
        return 130
    return 0


def model_path(cfg: Any) -> str:
    """Which code runs the model (``--model-impl``: gpu.model.loader.load_spec) and why."""
    from gpu.model import loader

    spec = loader.load_spec(cfg.model, cfg.executor.model_impl)
    if spec.impl == "native":
        return f"model code native ({spec.arch})"
    why = "as asked" if cfg.executor.model_impl == "transformers" else "no native path for it"
    return f"model code transformers' ({spec.arch}: {why}; docs/models.md)"


def served_dtype(cfg: Any) -> str:
    """The dtype the executor will serve in and why (``--dtype auto``: gpu.model.loader)."""
    from gpu.model import loader

    device = loader.resolve_device(cfg.executor.device)
    dtype, why = loader.choose_dtype(cfg.executor.dtype, device, cfg.model)
    kv = loader.attention_dtype(dtype, device)
    name = str(dtype).removeprefix("torch.")
    tail = "" if kv == dtype else f"; attention and KV cache {str(kv).removeprefix('torch.')}"
    return f"{name}: {why}{tail}"


def _actor_args(p: argparse.ArgumentParser) -> None:
    from actors.runtime.config import ACTORS

    p.add_argument("name", choices=(*ACTORS, "http"))
    _config_args(p)


@command(
    "actor",
    _actor_args,
    "run one actor in this process (what `minirt up` and docker compose start)",
)
def _actor(args: argparse.Namespace) -> int:
    from minirt.launch.runner import run_actor

    return run_actor(args.name, config_from_args(args), args.config)


def _endpoint_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--run-dir", default=".minirt")
    p.add_argument("--endpoint", help="client endpoint (default: ipc://RUN_DIR/sock/client)")
    p.add_argument(
        "--curve-dir", help="client keys from `minirt keys` (servers that require CURVE)"
    )


def _endpoint(args: argparse.Namespace) -> str:
    if args.endpoint:
        return str(args.endpoint)
    from pathlib import Path

    return f"ipc://{Path(args.run_dir).absolute() / 'sock' / 'client'}"


def _generate_args(p: argparse.ArgumentParser) -> None:
    _endpoint_args(p)
    p.add_argument("prompt", nargs="?", help="prompt text")
    p.add_argument("--prompt-ids", help="comma-separated token ids instead of text")
    p.add_argument("--chat", action="store_true", help="send the prompt as a user chat message")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--min-p", type=float, default=0.0)
    p.add_argument("--seed", type=int)
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument("--ignore-eos", action="store_true")
    p.add_argument("--logprobs", type=int)
    p.add_argument("--json", action="store_true", help="print one JSON object at the end")
    p.add_argument("--timeout", type=float, default=600.0)


@command(
    "generate",
    _generate_args,
    "send one prompt to a running runtime over ZeroMQ and print the answer",
)
def _generate(args: argparse.Namespace) -> int:
    import json

    from messages import client as cm
    from minirt.client import RequestError, Result, SyncClient, build_generate

    if args.prompt is None and not args.prompt_ids:
        print("minirt generate: give a PROMPT or --prompt-ids", file=sys.stderr)
        return 2
    req = build_generate(
        prompt=None if args.chat or args.prompt_ids else args.prompt,
        messages=[{"role": "user", "content": args.prompt}] if args.chat else None,
        prompt_ids=[int(t) for t in args.prompt_ids.split(",")] if args.prompt_ids else None,
        stop=args.stop,
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        min_p=args.min_p,
        seed=args.seed,
        ignore_eos=args.ignore_eos,
        logprobs=args.logprobs,
    )
    result = Result(req.request_id)
    try:
        with SyncClient(
            _endpoint(args), timeout_s=args.timeout, curve_dir=args.curve_dir
        ) as client:
            for msg in client.stream(req):
                if isinstance(msg, cm.Delta) and not args.json:
                    print(msg.text, end="", flush=True)
                result.apply(msg)
    except (RequestError, TimeoutError, RuntimeError) as e:
        print(f"\nminirt generate: {e}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(result.to_dict()))
    else:
        print(f"\n[{result.finish_reason}] {result.usage}", file=sys.stderr)
    return 0


def _events_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--run-dir", default=".minirt")
    p.add_argument("--follow", "-f", action="store_true")
    p.add_argument("--request", help="only this request id")
    p.add_argument("--event", help="only events with this name (prefix match: 'kv.' works)")
    p.add_argument("--json", action="store_true", help="raw JSON lines")
    p.add_argument("--html", metavar="FILE", help="write the dashboard's views as one HTML file")


@command("events", _events_args, "print or follow a run's merged event log")
def _events(args: argparse.Namespace) -> int:
    from minirt.eventlog import show_events

    if args.html:
        from minirt.http.dashboard.export import export_html

        return export_html(args.run_dir, args.html, request_id=args.request)
    return show_events(
        args.run_dir, follow=args.follow, request=args.request, event=args.event, as_json=args.json
    )


def _trace_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("request_id")
    p.add_argument("--run-dir", default=".minirt")
    p.add_argument("--html", metavar="FILE", help="write the dashboard, open on this request")


@command("trace", _trace_args, "one request's events across the actors, in order")
def _trace(args: argparse.Namespace) -> int:
    from minirt.eventlog import trace

    if args.html:
        from minirt.http.dashboard.export import export_html

        return export_html(args.run_dir, args.html, request_id=args.request_id)
    return trace(args.run_dir, args.request_id)


def _replay_args(p: argparse.ArgumentParser) -> None:
    from minirt.replay.cli import build_args

    build_args(p)


@command(
    "replay", _replay_args, "re-run a recorded event log under another policy, budget or batch size"
)
def _replay(args: argparse.Namespace) -> int:
    from minirt.replay.cli import run_checked

    return run_checked(args, sys.argv[2:])


def _keys_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("dir", help="where to write the keys")
    p.add_argument(
        "--client",
        action="append",
        default=None,
        help="client key pair names to create and authorize (default: client)",
    )


@command("keys", _keys_args, "make the CURVE key pairs for encrypted, authenticated transport")
def _keys(args: argparse.Namespace) -> int:
    from actors.runtime.security import make_keys

    for path in make_keys(args.dir, tuple(args.client or ["client"])):
        print(path)
    return 0


def _ping_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "target",
        help="actor name (tokenizer, scheduler, kv_manager, executor, http, client) or an endpoint",
    )
    p.add_argument("--run-dir", help="default: MINIRT_RUN_DIR, else .minirt")
    p.add_argument("--timeout", type=float, default=2.0)
    p.add_argument("--curve-dir", help="client keys (servers that require CURVE)")


@command("ping", _ping_args, "ask each actor of a running runtime whether it answers")
def _ping(args: argparse.Namespace) -> int:
    import trio

    from actors.runtime import config
    from actors.runtime.ping import ping

    # Endpoints and keys as the actors see them: MINIRT_* variables (compose), then the flags.
    overrides: dict[str, Any] = {"run_dir": args.run_dir} if args.run_dir else {}
    if args.curve_dir:
        overrides["security"] = {"curve_dir": args.curve_dir}
    cfg = config.load(overrides=overrides).resolve()
    target = args.target
    if "://" not in target:
        names = ("client", *config.ACTORS, "http")
        if target not in names:
            print(
                f"minirt ping: {target!r} is not one of {', '.join(names)} nor an endpoint",
                file=sys.stderr,
            )
            return 2
        target = cfg.endpoints.of(target)
    pong = trio.run(ping, target, args.timeout, 1, cfg.curve_keys())
    if pong is None:
        print(f"no answer from {target}", file=sys.stderr)
        return 1
    print(f"{pong.actor} pid={pong.pid} boot={pong.boot_id}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="minirt", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True, metavar="VERB")
    order = [*ORDER, *(n for n in _COMMANDS if n not in ORDER)]
    for name in order:
        setup, _, help = _COMMANDS[name]
        setup(sub.add_parser(name, help=help, description=help[0].upper() + help[1:] + "."))
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return _COMMANDS[args.command][1](args)


if __name__ == "__main__":
    sys.exit(main())
