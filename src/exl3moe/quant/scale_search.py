"""The global scale g of each rotated weight: the factor whose trellis error on sample tiles is least."""

from __future__ import annotations

import torch

from ..format.bitstream import matrix_to_tiles
from .tiles import free_tile_cost
from .trellis import Ring

COARSE = (0.7, 0.8, 0.9, 1.0, 1.1, 1.2, 1.3)
FINE = (-0.05, -0.025, 0.025, 0.05)


def sample_tiles(W: torch.Tensor, count: int, generator: torch.Generator) -> torch.Tensor:
    """`count` tiles of W [k, n] (all when fewer), in packed order, float32 [count, 256]."""
    tiles = matrix_to_tiles(W).reshape(-1, 256)
    pick = torch.randperm(tiles.shape[0], generator=generator)[:count].to(W.device)
    return tiles[pick].to(torch.float32)


def _errors(ring: Ring, samples: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """samples [E, S, 256], scales [E, C] -> [E, C] summed free-path error of the scaled tiles, in unscaled units."""
    E, S, _ = samples.shape
    batch = (samples[:, None] * scales[:, :, None, None].to(torch.float32)).reshape(-1, 256)
    cost = free_tile_cost(ring, batch).view(E, scales.shape[1], S).sum(-1).double()
    return cost / scales.square()


def global_scales(ring: Ring, Ws: list, count: int, generators: list) -> list:
    """For each W: g such that g * W's tiles are quantized with the least error (relative to W), searched on
    `count` of its tiles at a coarse grid, then a fine one around the best, then the parabola's vertex."""
    samples = torch.stack([sample_tiles(W, count, gen) for W, gen in zip(Ws, generators)])
    rms = samples.double().square().mean((1, 2)).sqrt()
    base = float(ring.values.double().square().mean().sqrt()) / torch.where(rms > 0, rms, 1.0)
    scales = base[:, None] * torch.tensor(COARSE, dtype=torch.float64, device=base.device)
    errors = _errors(ring, samples, scales)
    best = scales.gather(1, errors.argmin(1, keepdim=True))
    fine = best * (1 + torch.tensor(FINE, dtype=torch.float64, device=best.device))
    scales, errors = torch.cat((scales, fine), 1), torch.cat((errors, _errors(ring, samples, fine)), 1)
    order = scales.argsort(1)
    scales, errors = scales.gather(1, order), errors.gather(1, order)
    return [_parabola_min(s.tolist(), e.tolist()) if r > 0 else 1.0
            for s, e, r in zip(scales, errors, rms.tolist())]


def _parabola_min(xs: list, ys: list) -> float:
    """Vertex of the parabola through the least point and its neighbours, kept between the neighbours."""
    i = min(range(len(xs)), key=ys.__getitem__)
    if i == 0 or i == len(xs) - 1:
        return xs[i]
    (x0, x1, x2), (y0, y1, y2) = xs[i - 1:i + 2], ys[i - 1:i + 2]
    denom = (x0 - x1) * (x0 - x2) * (x1 - x2)
    a = (x2 * (y1 - y0) + x1 * (y0 - y2) + x0 * (y2 - y1)) / denom
    b = (x2 * x2 * (y0 - y1) + x1 * x1 * (y2 - y0) + x0 * x0 * (y1 - y2)) / denom
    if a <= 0:
        return x1
    return min(max(-b / (2 * a), x0), x2)
