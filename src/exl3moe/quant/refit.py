"""Refit of the channel scales with the trellis fixed: W_hat = diag(su) A diag(sv), A = Hk W_inner Hn.

Each half-step is the exact minimiser of trace(E^T H E) over one side's scales given the other's, so the float
error never rises before the fp16 rounding; the caller keeps the result only if the rounded scales do better.
"""

from __future__ import annotations

import torch

RIDGE = 1e-9  # x mean diagonal, added to the row-scale normal equations


def _weighted(H: torch.Tensor | None, X: torch.Tensor) -> torch.Tensor:
    return X if H is None else H @ X


def column_scales(A: torch.Tensor, su: torch.Tensor, W: torch.Tensor, H: torch.Tensor | None) -> torch.Tensor:
    """sv minimising the error given su: sv_j = <q_j, w_j>_H / <q_j, q_j>_H with q_j = su * A_j."""
    Q = su[:, None] * A
    num = (Q * _weighted(H, W)).sum(0)
    den = (Q * _weighted(H, Q)).sum(0)
    return torch.where(den > 0, num / torch.where(den > 0, den, 1.0), 0.0)


def row_scales(A: torch.Tensor, sv: torch.Tensor, W: torch.Tensor, H: torch.Tensor | None) -> torch.Tensor:
    """su minimising the error given sv: (H o B B^T) su = rowsum(B o H W) with B = A diag(sv)."""
    B = A * sv[None, :]
    rhs = (B * _weighted(H, W)).sum(1)
    if H is None:
        den = B.square().sum(1)
        return torch.where(den > 0, rhs / torch.where(den > 0, den, 1.0), 0.0)
    normal = H * (B @ B.T)
    ridge = RIDGE * float(normal.diagonal().mean()) + 1e-300
    normal = normal + ridge * torch.eye(normal.shape[0], dtype=normal.dtype, device=normal.device)
    return torch.linalg.solve(normal, rhs)


def refit_scales(A: torch.Tensor, su: torch.Tensor, sv: torch.Tensor, W: torch.Tensor, H: torch.Tensor | None,
                 rounds: int = 2) -> tuple[torch.Tensor, torch.Tensor]:
    """Alternate column and row refits `rounds` times from (su, sv); float64 results."""
    su, sv = su.to(torch.float64), sv.to(torch.float64)
    for _ in range(rounds):
        sv = column_scales(A, su, W, H)
        su = row_scales(A, sv, W, H)
    return su, sv
