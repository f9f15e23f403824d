"""A row's bytes on the H200 whatever call it is in: rows of a 2048-row linear call against the same rows in calls of
1-512 rows (mma.sync, wgmma, clusters, split reductions and the decode-once GEMM above 128 rows), in every output
dtype, and inside one cached runner (the path an engine takes)."""

import pytest
import torch

from exl3moe.ops.linear import linear
from test_linear_gpu import make_weight

pytestmark = pytest.mark.gpu

ROWS = [1, 2, 7, 16, 17, 33, 64, 128, 129, 300, 512]


@pytest.mark.parametrize("k,n,K,codebook", [(4096, 14336, 4, "mcg"), (14336, 4096, 4, "mcg"), (2048, 768, 4, "mcg"),
                                            (4096, 1408, 3, "mul1"), (768, 2048, 2, "3inst")])
def test_rows_of_a_2048_row_call_match_every_smaller_call(k, n, K, codebook):
    w = make_weight(k, n, K, codebook, seed=k + n)
    x = torch.randn(2048, k, device="cuda").half()
    for dtype in (torch.float16, torch.bfloat16, torch.float32):
        full = linear(x, w, out_dtype=dtype)
        for rows in ROWS:
            assert torch.equal(linear(x[:rows], w, out_dtype=dtype), full[:rows]), (dtype, rows)
        tail = linear(x[-3:], w, out_dtype=dtype)
        assert torch.equal(tail, full[-3:]), dtype


def test_cached_runner_rows_match_across_the_128_row_boundary():
    w = make_weight(4096, 1408, 4, "mcg", seed=3)
    x = torch.randn(700, 4096, device="cuda").half()
    full = linear(x, w, out=torch.empty(700, 1408, device="cuda").half())
    for rows in (1, 100, 128, 129, 699):
        out = torch.empty(rows, 1408, device="cuda").half()
        assert torch.equal(linear(x[:rows], w, out=out), full[:rows]), rows
