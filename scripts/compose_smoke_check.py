"""Checks for scripts/compose-smoke, run with the host's .venv python.

    compose_smoke_check.py prompts N SEED                      # print N prompts, one per line
    compose_smoke_check.py answers --model DIR OUT_DIR         # exact vs transformers' greedy
    compose_smoke_check.py events --run-dir DIR OUT_DIR        # admission and completion events

OUT_DIR holds, per request NAME, ``NAME.req`` ({"prompt_ids": [...], "max_tokens": N}, written
by the smoke script) and ``NAME.json`` (what ``minirt generate --json`` printed). Each check prints
one line per request and exits 1 with the reasons when any request fails.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path
from typing import Any

from messages.tokenizer import client_request_id


def load_pairs(out_dir: Path) -> list[tuple[str, dict[str, Any], dict[str, Any]]]:
    pairs = []
    for req in sorted(out_dir.glob("*.req")):
        res = req.with_suffix(".json")
        if not res.exists() or not res.read_text().strip():
            raise SystemExit(f"{req.stem}: no answer ({res} is missing or empty)")
        pairs.append((req.stem, json.loads(req.read_text()), json.loads(res.read_text())))
    if not pairs:
        raise SystemExit(f"no requests under {out_dir}")
    return pairs


def prompts(n: int, seed: int) -> int:
    """Prompt lengths that cover one token, a partial block, block boundaries and several blocks
    (block size 16), with token ids away from the special ones."""
    rng = random.Random(seed)
    lengths = [1, 3, 15, 16, 17, 40, 75, 130]
    for i in range(n):
        length = lengths[i % len(lengths)]
        print(",".join(str(rng.randrange(3, 500)) for _ in range(length)))
    return 0


def reference(
    model_dir: str, prompt: list[int], max_new: int, cache: dict[Any, list[int]]
) -> list[int]:
    key = (tuple(prompt), max_new)
    if key not in cache:
        import torch
        from transformers import AutoModelForCausalLM
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()

        if "model" not in cache:
            model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
            model.eval()
            cache["model"] = model
        model = cache["model"]
        ids = torch.tensor([prompt])
        with torch.no_grad():
            out = model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=max_new,
                do_sample=False,
            )
        cache[key] = out[0, len(prompt) :].tolist()
    return cache[key]


def answers(model_dir: str, out_dir: Path) -> int:
    cache: dict[Any, Any] = {}
    bad = []
    for name, req, res in load_pairs(out_dir):
        want = reference(model_dir, req["prompt_ids"], req["max_tokens"], cache)
        got = res.get("token_ids")
        usage = res.get("usage") or {}
        why = []
        if got != want:
            why.append(f"token_ids {got} != transformers {want}")
        if usage.get("prompt_tokens") != len(req["prompt_ids"]):
            why.append(
                f"usage.prompt_tokens {usage.get('prompt_tokens')} != {len(req['prompt_ids'])}"
            )
        if got is not None and usage.get("completion_tokens") != len(got):
            why.append(f"usage.completion_tokens {usage.get('completion_tokens')} != {len(got)}")
        if res.get("finish_reason") not in ("stop", "length"):
            why.append(f"finish_reason {res.get('finish_reason')!r}")
        rid = res.get("request_id", "?")
        if why:
            bad.append(
                f"{name} ({rid}, prompt of {len(req['prompt_ids'])} tokens): " + "; ".join(why)
            )
            print(f"  MISMATCH {name} {rid}", flush=True)
        else:
            print(
                f"  exact    {name} {rid} prompt={len(req['prompt_ids'])} "
                f"out={len(got)} cached={usage.get('cached_tokens')} {res['finish_reason']}",
                flush=True,
            )
    for line in bad:
        print(f"answers: {line}", file=sys.stderr)
    return 1 if bad else 0


# (actor, event) every finished request must have in the event files.
REQUIRED = (
    ("tokenizer", "client.received"),
    ("scheduler", "request.admitted"),
    ("scheduler", "request.finished"),
    ("tokenizer", "client.completed"),
)


def events(run_dir: Path, out_dir: Path) -> int:
    files = {p.stem: p for p in (run_dir / "events").glob("*.jsonl")}
    missing_files = [
        a for a in ("tokenizer", "scheduler", "kv_manager", "executor") if a not in files
    ]
    if missing_files:
        print(f"events: no event file for {missing_files} under {run_dir}/events", file=sys.stderr)
        return 1
    configs = [
        json.loads(line)
        for line in files["executor"].read_text(errors="replace").splitlines()
        if '"executor.config"' in line
    ]
    paths = {c.get("decode_attention") for c in configs}
    if paths != {"paged_kernel"}:  # the image's install built the kernel library
        print(
            f"events: executor.config decode_attention {sorted(map(str, paths))}", file=sys.stderr
        )
        return 1
    seen: dict[str, set[tuple[str, str]]] = {}
    for path in files.values():
        for line in path.read_text(errors="replace").splitlines():
            try:
                e = json.loads(line)
            except json.JSONDecodeError:
                continue
            rid = e.get("request_id")
            if rid:  # runtime-wide ids hold the client's own id (requests are per connection)
                rid = client_request_id(rid)
                seen.setdefault(rid, set()).add((e.get("actor", ""), e.get("event", "")))
    bad = []
    for name, _req, res in load_pairs(out_dir):
        rid = res["request_id"]
        lacking = [f"{a}:{ev}" for a, ev in REQUIRED if (a, ev) not in seen.get(rid, set())]
        if lacking:
            bad.append(f"{name} ({rid}) lacks {', '.join(lacking)}")
            print(f"  MISSING  {name} {rid}", flush=True)
        else:
            print(f"  events   {name} {rid} admitted, finished, completed", flush=True)
    for line in bad:
        print(f"events: {line}", file=sys.stderr)
    return 1 if bad else 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    pp = sub.add_parser("prompts")
    pp.add_argument("n", type=int)
    pp.add_argument("seed", type=int)
    pa = sub.add_parser("answers")
    pa.add_argument("--model", required=True)
    pa.add_argument("out_dir", type=Path)
    pe = sub.add_parser("events")
    pe.add_argument("--run-dir", required=True, type=Path)
    pe.add_argument("out_dir", type=Path)
    args = p.parse_args(argv)
    if args.cmd == "prompts":
        return prompts(args.n, args.seed)
    if args.cmd == "answers":
        return answers(args.model, args.out_dir)
    return events(args.run_dir, args.out_dir)


if __name__ == "__main__":
    sys.exit(main())
