"""The encoder on the GPU: the same search as on the CPU, bit-exact decode, the issue's error figure at full size."""

import time

import pytest
import torch

from exl3moe.quant import quantize_tiles, quantize_weight, quantize_weights, tile_ring

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("one_torch_thread")]
# issue #48, exllamav3 1.6.5 on 1024x768 iid Gaussian weights with H from 8192 iid Gaussian rows
EXLLAMAV3_GAUSSIAN = {("mcg", 2): 0.0644, ("mcg", 4): 0.00425, ("mul1", 3): 0.0163}


@pytest.mark.parametrize("codebook, K", [("mcg", 2), ("3inst", 4), ("mul1", 2.5), ("mul1", 6)])
def test_tile_search_on_the_gpu_equals_the_cpu(codebook, K):
    targets = torch.randn(24, 256, generator=torch.Generator().manual_seed(0)) * 1.2   # the CPU search is slow
    cpu = quantize_tiles(tile_ring(K, codebook, torch.device("cpu")), targets)
    gpu = quantize_tiles(tile_ring(K, codebook, torch.device("cuda")), targets.cuda())
    assert torch.equal(gpu.states.cpu(), cpu.states)  # elementwise IEEE ops and exact minima: same bits
    assert torch.allclose(gpu.cost.cpu(), cpu.cost, rtol=1e-6)


def _gaussian(k, n, rows, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    W = torch.randn(k, n, device="cuda", generator=g)
    X = torch.randn(rows, k, device="cuda", generator=g, dtype=torch.float64)
    return W, X.T @ X / rows


@pytest.mark.parametrize("codebook, K", sorted(EXLLAMAV3_GAUSSIAN))
def test_full_size_gaussian_meets_the_issue_figure(codebook, K):
    W, H = _gaussian(1024, 768, 8192)
    torch.cuda.synchronize()
    start = time.perf_counter()
    weight, stats = quantize_weight(W, H, K=K, codebook=codebook, keep_inner=True)
    seconds = time.perf_counter() - start
    assert weight.trellis.is_cuda and weight.trellis.shape == (64, 48, int(16 * K))
    assert torch.equal(weight.inner().view(torch.int16), stats.inner.view(torch.int16))
    assert stats.proxy_error <= EXLLAMAV3_GAUSSIAN[(codebook, K)]
    print(f"{codebook} K{K}: proxy {stats.proxy_error:.5f}, {seconds:.2f} s, {stats.counters}")


def test_experts_batch_on_the_gpu():
    pairs = [_gaussian(256, 256, 2048, seed=s) for s in range(4)]
    results = quantize_weights([w for w, _ in pairs], [h for _, h in pairs], K=3, codebook="mcg")
    for (W, H), (weight, stats) in zip(pairs, results):
        E = weight.dense(torch.float64) - W.double()
        assert stats.proxy_error == pytest.approx(float((E * (H @ E)).sum() / (W.double() * (H @ W.double())).sum()),
                                                  rel=1e-9)
        assert stats.proxy_error < 1.08 * 2.0 ** -6
