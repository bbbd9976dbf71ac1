"""Decode grouping and packed linears: the parts of the forward that trade layout for speed must
not change what is computed."""

from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F

from gpu.model import attention, linear, paged_kernel
from gpu.model.attention import build_metadata, group_by_length, paged_attention
from gpu.model.kv_cache import PagedKVCache
from gpu.model.linear import Linear, packing_enabled


def _cost(nblocks: list[int], groups: list[list[int]], group_cost: int) -> int:
    return sum(len(g) * max(nblocks[r] for r in g) + group_cost for g in groups)


@pytest.mark.parametrize("seed", range(20))
def test_groups_partition_rows_and_never_cost_more_than_one_group(seed):
    rng = random.Random(seed)
    n = rng.randint(1, 300)
    hi = rng.choice([4, 30, 300])
    nblocks = [rng.randint(1, hi) for _ in range(n)]
    groups = group_by_length(nblocks, 64)
    rows = [r for g in groups for r in g]
    assert sorted(rows) == list(range(n)), "every decode row in exactly one group"
    assert all(g == sorted(g) for g in groups)
    assert _cost(nblocks, groups, 64) <= _cost(nblocks, [list(range(n))], 64)


def test_grouping_splits_short_from_long_contexts_only_when_worth_it():
    assert group_by_length([7] * 50, 64) == [list(range(50))]
    short_long = [2] * 40 + [100] * 40
    assert group_by_length(short_long, 64) == [list(range(40)), list(range(40, 80))]
    # Two rows of different length: padding one block is cheaper than a second group.
    assert group_by_length([3, 4], 64) == [[0, 1]]
    assert group_by_length([], 64) == []


