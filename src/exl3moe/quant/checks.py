"""Refusals of quantize_weight, raised before any work: every one names the tensor and the rule."""

from __future__ import annotations

import torch

from ..errors import ContractError
from ..format.bitstream import HALF_K, INTEGER_K
from ..format.codebook import CODEBOOKS
from ..format.hadamard import HAD

# A Hessian whose asymmetry max|H - H^T| / max|H| exceeds this is refused; below it, H is symmetrised.
ASYMMETRY_LIMIT = 1e-3
# A Hessian whose smallest eigenvalue is below -NEGATIVE_LIMIT x mean(diag H) is refused; above it, it is shifted.
NEGATIVE_LIMIT = 0.1
FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def check_rate(K: float, codebook: str) -> None:
    if codebook not in CODEBOOKS:
        raise ContractError("codebook", f"must be one of {CODEBOOKS}, got {codebook!r}")
    if isinstance(K, bool) or not isinstance(K, (int, float)) or not (K in INTEGER_K or K in HALF_K):
        raise ContractError("K", f"must be an integer 1..8 or one of 1.5, 2.5, 3.5, got {K!r}")
    if K in HALF_K and codebook != "mul1":
        raise ContractError("K", f"half-integer K={K} exists only with the mul1 codebook, not {codebook}")


def check_weight(W) -> None:
    if not isinstance(W, torch.Tensor):
        raise ContractError("W", f"must be a tensor, got {type(W).__name__}")
    if W.dtype not in FLOAT_DTYPES:
        raise ContractError("W", f"dtype must be one of fp16/bf16/fp32/fp64, got {W.dtype}")
    if W.dim() != 2:
        raise ContractError("W", f"must be 2-D [in_features, out_features], got shape {list(W.shape)}")
    k, n = W.shape
    if k == 0 or n == 0 or k % HAD or n % HAD:
        raise ContractError("W", f"shape {list(W.shape)}: in_features and out_features must be non-zero multiples of "
                                 f"{HAD} (the Hadamard block); pad W with zero rows/columns first")
    if not bool(torch.isfinite(W).all()):
        raise ContractError("W", "must be finite (found inf or nan)")


def check_hessian(H, k: int) -> None:
    """Shape, dtype and finiteness; symmetry and definiteness are judged by regularised_hessian."""
    if not isinstance(H, torch.Tensor):
        raise ContractError("H", f"must be a tensor or None, got {type(H).__name__}")
    if H.dtype not in FLOAT_DTYPES:
        raise ContractError("H", f"dtype must be one of fp16/bf16/fp32/fp64, got {H.dtype}")
    if list(H.shape) != [k, k]:
        raise ContractError("H", f"must be [in_features, in_features] = [{k}, {k}], got {list(H.shape)}")
    if not bool(torch.isfinite(H).all()):
        raise ContractError("H", "must be finite (found inf or nan)")


def symmetric_psd_hessian(H: torch.Tensor) -> tuple[torch.Tensor, float]:
    """float64 (H + H^T)/2 shifted up to positive semidefinite, and the shift; refuses H beyond the limits."""
    H = H.to(torch.float64)
    scale = float(H.abs().max())
    if scale == 0:
        raise ContractError("H", "is all zeros: no calibration signal (pass H=None for an unweighted error)")
    asymmetry = float((H - H.T).abs().max()) / scale
    if asymmetry > ASYMMETRY_LIMIT:
        raise ContractError("H", f"is not symmetric: max|H - H^T| / max|H| = {asymmetry:.3g} > {ASYMMETRY_LIMIT}")
    H = (H + H.T) / 2
    mean_diag = float(H.diagonal().mean())
    if mean_diag <= 0:
        raise ContractError("H", f"mean diagonal {mean_diag:.3g} <= 0: not a Hessian X^T X / rows")
    lowest = float(torch.linalg.eigvalsh(H)[0])
    if lowest < -NEGATIVE_LIMIT * mean_diag:
        raise ContractError("H", f"is not positive semidefinite: smallest eigenvalue {lowest:.3g} is below "
                                 f"-{NEGATIVE_LIMIT} x mean diagonal ({mean_diag:.3g})")
    shift = max(0.0, -lowest)
    if shift:
        H = H + shift * torch.eye(H.shape[0], dtype=H.dtype, device=H.device)
    return H, shift


def resolve_device(device, W: torch.Tensor) -> torch.device:
    if device is None:
        return W.device
    try:
        return torch.device(device)
    except (RuntimeError, TypeError) as err:
        raise ContractError("device", f"not a torch device: {device!r} ({err})") from None
