"""Refusals of quantize_weight, raised before any work: every one names the tensor and the rule."""

from __future__ import annotations

import torch

from ..errors import ContractError
from ..format.bitstream import HALF_K, INTEGER_K
from ..format.codebook import CODEBOOKS
from ..format.hadamard import HAD
from ..format.weight import EXL3Weight

# A Hessian whose asymmetry max|H - H^T| / max|H| exceeds this is refused; below it, H is symmetrised.
ASYMMETRY_LIMIT = 1e-3
# A Hessian whose smallest eigenvalue is below -NEGATIVE_LIMIT x mean(diag H) is refused; above it, it is shifted.
NEGATIVE_LIMIT = 0.1
# H + PSD_RIDGE x mean(diag H) x I that has a Cholesky factor counts as positive semidefinite (no shift).
PSD_RIDGE = 1e-12
FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def check_rate(K: float, codebook: str) -> None:
    if codebook not in CODEBOOKS:
        raise ContractError("codebook", f"must be one of {CODEBOOKS}, got {codebook!r}")
    if isinstance(K, bool) or not isinstance(K, (int, float)) or not (K in INTEGER_K or K in HALF_K):
        raise ContractError("K", f"must be an integer 1..8 or one of 1.5, 2.5, 3.5, got {K!r}")
    if K in HALF_K and codebook != "mul1":
        raise ContractError("K", f"half-integer K={K} exists only with the mul1 codebook, not {codebook}")


def check_weight(W, name: str = "W") -> None:
    if not isinstance(W, torch.Tensor):
        raise ContractError(name, f"must be a tensor, got {type(W).__name__}")
    if W.dtype not in FLOAT_DTYPES:
        raise ContractError(name, f"dtype must be one of fp16/bf16/fp32/fp64, got {W.dtype}")
    if W.dim() != 2:
        raise ContractError(name, f"must be 2-D [in_features, out_features], got shape {list(W.shape)}")
    k, n = W.shape
    if k == 0 or n == 0 or k % HAD or n % HAD:
        raise ContractError(name, f"shape {list(W.shape)}: in_features and out_features must be non-zero multiples "
                                  f"of {HAD} (the Hadamard block); pad W with zero rows/columns first")
    if not bool(torch.isfinite(W).all()):
        raise ContractError(name, "must be finite (found inf or nan)")


def check_hessian(H, k: int, name: str = "H") -> None:
    """Shape, dtype and finiteness; symmetry and definiteness are judged by symmetric_psd_hessian."""
    if not isinstance(H, torch.Tensor):
        raise ContractError(name, f"must be a tensor or None, got {type(H).__name__}")
    if H.dtype not in FLOAT_DTYPES:
        raise ContractError(name, f"dtype must be one of fp16/bf16/fp32/fp64, got {H.dtype}")
    if list(H.shape) != [k, k]:
        raise ContractError(name, f"must be [in_features, in_features] = [{k}, {k}], got {list(H.shape)}")
    if not bool(torch.isfinite(H).all()):
        raise ContractError(name, "must be finite (found inf or nan)")


def symmetric_psd_hessian(H: torch.Tensor, name: str = "H") -> tuple[torch.Tensor, float]:
    """float64 (H + H^T)/2 shifted up to positive semidefinite, and the shift; refuses H beyond the limits."""
    H = H.to(torch.float64)
    scale = float(H.abs().max())
    if scale == 0:
        raise ContractError(name, "is all zeros: no calibration signal (pass H=None for an unweighted error)")
    asymmetry = float((H - H.T).abs().max()) / scale
    if asymmetry > ASYMMETRY_LIMIT:
        raise ContractError(name, f"is not symmetric: max|H - H^T| / max|H| = {asymmetry:.3g} > {ASYMMETRY_LIMIT}")
    H = (H + H.T) / 2
    mean_diag = float(H.diagonal().mean())
    if mean_diag <= 0:
        raise ContractError(name, f"mean diagonal {mean_diag:.3g} <= 0: not a Hessian X^T X / rows")
    eye = torch.eye(H.shape[0], dtype=H.dtype, device=H.device)
    if int(torch.linalg.cholesky_ex(H + PSD_RIDGE * mean_diag * eye)[1]) == 0:
        return H, 0.0  # positive semidefinite up to rounding: no eigen decomposition needed
    lowest = float(torch.linalg.eigvalsh(H)[0])
    if lowest < -NEGATIVE_LIMIT * mean_diag:
        raise ContractError(name, f"is not positive semidefinite: smallest eigenvalue {lowest:.3g} is below "
                                  f"-{NEGATIVE_LIMIT} x mean diagonal ({mean_diag:.3g})")
    shift = max(0.0, -lowest)
    return H + shift * eye, shift


