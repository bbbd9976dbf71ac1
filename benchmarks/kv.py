"""``minirt bench kv``: admit/finish throughput and eviction cost of the KV manager.

Workload: ``--requests`` prompts of ``--prompt-tokens`` tokens whose first ``--shared-frac``
comes from one of ``--prefixes`` shared prefixes (the rest unique), admitted with up to
``--concurrency`` running, each finished with ``--gen-tokens`` generated tokens so the cache
fills and the pool must evict. Then eviction alone is timed on caches of ``--leaves`` unused
leaves to show its cost does not grow with the tree. Prints a table; ``--json PATH`` saves it.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from collections import deque
from collections.abc import Sequence
from typing import Any

from actors.kv.block_manager import BlockManager
from actors.kv.radix_cache import RadixCache
from actors.kv.results import Admitted

VOCAB = 32000


class _TimedCache(RadixCache):
    """RadixCache that accumulates the time spent evicting and the blocks evicted."""

    evict_ns = 0
    evicted = 0

    def evict(self, n: int) -> list[int]:
        t0 = time.perf_counter_ns()
        freed = super().evict(n)
        self.evict_ns += time.perf_counter_ns() - t0
        self.evicted += len(freed)
        return freed


def _pct(values: list[float], q: float) -> float:
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def run_workload(args: argparse.Namespace) -> dict[str, Any]:
    """Admit and finish ``args.requests`` requests; returns timings in microseconds."""
    rng = random.Random(args.seed)
    bs = args.block_size
    shared_len = int(args.prompt_tokens * args.shared_frac)
    prefixes = [rng.choices(range(VOCAB), k=shared_len) for _ in range(args.prefixes)]
    mgr = BlockManager(args.num_blocks, bs, mode=args.mode)
    cache = _TimedCache(mgr.pool, bs)
    mgr.cache = cache
    running: deque[tuple[str, list[int]]] = deque()
    admit_us: list[float] = []
    admit_evict_us: list[float] = []
    finish_us: list[float] = []
    refused = 0
    reserve = mgr.reserve_for(args.prompt_tokens, args.gen_tokens)
    for i in range(args.requests):
        prompt = rng.choice(prefixes) + rng.choices(range(VOCAB), k=args.prompt_tokens - shared_len)
        rid = f"r{i}"
        while True:
            t0 = time.perf_counter_ns()
            res = mgr.admit(rid, prompt, reserve)
            dt = (time.perf_counter_ns() - t0) / 1000
            if isinstance(res, Admitted) or not running:
                break
            refused += 1
            _finish_oldest(mgr, running, rng, args.gen_tokens, finish_us)
        if not isinstance(res, Admitted):
            raise SystemExit(f"request {rid} refused with nothing running: {res.reason}")
        admit_us.append(dt)
        if res.evicted_blocks:
            admit_evict_us.append(dt)
        running.append((rid, prompt))
        if len(running) >= args.concurrency:
            _finish_oldest(mgr, running, rng, args.gen_tokens, finish_us)
    while running:
        _finish_oldest(mgr, running, rng, args.gen_tokens, finish_us)
    mgr.check()
    st = mgr.stats()
    return {
        "requests": args.requests,
        "admit_us_mean": statistics.fmean(admit_us),
        "admit_us_p50": _pct(admit_us, 0.5),
        "admit_us_p99": _pct(admit_us, 0.99),
        "admits_that_evicted": len(admit_evict_us),
        "admit_evicting_us_mean": statistics.fmean(admit_evict_us) if admit_evict_us else 0.0,
        "finish_us_mean": statistics.fmean(finish_us),
        "refused_then_retried": refused,
        "evicted_blocks": cache.evicted,
        "evict_us_per_block": cache.evict_ns / 1000 / cache.evicted if cache.evicted else 0.0,
        "hit_rate": st.hit_rate,
        "cached_blocks_at_end": st.cached,
    }


def _finish_oldest(
    mgr: BlockManager,
    running: deque[tuple[str, list[int]]],
    rng: random.Random,
    gen_tokens: int,
    out: list[float],
) -> None:
    rid, prompt = running.popleft()
    mgr.extend(rid, len(prompt) + gen_tokens)
    written = prompt + rng.choices(range(VOCAB), k=max(0, gen_tokens - 1))
    t0 = time.perf_counter_ns()
    mgr.finish(rid, written)
    out.append((time.perf_counter_ns() - t0) / 1000)


def time_eviction(leaves: int, evictions: int, block_size: int) -> dict[str, Any]:
    """Fill a cache with ``leaves`` unused one-block leaves, then time ``evictions`` single
    evictions (one ``evict(1)`` call each)."""
    mgr = BlockManager(leaves, block_size)
    pool, cache = mgr.pool, mgr.cache
    blocks = pool.allocate(leaves)
    for i, b in enumerate(blocks):
        cache.insert([i] * block_size, [b])
    pool.free_many(blocks)
    n = min(evictions, leaves)
    t0 = time.perf_counter_ns()
    for _ in range(n):
        cache.evict(1)
    dt = time.perf_counter_ns() - t0
    assert cache.num_cached == leaves - n
    return {"leaves": leaves, "evictions": n, "us_per_eviction": dt / 1000 / n}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="minirt bench kv", description=__doc__)
    p.add_argument("--requests", type=int, default=10_000)
    p.add_argument("--prompt-tokens", type=int, default=512)
    p.add_argument("--shared-frac", type=float, default=0.5, help="shared prefix fraction")
    p.add_argument("--prefixes", type=int, default=16, help="distinct shared prefixes")
    p.add_argument("--gen-tokens", type=int, default=16)
    p.add_argument("--concurrency", type=int, default=64)
    p.add_argument("--num-blocks", type=int, default=100_000)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--mode", choices=["full", "on_demand"], default="full")
    p.add_argument("--leaves", default="1000,100000", help="cache sizes for the eviction test")
    p.add_argument("--evictions", type=int, default=1000, help="evictions timed per size")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(list(argv) if argv is not None else None)
    work = run_workload(args)
    evict = [time_eviction(int(n), args.evictions, args.block_size) for n in args.leaves.split(",")]
    print(
        f"KV manager: {args.requests} requests x {args.prompt_tokens} tokens, "
        f"{args.shared_frac:.0%} shared prefix ({args.prefixes} prefixes), "
        f"{args.num_blocks} blocks of {args.block_size}, mode {args.mode}, "
        f"concurrency {args.concurrency}"
    )
    rows = [
        (
            "admit us (mean / p50 / p99)",
            "{admit_us_mean:.1f} / {admit_us_p50:.1f} / {admit_us_p99:.1f}",
        ),
        ("admits that evicted", "{admits_that_evicted} (mean {admit_evicting_us_mean:.1f} us)"),
        ("finish us (mean)", "{finish_us_mean:.1f}"),
        ("evicted blocks", "{evicted_blocks}"),
        ("us per evicted block", "{evict_us_per_block:.2f}"),
        ("prefix hit rate", "{hit_rate:.1%}"),
        ("cached blocks at end", "{cached_blocks_at_end}"),
    ]
    for label, fmt in rows:
        print(f"  {label:<30} {fmt.format(**work)}")
    print("eviction cost vs cache size (evict(1) calls on unused leaves)")
    print(f"  {'cached leaves':>14} {'evictions':>10} {'us/eviction':>12}")
    for e in evict:
        print(f"  {e['leaves']:>14} {e['evictions']:>10} {e['us_per_eviction']:>12.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "workload": work, "eviction": evict}, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
