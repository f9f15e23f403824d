"""Wide and narrow route blocks: each expert's rows split between blocks of two sizes, on the device.

After `route_pack` has written `counts` and `offsets`, `route_split` gives expert e with r rows `a` wide blocks
(`wide_m` rows each, from offsets[e]) and then `b` narrow blocks (`narrow_m` rows each, from offsets[e] + wide_m a),
the pair of least cost wide_cost a + narrow_cost b that covers r rows with no empty block. A wide block decodes its
weights once for more rows but costs more than a narrow one, so an expert of 129-192 rows takes one wide block where
it would take two narrow ones, an expert of up to 128 rows (or 193-256) keeps narrow blocks, and 257-320 rows take
one of each. It writes two block tables, each as route_pack's (`*_expert` -1 and `*_start` N past the live
entries, blocks in expert order or in `expert_order`), so one kernel of each block size can run its own table.
No host sync, no atomics, one program: it can be captured in a CUDA graph, and the tables never change a row's
bytes (the kernels of either size sum every row in the same order).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .route_pack import BLOCK_TABLE_TILE

WIDE_ROWS, NARROW_ROWS = 192, 128
# Relative cost of a 192- and a 128-row block on the H200 (~1.2x with two consumer warpgroups busy, ~1.45x with
# three); any ratio from 1.05 to 1.5 chooses the same blocks for every row count.
WIDE_COST, NARROW_COST = 5, 4


def route_split_max_blocks(num_slots: int, num_experts: int, wide_m: int = WIDE_ROWS,
                           narrow_m: int = NARROW_ROWS) -> tuple:
    """(wide, narrow) table lengths that always suffice: only experts of more than narrow_m rows take wide blocks,
    never more than (rows + wide_m - narrow_m - 1) // wide_m nor one per narrow_m + 1 rows; an expert takes at most
    two narrow blocks, two only past narrow_m rows."""
    big = min(num_experts, num_slots // (narrow_m + 1))
    wide = min(num_slots // (narrow_m + 1), (num_slots + (wide_m - narrow_m - 1) * big) // wide_m)
    narrow = min(min(num_experts, num_slots) + big, triton.cdiv(num_slots, narrow_m) + min(num_experts, num_slots))
    return wide, narrow


@triton.jit
def _fill_unused(expert_ptr, start_ptr, first_unused, length, num_slots, TILE: tl.constexpr):
    """Entries [first_unused, length): expert -1, start num_slots."""
    for tile in range(first_unused, length, TILE):
        entry = tile + tl.arange(0, TILE)
        tl.store(expert_ptr + entry, tl.full([TILE], -1, tl.int32), mask=entry < length)
        tl.store(start_ptr + entry, tl.full([TILE], 0, tl.int32) + num_slots, mask=entry < length)


@triton.jit
def _route_split_kernel(
    counts_ptr, offsets_ptr, order_ptr, wide_expert_ptr, wide_start_ptr, narrow_expert_ptr, narrow_start_ptr,
    num_experts, num_slots, wide_blocks, narrow_blocks,
    EXPERTS_PAD: tl.constexpr, WIDE_M: tl.constexpr, NARROW_M: tl.constexpr, WIDE_COST_: tl.constexpr,
    NARROW_COST_: tl.constexpr, TILE: tl.constexpr, ORDERED: tl.constexpr,
):
    """Both block tables in one program: each expert's blocks scattered from its place in the block order."""
    position = tl.arange(0, EXPERTS_PAD)
    real = position < num_experts
    if ORDERED:
        expert = tl.load(order_ptr + position, mask=real, other=0)
    else:
        expert = position
    rows = tl.where(real, tl.load(counts_ptr + expert, mask=real, other=0), 0)
    wide = (rows + WIDE_M - 1) // WIDE_M
    best_cost = WIDE_COST_ * wide
    for narrow in tl.static_range(1, 3):
        fewer = (tl.maximum(rows - NARROW_M * narrow, 0) + WIDE_M - 1) // WIDE_M
        cost = WIDE_COST_ * fewer + NARROW_COST_ * narrow
        better = cost < best_cost
        wide = tl.where(better, fewer, wide)
        best_cost = tl.where(better, cost, best_cost)
    narrow = (tl.maximum(rows - WIDE_M * wide, 0) + NARROW_M - 1) // NARROW_M
    first_row = tl.load(offsets_ptr + expert, mask=real, other=0)
    wide_first = tl.cumsum(wide, 0) - wide
    for j in range(0, tl.max(wide, 0)):
        entry = wide_first + j
        live = real & (j < wide) & (entry < wide_blocks)
        tl.store(wide_expert_ptr + entry, expert, mask=live)
        tl.store(wide_start_ptr + entry, first_row + WIDE_M * j, mask=live)
    narrow_first = tl.cumsum(narrow, 0) - narrow
    for j in tl.static_range(2):
        entry = narrow_first + j
        live = real & (j < narrow) & (entry < narrow_blocks)
        tl.store(narrow_expert_ptr + entry, expert, mask=live)
        tl.store(narrow_start_ptr + entry, first_row + WIDE_M * wide + NARROW_M * j, mask=live)
    _fill_unused(wide_expert_ptr, wide_start_ptr, tl.sum(wide, 0), wide_blocks, num_slots, TILE)
    _fill_unused(narrow_expert_ptr, narrow_start_ptr, tl.sum(narrow, 0), narrow_blocks, num_slots, TILE)


def route_split(counts: torch.Tensor, offsets: torch.Tensor, num_slots: int, wide_expert: torch.Tensor,
                wide_start: torch.Tensor, narrow_expert: torch.Tensor, narrow_start: torch.Tensor,
                expert_order: torch.Tensor | None = None, wide_m: int = WIDE_ROWS, narrow_m: int = NARROW_ROWS) -> None:
    """Launch the wide and narrow block tables from route_pack's counts [E+1] and offsets [E+2] of num_slots slots;
    validates nothing. Tables of at least route_split_max_blocks(num_slots, E) entries; expert_order as
    route_pack's."""
    num_experts = counts.numel() - 1
    ordered = expert_order is not None
    _route_split_kernel[(1,)](
        counts, offsets, expert_order if ordered else counts, wide_expert, wide_start, narrow_expert, narrow_start,
        num_experts, num_slots, wide_expert.numel(), narrow_expert.numel(),
        EXPERTS_PAD=triton.next_power_of_2(num_experts + 2), WIDE_M=wide_m, NARROW_M=narrow_m, WIDE_COST_=WIDE_COST,
        NARROW_COST_=NARROW_COST, TILE=BLOCK_TABLE_TILE, ORDERED=ordered, num_warps=4,
    )
