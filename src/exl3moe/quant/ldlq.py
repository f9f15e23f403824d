"""LDLQ: quantize 16-row strips of W_r from the last to the first, feeding back the error of the strips below.

With H_r = L D L^T (L unit block-lower-triangular in 16x16 blocks), the loss tr(E^T H_r E) is the sum over strips b
of the D_b-weighted norm of E_b + sum_{j>b} L_jb^T E_j, so strip b aims at W_b - sum_{j>b} L_jb^T E_j.
"""

from __future__ import annotations

import torch

from ..errors import ContractError
from ..format.bitstream import TILE
from .tiles import quantize_strip
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


def ldlq(ring: Ring, W_r: torch.Tensor, L: torch.Tensor | None, exact: bool = True):
    """Quantize W_r [k, n] (float64); L None means H_r = I (no feedback).

    Returns (states int64 [k/16, n/16, 256], Q float64 [k, n], counters dict).
    """
    k, n = W_r.shape
    strips = k // TILE
    Q = torch.zeros_like(W_r)
    states = torch.empty(strips, n // TILE, 256, dtype=torch.int64, device=W_r.device)
    counters = {"forced": 0, "seams_searched": 0, "improved": 0}
    for b in reversed(range(strips)):
        rows = slice(b * TILE, (b + 1) * TILE)
        target = W_r[rows]
        if L is not None and b + 1 < strips:
            below = slice((b + 1) * TILE, k)
            target = target + L[below, rows].T @ (W_r[below] - Q[below])
        states[b], Q[rows], result = quantize_strip(ring, target, exact)
        for key in counters:
            counters[key] += getattr(result, key)
    return states, Q, counters
