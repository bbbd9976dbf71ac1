"""The KV benchmark runs end to end on a small configuration (no timing assertions)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from actors.kv import Admitted, BlockManager
from benchmarks.kv import main, time_eviction


def test_bench_main_prints_table_and_writes_json(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "kv.json"
    argv = [
        "--requests",
        "300",
        "--prompt-tokens",
        "64",
        "--num-blocks",
        "400",
        "--concurrency",
        "8",
    ]
    argv += ["--block-size", "8", "--leaves", "50,500", "--evictions", "40", "--json", str(out)]
    assert main(argv) == 0
    text = capsys.readouterr().out
    assert "admit us" in text and "us/eviction" in text
    data = json.loads(out.read_text())
    work = data["workload"]
    assert work["requests"] == 300
    assert work["evicted_blocks"] > 0  # the pool is small enough to force eviction
    assert 0.3 < work["hit_rate"] < 0.6  # about half of each prompt is a shared prefix
    assert [e["leaves"] for e in data["eviction"]] == [50, 500]
    assert all(e["evictions"] == 40 for e in data["eviction"])


def test_time_eviction_evicts_requested_count() -> None:
    r = time_eviction(100, 30, 4)
    assert r["evictions"] == 30 and r["us_per_eviction"] > 0


def test_admit_finish_benchmark(benchmark) -> None:  # type: ignore[no-untyped-def]
    """pytest-benchmark of one admit + finish of a 512-token prompt with a 256-token shared
    prefix on a warm cache (reported, not asserted)."""
    m = BlockManager(4096, 16)
    shared = list(range(256))
    counter = iter(range(10**9))

    def one() -> None:
        i = next(counter)
        prompt = shared + [100_000 + i] * 256
        res = m.admit(f"r{i}", prompt, 512)
        assert isinstance(res, Admitted)
        m.finish(f"r{i}", prompt)

    benchmark.pedantic(one, rounds=200, iterations=1, warmup_rounds=5)
    m.check()
