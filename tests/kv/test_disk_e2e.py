"""The prefix cache's disk tier end to end (``--kv-disk-dir``): real ``minirt up`` processes,
restarted; prompts served again after a restart load their prefix from disk (cached tokens
counted), and every output stays transformers' greedy output, also when block files were
corrupted, truncated or belong to another model; ``cache_salt`` keeps tenants apart; the tier
stays within its byte bound."""

from __future__ import annotations

import contextlib
import os
import random
import shutil
import signal
import threading
from pathlib import Path
from typing import Any

import pytest
import trio

from messages.scheduler import MetricsQuery, MetricsText
from minirt.client import open_client
from tests.support.runtime import (
    hf_greedy,
    kv_stats,
    query,
    start_runtime,
    stopped,
    wait_until,
)

MAX_NEW = 8
BS = 16


def _prompts(n: int, seed: int, length: int = 90) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 500) for _ in range(length)] for _ in range(n)]


async def _serve(rt, prompts, **kw) -> list:
    out: list = [None] * len(prompts)
    async with open_client(rt.endpoint) as client:
        with trio.fail_after(120):
            for i, p in enumerate(prompts):  # one at a time: each sees what the last cached
                out[i] = await client.generate(
                    prompt_ids=p, max_tokens=MAX_NEW, temperature=0, **kw
                )
    return out


async def _settled(rt):
    """The KV manager's stats once nothing runs and no save is in flight (its check passes)."""

    async def ok():
        s = await kv_stats(rt)
        return s if s.running == 0 and s.in_use == 0 and s.check_ok else None

    return await wait_until(ok, timeout=30)


async def _fill(model: Path, run_dir: Path, flags: tuple[str, ...], prompts) -> None:
    """A runtime that serves ``prompts`` and stops once their blocks are written to disk."""
    with start_runtime(model, run_dir, *flags) as rt:
        await _serve(rt, prompts)
        await _settled(rt)


def _files(disk: Path) -> list[Path]:
    return sorted(disk.rglob("*.kv"))


def _full_blocks(p: list[int]) -> int:
    return (len(p) - 1) // BS * BS


