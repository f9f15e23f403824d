"""Fused trellis matmul: partial[s] = x_had @ W_inner over split s's k range, W_inner decoded on the fly.

Each program owns one BN-column block and one split of k; it decodes each [BK, BN] weight block once
and multiplies it into every row (BM rows, masked), accumulating in fp32. The epilogue sums the
splits in fixed order, applies the output Hadamard, svh and bias, and writes the output dtype.
"""

import torch
import triton
import triton.language as tl

from .hadamard import hadamard128_rows, split_bf16
from .trellis_decode import CODEBOOK_ID, decode_lanes, interpreting, lane_setup, load_word_rows


@triton.jit
def _trellis_matmul_kernel(xh_ptr, words_ptr, part_ptr, rows, n, tiles_n, chunks_per_split, chunks_total,
                           stride_x, K2: tl.constexpr, CODEBOOK: tl.constexpr, BM: tl.constexpr,
                           BN: tl.constexpr, BK: tl.constexpr, USE_ASM: tl.constexpr, DENSE: tl.constexpr,
                           WPAD: tl.constexpr):
    pid_n = tl.program_id(0)
    pid_s = tl.program_id(1)
    pid_m = tl.program_id(2)
    if DENSE:
        dense_offs = tl.arange(0, BK)[:, None] * n + tl.arange(0, BN)[None, :]
    else:
        i0, i1, i2, misalign = lane_setup(BK, BN, K2, WPAD)
    r = pid_m * BM + tl.arange(0, BM)
    row_mask = (r < rows)[:, None]
    ks = tl.arange(0, BK)
    first = pid_s * chunks_per_split
    last = tl.minimum(first + chunks_per_split, chunks_total)
    if DENSE:
        chunk_words = BK * n
        words = words_ptr + pid_n * BN + first.to(tl.int64) * chunk_words
    else:
        chunk_words = (BK // 16) * tiles_n * (4 * K2)
        words = words_ptr + (pid_n * (BN // 16) * (4 * K2)).to(tl.int64) + first.to(tl.int64) * chunk_words
    x_ptrs = xh_ptr + r.to(tl.int64)[:, None] * stride_x + (first * BK + ks)[None, :]
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for _ in range(first, last):
        if DENSE:
            w = tl.load(words + dense_offs)
        else:
            w = decode_lanes(load_word_rows(words, tiles_n, K2, BK, BN, WPAD), i0, i1, i2, misalign, BK, BN, WPAD,
                             K2, CODEBOOK, USE_ASM)
        x = tl.load(x_ptrs, mask=row_mask, other=0.0)
        acc = tl.dot(x, w, acc)
        words += chunk_words
        x_ptrs += BK
    c = pid_n * BN + tl.arange(0, BN)
    out = part_ptr + pid_s.to(tl.int64) * rows * n + r.to(tl.int64)[:, None] * n + c[None, :]
    tl.store(out, acc, mask=row_mask)


@triton.jit
def _epilogue_kernel(part_ptr, svh_ptr, bias_ptr, row_ptr, out_ptr, rows, n, splits, stride_o,
                     HAS_BIAS: tl.constexpr, HAS_ROW: tl.constexpr, BM: tl.constexpr, SPLIT_BF16: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_b = tl.program_id(1)
    r = pid_m * BM + tl.arange(0, BM)
    c = pid_b * 128 + tl.arange(0, 128)
    mask = (r < rows)[:, None]
    offs = r.to(tl.int64)[:, None] * n + c[None, :]
    acc = tl.zeros((BM, 128), dtype=tl.float32)
    for s in range(splits):
        acc += tl.load(part_ptr + s * rows * n + offs, mask=mask, other=0.0)
    y = hadamard128_rows(acc, SPLIT_BF16)
    y = y * tl.load(svh_ptr + c).to(tl.float32)[None, :]
    if HAS_ROW:
        y = y * (1.0 / tl.load(row_ptr + r, mask=r < rows, other=1.0))[:, None]
    if HAS_BIAS:
        y = y + tl.load(bias_ptr + c).to(tl.float32)[None, :]
    tl.store(out_ptr + r.to(tl.int64)[:, None] * stride_o + c[None, :], y.to(out_ptr.dtype.element_ty), mask=mask)


def trellis_matmul(xh: torch.Tensor, trellis: torch.Tensor, K: float, codebook: str, partials: torch.Tensor,
                   splits: int, block_m: int, block_n: int, block_k: int, num_warps: int = 4,
                   num_stages: int = 3, dense: torch.Tensor | None = None, asm_level: int = 2) -> torch.Tensor:
    """partials [splits, rows, n] fp32 <- xh [rows, k] fp16 @ W_inner, k split into `splits` chunk ranges.

    With `dense` (fp16 [k, n], W_inner decoded once) the weight is read from it instead of decoded.
    asm_level on a GPU: 0 portable Triton, 1 funnel shift in asm, 2 whole window + codebook in asm.
    """
    rows, k = xh.shape
    tiles_n = trellis.shape[1]
    n = tiles_n * 16
    source = dense if dense is not None else trellis.view(torch.int32)
    chunks_total = k // block_k
    per_split = triton.cdiv(chunks_total, splits)
    grid = (n // block_n, splits, triton.cdiv(rows, block_m))
    k2 = int(K * 2)
    use_asm = asm_level if xh.is_cuda and not interpreting() else 0
    _trellis_matmul_kernel[grid](xh, source, partials, rows, n, tiles_n, per_split, chunks_total,
                                 xh.stride(0), k2, CODEBOOK_ID[codebook], block_m, block_n, block_k,
                                 use_asm, dense is not None, triton.next_power_of_2(block_n // 16 * 4 * k2),
                                 num_warps=num_warps, num_stages=num_stages)
    return partials


def trellis_epilogue(partials: torch.Tensor, svh: torch.Tensor, bias: torch.Tensor | None,
                     out: torch.Tensor, row_scale: torch.Tensor | None = None) -> torch.Tensor:
    """out = (sum over splits in order) @ Hn128 blockwise * svh / row_scale + bias, cast to out's dtype; row_scale:
    the powers of two the input rows were multiplied by (row_scale.row_scales)."""
    splits, rows, n = partials.shape
    block_m = 16
    grid = (triton.cdiv(rows, block_m), n // 128)
    _epilogue_kernel[grid](partials, svh, bias if bias is not None else svh,
                           row_scale if row_scale is not None else svh, out, rows, n, splits, out.stride(0),
                           bias is not None, row_scale is not None, block_m, split_bf16(out))
    return out
