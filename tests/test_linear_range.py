"""The linear on rows of any magnitude (issue: numerically safe intermediates), under the Triton interpreter and on the
torch path: rows from 1e-6 to the input dtype's largest finite value, each within 2e-3 of float64 (bf16 output: plus
its own rounding) wherever float64's result is finite in the output dtype, above its subnormals; ordinary rows keep
their bytes."""

import os

import pytest
import torch

from exl3moe.ops.linear import linear
from helpers import random_weight

MAGNITUDES = {torch.float16: [1e-6, 1e-3, 1.0, 6000.0, 65504.0],
              torch.bfloat16: [1e-6, 1e-3, 1.0, 3.3e6, 1e30, 3.3e38]}
LIMIT = {torch.float16: 2e-3, torch.bfloat16: 6e-3, torch.float32: 2e-3}
FINITE = {torch.float16: 65504.0, torch.bfloat16: 3.38e38, torch.float32: 3.4e38}


def rows_of_magnitudes(dtype, k, seed):
    g = torch.Generator().manual_seed(seed)
    rows = []
    for m in MAGNITUDES[dtype]:
        r = torch.randn(2, k, generator=g, dtype=torch.float64)
        rows.append((r / r.abs().max() * m).clamp(-FINITE[dtype], FINITE[dtype]))
    rows.append(torch.full((1, k), 6000.0 if dtype == torch.float16 else 3e38, dtype=torch.float64))
    return torch.cat(rows).to(dtype)


@pytest.mark.parametrize("in_dtype", [torch.float16, torch.bfloat16])
def test_rows_of_any_magnitude_stay_within_the_bound(kernel_path, in_dtype):
    w = random_weight(256, 128, 4, "mcg", generator=torch.Generator().manual_seed(3))
    w = w.replace(suh=torch.ones(256, dtype=torch.float16), svh=torch.full((128,), 1e-3, dtype=torch.float16))
    x = rows_of_magnitudes(in_dtype, 256, 4)
    ref = x.double() @ w.dense(torch.float64)
    checked = 0
    for out_dtype in (torch.float16, torch.bfloat16, torch.float32):
        y = linear(x, w, out_dtype=out_dtype)
        for r in range(x.shape[0]):
            biggest = ref[r].abs().max()
            if biggest >= FINITE[out_dtype] or biggest < torch.finfo(out_dtype).tiny * 1024:
                continue   # not representable to the bound in the output dtype itself
            err = ((y[r].double() - ref[r]).norm() / ref[r].norm()).item()
            assert err < LIMIT[out_dtype], (kernel_path, out_dtype, r, err)
            checked += 1
    assert checked >= 2 * x.shape[0], "most rows' results are finite in the output dtypes"


def test_ordinary_rows_keep_their_bytes_beside_extreme_ones(kernel_path):
    w = random_weight(256, 128, 3, "mul1", generator=torch.Generator().manual_seed(5))
    x = torch.randn(6, 256, generator=torch.Generator().manual_seed(6)).half()
    alone = linear(x[:3], w, out_dtype=torch.float32)
    x[3:] = torch.tensor([1e-6, 6000.0, 3e-5]).half()[:, None]
    mixed = linear(x, w, out_dtype=torch.float32)
    assert torch.equal(mixed[:3], alone) and torch.isfinite(mixed).all()
