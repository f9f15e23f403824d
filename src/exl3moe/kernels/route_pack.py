"""Device route packing for the fused MoE: expert histogram, offsets, stable expert-sorted slots, route blocks.

Given `topk_ids` [T, top_k] (int32 or int64, any values, contiguous), with N = T*top_k flat slots
(slot s = token*top_k + k) and E experts, `route_pack` writes into caller-provided int32 buffers:

- `counts` [E+1]: rows routed to each expert; bucket E counts every id outside [0, E) (negative too).
- `offsets` [E+2]: exclusive prefix sum of counts; offsets[E] = rows of real experts, offsets[E+1] = N.
- `sorted_slots` [N]: the flat slots ordered by expert id, stable (equal to
  torch.argsort(mapped_ids, stable=True) with invalid ids mapped to E), so expert e owns
  sorted_slots[offsets[e]:offsets[e+1]] in token order and the sentinel rows come last.
- Route blocks for the grouped expert kernel, each at most `block_m` rows of one real expert, in
  expert order, or in the order of `expert_order` (a permutation of [0, E): a mixed-width layer lists the
  experts of one format together, so the blocks that share a multiprocessor share their code): expert e
  gets ceil(counts[e] / block_m) blocks. `block_expert` [max_blocks] and
  `block_start` [max_blocks] (row of the block in sorted_slots); `num_blocks` [1]. Entries at and past
  num_blocks hold block_expert = -1 and block_start = N, so a persistent kernel can skip them.
  max_blocks = route_pack_max_blocks(N, E, block_m) = ceil(N/block_m) + min(E, N) is always enough.
- `workspace` [route_pack_workspace_numel(N, E)]: workspace[:E+1] holds the exclusive prefix of block
  counts per expert in block order (workspace[E] = num_blocks); the rest is scratch of the many-slot path.

No host sync and a grid fixed by (N, E), so it can be captured in a CUDA graph. Deterministic (no
atomics). Ids are only used as addresses after being mapped into [0, E], so any value is safe.

Paths (picked on the host from N alone):
- few slots (N <= SMALL_MAX_SLOTS), 1 launch: one program loads every id, histograms, scans, sorts the
  keys id*BLOCK + slot (unique, so the sort is stable) and writes each slot at its sorted position.
- many slots, 3 launches: per-chunk histograms; one program scans them over experts and chunks; each
  chunk sorts its keys and scatters slot s to offsets[id] + (rows of id in earlier chunks) + (rank of s
  among equal ids in its chunk), and fills its share of the block table.
The block table is filled by a binary search of each block index in the block prefix per expert.
The order of the block table never changes a block's rows, so outputs do not depend on it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# Largest N on the one-launch path: a one-program sort of 4096 keys stays register resident, and
# decode / small prefill save two launches (~2-4 us each); the crossover is for a GPU benchmark to set.
SMALL_MAX_SLOTS = 4096
# Slots per chunk on the many-slot path: 32 programs at 4096x8 slots while the one-program scan
# over chunks stays short at 10^5 x 16 slots.
CHUNK_SLOTS = 1024
# Elements of the [chunk rows, experts] tile the scan program reads per step: 32 int32 per thread at
# 8 warps, so one step covers 32 chunks at E = 128 and 8 chunks at E = 512 without spilling.
SCAN_TILE_ELEMENTS = 8192
# Block indices resolved per step of the binary search: a tile wide enough to cover decode in one step.
BLOCK_TABLE_TILE = 256


def route_pack_max_blocks(num_slots: int, num_experts: int, block_m: int) -> int:
    """Upper bound on route blocks: each of the at most min(E, N) experts with rows may waste one partial block."""
    return triton.cdiv(num_slots, block_m) + min(num_experts, num_slots)


def _uses_small_path(num_slots: int, small_max_slots: int) -> bool:
    return num_slots <= small_max_slots


def _sort_warps(keys: int) -> int:
    """Warps for a program sorting `keys` keys: at most 8 keys per thread up to 1024 keys."""
    return 4 if keys <= 1024 else 8


def route_pack_workspace_numel(
    num_slots: int, num_experts: int, small_max_slots: int = SMALL_MAX_SLOTS, chunk_slots: int = CHUNK_SLOTS
) -> int:
    """int32 elements of workspace `route_pack` needs: block prefix [E+1], plus two [chunks, E+1] tables."""
    if _uses_small_path(num_slots, small_max_slots):
        return num_experts + 1
    return (num_experts + 1) * (1 + 2 * triton.cdiv(num_slots, chunk_slots))


@triton.jit
def _mapped_ids(ids_ptr, slot, num_slots, num_experts):
    """Expert ids of the given slots as int32 in [0, E]; E for invalid ids, E+1 for slots past N."""
    in_range = slot < num_slots
    raw = tl.load(ids_ptr + slot, mask=in_range, other=0)
    valid = (raw >= 0) & (raw < num_experts)
    mapped = tl.where(valid, raw, num_experts).to(tl.int32)
    return tl.where(in_range, mapped, num_experts + 1)


@triton.jit
def _compare_and_swap(x, flip, dim: tl.constexpr, LOG2_N: tl.constexpr):
    """One bitonic step: partners 2**(LOG2_N - dim - 1) apart; the right one takes the max unless flipped."""
    shape: tl.constexpr = [2**dim, 2, 2 ** (LOG2_N - dim - 1)]
    pairs = tl.reshape(x, shape)
    smaller = tl.broadcast_to(tl.min(pairs, 1)[:, None, :], shape)
    larger = tl.broadcast_to(tl.max(pairs, 1)[:, None, :], shape)
    is_right = tl.broadcast_to(tl.arange(0, 2)[None, :, None], shape)
    takes_larger = is_right ^ tl.reshape(flip, shape)
    return tl.reshape(tl.where(takes_larger != 0, larger, smaller), x.shape)


@triton.jit
def _run_direction(LOG2_N: tl.constexpr, STAGE: tl.constexpr):
    """1 where an element's run of 2**STAGE sorts descending: runs alternate so pairs of runs are bitonic."""
    shape: tl.constexpr = [2 ** (LOG2_N - 1 - STAGE), 2, 2**STAGE]
    return tl.reshape(tl.broadcast_to(tl.arange(0, 2)[None, :, None], shape), [2**LOG2_N])


