"""Deterministic MoE combine: out[t] = sum_j weight[t, j] * y[t * top_k + j] (+ shared[t]), in slot order.

fp32 accumulation over j = 0, 1, ..., top_k - 1 in order, then the shared expert's row, written once in
out's dtype. Slots whose id lies outside [0, E) contribute nothing: their y row is never read and their
weight is never multiplied (so a nan weight on a remote expert is harmless). No atomics: a token's bytes
depend only on its own ids, weights and y rows.
"""

import torch
import triton
import triton.language as tl

# Outputs per program (tokens x columns) and its warps: a whole 2048-wide row per program reads y fastest.
BLOCK_ELEMENTS, WARPS = 2048, 8


@triton.jit
def moe_combine_kernel(ids_ptr, weights_ptr, y_ptr, shared_ptr, out_ptr, num_tokens, num_experts, hidden_size,
                       stride_out, TOP_K: tl.constexpr, HAS_SHARED: tl.constexpr, BT: tl.constexpr,
                       BC: tl.constexpr):
    pid_t = tl.program_id(0)
    pid_c = tl.program_id(1)
    token = pid_t * BT + tl.arange(0, BT)
    cols = pid_c * BC + tl.arange(0, BC)
    live = token < num_tokens
    acc = tl.zeros((BT, BC), dtype=tl.float32)
    for j in tl.static_range(TOP_K):
        slot = token.to(tl.int64) * TOP_K + j
        ids = tl.load(ids_ptr + slot, mask=live, other=-1)
        valid = live & (ids >= 0) & (ids < num_experts)
        weight = tl.where(valid, tl.load(weights_ptr + slot, mask=valid, other=0.0).to(tl.float32), 0.0)
        y = tl.load(y_ptr + slot[:, None] * hidden_size + cols[None, :], mask=valid[:, None], other=0.0)
        acc += weight[:, None] * y
    if HAS_SHARED:
        acc += tl.load(shared_ptr + token.to(tl.int64)[:, None] * hidden_size + cols[None, :], mask=live[:, None],
                       other=0.0)
    out = out_ptr + token.to(tl.int64)[:, None] * stride_out + cols[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=live[:, None])


def moe_combine(topk_ids: torch.Tensor, topk_weights: torch.Tensor, y: torch.Tensor, shared: torch.Tensor | None,
                out: torch.Tensor, num_experts: int) -> torch.Tensor:
    """out [T, H] <- weighted slot-order sum of y [>= T*top_k, H] fp32 (+ shared [>= T, H] fp32). No validation."""
    tokens, top_k = topk_ids.shape
    hidden = out.shape[1]
    block_cols = min(BLOCK_ELEMENTS, hidden & -hidden)   # the largest power of two dividing the hidden size
    grid = (triton.cdiv(tokens, BLOCK_ELEMENTS // block_cols), hidden // block_cols)
    moe_combine_kernel[grid](topk_ids, topk_weights, y, shared if shared is not None else y, out, tokens,
                             num_experts, hidden, out.stride(0), TOP_K=top_k, HAS_SHARED=shared is not None,
                             BT=BLOCK_ELEMENTS // block_cols, BC=block_cols, num_warps=WARPS)
    return out
