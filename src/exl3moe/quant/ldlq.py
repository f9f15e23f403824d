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


def _search_strips(ring: Ring, targets: list, exact: bool):
    """Search strip b of every weight in one batch of tiles: targets [16, n] each -> (states, Q rows, result)."""
    tiles = torch.cat([matrix_to_tiles(t)[0] for t in targets]).to(torch.float32)
    result = quantize_tiles(ring, tiles, exact)
    per = targets[0].shape[1] // TILE
    values = tiles_to_matrix(ring.values[result.states].to(torch.float64).view(len(targets), per, 256)
                             .reshape(1, -1, 256)).view(TILE, len(targets), -1).transpose(0, 1)
    return result.states.view(len(targets), per, 256), values, result


def _count(counters: dict, result) -> None:
    for key in ("forced", "seams_searched", "improved"):
        counters[key] = counters.get(key, 0) + getattr(result, key)


def ldlq(ring: Ring, W_rs: list, Ls: list, exact: bool = True):
    """Quantize each W_r [k, n] (float64, one shape) with its L (None: H_r = I, no feedback), strips in lockstep.

    Returns (states int64 [k/16, n/16, 256] per weight, Q float64 [k, n] per weight, counters).
    """
    k, n = W_rs[0].shape
    strips = k // TILE
    Qs = [torch.zeros_like(W) for W in W_rs]
    states = [torch.empty(strips, n // TILE, 256, dtype=torch.int64, device=W.device) for W in W_rs]
    counters: dict = {}
    for b in reversed(range(strips)):
        rows, below = slice(b * TILE, (b + 1) * TILE), slice((b + 1) * TILE, k)
        targets = [W[rows] if L is None or b + 1 == strips else W[rows] + L[below, rows].T @ (W[below] - Q[below])
                   for W, L, Q in zip(W_rs, Ls, Qs)]
        found, values, result = _search_strips(ring, targets, exact)
        for i in range(len(W_rs)):
            states[i][b], Qs[i][rows] = found[i], values[i]
        _count(counters, result)
    return states, Qs, counters


def refine(ring: Ring, W_rs: list, Qs: list, states: list, H_rs: list, exact: bool = True) -> int:
    """One sweep of block coordinate descent after LDLQ: each strip is searched again against the target that is
    optimal given every other strip, and kept where tr(E^T H_r E) falls. Updates Qs, states; returns strips kept."""
    k = W_rs[0].shape[0]
    active = [i for i, H in enumerate(H_rs) if H is not None]
    kept = 0
    for b in reversed(range(k // TILE)):
        rows = slice(b * TILE, (b + 1) * TILE)
        pulls, targets = [], []
        for i in active:
            E, block = Qs[i] - W_rs[i], H_rs[i][rows, rows]
            pulls.append(H_rs[i][rows] @ E - block @ E[rows])
            targets.append(W_rs[i][rows] - torch.linalg.solve(block, pulls[-1]))
        if not active:
            break
        found, values, _ = _search_strips(ring, targets, exact)
        for j, i in enumerate(active):
            block, old_E, new_E = H_rs[i][rows, rows], Qs[i][rows] - W_rs[i][rows], values[j] - W_rs[i][rows]
            change = ((new_E * (block @ new_E)).sum() - (old_E * (block @ old_E)).sum()
                      + 2 * ((new_E - old_E) * pulls[j]).sum())
            if float(change) < 0:
                Qs[i][rows], states[i][b] = values[j], found[j]
                kept += 1
    return kept
