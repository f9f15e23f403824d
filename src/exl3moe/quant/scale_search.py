"""The global scale g of the rotated weight: the factor whose trellis error on sample tiles is least."""

from __future__ import annotations

import torch

from ..format.bitstream import matrix_to_tiles
from .tiles import free_tile_cost
from .trellis import Ring

COARSE = (0.7, 0.8, 0.9, 1.0, 1.1, 1.2, 1.3)
FINE_STEP = 0.025


def sample_tiles(W: torch.Tensor, count: int, generator: torch.Generator) -> torch.Tensor:
    """`count` tiles of W [k, n] (all when fewer), in packed order, float32 [count, 256]."""
    tiles = matrix_to_tiles(W).reshape(-1, 256)
    pick = torch.randperm(tiles.shape[0], generator=generator)[:count].to(W.device)
    return tiles[pick].to(torch.float32)


def _errors(ring: Ring, sample: torch.Tensor, scales: list) -> list:
    g = torch.tensor(scales, dtype=torch.float32, device=sample.device)
    batch = (sample[None] * g[:, None, None]).reshape(-1, sample.shape[-1])
    cost = free_tile_cost(ring, batch).view(len(scales), -1).sum(1).double()
    return (cost / g.double().square()).tolist()


def global_scale(ring: Ring, W: torch.Tensor, count: int, generator: torch.Generator) -> float:
    """g such that g * W's tiles are quantized with the least error (relative to W), searched on `count` tiles."""
    sample = sample_tiles(W, count, generator)
    rms = float(sample.square().mean().sqrt())
    if rms == 0:
        return 1.0
    base = float(ring.values.square().mean().sqrt()) / rms
    scales = [base * f for f in COARSE]
    errors = _errors(ring, sample, scales)
    best = scales[min(range(len(scales)), key=errors.__getitem__)]
    fine = [best * (1 + FINE_STEP * d) for d in (-2, -1, 1, 2)]
    scales += fine
    errors += _errors(ring, sample, fine)
    order = sorted(range(len(scales)), key=scales.__getitem__)
    scales, errors = [scales[i] for i in order], [errors[i] for i in order]
    i = min(range(len(scales)), key=errors.__getitem__)
    return _parabola_min(scales, errors, i)


def _parabola_min(xs: list, ys: list, i: int) -> float:
    """Vertex of the parabola through the least point and its neighbours, kept between the neighbours."""
    if i == 0 or i == len(xs) - 1:
        return xs[i]
    (x0, x1, x2), (y0, y1, y2) = xs[i - 1:i + 2], ys[i - 1:i + 2]
    denom = (x0 - x1) * (x0 - x2) * (x1 - x2)
    a = (x2 * (y1 - y0) + x1 * (y0 - y2) + x0 * (y2 - y1)) / denom
    b = (x2 * x2 * (y0 - y1) + x1 * x1 * (y2 - y0) + x0 * x0 * (y1 - y2)) / denom
    if a <= 0:
        return x1
    return min(max(-b / (2 * a), x0), x2)