@triton.jit
def _sort_ascending(x, LOG2_N: tl.constexpr):
    """Bitonic sort of a 1-D tensor of 2**LOG2_N distinct ints (min/max steps, so ties need no care)."""
    for stage in tl.static_range(1, LOG2_N + 1):
        if stage < LOG2_N:
            flip = _run_direction(LOG2_N, stage)
        else:
            flip = tl.zeros(x.shape, dtype=tl.int32)
        for step in tl.static_range(stage):
            x = _compare_and_swap(x, flip, LOG2_N - stage + step, LOG2_N)
    return x


@triton.jit
def _fill_block_table(
    block_prefix_ptr, offsets_ptr, block_expert_ptr, block_start_ptr, order_ptr, num_experts, num_slots,
    block_begin, block_end,
    BLOCK_M: tl.constexpr, TILE: tl.constexpr, SEARCH_STEPS: tl.constexpr, ORDERED: tl.constexpr,
):
    """Block table entries [block_begin, block_end) from the block prefix (per position of the block order)
    and row offsets in global memory."""
    total_blocks = tl.load(block_prefix_ptr + num_experts)
    for tile_begin in range(block_begin, block_end, TILE):
        block = tile_begin + tl.arange(0, TILE)
        # Largest position e with block_prefix[e] <= block; hi stays <= E so every load is in bounds.
        lo = tl.zeros([TILE], dtype=tl.int32)
        hi = lo + num_experts
        for _ in tl.static_range(SEARCH_STEPS):
            mid = (lo + hi) // 2
            go_right = tl.load(block_prefix_ptr + mid) <= block
            lo = tl.where(go_right, mid, lo)
            hi = tl.where(go_right, hi, mid)
        first_block = tl.load(block_prefix_ptr + lo)
        if ORDERED:
            expert = tl.load(order_ptr + lo, mask=lo < num_experts, other=num_experts)
        else:
            expert = lo
        row_start = tl.load(offsets_ptr + expert) + (block - first_block) * BLOCK_M
        live = block < total_blocks
        in_range = block < block_end
        tl.store(block_expert_ptr + block, tl.where(live, expert, -1), mask=in_range)
        tl.store(block_start_ptr + block, tl.where(live, row_start, num_slots), mask=in_range)


