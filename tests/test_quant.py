"""quantize_weight end to end on the CPU: bit-exact decode, proxy error against issue #48's figures, re-encoding."""

import pytest
import torch

from exl3moe import EXL3Weight
from exl3moe.quant import proxy_error, quantize_weight, quantize_weights

pytestmark = pytest.mark.usefixtures("one_torch_thread")

# issue #48, exllamav3 1.6.5 on 1024x768 iid Gaussian weights, H from 8192 iid Gaussian rows (in / rows = 1/8)
EXLLAMAV3_GAUSSIAN_MCG_K4 = 0.00425
# Reduced case: 128x128 with H from 1024 rows (the same in / rows); its expected error is the issue's figure.
K_IN, N_OUT, ROWS = 128, 128, 1024


def gaussian_case(seed=0):
    g = torch.Generator().manual_seed(seed)
    W = torch.randn(K_IN, N_OUT, generator=g, dtype=torch.float64)
    X = torch.randn(ROWS, K_IN, generator=g, dtype=torch.float64)
    return W, X.T @ X / ROWS


@pytest.fixture(scope="module")
def encoded_k4():
    W, H = gaussian_case()
    weight, stats = quantize_weight(W, H, K=4, codebook="mcg", seed=1, scale_tiles=8, keep_inner=True)
    return W, H, weight, stats


def test_decode_equals_the_search_and_error_meets_the_issue_figure(encoded_k4):
    W, H, weight, stats = encoded_k4
    assert isinstance(weight, EXL3Weight) and weight.K == 4 and weight.codebook == "mcg"
    assert weight.trellis.shape == (8, 8, 64)
    assert torch.equal(weight.inner().view(torch.int16), stats.inner.view(torch.int16))
    E = weight.dense(torch.float64) - W
    assert stats.proxy_error == pytest.approx(float((E * (H @ E)).sum() / (W * (H @ W)).sum()), rel=1e-9)
    assert stats.proxy_error <= 1.05 * EXLLAMAV3_GAUSSIAN_MCG_K4
    assert stats.proxy_error >= 0.5 * 2.0 ** -8  # not below what 4 bits can plausibly reach
    assert stats.K == 4 and stats.seconds > 0


def test_exl3_weight_reencodes_to_itself(encoded_k4):
    _, H, weight, _ = encoded_k4
    again, stats = quantize_weight(weight.dense(torch.float64), H, K=4, codebook="mcg", init=weight,
                                   keep_inner=True, refit=False)
    assert torch.equal(stats.inner.view(torch.int16), weight.inner().view(torch.int16))  # the search found it
    assert stats.proxy_error == 0.0 and stats.kept_init  # a tie keeps the weight given
    assert torch.equal(again.dense(), weight.dense())


def test_reencoding_with_init_is_never_worse(encoded_k4):
    W, H, weight, stats = encoded_k4
    H2 = H + 0.3 * torch.diag(torch.rand(K_IN, generator=torch.Generator().manual_seed(5), dtype=torch.float64))
    current = proxy_error(W, weight.dense(torch.float64), H2)
    again, stats2 = quantize_weight(W, H2, K=4, codebook="mcg", init=weight)
    assert stats2.proxy_error <= current
    assert stats2.proxy_error == pytest.approx(proxy_error(W, again.dense(torch.float64), H2), rel=1e-12)


def test_half_rate_mul1_without_hessian():
    W, _ = gaussian_case(seed=3)
    weight, stats = quantize_weight(W, None, K=2.5, codebook="mul1", scale_tiles=4, keep_inner=True)
    assert weight.trellis.shape == (8, 8, 40) and weight.K == 2.5
    assert torch.equal(weight.inner().view(torch.int16), stats.inner.view(torch.int16))
    E = weight.dense(torch.float64) - W
    assert stats.proxy_error == pytest.approx(float(E.square().sum() / W.square().sum()), rel=1e-9)
    # identity H: no LDLQ gain, so the Gaussian rate-distortion bound 2^-2K holds
    assert 0.97 * 2.0 ** -5 <= stats.proxy_error <= 1.15 * 2.0 ** -5


def test_a_batch_encodes_each_weight_as_alone():
    W0, H0 = gaussian_case(seed=7)
    W1, H1 = gaussian_case(seed=8)
    options = dict(K=3, codebook="3inst", scale_tiles=2)
    batch = quantize_weights([W0, W1], [H0, H1], seed=4, **options)
    alone = [quantize_weight(W0, H0, seed=4, **options), quantize_weight(W1, H1, seed=5, **options)]
    for (wb, sb), (wa, sa) in zip(batch, alone):
        assert torch.equal(wb.trellis, wa.trellis)
        assert torch.equal(wb.suh, wa.suh) and torch.equal(wb.svh, wa.svh)
        assert sb.proxy_error == sa.proxy_error


def test_channel_scales_follow_the_hessian_on_skewed_weights():
    """Rows of log-normal size and inputs of log-normal scale: scales (RMS^2 / diag H)^(1/4) beat RMS scaling."""
    g = torch.Generator().manual_seed(11)
    W = torch.randn(K_IN, N_OUT, generator=g, dtype=torch.float64) * torch.randn(K_IN, 1, generator=g,
                                                                               dtype=torch.float64).exp()
    X = torch.randn(ROWS, K_IN, generator=g, dtype=torch.float64) * (0.7 * torch.randn(K_IN, generator=g,
                                                                                     dtype=torch.float64)).exp()
    H = X.T @ X / ROWS
    errors = {p: quantize_weight(W, H, K=4, codebook="mcg", scale_tiles=4, channel_power=p)[1].proxy_error
              for p in (0.5, 1.0)}
    assert errors[0.5] < 0.7 * errors[1.0]


def test_a_coordinate_descent_sweep_keeps_only_improvements(encoded_k4):
    W, H, _, stats = encoded_k4
    _, swept = quantize_weight(W, H, K=4, codebook="mcg", seed=1, scale_tiles=8, sweeps=1)
    assert swept.counters["refined_strips"] > 0
    assert swept.proxy_error <= stats.proxy_error * 1.001
