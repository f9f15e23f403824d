"""Split rules for EXL3 weights: a quantized linear can only be cut along whole 128-wide Hadamard blocks.

A column shard keeps its 128-column groups with their svh (and bias); every rank's output is a slice of the
whole output. A row shard keeps its 128-row groups with their suh; the ranks' outputs are partial sums whose sum is
the whole output, and the bias stays with rank 0 so that it is added once.
"""

from __future__ import annotations

from ..format.hadamard import HAD as HADAMARD_SIZE
from ..format.shards import shard_range, shard_ranges
from ..format.weight import EXL3Weight

TILES_PER_BLOCK = HADAMARD_SIZE // 16


def block_ranges(blocks: int, world: int, name: str) -> list:
    """[(first, stop)] 128-wide blocks of each rank, in rank order: the first `blocks % world` ranks hold one more."""
    return shard_ranges(blocks, world, name, f"blocks of {HADAMARD_SIZE}")


def _rank_range(blocks: int, rank: int, world: int, name: str) -> tuple:
    return shard_range(blocks, rank, world, name, f"blocks of {HADAMARD_SIZE}")


def column_slice(w: EXL3Weight, first: int, stop: int) -> EXL3Weight:
    """Output columns of blocks first..stop-1 of `w` (whole 128-column groups with their svh and bias)."""
    w.ensure_valid()
    cols = slice(first * HADAMARD_SIZE, stop * HADAMARD_SIZE)
    tiles = slice(first * TILES_PER_BLOCK, stop * TILES_PER_BLOCK)
    bias = None if w.bias is None else w.bias[cols].contiguous()
    return w.replace(trellis=w.trellis[:, tiles].contiguous(), svh=w.svh[cols].contiguous(), bias=bias,
                     name=f"{w.name}[columns {cols.start}:{cols.stop}]")


def row_slice(w: EXL3Weight, first: int, stop: int) -> EXL3Weight:
    """Input rows of blocks first..stop-1 of `w` (whole 128-row groups with their suh); the bias stays with the
    slice that starts at row 0."""
    w.ensure_valid()
    rows = slice(first * HADAMARD_SIZE, stop * HADAMARD_SIZE)
    tiles = slice(first * TILES_PER_BLOCK, stop * TILES_PER_BLOCK)
    return w.replace(trellis=w.trellis[tiles].contiguous(), suh=w.suh[rows].contiguous(),
                     bias=w.bias if first == 0 else None, name=f"{w.name}[rows {rows.start}:{rows.stop}]")


def column_shard(w: EXL3Weight, rank: int, world: int) -> EXL3Weight:
    """Rank `rank`'s output columns of `w` (whole 128-column groups with their svh and bias)."""
    w.ensure_valid()
    return column_slice(w, *_rank_range(w.out_features // HADAMARD_SIZE, rank, world, f"{w.name} (columns)"))


def row_shard(w: EXL3Weight, rank: int, world: int) -> EXL3Weight:
    """Rank `rank`'s input rows of `w` (whole 128-row groups with their suh); the bias stays on rank 0."""
    w.ensure_valid()
    return row_slice(w, *_rank_range(w.in_features // HADAMARD_SIZE, rank, world, f"{w.name} (rows)"))


def input_slice(rank: int, world: int, in_features: int) -> slice:
    """The input columns a row shard of rank `rank` reads (x[:, input_slice(...)])."""
    first, stop = _rank_range(in_features // HADAMARD_SIZE, rank, world, "in_features")
    return slice(first * HADAMARD_SIZE, stop * HADAMARD_SIZE)
