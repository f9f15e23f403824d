"""The linear op on the CPU: Triton kernels under the interpreter, and the torch path, against float64."""

import os

import pytest
import torch

import exl3moe
from exl3moe import ContractError, reference
from exl3moe.kernels.hadamard import hadamard128
from exl3moe.kernels.trellis_decode import trellis_decode
from exl3moe.ops.linear import LinearPlan, LinearTiles, linear, plan_tiles
from exl3moe.ops.modules import EXL3Linear

from helpers import random_weight

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
def test_decode_kernel_is_bit_exact():
    for K, codebook in [(3, "3inst"), (2.5, "mul1"), (7, "mcg")]:
        w = random_weight(128, 384, K, codebook)
        out = torch.full((128, 384), float("nan"), dtype=torch.float16)
        trellis_decode(w.trellis, K, codebook, out)
        assert torch.equal(out.view(torch.int16), w.inner().view(torch.int16))


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
