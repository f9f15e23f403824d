"""The split-ordered GEMM of calls over 128 rows, under the Triton interpreter: the sum it computes, and row bytes
that do not depend on the rows around them."""

import os

import pytest
import torch

from exl3moe.kernels.split_gemm import split_ordered_gemm

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="needs TRITON_INTERPRET=1")


def operands(rows, k, n, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rows, k, generator=g).half(), torch.randn(k, n, generator=g).half()


@pytest.mark.parametrize("split_k", [64, 128, 192])
def test_sums_each_split_then_the_splits_in_order(split_k):
    x, w = operands(150, 384, 128, split_k)
    y = split_ordered_gemm(x, w, torch.empty(150, 128), split_k)
    total = torch.zeros(150, 128, dtype=torch.float64)
    for k0 in range(0, 384, split_k):   # the last split may be shorter (384 / 192 is whole, 384 / 128 too)
        total += x[:, k0:k0 + split_k].double() @ w[k0:k0 + split_k].double()
    assert ((y.double() - total).norm() / total.norm()).item() < 1e-6
    assert not torch.equal(y, torch.zeros_like(y))


def test_a_row_gets_the_same_bytes_in_any_call():
    x, w = operands(260, 256, 256, 7)
    full = split_ordered_gemm(x, w, torch.empty(260, 256), 128)
    for rows in (1, 3, 128, 129, 200):
        part = split_ordered_gemm(x[:rows], w, torch.empty(rows, 256), 128)
        assert torch.equal(part, full[:rows]), rows
    one = split_ordered_gemm(x[259:260], w, torch.empty(1, 256), 128)
    assert torch.equal(one, full[259:260])
