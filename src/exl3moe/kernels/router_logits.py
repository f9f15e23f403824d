"""A router's fp32 logits hidden @ weight.T, each row's sums in an order fixed by the shapes alone, so that a token's
logits, and so its routing, never depend on the tokens beside it. k is cut in LOGITS_SPLIT_K-wide splits that run
as their own programs (a one-token call still fills the GPU); within a split, each of BK lanes sums its k values in
order and the lanes are summed by one fixed tree; the splits' partials are then added in split order."""

import torch
import triton
import triton.language as tl

LOGITS_BM, LOGITS_BE, LOGITS_BK = 16, 8, 64
LOGITS_SPLIT_K = 512
REDUCE_BLOCK = 1024


@triton.jit(do_not_specialize=["rows"])
def _router_logits_kernel(h_ptr, w_ptr, out_ptr, rows, hidden, experts, stride_h, stride_w, stride_s, stride_o,
                          SPLIT_K: tl.constexpr, BM: tl.constexpr, BE: tl.constexpr, BK: tl.constexpr):
    r = tl.program_id(0) * BM + tl.arange(0, BM)
    e = tl.program_id(1) * BE + tl.arange(0, BE)
    split = tl.program_id(2)
    ks = tl.arange(0, BK)
    lanes = tl.zeros((BM, BE, BK), dtype=tl.float32)
    for k0 in range(0, SPLIT_K, BK):
        k = split * SPLIT_K + k0 + ks
        h = tl.load(h_ptr + r.to(tl.int64)[:, None] * stride_h + k[None, :],
                    mask=(r < rows)[:, None] & (k < hidden)[None, :], other=0.0).to(tl.float32)
        w = tl.load(w_ptr + e.to(tl.int64)[:, None] * stride_w + k[None, :],
                    mask=(e < experts)[:, None] & (k < hidden)[None, :], other=0.0).to(tl.float32)
        lanes += h[:, None, :] * w[None, :, :]
    acc = tl.sum(lanes, axis=2)
    tl.store(out_ptr + split.to(tl.int64) * stride_s + r.to(tl.int64)[:, None] * stride_o + e[None, :], acc,
             mask=(r < rows)[:, None] & (e < experts)[None, :])


@triton.jit
def _sum_splits_kernel(part_ptr, out_ptr, count, splits, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = i < count
    acc = tl.load(part_ptr + i, mask=mask, other=0.0)
    for s in range(1, splits):
        acc += tl.load(part_ptr + s * count + i, mask=mask, other=0.0)
    tl.store(out_ptr + i, acc, mask=mask)


def router_logits_kernel(hidden: torch.Tensor, weight: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """out [T, E] fp32 (contiguous) <- hidden [T, H] @ weight [E, H].T (rows with unit column stride)."""
    rows, h = hidden.shape
    experts = weight.shape[0]
    splits = triton.cdiv(h, LOGITS_SPLIT_K)
    part = out if splits == 1 else torch.empty(splits, rows, experts, dtype=torch.float32, device=out.device)
    grid = (triton.cdiv(rows, LOGITS_BM), triton.cdiv(experts, LOGITS_BE), splits)
    _router_logits_kernel[grid](hidden, weight, part, rows, h, experts, hidden.stride(0), weight.stride(0),
                                rows * experts, experts, LOGITS_SPLIT_K, LOGITS_BM, LOGITS_BE, LOGITS_BK)
    if splits > 1:
        count = rows * experts
        _sum_splits_kernel[(triton.cdiv(count, REDUCE_BLOCK),)](part, out, count, splits, REDUCE_BLOCK)
    return out