async def test_restart_loads_from_disk_exactly(tiny_model, tmp_path):
    disk = tmp_path / "disk"
    flags = ("--num-blocks", "64", "--kv-disk-dir", str(disk))
    prompts = _prompts(4, seed=1)
    expected = hf_greedy(tiny_model, prompts, MAX_NEW)
    with start_runtime(tiny_model, tmp_path / "run1", *flags) as rt:
        cold = await _serve(rt, prompts)
        await _settled(rt)
        s = await kv_stats(rt)
        assert s.disk_blocks >= sum(len(p) // BS for p in prompts)
    assert [r.token_ids for r in cold] == expected
    assert all(r.usage["cached_tokens"] == 0 for r in cold)
    # a new runtime (every actor a new process) finds the blocks again
    with start_runtime(tiny_model, tmp_path / "run2", *flags) as rt:
        warm = await _serve(rt, prompts)
        s = await _settled(rt)
        loads = rt.events("executor.disk_loaded")
        metrics = (await query(rt.actor_endpoint("scheduler"), MetricsQuery(), MetricsText)).text
    assert [r.token_ids for r in warm] == expected
    assert [r.usage["cached_tokens"] for r in warm] == [_full_blocks(p) for p in prompts]
    assert s.disk_hit_tokens == sum(_full_blocks(p) for p in prompts)
    assert len(loads) == len(prompts) and all(e["blocks"] > 0 for e in loads)
    disk_hits = f'minirt:prefix_cache_hits_by_tier_total{{tier="disk"}} {float(s.disk_hit_tokens)}'
    assert disk_hits in metrics
    assert f"minirt:kv_disk_bytes {float(s.disk_bytes)}" in metrics


@pytest.mark.parametrize("damage", ["flip", "truncate", "foreign"])
async def test_bad_block_files_are_recomputed(tiny_model, tiny_models, tmp_path, damage):
    disk = tmp_path / "disk"
    flags = ("--num-blocks", "64", "--kv-disk-dir", str(disk))
    prompts = _prompts(2, seed=2)
    expected = hf_greedy(tiny_model, prompts, MAX_NEW)
    await _fill(tiny_model, tmp_path / "run1", flags, prompts)
    files = _files(disk)
    assert files
    if damage == "foreign":  # every file replaced by one of another model (its own header)
        other = tmp_path / "other"
        with start_runtime(
            tiny_models["llama"], tmp_path / "run0", "--kv-disk-dir", str(other)
        ) as rt:
            await _serve(rt, _prompts(1, seed=9))
            await _settled(rt)
        alien = _files(other)[0].read_bytes()
        for f in files:
            f.write_bytes(alien)
    for f in files:
        data = bytearray(f.read_bytes())
        if damage == "flip":
            data[len(data) // 2] ^= 0x40
            f.write_bytes(bytes(data))
        elif damage == "truncate":
            f.write_bytes(bytes(data[: len(data) - 100]))
    with start_runtime(tiny_model, tmp_path / "run2", *flags) as rt:
        again = await _serve(rt, prompts)
        s = await _settled(rt)
        bad = rt.events("executor.disk_bad_block")
        dropped = rt.events("kv.disk_dropped")
        rewritten = rt.events("kv.disk_spill")
    assert [r.token_ids for r in again] == expected  # 0 wrong tokens
    assert bad and dropped
    assert all(r.usage["cached_tokens"] == 0 for r in again)  # recomputed, not counted
    assert s.check_ok and rewritten  # bad files dropped; the recomputed blocks written again


async def test_cache_salt_isolates_tenants(tiny_model, tmp_path):
    disk = tmp_path / "disk"
    flags = ("--num-blocks", "64", "--kv-disk-dir", str(disk))
    prompt = _prompts(1, seed=3)[0]
    expected = hf_greedy(tiny_model, [prompt], MAX_NEW)[0]
    with start_runtime(tiny_model, tmp_path / "run1", *flags) as rt:
        a1, a2, b1 = [
            (await _serve(rt, [prompt], cache_salt=salt))[0] for salt in ("alice", "alice", "bob")
        ]
        plain = (await _serve(rt, [prompt]))[0]
        await _settled(rt)
    assert [r.token_ids for r in (a1, a2, b1, plain)] == [expected] * 4
    assert a1.usage["cached_tokens"] == 0
    assert a2.usage["cached_tokens"] == _full_blocks(prompt)  # same salt: shared
    assert b1.usage["cached_tokens"] == 0  # another salt: not, in the pool ...
    assert plain.usage["cached_tokens"] == 0
    with start_runtime(tiny_model, tmp_path / "run2", *flags) as rt:  # ... nor on disk
        b2 = (await _serve(rt, [prompt], cache_salt="carol"))[0]
        a3 = (await _serve(rt, [prompt], cache_salt="alice"))[0]
    assert b2.usage["cached_tokens"] == 0
    assert a3.usage["cached_tokens"] == _full_blocks(prompt)
    assert b2.token_ids == a3.token_ids == expected


async def test_byte_bound_and_eviction_back_from_disk(tiny_model, tmp_path):
    """A pool too small for the prompts' prefixes, a tier bounded to a few blocks: the tier never
    holds more than its bound; a prefix the pool evicted is loaded back from disk."""
    disk = tmp_path / "disk"
    prompts = _prompts(6, seed=4)
    expected = hf_greedy(tiny_model, prompts, MAX_NEW)
    per_block = None
    flags = ("--num-blocks", "24", "--kv-disk-dir", str(disk), "--kv-disk-bytes", str(10**9))
    with start_runtime(tiny_model, tmp_path / "run1", *flags) as rt:
        first = await _serve(rt, prompts)
        again = await _serve(rt, prompts[:2])  # evicted from the pool by the four after them
        s = await _settled(rt)
        per_block = s.disk_bytes // max(1, s.disk_blocks)
    assert [r.token_ids for r in first + again] == expected + expected[:2]
    assert [r.usage["cached_tokens"] for r in again] == [_full_blocks(p) for p in prompts[:2]]
    bound = 7 * per_block + per_block // 2  # room for 7 blocks and a half
    flags = (
        "--num-blocks",
        "24",
        "--kv-disk-dir",
        str(tmp_path / "d2"),
        "--kv-disk-bytes",
        str(bound),
    )
    with start_runtime(tiny_model, tmp_path / "run2", *flags) as rt:
        out = await _serve(rt, prompts)
        s = await _settled(rt)
        assert rt.events("kv.disk_evicted")
    assert [r.token_ids for r in out] == expected
    assert s.disk_bytes <= bound
    on_disk = sum(f.stat().st_size for f in _files(tmp_path / "d2"))
    assert on_disk <= bound + per_block  # headers included: within one block of the bound


@pytest.mark.deadline(240)
async def test_kv_manager_killed_while_loads_are_in_flight(tiny_model, tmp_path):
    """After a restart, the same prefixes admitted at once (two requests each) load from disk;
    the KV manager is killed while those loads wait in the stopped executor's inbox. Its
    successor rebuilds the pool from its peers; every output is exact and nothing leaks."""
    disk = tmp_path / "disk"
    flags = ("--num-blocks", "64", "--kv-disk-dir", str(disk))
    prompts = _prompts(2, seed=5)
    expected = hf_greedy(tiny_model, prompts, MAX_NEW)
    await _fill(tiny_model, tmp_path / "run1", flags, prompts)
    with start_runtime(tiny_model, tmp_path / "run2", *flags) as rt:
        results: dict[int, Any] = {}
        async with open_client(rt.endpoint) as client:

            async def one(i: int) -> None:
                results[i] = await client.generate(
                    prompt_ids=prompts[i % 2], max_tokens=MAX_NEW, temperature=0
                )

            with trio.fail_after(150):
                async with trio.open_nursery() as nursery:
                    with stopped(rt, "executor"):
                        for i in range(4):
                            nursery.start_soon(one, i)
                        await wait_until(
                            lambda: any(e.get("disk_tokens") for e in rt.events("prefix.matched")),
                            timeout=30,
                        )
                        old = rt.pid_of("kv_manager")
                        os.kill(old, signal.SIGKILL)
                        await wait_until(lambda: rt.pid_of("kv_manager") != old, timeout=30)
        s = await _settled(rt)
        assert rt.events("kv.rebuilt")
    assert {i: r.token_ids for i, r in results.items()} == {i: expected[i % 2] for i in range(4)}
    assert s.check_ok and s.in_use == 0


async def test_a_second_instance_on_the_same_directory_is_refused(tiny_model, tmp_path):
    disk = tmp_path / "disk"
    flags = ("--num-blocks", "64", "--kv-disk-dir", str(disk))
    with start_runtime(tiny_model, tmp_path / "run1", *flags) as rt:
        with (
            pytest.raises(Exception, match="in use by another minirt instance"),
            start_runtime(tiny_model, tmp_path / "run2", *flags, timeout=60),
        ):
            pass
        assert (await _serve(rt, _prompts(1, seed=6)))[0].finish_reason  # the first serves on


async def test_blocks_never_cross_a_change_of_what_computed_them(tiny_model, tiny_models, tmp_path):
    """One tier, servers started on it one after another: a block written by one is loaded only
    by a server that computes the same KV (the same weights, compute dtype, block size); the
    same settings again hit."""
    disk = tmp_path / "disk"
    prompts = _prompts(2, seed=11)
    base = ("--num-blocks", "64", "--kv-disk-dir", str(disk), "--dtype", "float32")

    async def loads(run: str, *flags: str, model: Path = tiny_model) -> tuple[int, int]:
        with start_runtime(model, tmp_path / run, *base, *flags) as rt:
            out = await _serve(rt, prompts)
            await _settled(rt)
            return len(rt.events("executor.disk_loaded")), sum(
                r.usage["cached_tokens"] for r in out
            )

    assert await loads("fp32") == (0, 0)  # writes the blocks
    assert await loads("bf16", "--dtype", "bfloat16") == (0, 0)  # another compute dtype
    assert await loads("bs32", "--block-size", "32") == (0, 0)  # another block size
    assert await loads("llama", model=tiny_models["llama"]) == (0, 0)  # other weights
    hits = await loads("fp32-again")
    assert hits == (len(prompts), sum(_full_blocks(p) for p in prompts))


def _tier_bytes(disk: Path) -> int:
    """Every file of the tier, temporary ones included (a file gone meanwhile counts 0)."""
    total = 0
    for root, _, names in os.walk(disk):
        for n in names:
            with contextlib.suppress(FileNotFoundError):
                total += os.stat(os.path.join(root, n)).st_size
    return total


async def test_the_tier_never_holds_more_than_its_bound_while_it_writes(tiny_model, tmp_path):
    """Prompts cycling through a small pool spill and evict all the time; a thread samples the
    tier's directory meanwhile: no sample exceeds ``--kv-disk-bytes`` plus one block file."""
    disk = tmp_path / "disk"
    prompts = _prompts(4, seed=12)
    flags = ("--num-blocks", "64", "--kv-disk-dir", str(disk))
    with start_runtime(tiny_model, tmp_path / "probe", *flags) as rt:
        await _serve(rt, prompts[:1])
        await _settled(rt)
    per_file = max(f.stat().st_size for f in _files(disk))
    shutil.rmtree(disk)
    bound = 6 * per_file
    samples: list[int] = []
    done = threading.Event()

    def sample() -> None:
        while not done.is_set():
            samples.append(_tier_bytes(disk))

    sampler = threading.Thread(target=sample, daemon=True)
    flags = ("--num-blocks", "24", "--kv-disk-dir", str(disk), "--kv-disk-bytes", str(bound))
    with start_runtime(tiny_model, tmp_path / "run", *flags) as rt:
        sampler.start()
        try:
            rng = random.Random(3)
            for _ in range(4):
                fresh = _prompts(4, seed=rng.randrange(10**6))  # new prefixes: spills, evictions
                await _serve(rt, fresh + prompts)
            await _settled(rt)
        finally:
            done.set()
            sampler.join(timeout=10)
        evicted = rt.events("kv.disk_evicted")
    assert evicted and len(samples) > 100
    assert max(samples) <= bound + per_file, (max(samples), bound, per_file)


async def test_the_transformers_path_loads_from_disk_exactly(tmp_path):
    """A model served by transformers' own code (StarCoder 2: a sliding window shorter than the
    prompts) writes its blocks and finds them again after a restart, answers unchanged."""
    from gpu.model.make_model import make_model

    model = make_model("starcoder2", "tiny", tmp_path / "starcoder2")
    disk = tmp_path / "disk"
    flags = ("--num-blocks", "64", "--kv-disk-dir", str(disk), "--dtype", "float32")
    prompts = _prompts(3, seed=4)
    expected = hf_greedy(model, prompts, MAX_NEW)
    await _fill(model, tmp_path / "run1", flags, prompts)
    with start_runtime(model, tmp_path / "run2", *flags) as rt:
        warm = await _serve(rt, prompts)
        s = await _settled(rt)
        (config,) = rt.events("executor.config")
    assert config["model_impl"] == "transformers"
    assert [r.token_ids for r in warm] == expected
    assert s.disk_hit_tokens == sum(_full_blocks(p) for p in prompts)
