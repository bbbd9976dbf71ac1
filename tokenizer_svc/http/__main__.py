"""``python -m tokenizer_svc.http --config RUN_DIR/config.json [--port N]``: the HTTP actor alone,
against a runtime started elsewhere (``minirt up`` starts it itself)."""

from __future__ import annotations

import argparse
import dataclasses

from actors.runtime import config as rc
from tokenizer_svc.http.actor import HttpSettings, run


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tokenizer_svc.http", description=__doc__)
    p.add_argument("--config", required=True, help="the runtime's config (RUN_DIR/config.json)")
    p.add_argument("--host", help="address to listen on (default 127.0.0.1)")
    p.add_argument("--port", type=int, help="port to listen on (default 8000)")
    p.add_argument("--api-key", help="require Authorization: Bearer KEY")
    p.add_argument("--served-model-name", help="the model's name in the API (default: its path)")
    args = p.parse_args(argv)
    cfg = rc.load(args.config)
    given = {
        "host": args.host,
        "port": args.port,
        "api_key": args.api_key,
        "served_model_name": args.served_model_name,
    }
    settings = dataclasses.replace(
        HttpSettings.of(cfg), **{k: v for k, v in given.items() if v is not None}
    )
    return run(cfg, settings)


if __name__ == "__main__":
    raise SystemExit(main())
