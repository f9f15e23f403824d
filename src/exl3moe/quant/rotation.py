"""The two-sided rotation: W = diag(su) Hk W_r Hn diag(sv), with random signs and per-channel magnitudes."""

from __future__ import annotations

import torch

from ..format.hadamard import hadamard_blockwise

FP16_TINY = 2.0 ** -14   # smallest normal fp16: scales are kept at or above it
FP16_MAX = 65504.0


def left_hadamard(x: torch.Tensor) -> torch.Tensor:
    """Hk x: the blockwise normalised Hadamard over rows."""
    return hadamard_blockwise(x.T).T


def random_signs(length: int, generator: torch.Generator, device: torch.device) -> torch.Tensor:
    return (torch.randint(0, 2, (length,), generator=generator) * 2 - 1).to(torch.float64).to(device)


def channel_rms(x: torch.Tensor, dim: int) -> torch.Tensor:
    return x.square().mean(dim).sqrt()


def to_fp16_scale(scale: torch.Tensor) -> torch.Tensor:
    """Round scales to fp16, keeping each non-zero magnitude within the normal fp16 range."""
    magnitude = scale.abs().clamp(FP16_TINY, FP16_MAX)
    return torch.where(scale == 0, 0.0, magnitude * scale.sign()).to(torch.float16)


def _relative(x: torch.Tensor) -> torch.Tensor:
    """x over the mean of its positive entries (x itself when none is positive)."""
    positive = x > 0
    return x / x[positive].mean() if bool(positive.any()) else x


def output_scales(W: torch.Tensor, generator: torch.Generator, power: float) -> torch.Tensor:
    """sv: random signs x (column RMS / mean column RMS)^power; zero columns get 0."""
    rms = _relative(channel_rms(W, 0))
    return to_fp16_scale(random_signs(W.shape[1], generator, W.device) * torch.where(rms > 0, rms, 0.0) ** power)


def input_scales(W_cols: torch.Tensor, H: torch.Tensor | None, generator: torch.Generator,
                 power: float) -> torch.Tensor:
    """su before the global scale: random signs x (row RMS^2 / relative diag H)^(power/2) of W_cols = W diag(1/sv) Hn;
    zero rows get 0. Rows that H weighs more get finer steps."""
    rms = _relative(channel_rms(W_cols, 1))
    weight = torch.ones_like(rms) if H is None else _relative(H.diagonal().clamp(min=0)).clamp(min=1e-6)
    magnitude = torch.where(rms > 0, (rms.square() / weight) ** (power / 2), 0.0)
    return random_signs(W_cols.shape[0], generator, W_cols.device) * magnitude


def divide_channels(W: torch.Tensor, scale: torch.Tensor, dim: int) -> torch.Tensor:
    """W / scale along dim (0: rows, 1: columns); zero scales leave their (zero) channel as it is."""
    s = scale.to(W.dtype)
    s = torch.where(s == 0, 1.0, s)
    return W / (s[:, None] if dim == 0 else s[None, :])


def rotate(W: torch.Tensor, su: torch.Tensor, sv: torch.Tensor) -> torch.Tensor:
    """W_r = Hk diag(1/su) W diag(1/sv) Hn (float64)."""
    return left_hadamard(divide_channels(hadamard_blockwise(divide_channels(W, sv, 1)), su, 0))


def unrotate(W_r: torch.Tensor, su: torch.Tensor, sv: torch.Tensor) -> torch.Tensor:
    """diag(su) Hk W_r Hn diag(sv) (the format's dense weight) in W_r's dtype."""
    w = hadamard_blockwise(left_hadamard(W_r))
    return su.to(W_r.dtype)[:, None] * w * sv.to(W_r.dtype)[None, :]


def rotated_hessian(H: torch.Tensor, su: torch.Tensor) -> torch.Tensor:
    """The Hessian of W_r: Hk diag(su) H diag(su) Hk (zero su counted as 1: those rows decode to zero)."""
    s = su.to(H.dtype)
    s = torch.where(s == 0, 1.0, s)
    return left_hadamard(hadamard_blockwise(s[:, None] * H * s[None, :]))
