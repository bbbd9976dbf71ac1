"""Where one forward's time goes: the linears (and their FLOP rate) against everything else, and
the same linears run alone on the same rows (the kernel's own rate on this machine, now).

Two W1-like forwards of the bench model (float32, 2 threads), three rounds each:

- **prefill**: ``--prompts`` prompts of ``--prompt-len`` tokens in one step;
- **decode**: ``--rows`` decode rows, each at context ``--context``.

The linears are timed by wrapping :class:`gpu.model.linear.Linear` calls (the LM head included), the
forward by the wall clock; "rest" is the difference (attention, norms, RoPE, SiLU, KV writes).
The K/V the forward reads is whatever the scratch cache holds: the timing does not depend on it::

    python -m benchmarks.forward_split [--model DIR]
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch

import gpu.model.linear as linear
from benchmarks.compute import linear_seconds
from gpu.model.attention import build_metadata
from gpu.model.kv_cache import PagedKVCache
from gpu.model_runner import ModelRunner
from minirt.bench.serve import default_bench_model

BS = 16
CPU = torch.device("cpu")


def _forwards(model, o: argparse.Namespace) -> list[tuple[str, int, Callable[[], None]]]:
    """``(name, rows, forward)`` of the prefill and the decode forward."""
    spec = model.spec
    n, pl, rows, ctx = o.prompts, o.prompt_len, o.rows, o.context
    per = -(-max(pl, ctx + 1) // BS)
    cache = PagedKVCache(
        spec.num_layers, spec.num_kv_heads, spec.head_dim, per * max(n, rows), BS,
        torch.float32, CPU,
    )  # fmt: skip

    def prefill() -> None:
        pre = [(list(range(i * per, (i + 1) * per)), 0, pl) for i in range(n)]
        meta = build_metadata([], pre, cache, torch.float32, CPU)
        ids = torch.randint(16, spec.vocab_size, (n * pl,))
        last = torch.arange(pl - 1, n * pl, pl)
        float(model.forward(ids, torch.arange(pl).repeat(n), meta, cache, last)[-1, 0])

    def decode() -> None:
        dec = [(list(range(i * per, (i + 1) * per)), ctx) for i in range(rows)]
        meta = build_metadata(dec, [], cache, torch.float32, CPU)
        ids = torch.randint(16, spec.vocab_size, (rows,))
        pos = torch.full((rows,), ctx)
        float(model.forward(ids, pos, meta, cache, torch.arange(rows))[-1, 0])

    return [
        (f"prefill {n} x {pl}", n * pl, prefill),
        (f"decode {rows} rows at context {ctx}", rows, decode),
    ]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", help="model directory (default: the bench model)")
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--rows", type=int, default=64)
    p.add_argument("--context", type=int, default=176)
    p.add_argument("--rounds", type=int, default=3)
    o = p.parse_args(argv)
    torch.set_num_threads(2)
    model_dir = o.model or default_bench_model()
    ex = ModelRunner(
        model_dir, dtype="float32", device="cpu", num_blocks=64, chunk_cap=1024,
        step_budget=8192, max_batch_size=256, threads=2,
    )  # fmt: skip
    model = ex.model
    spent: dict[tuple[int, int], list[float]] = {}  # (in, out) -> [seconds, flops]
    plain = linear.Linear.__call__

    def timed(self: linear.Linear, x: torch.Tensor) -> torch.Tensor:
        t = time.perf_counter()
        y = plain(self, x)
        s = spent.setdefault((self.in_features, self.out_features), [0.0, 0.0])
        s[0] += time.perf_counter() - t
        s[1] += 2.0 * x.shape[0] * self.in_features * self.out_features
        return y

    print(f"model {model_dir}, float32, 2 threads")
    for name, rows, fwd in _forwards(model, o):
        fwd()  # kernels built, caches warm
        for rnd in range(o.rounds):
            t = time.perf_counter()
            fwd()
            whole = time.perf_counter() - t
            spent.clear()
            linear.Linear.__call__ = timed  # type: ignore[method-assign]
            fwd()
            linear.Linear.__call__ = plain  # type: ignore[method-assign]
            secs = sum(s for s, _ in spent.values())
            flops = sum(f for _, f in spent.values())
            alone = _alone(model, rows, spent)
            print(
                f"{name}, round {rnd + 1}: forward {whole * 1e3:.1f} ms; linears "
                f"{secs * 1e3:.1f} ms ({100 * secs / whole:.0f}%) at {flops / secs / 1e9:.0f} "
                f"GFLOP/s (alone on the same rows: {alone / 1e9:.0f}); rest "
                f"{(whole - secs) * 1e3:.1f} ms",
                flush=True,
            )
    return 0


def _alone(model, rows: int, spent: dict[tuple[int, int], list[float]]) -> float:
    """FLOP/s of the layer's linears run alone on ``rows`` random rows (best of 4 calls each),
    weighted as the forward's FLOPs were (the LM head, which a prefill runs on a few rows only,
    left out)."""
    ly = model.layers[0]
    secs = flops = 0.0
    for lin in (ly.qkv, ly.o, ly.gate_up, ly.down):
        one = linear_seconds(lin, rows, 4, CPU)
        share = spent[(lin.in_features, lin.out_features)][1]
        secs += share / (2.0 * rows * lin.in_features * lin.out_features) * one
        flops += share
    return flops / secs


if __name__ == "__main__":
    raise SystemExit(main())
