"""``python -m minirt.http --config RUN_DIR/config.json [--http-port N ...]``: the HTTP
actor alone, against a runtime started elsewhere (``minirt up`` starts it itself, and
``minirt actor http`` is the same with every config flag)."""

from __future__ import annotations

import argparse

from actors.runtime import config as rc
from minirt.launch.runner import run_actor


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m minirt.http", description=__doc__)
    p.add_argument("--config", required=True, help="the runtime's config (RUN_DIR/config.json)")
    p.add_argument("--http-host", help="address to listen on (default 127.0.0.1)")
    p.add_argument("--http-port", type=int, help="port to listen on (default 8000)")
    p.add_argument("--api-key", help="require Authorization: Bearer KEY")
    p.add_argument("--served-model-name", help="the model's name in the API (default: its path)")
    args = p.parse_args(argv)
    given = {
        "host": args.http_host,
        "port": args.http_port,
        "api_key": args.api_key,
        "served_model_name": args.served_model_name,
    }
    http = {k: v for k, v in given.items() if v is not None}
    cfg = rc.load(args.config, overrides={"http": http} if http else None)
    return run_actor("http", cfg)


if __name__ == "__main__":
    raise SystemExit(main())
