"""Per-expert widths: each routed expert projection's K under an average-bits budget.

Unit u (expert e, projection p) of n_u weights costs n_u K_u trellis bits and adds about a_u eps(K_u) to the MoE
layer's squared output error, a_u its routing-weighted output energy (calibration.py) and eps(K) the encoder's
relative proxy error at K. eps is convex and falling in K, so raising, one step at a time, the unit with the most
error removed per extra bit while the budget sum n_u K_u <= AVG sum n_u allows is the greedy solution of the
knapsack; it ends no worse than any uniform K within the budget (tested). Half-integer K exist only with mul1
(docs/exl3-format.md), so the widths are {2, 2.5, 3, 3.5, 4, 5, 6, 8} with mul1 and {2, 3, 4, 5, 6, 8} otherwise.
"""

from __future__ import annotations

import math

import torch

from ..errors import ContractError

WIDTHS = (2, 2.5, 3, 3.5, 4, 5, 6, 8)
HALF_WIDTH_CODEBOOK = "mul1"


def widths_for(codebook: str) -> tuple:
    return WIDTHS if codebook == HALF_WIDTH_CODEBOOK else tuple(k for k in WIDTHS if k == int(k))


def relative_error(K: float) -> float:
    """The encoder's proxy error at K on Gaussian weights (docs/quant.md: 0.0635 at K2, 0.0161 K3, 0.0042 K4,
    0.0011 K5): the Gaussian bound 2^-2K times a gap growing 4.5 % per bit."""
    return 2.0 ** (-2 * K) * (1 + 0.045 * (K - 2))


def check_budget(avg_bits, codebook: str, name: str = "expert_bits") -> None:
    widths = widths_for(codebook)
    if isinstance(avg_bits, bool) or not isinstance(avg_bits, (int, float)) or not math.isfinite(avg_bits) \
            or not widths[0] <= avg_bits <= widths[-1]:
        raise ContractError(name, f"average bits must lie within the widths' range {widths[0]}..{widths[-1]} "
                                  f"({codebook}), got {avg_bits!r}")


def allocate_widths(importance: torch.Tensor, sizes: torch.Tensor, avg_bits: float, codebook: str) -> torch.Tensor:
    """K per unit (same shape as `importance`) minimising sum a_u eps(K_u) with sum n_u K_u <= avg_bits sum n_u.

    importance: a_u >= 0; sizes: n_u weights per unit (broadcast to importance's shape)."""
    check_budget(avg_bits, codebook)
    a = importance.double().flatten()
    n = torch.broadcast_to(sizes, importance.shape).double().flatten()
    if bool((a < 0).any()) or not bool(torch.isfinite(a).all()):
        raise ContractError("importance", "must be finite and >= 0")
    widths = widths_for(codebook)
    level = [0] * len(a)
    budget = avg_bits * float(n.sum()) - widths[0] * float(n.sum())
    eps = [relative_error(k) for k in widths]
    while True:
        best, best_gain = None, 0.0
        for u in range(len(a)):
            step = level[u] + 1
            if step == len(widths):
                continue
            extra = (widths[step] - widths[level[u]]) * float(n[u])
            if extra > budget + 1e-9:
                continue
            gain = float(a[u]) * (eps[level[u]] - eps[step]) / extra
            if best is None or gain > best_gain:
                best, best_gain = u, gain
        if best is None:
            break
        budget -= (widths[level[best] + 1] - widths[level[best]]) * float(n[best])
        level[best] += 1
    return torch.tensor([widths[i] for i in level], dtype=torch.float64).reshape(importance.shape)


def predicted_error(importance: torch.Tensor, K: torch.Tensor) -> float:
    """sum a_u eps(K_u): the allocation's objective."""
    return float((importance.double() * K.double().apply_(relative_error)).sum())
