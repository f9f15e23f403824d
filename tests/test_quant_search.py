"""The tail-biting trellis search: optimal against brute force and against every forced seam, bit-exact with decode."""

import pytest
import torch

from exl3moe.format.bitstream import matrix_to_tiles, pack_states, tiles_to_matrix
from exl3moe.format.weight import decode
from exl3moe.quant.ring_search import bound_paths, forced_seam, free_cost, search_ring
from exl3moe.quant.tiles import quantize_tiles, tile_ring
from exl3moe.quant.trellis import Ring, path_cost, ring_consistent


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _gen(seed):
    return torch.Generator().manual_seed(seed)


def brute_force_ring(ring: Ring, targets: torch.Tensor) -> torch.Tensor:
    """Least cost over every bit pattern of the ring, states read as the format reads them (windows ending at S(p))."""
    R, L = sum(ring.steps), ring.L
    codes = torch.arange(1 << R)
    bits = (codes[:, None] >> (R - 1 - torch.arange(R))) & 1
    ends = torch.tensor(ring.steps).cumsum(0)
    weights = 1 << torch.arange(L - 1, -1, -1)
    states = torch.stack([(bits[:, (torch.arange(e - L, e)) % R] * weights).sum(-1) for e in ends.tolist()], 1)
    return (ring.values[states][None] - targets[:, None, :]).square().sum(-1).min(1).values


@pytest.mark.parametrize("L, steps", [(6, (2,) * 8), (6, (1, 2) * 5), (8, (3,) * 5), (5, (1,) * 12), (8, (2,) * 8)])
def test_search_equals_brute_force_on_tiny_rings(L, steps):
    ring = Ring(L, steps, torch.randn(1 << L, generator=_gen(L), dtype=torch.float64), torch.float64)
    targets = torch.randn(64, len(steps), generator=_gen(1), dtype=torch.float64)
    exact = search_ring(ring, targets)
    assert torch.allclose(exact.cost, brute_force_ring(ring, targets), rtol=0, atol=1e-12)
    assert bool(ring_consistent(ring, exact.states).all())
    assert torch.allclose(path_cost(ring, targets, exact.states), exact.cost, rtol=0, atol=1e-12)
    least_bound = search_ring(ring, targets, exact=False)
    assert bool((exact.cost <= least_bound.cost + 1e-12).all())
    assert exact.improved > 0  # short rings: the seam of least bound is often not the optimum


@pytest.mark.parametrize("steps", [(2,) * 256, (2, 3) * 128])
def test_search_equals_best_forced_seam_on_full_length_rings(steps):
    L = 10
    ring = Ring(L, steps, torch.randn(1 << L, generator=_gen(3), dtype=torch.float64), torch.float64)
    targets = torch.randn(3, 256, generator=_gen(4), dtype=torch.float64)
    result = search_ring(ring, targets)
    seams = torch.arange(ring.node_count)
    for b in range(targets.shape[0]):
        every, _ = forced_seam(ring, targets[b:b + 1].expand(seams.numel(), -1), seams, with_path=False)
        assert float(result.cost[b]) == pytest.approx(float(every.min()), rel=0, abs=1e-10)
        bounds, _, _, _ = bound_paths(ring, targets[b:b + 1])
        assert bool((bounds[0] <= every + 1e-9).all())  # the seam bounds are lower bounds
    assert bool(ring_consistent(ring, result.states).all())


CASES = [("3inst", 1), ("3inst", 3), ("mcg", 2), ("mcg", 4), ("mcg", 8), ("mul1", 1.5), ("mul1", 2.5),
         ("mul1", 3.5), ("mul1", 6)]


@pytest.mark.parametrize("codebook, K", CASES)
def test_format_ring_search_decodes_bit_exact(codebook, K):
    ring = tile_ring(K, codebook, torch.device("cpu"))
    targets = torch.randn(2, 256, generator=_gen(int(K * 2)), dtype=torch.float32) * 1.2
    result = quantize_tiles(ring, targets)
    trellis = pack_states(result.states.view(1, 2, 256), K)
    assert trellis.shape == (1, 2, int(16 * K))
    decoded = decode(trellis, K, codebook)
    searched = tiles_to_matrix(ring.values[result.states].view(1, 2, 256).to(torch.float16))
    assert torch.equal(decoded.view(torch.int16), searched.view(torch.int16))
    assert bool(ring_consistent(ring, result.states).all())
    error = (matrix_to_tiles(decoded.float())[0] - targets).square().sum(-1)
    assert torch.allclose(error, result.cost, rtol=1e-5)
    assert bool((result.cost >= free_cost(ring, targets) * (1 - 1e-5)).all())
    least_bound = search_ring(ring, targets, exact=False)
    assert bool((result.cost <= least_bound.cost * (1 + 1e-6)).all())