@triton.jit
def _store_offsets_and_block_prefix(
    bucket_counts, counts_ptr, offsets_ptr, block_prefix_ptr, num_blocks_ptr, order_ptr, num_experts,
    BLOCK_M: tl.constexpr, EXPERTS_PAD: tl.constexpr, ORDERED: tl.constexpr,
):
    """From counts per bucket (zero past E): store counts, offsets, block prefix per position of the block
    order, num_blocks."""
    bucket = tl.arange(0, EXPERTS_PAD)
    tl.store(counts_ptr + bucket, bucket_counts, mask=bucket <= num_experts)
    tl.store(offsets_ptr + bucket, tl.cumsum(bucket_counts, 0) - bucket_counts, mask=bucket <= num_experts + 1)
    if ORDERED:
        # Counts of the experts in block order, read back from the counts this program just stored.
        tl.debug_barrier()
        real = bucket < num_experts
        expert = tl.load(order_ptr + bucket, mask=real, other=0)
        bucket_counts = tl.load(counts_ptr + expert, mask=real, other=0)
    blocks = tl.where(bucket < num_experts, (bucket_counts + BLOCK_M - 1) // BLOCK_M, 0)
    tl.store(block_prefix_ptr + bucket, tl.cumsum(blocks, 0) - blocks, mask=bucket <= num_experts)
    tl.store(num_blocks_ptr, tl.sum(blocks, 0))


@triton.jit
def _route_pack_single_kernel(
    ids_ptr, counts_ptr, offsets_ptr, sorted_slots_ptr, block_expert_ptr, block_start_ptr, num_blocks_ptr,
    block_prefix_ptr, order_ptr, num_slots, num_experts, max_blocks,
    BLOCK: tl.constexpr, LOG2_BLOCK: tl.constexpr, EXPERTS_PAD: tl.constexpr, BLOCK_M: tl.constexpr,
    TABLE_TILE: tl.constexpr, SEARCH_STEPS: tl.constexpr, ORDERED: tl.constexpr,
):
    """Whole route pack in one program for N <= BLOCK."""
    slot = tl.arange(0, BLOCK)
    mapped = _mapped_ids(ids_ptr, slot, num_slots, num_experts)
    bucket_counts = tl.histogram(mapped, EXPERTS_PAD)
    bucket_counts = tl.where(tl.arange(0, EXPERTS_PAD) <= num_experts, bucket_counts, 0)
    _store_offsets_and_block_prefix(
        bucket_counts, counts_ptr, offsets_ptr, block_prefix_ptr, num_blocks_ptr, order_ptr, num_experts, BLOCK_M,
        EXPERTS_PAD, ORDERED,
    )
    # Keys are unique, so the sort is stable; padding (id E+1) sorts past every real slot.
    sorted_keys = _sort_ascending(mapped * BLOCK + slot, LOG2_BLOCK)
    tl.store(sorted_slots_ptr + slot, sorted_keys % BLOCK, mask=slot < num_slots)
    # The block table reads back offsets and the block prefix this program just stored.
    tl.debug_barrier()
    _fill_block_table(
        block_prefix_ptr, offsets_ptr, block_expert_ptr, block_start_ptr, order_ptr, num_experts, num_slots,
        0, max_blocks, BLOCK_M, TABLE_TILE, SEARCH_STEPS, ORDERED,
    )


@triton.jit
def _chunk_histogram_kernel(
    ids_ptr, chunk_counts_ptr, num_slots, num_experts, CHUNK: tl.constexpr, EXPERTS_PAD: tl.constexpr
):
    """chunk_counts[c, e] = slots of chunk c routed to bucket e, for e in [0, E]."""
    chunk = tl.program_id(0)
    mapped = _mapped_ids(ids_ptr, chunk * CHUNK + tl.arange(0, CHUNK), num_slots, num_experts)
    bucket = tl.arange(0, EXPERTS_PAD)
    row_ptr = chunk_counts_ptr + chunk * (num_experts + 1)
    tl.store(row_ptr + bucket, tl.histogram(mapped, EXPERTS_PAD), mask=bucket <= num_experts)


@triton.jit
def _chunk_scan_kernel(
    chunk_counts_ptr, chunk_base_ptr, counts_ptr, offsets_ptr, block_prefix_ptr, num_blocks_ptr, order_ptr,
    num_chunks, num_experts,
    EXPERTS_PAD: tl.constexpr, SCAN_ROWS: tl.constexpr, BLOCK_M: tl.constexpr, ORDERED: tl.constexpr,
):
    """Counts, offsets, block prefix, and chunk_base[c, e] = offsets[e] + (rows of e in chunks before c)
    - (rows of buckets below e in chunk c): the slot at sorted position p of chunk c goes to row
    chunk_base[c, id] + p."""
    bucket = tl.arange(0, EXPERTS_PAD)
    row = tl.arange(0, SCAN_ROWS)
    stride = num_experts + 1
    in_bucket = bucket <= num_experts
    totals = tl.zeros([EXPERTS_PAD], dtype=tl.int32)
    for row_begin in range(0, num_chunks, SCAN_ROWS):
        tile_mask = ((row_begin + row) < num_chunks)[:, None] & in_bucket[None, :]
        tile_ptr = chunk_counts_ptr + (row_begin + row)[:, None] * stride + bucket[None, :]
        totals += tl.sum(tl.load(tile_ptr, mask=tile_mask, other=0), 0)
    _store_offsets_and_block_prefix(
        totals, counts_ptr, offsets_ptr, block_prefix_ptr, num_blocks_ptr, order_ptr, num_experts, BLOCK_M,
        EXPERTS_PAD, ORDERED,
    )
    # offsets[e] + rows of bucket e in the chunks before this tile.
    running = tl.cumsum(totals, 0) - totals
    for row_begin in range(0, num_chunks, SCAN_ROWS):
        tile_mask = ((row_begin + row) < num_chunks)[:, None] & in_bucket[None, :]
        tile_offset = (row_begin + row)[:, None] * stride + bucket[None, :]
        tile = tl.load(chunk_counts_ptr + tile_offset, mask=tile_mask, other=0)
        rows_in_earlier_chunks = tl.cumsum(tile, 0) - tile
        rows_of_lower_buckets_in_chunk = tl.cumsum(tile, 1) - tile
        base = running[None, :] + rows_in_earlier_chunks - rows_of_lower_buckets_in_chunk
        tl.store(chunk_base_ptr + tile_offset, base, mask=tile_mask)
        running += tl.sum(tile, 0)


@triton.jit
def _chunk_scatter_kernel(
    ids_ptr, chunk_base_ptr, sorted_slots_ptr, offsets_ptr, block_prefix_ptr, block_expert_ptr,
    block_start_ptr, order_ptr, num_slots, num_experts, max_blocks, blocks_per_program,
    CHUNK: tl.constexpr, LOG2_CHUNK: tl.constexpr, BLOCK_M: tl.constexpr,
    TABLE_TILE: tl.constexpr, SEARCH_STEPS: tl.constexpr, ORDERED: tl.constexpr,
):
    """Stable scatter of one chunk's slots to their sorted rows, then this program's share of the block table."""
    chunk = tl.program_id(0)
    local = tl.arange(0, CHUNK)
    mapped = _mapped_ids(ids_ptr, chunk * CHUNK + local, num_slots, num_experts)
    # Unique keys: equal ids keep slot order; padding (id E+1) sorts past every real slot.
    sorted_keys = _sort_ascending(mapped * CHUNK + local, LOG2_CHUNK)
    sorted_ids = sorted_keys // CHUNK
    live = chunk * CHUNK + local < num_slots
    base = tl.load(chunk_base_ptr + chunk * (num_experts + 1) + sorted_ids, mask=live, other=0)
    tl.store(sorted_slots_ptr + base + local, chunk * CHUNK + sorted_keys % CHUNK, mask=live)
    block_begin = chunk * blocks_per_program
    block_end = tl.minimum(block_begin + blocks_per_program, max_blocks)
    _fill_block_table(
        block_prefix_ptr, offsets_ptr, block_expert_ptr, block_start_ptr, order_ptr, num_experts, num_slots,
        block_begin, block_end, BLOCK_M, TABLE_TILE, SEARCH_STEPS, ORDERED,
    )


def route_pack(
    topk_ids: torch.Tensor,
    num_experts: int,
    counts: torch.Tensor,
    offsets: torch.Tensor,
    sorted_slots: torch.Tensor,
    block_expert: torch.Tensor,
    block_start: torch.Tensor,
    num_blocks: torch.Tensor,
    workspace: torch.Tensor,
    block_m: int = 16,
    small_max_slots: int = SMALL_MAX_SLOTS,
    chunk_slots: int = CHUNK_SLOTS,
    expert_order: torch.Tensor | None = None,
) -> None:
    """Launch route packing into the given int32 buffers (see the module docstring); validates nothing.

    Buffers: counts [E+1], offsets [E+2], sorted_slots [N], block_expert and block_start [max_blocks]
    with max_blocks >= route_pack_max_blocks(N, E, block_m), num_blocks [1], workspace of at least
    route_pack_workspace_numel(N, E, small_max_slots, chunk_slots) elements. topk_ids contiguous;
    block_m a multiple of 16, chunk_slots a power of two; sort keys are int32, so (E+2) * max(next_pow2(N) on the
    one-launch path, chunk_slots) must stay below 2**31. The grid depends on N and E only. `expert_order`:
    None, or an int32 permutation of [0, E) on the ids' device, the order of the block table.
    """
    ordered = expert_order is not None
    order = expert_order if ordered else counts  # any int32 pointer: never read without ORDERED
    num_slots = topk_ids.numel()
    max_blocks = block_expert.numel()
    experts_pad = triton.next_power_of_2(num_experts + 2)
    search_steps = max(1, (num_experts - 1).bit_length())
    block_prefix = workspace[: num_experts + 1]
    if _uses_small_path(num_slots, small_max_slots):
        block = max(16, triton.next_power_of_2(num_slots))
        _route_pack_single_kernel[(1,)](
            topk_ids, counts, offsets, sorted_slots, block_expert, block_start, num_blocks, block_prefix, order,
            num_slots, num_experts, max_blocks,
            BLOCK=block, LOG2_BLOCK=block.bit_length() - 1, EXPERTS_PAD=experts_pad, BLOCK_M=block_m,
            TABLE_TILE=BLOCK_TABLE_TILE, SEARCH_STEPS=search_steps, ORDERED=ordered, num_warps=_sort_warps(block),
        )
        return
    num_chunks = triton.cdiv(num_slots, chunk_slots)
    table_numel = num_chunks * (num_experts + 1)
    chunk_counts = workspace[num_experts + 1 : num_experts + 1 + table_numel]
    chunk_base = workspace[num_experts + 1 + table_numel : num_experts + 1 + 2 * table_numel]
    _chunk_histogram_kernel[(num_chunks,)](
        topk_ids, chunk_counts, num_slots, num_experts, CHUNK=chunk_slots, EXPERTS_PAD=experts_pad
    )
    _chunk_scan_kernel[(1,)](
        chunk_counts, chunk_base, counts, offsets, block_prefix, num_blocks, order, num_chunks, num_experts,
        EXPERTS_PAD=experts_pad, SCAN_ROWS=max(1, SCAN_TILE_ELEMENTS // experts_pad), BLOCK_M=block_m,
        ORDERED=ordered, num_warps=8,
    )
    _chunk_scatter_kernel[(num_chunks,)](
        topk_ids, chunk_base, sorted_slots, offsets, block_prefix, block_expert, block_start, order,
        num_slots, num_experts, max_blocks, triton.cdiv(max_blocks, num_chunks),
        CHUNK=chunk_slots, LOG2_CHUNK=chunk_slots.bit_length() - 1, BLOCK_M=block_m,
        TABLE_TILE=BLOCK_TABLE_TILE, SEARCH_STEPS=search_steps, ORDERED=ordered, num_warps=_sort_warps(chunk_slots),
    )
