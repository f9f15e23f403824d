"""Triton blockwise normalised 128-Hadamard with an optional pre- or post-scale, fp32 arithmetic."""

import os

import torch
import triton
import triton.language as tl

INV_SQRT_128 = tl.constexpr(0.08838834764831845)


def split_bf16(t: torch.Tensor) -> bool:
    """Whether kernels on t may use the bf16-split tensor-core Hadamard (compiled GPU code only)."""
    return t.is_cuda and os.environ.get("TRITON_INTERPRET", "0") != "1"


@triton.jit
def hadamard128_tile():
    """The +-1 Sylvester matrix H[a, b] = (-1)^popcount(a & b) as fp32 [128, 128]."""
    idx = tl.arange(0, 128)
    x = idx[:, None] & idx[None, :]
    x = x ^ (x >> 4)
    x = x ^ (x >> 2)
    x = x ^ (x >> 1)
    return (1 - 2 * (x & 1)).to(tl.float32)


@triton.jit
def hadamard128_rows(x, SPLIT_BF16: tl.constexpr):
    """x [BM, 128] fp32 @ Hn128. SPLIT_BF16 (GPU): tensor cores on x = hi + lo in bf16, exact to ~2^-17;
    otherwise an fp32 dot (the interpreter, which cannot multiply bf16)."""
    if not SPLIT_BF16:
        return tl.dot(x, hadamard128_tile(), input_precision="ieee") * INV_SQRT_128
    h = hadamard128_tile().to(tl.bfloat16)
    hi = x.to(tl.bfloat16)
    lo = (x - hi.to(tl.float32)).to(tl.bfloat16)
    return tl.dot(lo, h, tl.dot(hi, h)) * INV_SQRT_128


@triton.jit
def _hadamard_kernel(x_ptr, pre_ptr, post_ptr, row_ptr, out_ptr, rows, stride_x, stride_o,
                     HAS_PRE: tl.constexpr, HAS_POST: tl.constexpr, HAS_ROW: tl.constexpr, BM: tl.constexpr,
                     SPLIT_BF16: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_b = tl.program_id(1)
    r = pid_m * BM + tl.arange(0, BM)
    c = pid_b * 128 + tl.arange(0, 128)
    mask = (r < rows)[:, None]
    x = tl.load(x_ptr + r.to(tl.int64)[:, None] * stride_x + c[None, :], mask=mask, other=0.0).to(tl.float32)
    if HAS_ROW:
        x = x * tl.load(row_ptr + r, mask=r < rows, other=1.0)[:, None]
    if HAS_PRE:
        x = x * tl.load(pre_ptr + c).to(tl.float32)[None, :]
    y = hadamard128_rows(x, SPLIT_BF16)
    if HAS_POST:
        y = y * tl.load(post_ptr + c).to(tl.float32)[None, :]
    tl.store(out_ptr + r.to(tl.int64)[:, None] * stride_o + c[None, :], y.to(out_ptr.dtype.element_ty), mask=mask)


def hadamard128(x: torch.Tensor, out: torch.Tensor, pre: torch.Tensor | None = None,
                post: torch.Tensor | None = None, row_scale: torch.Tensor | None = None) -> torch.Tensor:
    """out[r, blk] = ((x[r, blk] * row_scale[r] * pre) @ Hn128) * post per 128-column block; x, out 2-D, row stride
    any; row_scale fp32 [rows]."""
    rows, cols = x.shape
    block_m = 16
    grid = (triton.cdiv(rows, block_m), cols // 128)
    _hadamard_kernel[grid](x, pre if pre is not None else x, post if post is not None else x,
                           row_scale if row_scale is not None else x, out, rows, x.stride(0), out.stride(0),
                           pre is not None, post is not None, row_scale is not None, block_m, split_bf16(x))
    return out
