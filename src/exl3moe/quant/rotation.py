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


def output_scales(W: torch.Tensor, generator: torch.Generator, use_rms: bool) -> torch.Tensor:
    """sv: random signs, times each column's RMS over the mean column RMS; zero columns get 0."""
    signs = random_signs(W.shape[1], generator, W.device)
    rms = channel_rms(W, 0)
    if not use_rms:
        return to_fp16_scale(torch.where(rms > 0, signs, 0.0))
    mean = rms[rms > 0].mean() if bool((rms > 0).any()) else torch.ones((), dtype=W.dtype, device=W.device)
    return to_fp16_scale(signs * rms / mean)


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
