"""Float64 oracle of an EXL3 linear layer: y = x @ W + bias, W = diag(suh) Hk W_inner Hn diag(svh)."""

from __future__ import annotations

import torch

from ..errors import ContractError
from ..format.weight import EXL3Weight

INPUT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def check_input(x: torch.Tensor, in_features: int, device: torch.device, name: str = "x") -> None:
    """x must be a floating tensor [..., in_features] on the weight's device."""
    if not isinstance(x, torch.Tensor):
        raise ContractError(name, f"must be a tensor, got {type(x).__name__}")
    if x.dtype not in INPUT_DTYPES:
        raise ContractError(name, f"dtype must be one of fp16/bf16/fp32/fp64, got {x.dtype}")
    if x.dim() < 1 or x.shape[-1] != in_features:
        raise ContractError(name, f"last dim must be in_features = {in_features}, got shape {list(x.shape)}")
    if x.device != device:
        raise ContractError(name, f"on {x.device}, the weight is on {device}")


def dense_with_bias(w: EXL3Weight) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(W float64 [in, out], bias float64 [out] or None)."""
    bias = None if w.bias is None else w.bias.to(torch.float64)
    return w.dense(torch.float64), bias


def apply_dense(x64: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x64 @ weight (+ bias), all float64."""
    y = x64 @ weight
    return y if bias is None else y + bias


def linear(x: torch.Tensor, w: EXL3Weight) -> torch.Tensor:
    """The exact layer output in float64, shape [..., out_features]; x may be fp16, bf16, fp32 or fp64."""
    if not isinstance(w, EXL3Weight):
        raise ContractError("w", f"must be an EXL3Weight, got {type(w).__name__}")
    check_input(x, w.in_features, w.device)
    weight, bias = dense_with_bias(w)
    return apply_dense(x.to(torch.float64), weight, bias)
