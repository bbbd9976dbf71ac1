"""The fused C passes of the float32 forward (gpu.model.cpu_ops) compute what the torch expressions
they replace compute: RoPE and the KV write bit for bit, RMSNorm and SiLU-and-multiply up to
float rounding; and they step aside (None) where they do not apply. Each test runs under every
instruction-set build of the kernels this CPU runs (the ``isa`` fixture), the portable one
included."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from gpu import kernels
from gpu.model import cpu_ops

pytestmark = pytest.mark.usefixtures("isa")


@pytest.mark.parametrize(("rows", "heads", "d"), [(1, 10, 64), (64, 10, 64), (700, 16, 128)])
def test_rope_is_bit_identical_to_the_torch_expression(rows, heads, d):
    torch.manual_seed(rows)
    qkv = torch.randn(rows, heads + 3, d) * 3  # rope reads a strided slice of the qkv output
    x = qkv[:, :heads]
    pos = torch.randint(0, 4000, (rows,))
    cos, sin = torch.randn(4096, d), torch.randn(4096, d)
    want = x * cos[pos][:, None] + x.roll(d // 2, dims=-1) * sin[pos][:, None]
    got = cpu_ops.rope(x, cos, sin, pos)
    assert got is not None and torch.equal(got, want)


@pytest.mark.parametrize(("rows", "n"), [(1, 512), (64, 896), (300, 64)])
def test_rms_norm_equals_torch_up_to_rounding(rows, n):
    torch.manual_seed(n)
    big = torch.randn(rows, n + 8) * 5
    x = big[:, :n]  # rows with a stride, as the row tiles of the residual stream have
    w = torch.randn(n)
    got = cpu_ops.rms_norm(x, w, 1e-6)
    assert got is not None
    torch.testing.assert_close(got, F.rms_norm(x, (n,), w, 1e-6), rtol=2e-6, atol=1e-6)


@pytest.mark.parametrize(("rows", "f"), [(1, 4864), (64, 1408), (300, 37)])
def test_silu_mul_equals_torch_up_to_rounding(rows, f):
    torch.manual_seed(f)
    big = torch.randn(rows, 2 * f + 5) * 4
    big[0, :8] = torch.tensor([0.0, -0.0, 1e-30, -1e-30, 90.0, -90.0, 30.0, -30.0])
    gu = big[:, : 2 * f]  # strided rows, as a row tile of the gate/up output may be
    gate, up = gu.chunk(2, dim=-1)
    got = cpu_ops.silu_mul(gu)
    assert got is not None and got.shape == (rows, f)
    torch.testing.assert_close(got, F.silu(gate) * up, rtol=1e-6, atol=1e-30)
    # bfloat16 rows: computed in float32 and rounded once, so at most one bf16 rounding from the
    # exact product (torch's two bf16 ops round twice)
    got16 = cpu_ops.silu_mul(gu.bfloat16())
    exact = F.silu(gate.bfloat16().float()) * up.bfloat16().float()
    assert got16 is not None and got16.dtype == torch.bfloat16
    torch.testing.assert_close(got16.float(), exact, rtol=2**-8, atol=1e-30)


def test_silu_mul_keeps_nan_in_bf16_vector_and_tail_lanes():
    gu = torch.ones(2, 2 * 21)  # 21 columns: one vector of 16 and a tail of 5
    gu[0, 3] = gu[1, 20] = float("nan")
    got = cpu_ops.silu_mul(gu.bfloat16())
    assert got is not None
    assert got.isnan().nonzero().tolist() == [[0, 3], [1, 20]]


def test_they_step_aside_where_they_do_not_apply():
    x = torch.randn(4, 2, 64)
    tab = torch.randn(16, 64)
    pos = torch.arange(4)
    assert cpu_ops.rope(x.bfloat16(), tab.bfloat16(), tab.bfloat16(), pos) is None
    assert cpu_ops.rope(x.transpose(1, 2), tab, tab, pos) is None  # heads not contiguous
    assert cpu_ops.rms_norm(x[:, 0].bfloat16(), torch.ones(64), 1e-6) is None
    assert cpu_ops.rms_norm(x[:, 0, ::2], torch.ones(32), 1e-6) is None  # strided columns
    assert cpu_ops.silu_mul(x[:, 0].half()) is None
    assert cpu_ops.silu_mul(x[:, 0, ::2]) is None  # strided columns
    assert cpu_ops.silu_mul(x[:, 0, :63]) is None  # no even split into gate and up


def test_argmax_is_torchs_max_index_ties_and_nan_included():
    torch.manual_seed(0)
    x = torch.randn(70, 32003)
    x[3, 100] = x[3, 5000] = 1e9  # a tie: the first wins
    x[4, 31999] = float("inf")
    x[5, 7] = x[5, 32001] = float("nan")  # NaN wins, the first one
    x[6, 32002] = float("nan")  # in the tail past the last full vector
    x[7] = float("-inf")
    x[8, :] = 0.0
    x[8, 9] = -0.0
    want = x.max(dim=-1).indices
    got = cpu_ops.argmax(x)
    assert got is not None and torch.equal(got, want)
    assert torch.equal(cpu_ops.argmax(x[:, :9]), x[:, :9].max(dim=-1).indices)  # rows < 16


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kv_write_stores_what_index_copy_stores_and_refuses_slots_outside(dtype):
    torch.manual_seed(7)
    qkv = (torch.randn(37, 12, 64) * 3).to(dtype)
    k = qkv[:, 8:10]  # the strided K slice of the qkv output, as the forward hands it over
    slots = torch.randperm(1000)[:37]
    got, want = torch.zeros(2, 1000, 64, dtype=dtype), torch.zeros(2, 1000, 64, dtype=dtype)
    assert cpu_ops.kv_write(got, slots, k)
    want.index_copy_(1, slots, k.transpose(0, 1))
    assert torch.equal(got, want)
    with pytest.raises(IndexError, match="1 KV slot"):
        cpu_ops.kv_write(got, torch.tensor([3] * 36 + [1000]), k)
    assert not cpu_ops.kv_write(got.to(torch.float16), slots, k.to(torch.float16))


@pytest.fixture
def rows_kernel(isa):
    if not kernels.ops().has_vector("rows_f32"):
        pytest.skip(f"the {isa} build has no decode-row linear (AVX-512 only): oneDNN runs")


@pytest.mark.parametrize(("n", "k"), [(1152, 896), (37, 50), (12, 7), (25, 300)])
def test_rows_linear_equals_f_linear_up_to_rounding_at_every_decode_row_count(n, k, rows_kernel):
    torch.manual_seed(n + k)
    w, b = torch.randn(n, k), torch.randn(n)
    packed = cpu_ops.pack_rows(w)
    assert packed is not None
    big = torch.randn(cpu_ops.ROWS_MAX, k + 3)
    for m in (1, 2, 3, 4, 5, 8, 16, 17, 32, 33, 48, 64):
        x = big[:m, :k]  # rows with a stride, as the residual stream's tiles have
        want = F.linear(x.double(), w.double(), b.double())
        for bias in (b, None):
            got = cpu_ops.rows_linear(x, packed, bias, n)
            assert got is not None and got.shape == (m, n)
            ref = want if bias is not None else want - b.double()
            err = (got.double() - ref).abs().max() / ref.abs().max()
            assert err < 1e-5, (m, err)
    assert cpu_ops.rows_linear(big[:1, :k].t(), packed, b, n) is None  # columns, not rows
    assert cpu_ops.rows_linear(torch.randn(cpu_ops.ROWS_MAX + 1, k), packed, b, n) is None


def test_a_rows_result_does_not_depend_on_the_rest_of_the_batch(rows_kernel):
    """Each output is one multiply-add chain over K, whichever body the row count picks: a
    request decodes to the same logits alone or in a batch of 64."""
    torch.manual_seed(1)
    w = torch.randn(300, 520)
    packed = cpu_ops.pack_rows(w)
    x = torch.randn(cpu_ops.ROWS_MAX, 520)
    full = cpu_ops.rows_linear(x, packed, None, 300)
    for m in (1, 4, 5, 16, 17, 33):
        assert torch.equal(cpu_ops.rows_linear(x[:m], packed, None, 300), full[:m])


def test_the_operators_check_their_arguments_and_name_them():
    """torch's dispatcher checks each call against the operator's schema; the kernels then
    check dtypes, shapes and layouts, and an error names the argument (no raw pointer reaches a
    kernel unchecked, as it did through ctypes)."""
    lib = kernels.ops()
    x, tab = torch.randn(2, 3, 8), torch.randn(10, 8)
    with pytest.raises(RuntimeError, match="positions: one per row of x"):
        lib.rope(x, tab, tab, torch.zeros(3, dtype=torch.long))
    with pytest.raises(RuntimeError, match="x: Float expected, got Double"):
        lib.rms_norm(torch.randn(2, 8, dtype=torch.float64), torch.randn(8), 1e-6)
    with pytest.raises(RuntimeError, match="weight: 8 elements expected"):
        lib.rms_norm(torch.randn(2, 8), torch.randn(9), 1e-6)
    with pytest.raises(RuntimeError, match="minirt::rope"):  # the schema: four tensors
        lib.rope(x, tab)
    with pytest.raises(RuntimeError, match="not one this CPU runs"):
        lib.use_isa("avx9000")
    assert lib.isa() in lib.isas()


def test_a_build_without_a_compiler_fails_the_install_and_says_why(tmp_path):
    """The kernels are built by the install (setup.py): without a compiler the install fails,
    naming it, instead of a runtime that silently runs slower code."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    env = dict(os.environ, CC=str(tmp_path / "no-such-cc"))
    build = ["build_ext", "--build-temp", str(tmp_path / "t"), "--build-lib", str(tmp_path / "l")]
    got = subprocess.run(
        [sys.executable, "setup.py", "-q", *build], cwd=root, env=env, capture_output=True,
        text=True, timeout=300,
    )  # fmt: skip
    assert got.returncode != 0
    assert "no C compiler" in got.stdout + got.stderr, got.stderr[-2000:]
