"""The ``minirt`` command line: one entry point, one subcommand per verb."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence

Handler = Callable[[argparse.Namespace], int]
_COMMANDS: dict[str, tuple[Callable[[argparse.ArgumentParser], None], Handler]] = {}


def command(name: str, setup: Callable[[argparse.ArgumentParser], None]):
    """Register ``fn`` as the handler of subcommand ``name``; ``setup`` adds its arguments."""

    def register(fn: Handler) -> Handler:
        _COMMANDS[name] = (setup, fn)
        return fn

    return register


def _make_model_args(p: argparse.ArgumentParser) -> None:
    from gpu.make_model import ARCHS, SIZES

    p.add_argument("--arch", choices=ARCHS, default="qwen2")
    p.add_argument("--size", choices=SIZES, default="tiny")
    p.add_argument("--out", required=True, help="directory to write the model into")
    p.add_argument("--seed", type=int, default=0)


@command("make-model", _make_model_args)
def _make_model(args: argparse.Namespace) -> int:
    from gpu.make_model import make_model

    path = make_model(args.arch, args.size, args.out, seed=args.seed)
    print(path)
    return 0


_BENCH_MODES = {
    "executor": "gpu.bench_executor",  # W1 through the executor alone vs transformers
    "kv": "actors.kv.bench",  # KV manager admit/evict micro-benchmark
}


def _bench_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("mode", choices=sorted(_BENCH_MODES), help="what to benchmark")
    p.add_argument("rest", nargs=argparse.REMAINDER, help="options of that mode (--help)")


@command("bench", _bench_args)
def _bench(args: argparse.Namespace) -> int:
    import importlib

    module = importlib.import_module(_BENCH_MODES[args.mode])
    return int(module.main(args.rest) or 0)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="minirt", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    for name, (setup, _) in _COMMANDS.items():
        setup(sub.add_parser(name))
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return _COMMANDS[args.command][1](args)


if __name__ == "__main__":
    sys.exit(main())