def _random_cache(
    kvh: int, d: int, blocks: int, bs: int, dtype: torch.dtype, seed: int
) -> tuple[PagedKVCache, list[int], random.Random]:
    """A one-layer cache of random K/V, its block ids in shuffled order, and the seeded RNG."""
    torch.manual_seed(seed)
    rng = random.Random(seed)
    cache = PagedKVCache(1, kvh, d, blocks, bs, dtype, torch.device("cpu"))
    cache.k[0].normal_()
    cache.v[0].normal_()
    free = list(range(blocks))
    rng.shuffle(free)
    return cache, free, rng


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_grouped_decode_attention_equals_one_padded_batch(dtype):
    """Many groups (group_cost 0), one group (huge cost) and the CPU kernel (where it builds)
    attend to the same contexts."""
    kvh, heads, d, bs = 2, 8, 16, 4
    cache, free, rng = _random_cache(kvh, d, 1000, bs, dtype, seed=0)
    decodes = []
    for _ in range(23):
        pos = rng.randint(0, 150)
        decodes.append(([free.pop() for _ in range(pos // bs + 1)], pos))
    q = torch.randn(len(decodes), heads, d).to(dtype)
    k = torch.randn(len(decodes), kvh, d).to(dtype)
    v = torch.randn(len(decodes), kvh, d).to(dtype)
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    outs = []
    for cost in (0, 10**9):
        meta = build_metadata(decodes, [], cache, dtype, torch.device("cpu"), cost, False)
        assert len(meta.decode_groups) == (1 if cost else len({p // bs for _, p in decodes}))
        outs.append(paged_attention(q, k, v, cache, 0, meta, d**-0.5))
    if paged_kernel.usable(torch.device("cpu"), dtype):
        meta = build_metadata(decodes, [], cache, dtype, torch.device("cpu"))
        assert meta.kernel_tables is not None and not meta.decode_groups
        outs.append(paged_attention(q, k, v, cache, 0, meta, d**-0.5))
    for out in outs[1:]:
        torch.testing.assert_close(outs[0], out, **tol)
    # and against attention computed directly from the written cache, one request at a time
    for i, (table, pos) in enumerate(decodes):
        slots = torch.tensor([table[p // bs] * bs + p % bs for p in range(pos + 1)])
        kc = cache.k[0][:, slots].repeat_interleave(heads // kvh, 0).float()  # [heads, ctx, d]
        vc = cache.v[0][:, slots].repeat_interleave(heads // kvh, 0).float()
        want = F.scaled_dot_product_attention(q[i].float()[:, None], kc, vc)[:, 0]
        for out in outs:
            torch.testing.assert_close(out[i].view(heads, d).float(), want, **tol)


@pytest.mark.skipif(
    not packing_enabled(torch.device("cpu"), torch.float32), reason="no oneDNN in this torch"
)
@pytest.mark.parametrize("rows", [1, 5, 64, 300])
def test_packed_linear_matches_f_linear(rows):
    torch.manual_seed(rows)
    w, b = torch.randn(96, 40) * 0.1, torch.randn(96)
    lin = Linear(w, b, pack=True)
    assert lin.packed is not None and lin.weight is None, "packed, unpacked copy dropped"
    x = torch.randn(rows, 40)
    torch.testing.assert_close(lin(x), F.linear(x, w, b), rtol=1e-5, atol=1e-5)


def test_packing_only_on_cpu():
    assert not packing_enabled(torch.device("cuda"), torch.float32)
    assert not packing_enabled(torch.device("cpu"), torch.float16)


def test_packing_can_be_switched_off(monkeypatch):
    monkeypatch.setenv("MINIRT_PACKED_LINEAR", "0")
    assert not packing_enabled(torch.device("cpu"), torch.float32)
    lin = Linear(torch.eye(3), None, pack=packing_enabled(torch.device("cpu"), torch.float32))
    assert lin.packed is None
    torch.testing.assert_close(lin(torch.ones(2, 3)), torch.ones(2, 3))


@pytest.mark.skipif(
    not packing_enabled(torch.device("cpu"), torch.float32), reason="no oneDNN in this torch"
)
def test_lone_rows_use_the_kept_plain_weight_in_float32_only(monkeypatch):
    monkeypatch.setattr(linear, "mkl_gemv_fast", lambda: True)  # an Intel CPU
    torch.manual_seed(0)
    w, b = torch.randn(96, 40), torch.randn(96)
    lin = Linear(w, b, pack=True, keep_plain=True)
    assert lin.packed is not None and lin.weight is w and lin.gemv_rows == 2
    for rows in (1, 2, 3, 17):
        x = torch.randn(rows, 40)
        got = lin(x)
        if rows <= 2:  # the plain weight through F.linear: bit-identical to it
            assert torch.equal(got, F.linear(x, w, b))
        torch.testing.assert_close(got, F.linear(x, w, b), rtol=1e-5, atol=1e-5)
    bf = Linear(w.bfloat16(), None, pack=True, keep_plain=True)
    if bf.packed is not None:  # bf16: the packed kernel is faster at every row count
        assert bf.weight is None and bf.gemv_rows == 0


@pytest.mark.skipif(
    not packing_enabled(torch.device("cpu"), torch.float32), reason="no oneDNN in this torch"
)
def test_decode_row_counts_use_the_row_copy_and_prefill_tiles_the_packed_one(monkeypatch):
    from gpu.model import cpu_ops

    monkeypatch.setattr(linear, "mkl_gemv_fast", lambda: True)  # an Intel CPU
    torch.manual_seed(0)
    w, b = torch.randn(100, 64), torch.randn(100)
    lin = Linear(w, b, pack=True, keep_plain=True)
    if lin.rows is None:
        pytest.skip("no decode-row kernel on this machine")
    assert lin.weight is w and lin.gemv_rows == 2  # a kept plain weight still takes 1-2 rows
    for rows in (1, 2, 3, 64, 65, 300):
        x = torch.randn(rows, 64)
        got = lin(x)
        if rows <= 2:
            assert torch.equal(got, F.linear(x, w, b))
        elif rows <= cpu_ops.ROWS_MAX:
            assert torch.equal(got, cpu_ops.rows_linear(x, lin.rows, b, 100))
        torch.testing.assert_close(got, F.linear(x, w, b), rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(
    not packing_enabled(torch.device("cpu"), torch.bfloat16), reason="no oneDNN in this torch"
)
def test_bf16_decode_rows_are_within_one_rounding_of_the_exact_product(monkeypatch):
    """``--dtype bfloat16``'s MLP at decode row counts runs the avx512_bf16 row kernel: each
    output is the float32 sum of the bf16 products rounded to bf16 once, so it lies within one
    bf16 step of the exact product, at every row count it takes (1-12 in place, 13-64 through
    the transposed scratch); prefill tiles stay on oneDNN."""
    from gpu.model import cpu_ops

    monkeypatch.setattr(linear, "amx_bf16", lambda: False)  # the kernel, on AMX machines too
    torch.manual_seed(0)
    w, b = (torch.randn(100, 64) * 0.1).bfloat16(), (torch.randn(100) * 0.1).bfloat16()
    lin = Linear(w, b, pack=True)
    if lin.rows is None:
        pytest.skip("no avx512_bf16 decode-row kernel on this machine")
    for rows in (1, 5, 12, 13, 32, 64, 65):
        x = torch.randn(rows, 64).bfloat16()
        got = lin(x)
        assert got.dtype == torch.bfloat16 and got.shape == (rows, 100)
        if rows <= cpu_ops.ROWS_MAX:
            assert torch.equal(got, cpu_ops.rows_linear(x, lin.rows, b, 100))
        exact = F.linear(x.double(), w.double(), b.double())
        step = 2.0 ** (torch.floor(torch.log2(exact.abs().clamp(min=1e-30))) - 7)
        assert bool(((got.double() - exact).abs() <= step + 1e-6).all()), rows
    assert Linear(torch.randn(10, 33).bfloat16(), None, pack=True).rows is None  # odd K
    monkeypatch.setattr(linear, "amx_bf16", lambda: True)  # oneDNN's AMX tiles win past 4 rows
    amx, taken = Linear(w, b, pack=True), []
    kernel = cpu_ops.rows_linear
    monkeypatch.setattr(cpu_ops, "rows_linear", lambda x, *a: taken.append(len(x)) or kernel(x, *a))
    for rows in (1, linear.AMX_BF16_ROWS, linear.AMX_BF16_ROWS + 1, 64):
        amx(torch.randn(rows, 64).bfloat16())
    assert taken == [1, linear.AMX_BF16_ROWS]
    monkeypatch.setenv("MINIRT_ROWS_BF16", "0")
    assert Linear(w, b, pack=True).rows is None


@pytest.mark.skipif(
    not packing_enabled(torch.device("cpu"), torch.float32), reason="no oneDNN in this torch"
)
def test_off_intel_lone_rows_skip_mkl_and_the_plain_copy_is_not_kept(monkeypatch):
    """MKL's gemv is slow off Intel CPUs (2-4x the decode-row kernel on a Zen 5): one row goes
    through the row copy (or the packed weight), and a layer does not keep its plain copy."""
    from gpu.model import cpu_ops

    monkeypatch.setattr(linear, "mkl_gemv_fast", lambda: False)
    torch.manual_seed(0)
    w, b = torch.randn(100, 64), torch.randn(100)
    lin = Linear(w, b, pack=True, keep_plain=True)
    assert lin.weight is None and lin.gemv_rows == 0
    x = torch.randn(1, 64)
    if lin.rows is not None:
        assert torch.equal(lin(x), cpu_ops.rows_linear(x, lin.rows, b, 100))
    torch.testing.assert_close(lin(x), F.linear(x, w, b), rtol=1e-5, atol=1e-5)


def test_loading_the_paged_kernel_keeps_subnormal_floats() -> None:
    """A kernel built with -ffast-math would switch the whole process to flush-to-zero on load,
    silently changing every later float op (torch's and Python's): subnormals must survive."""
    import subprocess
    import sys

    code = (
        "import sys, torch; from gpu.model import paged_kernel\n"
        "lib = paged_kernel.kernel()\n"
        "tiny = sys.float_info.min\n"
        "t = torch.tensor([1e-39], dtype=torch.float32) * 1.0\n"
        "print(lib is not None, tiny / 2 > 0, float(t[0]) > 0)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=300
    ).stdout.split()
    assert out == ["True", "True", "True"], "loading the kernel turned on flush-to-zero"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    ("heads", "kvh", "d", "bs"), [(8, 2, 64, 16), (14, 2, 64, 4), (4, 4, 16, 16), (16, 2, 128, 8)]
)
def test_paged_kernel_bodies_attend_like_sdpa(dtype, heads, kvh, d, bs, isa):
    """The AVX-512 body (where this machine has it) and the portable one give attention over
    paged contexts: shared prefix blocks, lengths that end mid-block and mid-16, one-slot
    contexts, head groups that do not fill the vector body's register tiles; under every
    instruction-set build of the kernels this CPU runs (``isa``)."""
    if not paged_kernel.usable(torch.device("cpu"), dtype):
        pytest.skip("no C compiler: the paged kernel is not built here")
    torch.manual_seed(d + heads)
    num_blocks = 300
    kc = torch.randn(kvh, num_blocks * bs, d).to(dtype)
    vc = torch.randn(kvh, num_blocks * bs, d).to(dtype)
    perm = torch.randperm(num_blocks).tolist()
    shared = perm[:20]  # the first 20 blocks shared by half the rows (a common prefix)
    lens = [1, 2, 15, 16, 17, 31, 33, 20 * bs + 5, 20 * bs, 20 * bs + 37, 7 * bs + 3, 40 * bs]
    width = max(lens) // bs + 1
    tables, rest = [], perm[20:]
    for i, n in enumerate(lens):
        need = -(-n // bs)
        head = shared if i % 2 and need > 20 else []
        t = head + [rest.pop() for _ in range(need - len(head))]
        tables.append(t + [0] * (width - len(t)))
    q = torch.randn(len(lens), heads, d).to(dtype)
    tab, ln = torch.tensor(tables), torch.tensor(lens)
    vec = paged_kernel.decode(q, kc, vc, tab, ln, bs, d**-0.5)
    port = paged_kernel.decode(q, kc, vc, tab, ln, bs, d**-0.5, portable=True)
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    for i, n in enumerate(lens):
        slots = torch.tensor([tables[i][p // bs] * bs + p % bs for p in range(n)])
        k = kc[:, slots].float().repeat_interleave(heads // kvh, 0)
        v = vc[:, slots].float().repeat_interleave(heads // kvh, 0)
        want = F.scaled_dot_product_attention(q[i].float()[:, None], k, v)[:, 0]
        torch.testing.assert_close(vec[i].float(), want, **tol)
        torch.testing.assert_close(port[i].float(), want, **tol)
    if isa in ("v4", "v4bf16"):
        assert paged_kernel.vector(dtype, d)  # the vector body is what ran above
    elif isa == "generic":
        assert not paged_kernel.vector(dtype, d)  # the portable body, what any CPU runs


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_prefill_rows_through_the_kernel_match_sdpa_and_ignore_chunking(dtype, monkeypatch):
    """Prefill chunks (one from the start, one over cached context) beside decodes: through the
    paged kernel they equal SDPA's path, and a prompt split into two chunks gives its rows the
    same attention, bit for bit, as one chunk (each row is attended over its own prefix)."""
    if not paged_kernel.usable(torch.device("cpu"), dtype):
        pytest.skip("no paged kernel on this machine")
    kvh, heads, d, bs = 2, 8, 16, 4
    cache, free, _ = _random_cache(kvh, d, 400, bs, dtype, seed=1)
    decodes = [([free.pop() for _ in range(p // bs + 1)], p) for p in (5, 40)]
    t1 = [free.pop() for _ in range(30 // bs + 1)]  # a 30-token prompt from the start
    t2 = [free.pop() for _ in range(57 // bs + 1)]  # positions 20..56 over 20 cached ones
    prefills = [(t1, 0, 30), (t2, 20, 37)]
    n = 2 + 30 + 37
    q = torch.randn(n, heads, d).to(dtype)
    k = torch.randn(n, kvh, d).to(dtype)
    v = torch.randn(n, kvh, d).to(dtype)
    cpu = torch.device("cpu")
    outs = {}
    for kern in (False, True):
        meta = build_metadata(decodes, prefills, cache, dtype, cpu, prefill_kernel=kern)
        assert meta.prefill_kernel is kern
        outs[kern] = paged_attention(q, k, v, cache, 0, meta, d**-0.5)
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(outs[True], outs[False], **tol)
    # the 30-token prompt again, as chunks of 12 and 18 rows in two steps
    rows = slice(2, 32)
    split = []
    for start, length in ((0, 12), (12, 18)):
        r = slice(2 + start, 2 + start + length)
        meta = build_metadata([], [(t1, start, length)], cache, dtype, cpu, prefill_kernel=True)
        split.append(paged_attention(q[r], k[r], v[r], cache, 0, meta, d**-0.5))
    assert torch.equal(torch.cat(split), outs[True][rows])
    # a step whose per-row tables would exceed the cap takes SDPA's path for its prefill rows
    monkeypatch.setattr(attention, "KERNEL_TABLE_MAX", n * (57 // bs + 1) - 1)
    meta = build_metadata(decodes, prefills, cache, dtype, cpu)
    assert not meta.prefill_kernel and meta.kernel_tables is not None  # decodes still use it
    torch.testing.assert_close(paged_attention(q, k, v, cache, 0, meta, d**-0.5), outs[False])
