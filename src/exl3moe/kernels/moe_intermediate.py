"""The MoE intermediate's fp16 rows: each complete fp32 row of h32 (down's rotated input, written by gate/up's column
programs) times a power of two 2^-e chosen from the row's max |value| as row_scale.py chooses it (e = 0 for ordinary
rows, so they keep their bytes), stored as fp16 h_rot with 2^-e in h_scale; down undoes it after svh.

Grid (route block,): the rows down reads, selected as down selects them, each independently of the others.
"""

import torch
import triton
import triton.language as tl

from .moe_experts import _block_rows
from .row_scale import MAX_EXPONENT, ROW_SAFE_HIGH, ROW_SAFE_LOW, ROW_TARGET, scale_for_exponent

# Columns per step of a row: one output Hadamard block.
CHUNK = tl.constexpr(128)


@triton.jit
def moe_intermediate_kernel(h32_ptr, h_rot_ptr, h_scale_ptr, block_expert_ptr, block_start_ptr, offsets_ptr,
                            sorted_slots_ptr, num_rows, inter_size, ROUTED: tl.constexpr, BM: tl.constexpr,
                            LOW: tl.constexpr, HIGH: tl.constexpr, TARGET: tl.constexpr, MAX_E: tl.constexpr):
    expert, pos, row_mask, slot = _block_rows(tl.program_id(0), block_expert_ptr, block_start_ptr, offsets_ptr,
                                              sorted_slots_ptr, num_rows, BM, ROUTED)
    if expert >= 0:
        rows = pos.to(tl.int64)[:, None] * inter_size
        c = tl.arange(0, CHUNK)
        biggest = tl.zeros((BM,), dtype=tl.float32)
        for k0 in range(0, inter_size, CHUNK):
            h = tl.load(h32_ptr + rows + (k0 + c)[None, :], mask=row_mask[:, None], other=0.0)
            biggest = tl.maximum(biggest, tl.max(tl.abs(h), axis=1))
        exponent = tl.floor(tl.log2(tl.maximum(biggest, 1e-38)))
        scale = scale_for_exponent(exponent, biggest == 0.0, LOW, HIGH, TARGET, MAX_E)
        for k0 in range(0, inter_size, CHUNK):
            h = tl.load(h32_ptr + rows + (k0 + c)[None, :], mask=row_mask[:, None], other=0.0)
            tl.store(h_rot_ptr + rows + (k0 + c)[None, :], (h * scale[:, None]).to(tl.float16),
                     mask=row_mask[:, None])
        tl.store(h_scale_ptr + pos, scale, mask=row_mask)


def moe_intermediate(h32: torch.Tensor, h_rot: torch.Tensor, h_scale: torch.Tensor, route, num_rows: int,
                     grid_blocks: int, routed: bool, block_m: int, inter_size: int) -> None:
    """h_rot [rows, I] fp16 and h_scale [rows] fp32 <- the rows of h32 [rows, I] fp32 that down reads (same `route`
    convention as moe_experts.moe_gate_up). No validation."""
    block_expert, block_start, offsets, sorted_slots = route
    moe_intermediate_kernel[(grid_blocks,)](h32, h_rot, h_scale, block_expert, block_start, offsets, sorted_slots,
                                            num_rows, inter_size, ROUTED=routed, BM=block_m, LOW=ROW_SAFE_LOW,
                                            HIGH=ROW_SAFE_HIGH, TARGET=ROW_TARGET, MAX_E=MAX_EXPONENT, num_warps=4)
