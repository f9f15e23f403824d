"""Every rate on a benchmark shape on a CUDA GPU: both backends against float64, the decode kernel's bytes in every
output dtype, and row invariance at every row count up to 128."""

import pytest
import torch

from exl3moe import decode, reference
from exl3moe.kernels.trellis_decode import trellis_decode
from exl3moe.ops.linear import LinearPlan, linear
from test_linear_gpu import ALL_RATES, make_weight, rel_l2

pytestmark = pytest.mark.gpu

ROWS = (1, 7, 64, 128, 300)


@pytest.mark.parametrize("K,codebook", ALL_RATES)
def test_every_rate_at_every_row_count_on_2048x768(K, codebook):
    w = make_weight(2048, 768, K, codebook, seed=51)
    x = torch.randn(max(ROWS), 2048, device="cuda").half()
    ref = reference.linear(x, w)
    for rows in ROWS:
        y = linear(x[:rows], w)
        assert y.dtype == torch.float16 and rel_l2(y, ref[:rows]) < 2e-3, (rows, rel_l2(y, ref[:rows]))


@pytest.mark.parametrize("K,codebook", [(4, "mcg"), (2, "3inst"), (3.5, "mul1"), (6, "mul1"), (1.5, "mul1")])
def test_triton_fallback_at_rows_up_to_300_on_2048x768(K, codebook, monkeypatch):
    monkeypatch.setenv("EXL3MOE_CUDA_KERNELS", "0")
    w = make_weight(2048, 768, K, codebook, seed=53)
    assert LinearPlan(w, 300).mma is None, "EXL3MOE_CUDA_KERNELS=0 plans the Triton kernels"
    x = torch.randn(300, 2048, device="cuda").half()
    ref = reference.linear(x, w)
    for rows in (1, 64, 300):
        y = linear(x[:rows], w)
        assert rel_l2(y, ref[:rows]) < 2e-3, (rows, rel_l2(y, ref[:rows]))


@pytest.mark.parametrize("K,codebook", ALL_RATES)
def test_triton_decode_is_bit_exact_in_every_dtype(K, codebook):
    trellis = make_weight(256, 384, K, codebook, seed=55).trellis
    expected = decode(trellis.cpu(), K, codebook)
    for dtype in (torch.float16, torch.bfloat16, torch.float32):   # bf16: the fp16 value rounded to nearest even
        out = torch.full((256, 384), float("nan"), device="cuda", dtype=dtype)
        trellis_decode(trellis, K, codebook, out)
        assert torch.equal(out.cpu(), expected.to(dtype)), dtype


PARTIAL_COUNTS = (1, 2, 3, 7, 16, 17, 31, 32, 33, 63, 64, 65, 96, 127)


@pytest.mark.parametrize("K,codebook", [(4, "mcg"), (2.5, "mul1")])
def test_row_bytes_do_not_depend_on_row_count_on_4096x1408(K, codebook):
    """Every count 1..128 from the first row, and the listed counts ending at the last, give the 128-row bytes."""
    w = make_weight(4096, 1408, K, codebook, seed=57)
    x = torch.randn(128, 4096, device="cuda").half()
    full = linear(x, w).view(torch.int16)
    for rows in range(1, 129):
        assert torch.equal(linear(x[:rows], w).view(torch.int16), full[:rows]), ("first", rows)
    for rows in PARTIAL_COUNTS:
        assert torch.equal(linear(x[128 - rows:], w).view(torch.int16), full[128 - rows:]), ("last", rows)
