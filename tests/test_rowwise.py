"""matmul_by_rows: a row's bytes do not depend on how many rows are in the call, a lone row included."""

import pytest
import torch

from exl3moe.ops.rowwise import matmul_by_rows


@pytest.mark.parametrize("k, n", [(256, 128), (256, 8), (2048, 128), (768, 1024)])
def test_a_row_has_the_same_bytes_in_calls_of_any_size(k, n):
    g = torch.Generator().manual_seed(k + n)
    x, w = torch.randn(48, k, generator=g), torch.randn(k, n, generator=g)
    full = matmul_by_rows(x, w)
    assert torch.allclose(full.double(), x.double() @ w.double(), rtol=1e-4, atol=1e-3)
    for rows in (1, 2, 3, 7, 17, 47):
        for start in (0, 1):
            assert torch.equal(matmul_by_rows(x[start:start + rows], w), full[start:start + rows]), (rows, start)
    assert matmul_by_rows(x[:0], w).shape == (0, n)
