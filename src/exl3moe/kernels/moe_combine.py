"""Deterministic MoE combine: out[t] = sum_j weight[t, j] * y[t * top_k + j] (+ shared[t]), in slot order.

fp32 accumulation over j = 0, 1, ..., top_k - 1 in order, then the shared expert's row, written once in
out's dtype. Slots whose id lies outside [0, E) contribute nothing: their y row is never read and their
weight is never multiplied (so a nan weight on a remote expert is harmless). No atomics: a token's bytes
depend only on its own ids, weights and y rows.
"""

import torch
import triton
import triton.language as tl

# Slot rows in flight per program: top_k x tokens x 128 fp32 at 64 slot rows stays unspilled (sm_90 cuobjdump).
SLOT_ROWS_PER_PROGRAM = 64
# Columns per program: one 128-wide block, the unit every hidden size here is a multiple of.
BLOCK_COLS = 128


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
    block_tokens = max(1, min(16, SLOT_ROWS_PER_PROGRAM // triton.next_power_of_2(top_k)))
    grid = (triton.cdiv(tokens, block_tokens), hidden // BLOCK_COLS)
    moe_combine_kernel[grid](topk_ids, topk_weights, y, shared if shared is not None else y, out, tokens,
                             num_experts, hidden, out.stride(0), TOP_K=top_k, HAS_SHARED=shared is not None,
                             BT=block_tokens, BC=BLOCK_COLS)
    return out
