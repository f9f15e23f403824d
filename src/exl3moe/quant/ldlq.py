"""LDLQ: quantize 16-row strips of W_r from the last to the first, feeding back the error of the strips below.

With H_r = L D L^T (L unit block-lower-triangular in 16x16 blocks), the loss tr(E^T H_r E) is the sum over strips b
of the D_b-weighted norm of E_b + sum_{j>b} L_jb^T E_j, so strip b aims at W_b - sum_{j>b} L_jb^T E_j.
"""

from __future__ import annotations

import torch

from ..errors import ContractError
from ..format.bitstream import TILE, matrix_to_tiles, tiles_to_matrix
from .tiles import quantize_tiles
from .trellis import Ring

CHOLESKY_RETRIES = 6


def block_ldl(H: torch.Tensor) -> torch.Tensor:
    """The unit block-lower-triangular L of H = L D L^T with 16x16 diagonal blocks (float64)."""
    k = H.shape[0]
    extra = 0.0
    for _ in range(CHOLESKY_RETRIES):
        C, info = torch.linalg.cholesky_ex(H + extra * torch.eye(k, dtype=H.dtype, device=H.device))
        if int(info) == 0:
            break
        extra = max(2 * extra, 1e-9 * float(H.diagonal().mean()))
    else:
        raise ContractError("H", "the regularised rotated Hessian has no Cholesky factor (numerically singular)")
    blocks = k // TILE
    diag = C.view(blocks, TILE, blocks, TILE).diagonal(dim1=0, dim2=2).permute(2, 0, 1)
    inverse = torch.linalg.inv(diag)
    return torch.einsum("rbi,bij->rbj", C.view(k, blocks, TILE), inverse).reshape(k, k)


def _search_strips(ring: Ring, targets: torch.Tensor, exact: bool):
    """Strip b of every weight in one batch of tiles: targets [E, 16, n] -> (states [E, n/16, 256], Q rows
    [E, 16, n] float64, result)."""
    E, _, n = targets.shape
    side_by_side = targets.transpose(0, 1).reshape(TILE, E * n)
    result = quantize_tiles(ring, matrix_to_tiles(side_by_side)[0].to(torch.float32), exact)
    values = tiles_to_matrix(ring.values[result.states].to(torch.float64)[None])
    return result.states.view(E, n // TILE, 256), values.view(TILE, E, n).transpose(0, 1), result


def _count(counters: dict, result) -> None:
    for key in ("forced", "seams_searched", "improved"):
        counters[key] = counters.get(key, 0) + getattr(result, key)


def ldlq(ring: Ring, W_r: torch.Tensor, L: torch.Tensor | None, exact: bool = True):
    """Quantize W_r [E, k, n] (float64) with L [E, k, k] (None: H_r = I, no feedback), strip b of every weight at
    once. Returns (states int64 [E, k/16, n/16, 256], Q float64 [E, k, n], counters)."""
    E, k, n = W_r.shape
    strips = k // TILE
    Q = torch.zeros_like(W_r)
    states = torch.empty(E, strips, n // TILE, 256, dtype=torch.int64, device=W_r.device)
    counters: dict = {}
    for b in reversed(range(strips)):
        rows, below = slice(b * TILE, (b + 1) * TILE), slice((b + 1) * TILE, k)
        target = W_r[:, rows]
        if L is not None and b + 1 < strips:
            target = target + L[:, below, rows].transpose(1, 2) @ (W_r[:, below] - Q[:, below])
        states[:, b], Q[:, rows], result = _search_strips(ring, target, exact)
        _count(counters, result)
    return states, Q, counters


def refine(ring: Ring, W_r: torch.Tensor, Q: torch.Tensor, states: torch.Tensor, H_r: torch.Tensor,
           exact: bool = True) -> int:
    """One sweep of block coordinate descent after LDLQ: each strip is searched again against the target that is
    optimal given every other strip, and kept where tr(E^T H_r E) falls. Updates Q, states; returns strips kept."""
    k = W_r.shape[1]
    kept = 0
    for b in reversed(range(k // TILE)):
        rows = slice(b * TILE, (b + 1) * TILE)
        error, block = Q - W_r, H_r[:, rows, rows]
        pull = H_r[:, rows] @ error - block @ error[:, rows]
        found, values, _ = _search_strips(ring, W_r[:, rows] - torch.linalg.solve(block, pull), exact)
        old, new = error[:, rows], values - W_r[:, rows]
        change = ((new * (block @ new)).sum((1, 2)) - (old * (block @ old)).sum((1, 2))
                  + 2 * ((new - old) * pull).sum((1, 2)))
        better = change < 0
        Q[:, rows] = torch.where(better[:, None, None], values, Q[:, rows])
        states[:, b] = torch.where(better[:, None, None], found, states[:, b])
        kept += int(better.sum())
    return kept