def resolve_device(device, W: torch.Tensor) -> torch.device:
    if device is None:
        return W.device
    try:
        return torch.device(device)
    except (RuntimeError, TypeError) as err:
        raise ContractError("device", f"not a torch device: {device!r} ({err})") from None


def check_init(init, W: torch.Tensor, K: float, codebook: str, name: str = "init") -> None:
    if init is None:
        return
    if not isinstance(init, EXL3Weight):
        raise ContractError(name, f"must be an EXL3Weight or None, got {type(init).__name__}")
    if (init.in_features, init.out_features) != tuple(W.shape) or init.K != K or init.codebook != codebook:
        raise ContractError(name, f"is [{init.in_features}, {init.out_features}] K={init.K} {init.codebook}; "
                                  f"W is {list(W.shape)} and the call asks K={K} {codebook}")


def _listed(value, count: int, name: str) -> list:
    if not isinstance(value, (list, tuple)) or len(value) != count:
        raise ContractError(name, f"must be a list of {count} (one per weight), got {type(value).__name__}")
    return list(value)


def check_call(Ws, Hs, inits, K, codebook, device, damp, scale, scale_tiles=1, sweeps=0, channel_power=0.5) -> tuple:
    """Every refusal of quantize_weights; returns the device, each weight's (float64 PSD H or None, shift) and
    the inits (None for each when not given)."""
    check_rate(K, codebook)
    if not isinstance(Ws, (list, tuple)) or not Ws:
        raise ContractError("Ws", f"must be a non-empty list of weights, got {type(Ws).__name__}")
    one = len(Ws) == 1
    label = lambda base, i: base if one else f"{base}[{i}]"  # noqa: E731
    Hs = [None] * len(Ws) if Hs is None else _listed(Hs, len(Ws), "Hs")
    inits = [None] * len(Ws) if inits is None else _listed(inits, len(Ws), "inits")
    for i, W in enumerate(Ws):
        check_weight(W, label("W", i))
        if W.shape != Ws[0].shape:
            raise ContractError(label("W", i), f"shape {list(W.shape)} differs from the first weight's "
                                               f"{list(Ws[0].shape)}; a batch has one shape")
        if Hs[i] is not None:
            check_hessian(Hs[i], W.shape[0], label("H", i))
        check_init(inits[i], W, K, codebook, label("init", i))
    if not (isinstance(damp, (int, float)) and damp >= 0):
        raise ContractError("damp", f"must be a number >= 0, got {damp!r}")
    if scale is not None and not (isinstance(scale, (int, float)) and 0 < scale < float("inf")):
        raise ContractError("scale", f"must be a positive finite number or None, got {scale!r}")
    if isinstance(channel_power, bool) or not isinstance(channel_power, (int, float)) or not 0 <= channel_power <= 2:
        raise ContractError("channel_power", f"must be a number in [0, 2], got {channel_power!r}")
    for name, value, least in (("scale_tiles", scale_tiles, 1), ("sweeps", sweeps, 0)):
        if isinstance(value, bool) or not isinstance(value, int) or value < least:
            raise ContractError(name, f"must be an integer >= {least}, got {value!r}")
    dev = resolve_device(device, Ws[0])
    hessians = [(None, 0.0) if H is None else symmetric_psd_hessian(H.to(dev), label("H", i))
                for i, H in enumerate(Hs)]
    return dev, hessians, inits
