"""Tile quantization: the format's ring for (K, codebook) on a device, and ring search over many tiles in chunks."""

from __future__ import annotations

from functools import lru_cache

import torch

from ..format.codebook import codebook_table
from .ring_search import RingResult, free_cost, search_ring
from .trellis import Ring, format_ring

# Bytes of node costs a search may keep per chunk of tiles (each tile keeps 256 steps x 2^(16 - min D) floats).
CHUNK_BYTES = {"cpu": 1 << 29, "cuda": 1 << 34}


@lru_cache(maxsize=None)
def _ring(K: float, codebook: str, device: str) -> Ring:
    return format_ring(K, codebook_table(codebook, device).to(torch.float32))


def tile_ring(K: float, codebook: str, device: torch.device) -> Ring:
    return _ring(float(K), codebook, str(device))


def chunk_tiles(ring: Ring, device: torch.device) -> int:
    per_tile = ring.T * (1 << (ring.L - min(ring.steps))) * ring.values.element_size()
    return max(1, CHUNK_BYTES.get(device.type, 1 << 30) // per_tile)


def quantize_tiles(ring: Ring, targets: torch.Tensor, exact: bool = True) -> RingResult:
    """Ring optimum of every row of targets [B, 256], in chunks; counters summed over chunks."""
    step = chunk_tiles(ring, targets.device)
    parts = [search_ring(ring, targets[i:i + step], exact, step) for i in range(0, targets.shape[0], step)]
    out = RingResult(torch.cat([p.states for p in parts]), torch.cat([p.cost for p in parts]))
    for p in parts:
        out.forced += p.forced
        out.seams_searched += p.seams_searched
        out.improved += p.improved
    return out


def free_tile_cost(ring: Ring, targets: torch.Tensor) -> torch.Tensor:
    step = chunk_tiles(ring, targets.device)
    return torch.cat([free_cost(ring, targets[i:i + step]) for i in range(0, targets.shape[0], step)])
