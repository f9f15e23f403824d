"""Tile quantization: the format's ring for (K, codebook) on a device, and ring search over many tiles in chunks."""

from __future__ import annotations

from functools import lru_cache

import torch

from ..format.bitstream import matrix_to_tiles, tiles_to_matrix
from ..format.codebook import codebook_table
from .ring_search import RingResult, free_cost, search_ring
from .trellis import Ring, format_ring

# Tiles searched at once: each holds 256 steps of uint8 decisions (up to 8 MB at K=1) and a 2^16 cost row.
CHUNK_TILES = {"cpu": 32, "cuda": 1024}


@lru_cache(maxsize=None)
def _ring(K: float, codebook: str, device: str) -> Ring:
    return format_ring(K, codebook_table(codebook, device).to(torch.float32))


def tile_ring(K: float, codebook: str, device: torch.device) -> Ring:
    return _ring(float(K), codebook, str(device))


def chunk_tiles(device: torch.device) -> int:
    return CHUNK_TILES.get(device.type, 256)


def quantize_tiles(ring: Ring, targets: torch.Tensor, exact: bool = True) -> RingResult:
    """Ring optimum of every row of targets [B, 256], in chunks; counters summed over chunks."""
    step = chunk_tiles(targets.device)
    parts = [search_ring(ring, targets[i:i + step], exact=exact) for i in range(0, targets.shape[0], step)]
    out = RingResult(torch.cat([p.states for p in parts]), torch.cat([p.cost for p in parts]))
    for p in parts:
        out.forced += p.forced
        out.seams_searched += p.seams_searched
        out.improved += p.improved
    return out


def free_tile_cost(ring: Ring, targets: torch.Tensor) -> torch.Tensor:
    step = chunk_tiles(targets.device)
    return torch.cat([free_cost(ring, targets[i:i + step]) for i in range(0, targets.shape[0], step)])


def quantize_strip(ring: Ring, strip: torch.Tensor, exact: bool = True):
    """A [16, n] strip -> (states [n/16, 256], reconstruction [16, n] float64, RingResult)."""
    targets = matrix_to_tiles(strip)[0].to(torch.float32)
    result = quantize_tiles(ring, targets, exact)
    values = ring.values[result.states].to(torch.float64)
    return result.states, tiles_to_matrix(values[None]), result
