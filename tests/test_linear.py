"""The linear op on the CPU: Triton kernels under the interpreter, and the torch path, against float64."""

import gc
import os
import weakref

import pytest
import torch

import exl3moe
from exl3moe import ContractError, decode, reference
from exl3moe.kernels.hadamard import hadamard128
from exl3moe.kernels.trellis_decode import trellis_decode
from exl3moe.ops.linear import LinearPlan, LinearTiles, cached_runner, linear, plan_tiles
from exl3moe.ops.modules import EXL3Linear

from helpers import random_trellis, random_weight

COMBOS = [(K, cb) for cb in ("3inst", "mcg", "mul1") for K in range(1, 9)] + [(1.5, "mul1"), (2.5, "mul1"),
                                                                             (3.5, "mul1")]
interpreted = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="needs TRITON_INTERPRET=1")


def rel_l2(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def inputs(rows, k, seed):
    return torch.randn(rows, k, generator=torch.Generator().manual_seed(seed)).half()


@interpreted
@pytest.mark.parametrize("K,codebook", COMBOS)
def test_every_codebook_and_rate_at_every_row_count(K, codebook):
    w = random_weight(128, 256, K, codebook, bias=True, generator=torch.Generator().manual_seed(int(K * 10)))
    for rows in (1, 7, 64, 128, 300):
        x = inputs(rows, 128, rows)
        y = linear(x, w)
        assert y.dtype == torch.float16 and y.shape == (rows, 256)
        assert rel_l2(y, reference.linear(x, w)) < 2e-3, rows


@interpreted
@pytest.mark.parametrize("K,codebook", COMBOS)
def test_decode_kernel_is_bit_exact_at_every_rate_and_dtype(K, codebook):
    trellis = random_trellis(32, 128, K, torch.Generator().manual_seed(int(K * 10)))
    expected = decode(trellis, K, codebook)
    toward_zero = (expected.float().view(torch.int32) >> 16).to(torch.int16)   # the interpreter's cast to bf16
    for dtype, bits in ((torch.float16, expected.view(torch.int16)),
                        (torch.float32, expected.float().view(torch.int32)),
                        (torch.bfloat16, toward_zero)):   # a GPU rounds bf16 to nearest even (test_linear_gpu.py)
        out = torch.full((32, 128), float("nan"), dtype=dtype)
        trellis_decode(trellis, K, codebook, out)
        assert torch.equal(out.view(bits.dtype), bits), dtype


@interpreted
def test_hadamard_kernel_with_scales():
    x = inputs(5, 256, 0)
    pre, post = torch.rand(256).half() + 0.5, torch.rand(256).half() + 0.5
    out = torch.empty(5, 256)
    hadamard128(x, out, pre=pre)
    ref = exl3moe.format.hadamard_blockwise(x.double() * pre.double())
    assert (out.double() - ref).abs().max() < 1e-5
    hadamard128(x, out, post=post)
    ref = exl3moe.format.hadamard_blockwise(x.double()) * post.double()
    assert (out.double() - ref).abs().max() < 1e-5


@interpreted
def test_row_bytes_do_not_depend_on_batch():
    w = random_weight(256, 256, 3, "mcg")
    x = inputs(40, 256, 1)
    full = linear(x, w)
    for rows in (1, 2, 15, 16, 17, 33):
        assert torch.equal(linear(x[:rows], w).view(torch.int16), full[:rows].view(torch.int16)), rows


@interpreted
@pytest.mark.parametrize("K,codebook", [(3, "mcg"), (2.5, "mul1")])
def test_row_bytes_do_not_depend_on_batch_up_to_128_rows(K, codebook):
    w = random_weight(128, 256, K, codebook, bias=True, generator=torch.Generator().manual_seed(2))
    x = inputs(128, 128, 2)
    full = linear(x, w).view(torch.int16)
    for rows in (40, 65, 100):
        assert torch.equal(linear(x[:rows], w).view(torch.int16), full[:rows]), rows
    for row in (0, 39, 64, 99, 127):
        assert torch.equal(linear(x[row:row + 1], w).view(torch.int16), full[row:row + 1]), row


@interpreted
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_row_bytes_across_the_128_row_boundary(dtype):
    """Calls of more than 128 rows (128-row blocks) give each row the bytes of calls of 1-128 rows."""
    w = random_weight(128, 128, 4, "mcg", bias=True, generator=torch.Generator().manual_seed(5))
    x = inputs(300, 128, 5)
    full = linear(x, w, out_dtype=dtype)
    for rows in (1, 17, 128, 129, 257):
        assert torch.equal(linear(x[:rows], w, out_dtype=dtype), full[:rows]), rows
    for row in (128, 200, 299):
        assert torch.equal(linear(x[row:row + 1], w, out_dtype=dtype), full[row:row + 1]), row


def test_split_depends_on_shape_only():
    tiles = plan_tiles(4096, 14336, 4)
    assert tiles == plan_tiles(4096, 14336, 4)
    assert tiles.splits * (14336 // tiles.block_n) >= 512
    chunks = 4096 // tiles.block_k
    per = -(-chunks // tiles.splits)
    assert (tiles.splits - 1) * per < chunks, "no split may be empty"


@interpreted
def test_output_dtypes_and_leading_dims():
    w = random_weight(128, 128, 4, "mul1", bias=True)
    x = torch.randn(2, 3, 128).to(torch.bfloat16)
    ref = reference.linear(x, w)
    for dtype in (torch.float16, torch.bfloat16, torch.float32):
        y = linear(x, w, out_dtype=dtype)
        assert y.shape == (2, 3, 128) and y.dtype == dtype
        assert rel_l2(y, ref) < (6e-3 if dtype == torch.bfloat16 else 2e-3)


def test_torch_path_matches_reference(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    w = random_weight(256, 128, 2.5, "mul1", bias=True)
    x = inputs(9, 256, 3)
    assert rel_l2(linear(x, w), reference.linear(x, w)) < 2e-3


def test_torch_path_row_bytes_do_not_depend_on_batch(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")   # (the interpreter's: test_row_bytes_across_the_128_row_boundary)
    w = random_weight(384, 256, 4, "mcg", bias=True, generator=torch.Generator().manual_seed(8))
    x = inputs(300, 384, 9)
    full = linear(x, w, out_dtype=torch.float32)
    for rows in (1, 2, 7, 16, 17, 129, 299):
        assert torch.equal(linear(x[:rows], w, out_dtype=torch.float32), full[:rows]), rows


@interpreted
def test_plan_bind_run_reuses_workspace():
    w = random_weight(128, 256, 4, "mcg")
    plan = LinearPlan(w, 32)
    runner = plan.bind(plan.allocate())
    out = torch.full((20, 256), float("nan"), dtype=torch.float16)
    x = inputs(20, 128, 4)
    runner.run(x, out)
    assert not torch.isnan(out).any()
    assert rel_l2(out, reference.linear(x, w)) < 2e-3


def test_contract_errors_name_the_argument():
    w = random_weight(128, 256, 4, "mcg")
    plan = LinearPlan(w, 8)
    runner = plan.bind(plan.allocate())
    good_out = torch.empty(4, 256, dtype=torch.float16)
    cases = [
        (lambda: linear(torch.randn(4, 128), w), "x", "dtype"),
        (lambda: linear(torch.randn(4, 64).half(), w), "x", "in_features"),
        (lambda: linear(torch.randn(128, 4).half().t(), w), "x", "viewable"),
        (lambda: runner.run(inputs(4, 128, 0), torch.empty(4, 255, dtype=torch.float16)), "out", "shape"),
        (lambda: runner.run(inputs(4, 128, 0), torch.empty(4, 256, dtype=torch.int32)), "out", "dtype"),
        (lambda: runner.run(inputs(4, 128, 0), torch.empty(256, 4, dtype=torch.float16).t()), "out", "contiguous"),
        (lambda: runner.run(inputs(9, 128, 0), torch.empty(9, 256, dtype=torch.float16)), "x", "at most 8"),
        (lambda: plan.bind(torch.empty(10, dtype=torch.uint8)), "workspace", "needs"),
        (lambda: plan.bind(torch.empty(plan.workspace_bytes, dtype=torch.float32)), "workspace", "uint8"),
        (lambda: LinearPlan(w, 0), "max_rows", "positive"),
        (lambda: linear(inputs(4, 128, 0), "not a weight"), "w", "EXL3Weight"),
    ]
    for call, name, rule in cases:
        with pytest.raises(ContractError) as err:
            call()
        assert err.value.name == name and rule in str(err.value), (name, rule, str(err.value))
    assert runner.run(inputs(4, 128, 0), good_out) is good_out


def test_input_needs_a_unit_last_dim_stride_at_every_row_count():
    w = random_weight(128, 256, 4, "mcg")
    plan = LinearPlan(w, 4)
    runner = plan.bind(plan.allocate())
    strided = torch.randn(256).half()[::2]
    for x in (strided, strided.view(1, 128), torch.randn(128, 2).half()[:, 0][None], torch.randn(128, 3).half().t()):
        for call in (lambda: linear(x, w), lambda: runner.run(x, torch.empty(*x.shape[:-1], 256).half()),
                     lambda: EXL3Linear(w, 4)(x)):
            with pytest.raises(ContractError) as err:
                call()
            assert err.value.name == "x" and "last-dim stride 1" in str(err.value), str(err.value)


def test_bad_out_or_x_raises_before_any_plan_or_launch(monkeypatch):
    w = random_weight(128, 256, 4, "mcg")
    module = EXL3Linear(w, 8)

    def never(*args, **kwargs):
        raise AssertionError("planned, allocated or bound before validating")

    for name in ("__init__", "bind", "allocate"):
        monkeypatch.setattr(LinearPlan, name, never)
    x, out = inputs(4, 128, 0), torch.empty(4, 256, dtype=torch.float16)
    bad_outs = [(torch.empty(4, 255, dtype=torch.float16), "shape"), (torch.empty(2, 2, 256).half(), "shape"),
                (torch.empty(4, 256, dtype=torch.int32), "dtype"), (torch.empty(256, 4).half().t(), "contiguous")]
    bad_xs = [(torch.randn(4, 128), "dtype"), (torch.randn(256).half()[::2], "stride 1"),
              (inputs(4, 64, 0), "in_features")]
    cases = [(call, bad, "out", rule) for bad, rule in bad_outs for call in (lambda b: linear(x, w, out=b),
                                                                             lambda b: module(x, out=b))]
    cases += [(call, bad, "x", rule) for bad, rule in bad_xs for call in (lambda b: linear(b, w, out=out),
                                                                          lambda b: module(b, out=out))]
    for call, bad, name, rule in cases:
        with pytest.raises(ContractError) as err:
            call(bad)
        assert err.value.name == name and rule in str(err.value), (name, rule, str(err.value))


@interpreted
def test_calls_with_out_reuse_one_cached_plan_and_shared_workspace(monkeypatch):
    w = random_weight(128, 256, 4, "mcg", bias=True, generator=torch.Generator().manual_seed(6))
    same_layout = random_weight(128, 256, 4, "mcg", generator=torch.Generator().manual_seed(7))
    x = inputs(300, 128, 6)
    expected = {rows: linear(x[:rows], w) for rows in (1, 100, 200, 300)}
    out = torch.full((300, 256), float("nan"), dtype=torch.float16)
    linear(x[:1], w, out=out[:1])
    runner = cached_runner(w, 1)
    assert runner.plan.max_rows == 128 and runner.plan.weight is not w and runner.plan.weight.trellis is w.trellis
    assert cached_runner(same_layout, 1).workspace is runner.workspace, "one workspace per device and layout"
    planned, plan_init = [], LinearPlan.__init__
    monkeypatch.setattr(LinearPlan, "__init__", lambda plan, w, max_rows, tiles=None: (
        planned.append(max_rows), plan_init(plan, w, max_rows, tiles))[1])
    for rows, plans in ((1, []), (100, []), (300, [512]), (200, [512])):
        buffer = out[:rows]
        assert linear(x[:rows], w, out=buffer) is buffer and planned == plans, rows
        assert torch.equal(buffer.view(torch.int16), expected[rows].view(torch.int16)), rows
    assert cached_runner(w, 1).plan.max_rows == 512
    alive = weakref.ref(w)
    del w
    gc.collect()
    assert alive() is None, "the cache keeps no weight alive"


@interpreted
def test_module_from_checkpoint(tmp_path):
    w = random_weight(128, 256, 3, "mul1", bias=True)
    exl3moe.write_checkpoint(tmp_path / "ckpt", {"model.layers.0.mlp.down_proj": w}, {},
                             {"quantization_config": {"quant_method": "exl3"}})
    module = EXL3Linear.from_checkpoint(exl3moe.open_checkpoint(tmp_path / "ckpt"), "model.layers.0.mlp.down_proj")
    x = inputs(3, 128, 5)
    assert rel_l2(module(x), reference.linear(x, w)) < 2e-3
    assert "K=3" in repr(module)


def test_custom_tiles_are_accepted():
    w = random_weight(256, 256, 2, "mcg")
    plan = LinearPlan(w, 4, LinearTiles(128, 64, 2))
    assert plan.tiles.splits == 2 and plan.workspace_bytes > 0


@pytest.mark.parametrize("K,codebook", [(4, "mcg"), (2.5, "mul1"), (3, "3inst")])
def test_dense_weight_matches_float64(K, codebook):
    from exl3moe.ops.linear import dense_weight

    w = random_weight(256, 128, K, codebook, generator=torch.Generator().manual_seed(7))
    ref = w.dense(torch.float64)
    for dtype, limit in ((torch.float16, 1e-3), (torch.float32, 2e-5), (torch.bfloat16, 6e-3)):
        got = dense_weight(w, dtype)
        assert got.dtype == dtype and got.shape == (256, 128) and got.is_contiguous()
        assert rel_l2(got, ref) < limit, (dtype, rel_l2(got, ref))
    with pytest.raises(ContractError):
        dense_weight(w, torch.int8)
