"""A router's fp32 logits hidden @ weight.T, each row's sums in an order fixed by the shapes alone (fp32 FMAs over
k in fixed chunks), so that a token's logits, and so its routing, never depend on the tokens beside it."""

import torch
import triton
import triton.language as tl

LOGITS_BM, LOGITS_BE, LOGITS_BK = 16, 64, 64


@triton.jit(do_not_specialize=["rows"])
def _router_logits_kernel(h_ptr, w_ptr, out_ptr, rows, hidden, experts, stride_h, stride_w, stride_o,
                          BM: tl.constexpr, BE: tl.constexpr, BK: tl.constexpr):
    r = tl.program_id(0) * BM + tl.arange(0, BM)
    e = tl.program_id(1) * BE + tl.arange(0, BE)
    ks = tl.arange(0, BK)
    acc = tl.zeros((BM, BE), dtype=tl.float32)
    for k0 in range(0, hidden, BK):
        k = k0 + ks
        h = tl.load(h_ptr + r.to(tl.int64)[:, None] * stride_h + k[None, :],
                    mask=(r < rows)[:, None] & (k < hidden)[None, :], other=0.0).to(tl.float32)
        w = tl.load(w_ptr + e.to(tl.int64)[None, :] * stride_w + k[:, None],
                    mask=(e < experts)[None, :] & (k < hidden)[:, None], other=0.0).to(tl.float32)
        acc = tl.dot(h, w, acc, input_precision="ieee")
    tl.store(out_ptr + r.to(tl.int64)[:, None] * stride_o + e[None, :], acc,
             mask=(r < rows)[:, None] & (e < experts)[None, :])


def router_logits_kernel(hidden: torch.Tensor, weight: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """out [T, E] fp32 <- hidden [T, H] @ weight [E, H].T (rows with unit column stride)."""
    rows, h = hidden.shape
    experts = weight.shape[0]
    grid = (triton.cdiv(rows, LOGITS_BM), triton.cdiv(experts, LOGITS_BE))
    _router_logits_kernel[grid](hidden, weight, out, rows, h, experts, hidden.stride(0), weight.stride(0),
                                out.stride(0), LOGITS_BM, LOGITS_BE, LOGITS_BK)
    return out
