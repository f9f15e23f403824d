"""Triton blockwise normalised 128-Hadamard with an optional pre- or post-scale, fp32 arithmetic."""

import torch
import triton
import triton.language as tl

INV_SQRT_128 = 0.08838834764831845


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
def _hadamard_kernel(x_ptr, pre_ptr, post_ptr, out_ptr, rows, stride_x, stride_o,
                     HAS_PRE: tl.constexpr, HAS_POST: tl.constexpr, BM: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_b = tl.program_id(1)
    r = pid_m * BM + tl.arange(0, BM)
    c = pid_b * 128 + tl.arange(0, 128)
    mask = (r < rows)[:, None]
    x = tl.load(x_ptr + r.to(tl.int64)[:, None] * stride_x + c[None, :], mask=mask, other=0.0).to(tl.float32)
    if HAS_PRE:
        x = x * tl.load(pre_ptr + c).to(tl.float32)[None, :]
    y = tl.dot(x, hadamard128_tile(), input_precision="ieee") * INV_SQRT_128
    if HAS_POST:
        y = y * tl.load(post_ptr + c).to(tl.float32)[None, :]
    tl.store(out_ptr + r.to(tl.int64)[:, None] * stride_o + c[None, :], y.to(out_ptr.dtype.element_ty), mask=mask)


def hadamard128(x: torch.Tensor, out: torch.Tensor, pre: torch.Tensor | None = None,
                post: torch.Tensor | None = None) -> torch.Tensor:
    """out[r, blk] = ((x[r, blk] * pre) @ Hn128) * post per 128-column block; x, out 2-D, row stride any."""
    rows, cols = x.shape
    block_m = 16
    grid = (triton.cdiv(rows, block_m), cols // 128)
    _hadamard_kernel[grid](x, pre if pre is not None else x, post if post is not None else x, out, rows,
                           x.stride(0), out.stride(0), pre is not None, post is not None, block_m)
    return out
