"""The normalised 128-point Sylvester Hadamard, applied blockwise along the last dimension."""

import math
from functools import lru_cache

import torch

from ..errors import FormatError

HAD = 128


@lru_cache(maxsize=None)
def _sylvester(dtype: torch.dtype) -> torch.Tensor:
    idx = torch.arange(HAD)
    parity = torch.zeros(HAD, HAD, dtype=torch.int64)
    anded = idx[:, None] & idx[None, :]
    for bit in range(7):
        parity ^= (anded >> bit) & 1
    return ((1 - 2 * parity).to(torch.float64) / math.sqrt(HAD)).to(dtype)


def hadamard_matrix(dtype: torch.dtype = torch.float64, device: torch.device | str = "cpu") -> torch.Tensor:
    """Hn128 = H / sqrt(128), H[a, b] = (-1)^popcount(a & b); symmetric and its own inverse."""
    return _sylvester(dtype).to(device)


def hadamard_blockwise(x: torch.Tensor, name: str = "x") -> torch.Tensor:
    """x @ blockdiag(Hn128, ...) along the last dim, in x's dtype (which must be floating)."""
    n = x.shape[-1]
    if n % HAD:
        raise FormatError(name, f"last dim {n} is not a multiple of {HAD} (blockwise Hadamard)")
    h = hadamard_matrix(x.dtype, x.device)
    return (x.reshape(*x.shape[:-1], n // HAD, HAD) @ h).reshape(x.shape)


def hadamard_blockwise_by_rows(x: torch.Tensor) -> torch.Tensor:
    """hadamard_blockwise by butterflies: elementwise sums in a fixed order, so that a row's values never depend on
    the rows beside it (a matrix product's may); last dim a multiple of 128."""
    lead, n = x.shape[:-1], x.shape[-1]
    y = x.reshape(-1, n)
    half = 1
    while half < HAD:
        pairs = y.reshape(-1, n // (2 * half), 2, half)
        y = torch.stack((pairs[:, :, 0] + pairs[:, :, 1], pairs[:, :, 0] - pairs[:, :, 1]), dim=2)
        half *= 2
    return y.reshape(*lead, n) * (1.0 / math.sqrt(HAD))
