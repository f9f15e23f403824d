"""Per-row power-of-two scales that keep a linear's fp16 intermediates in range: x's rows are multiplied by
2^-e before the input rotation and the output by 2^e after the output rotation and svh. Powers of two scale exactly,
so rows that never overflow or underflow keep their bytes: e is 0 unless a row's max |x * suh| leaves
[2^ROW_SAFE_LOW, 2^ROW_SAFE_HIGH); then the row's max is moved into [2^ROW_TARGET, 2^(ROW_TARGET + 1)), with |e| at
most MAX_EXPONENT so that 2^-e and 2^e stay normal fp32 numbers. The MoE scales its hidden rows and its intermediate
rows the same way (ops/moe.py, kernels/moe_intermediate.py)."""

import torch
import triton
import triton.language as tl

ROW_SAFE_LOW, ROW_SAFE_HIGH, ROW_TARGET = -6, 11, 7
MAX_EXPONENT = 126
_SHIFT = 64   # |x * suh| measured at 2^-64 of its size: a bf16 row times an fp16 scale cannot overflow fp32 there


@triton.jit
def scale_for_exponent(exponent, zero, LOW: tl.constexpr, HIGH: tl.constexpr, TARGET: tl.constexpr,
                       MAX_E: tl.constexpr):
    """2^-e of rows whose max magnitude has binary exponent `exponent` (fp32; `zero`: the row is all zeros)."""
    safe = (exponent >= LOW) & (exponent < HIGH) | zero
    e = tl.where(safe, 0.0, tl.minimum(tl.maximum(exponent - TARGET, -MAX_E), MAX_E))
    return tl.exp2(-e)


@triton.jit
def _row_scale_kernel(x_ptr, pre_ptr, scale_ptr, rows, k, stride_x, BM: tl.constexpr, LOW: tl.constexpr,
                      HIGH: tl.constexpr, TARGET: tl.constexpr, SHIFT: tl.constexpr, MAX_E: tl.constexpr):
    r = tl.program_id(0) * BM + tl.arange(0, BM)
    mask = (r < rows)[:, None]
    c = tl.arange(0, 128)
    biggest = tl.zeros((BM,), dtype=tl.float32)
    for k0 in range(0, k, 128):
        x = tl.load(x_ptr + r.to(tl.int64)[:, None] * stride_x + (k0 + c)[None, :], mask=mask, other=0.0)
        pre = tl.load(pre_ptr + k0 + c).to(tl.float32)
        shrunk = tl.abs(x.to(tl.float32) * 5.421010862427522e-20) * tl.abs(pre)[None, :]   # 2^-64
        biggest = tl.maximum(biggest, tl.max(shrunk, axis=1))
    exponent = tl.floor(tl.log2(tl.maximum(biggest, 1e-38))) + SHIFT
    scale = scale_for_exponent(exponent, biggest == 0.0, LOW, HIGH, TARGET, MAX_E)
    tl.store(scale_ptr + r, scale, mask=r < rows)


def row_scales(x: torch.Tensor, pre: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """scales [rows] fp32 <- 2^-e of each row of x [rows, k] (k a multiple of 128) against the column scales pre."""
    rows, k = x.shape
    block_m = 16
    _row_scale_kernel[(triton.cdiv(rows, block_m),)](x, pre, scales, rows, k, x.stride(0), block_m, ROW_SAFE_LOW,
                                                     ROW_SAFE_HIGH, ROW_TARGET, _SHIFT, MAX_EXPONENT)
    return scales


def row_scales_torch(x: torch.Tensor, pre: torch.Tensor) -> torch.Tensor:
    """row_scales in torch (fp32), for the torch path."""
    shrunk = (x.float() * 2.0 ** -_SHIFT).abs() * pre.float().abs()
    biggest = shrunk.amax(dim=1)
    return _scales_torch(torch.floor(torch.log2(biggest.clamp_min(1e-38))) + _SHIFT, biggest == 0)


def fp32_row_scales_torch(rows: torch.Tensor) -> torch.Tensor:
    """2^-e of each fp32 row of rows [n, k] by its own max |value| (no column scales), for the torch path."""
    biggest = rows.abs().amax(dim=1)
    return _scales_torch(torch.floor(torch.log2(biggest.clamp_min(1e-38))), biggest == 0)


def _scales_torch(exponent: torch.Tensor, zero: torch.Tensor) -> torch.Tensor:
    safe = ((exponent >= ROW_SAFE_LOW) & (exponent < ROW_SAFE_HIGH)) | zero
    e = (exponent - ROW_TARGET).clamp(-MAX_EXPONENT, MAX_EXPONENT)
    return torch.exp2(-torch.where(safe, torch.zeros_like(exponent), e))
