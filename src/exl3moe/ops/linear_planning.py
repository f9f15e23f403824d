"""Which CUDA C++ kernel variant a linear call runs: the k split from (k, n), and from a call's rows the m16 tiles,
whether the kernel rotates x itself, the warp-specialized kernel, clusters, the split reduction and chained launches.

The k split depends on (k, n) only, so a row's bytes never depend on the batch; every other choice here gives the
same bytes either way, so it may depend on anything (rows, the device, the EXL3MOE_* settings).
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass

import torch

from ..kernels import nvrtc
from ..kernels.trellis_mma import CHUNK_K, MAX_CLUSTER, PREFETCH, WARPS, tiles_per_warp, words_per_lane

TARGET_WARPS = 4096  # warps in flight at one row: enough loads outstanding to cover DRAM latency
# Rows up to which the matmul kernel rotates x itself (above, rotate_input does, one launch more): small
# weights are launch-bound, large ones pay for rotating many rows in every block.
FUSED_ROTATION_ROWS_SMALL, FUSED_ROTATION_ROWS_LARGE, SMALL_WEIGHT = 16, 4, 1 << 24
# Grids up to this many blocks sum their splits in a cluster; larger ones keep the L2 reduction (co-scheduling a
# cluster's blocks costs more there than the reduction saves).
CLUSTER_MAX_BLOCKS = 384
ONE_WAVE_MIN_BLOCKS = 7
CHAIN_PREFETCH_KTILES = 8  # trellis words per warp asked of L2 by a chained call on a grid of <= 1 block per SM
WHOLE_SPLIT_PREFETCH, WHOLE_SPLIT_MAX_BLOCKS = CHUNK_K // 16, 512
MAX_CHAINED_ROWS = 128   # calls of up to this many rows chain their launches (above: the dense path)
PROMPT_WS_MAX_ROWS = 512   # calls over 128 rows up to this many run trellis_ws in 128-row blocks (prompt_on_ws)
# Calls from this many rows (x rotated) run on trellis_ws: weights under MID_WEIGHT entries, under SMALL_WEIGHT, larger.
WS_MIN_ROWS, WS_MIN_ROWS_MID, WS_MIN_ROWS_LARGE, MID_WEIGHT = 32, 33, 64, 1 << 22


@dataclass(frozen=True)
class MmaTiles:
    splits: int
    ktiles_per_split: int


def chunk_splits(k: int, busy_warps: int, target_warps: int = TARGET_WARPS) -> tuple:
    """(splits, k-tiles per split) of a k range cut in whole 128-input chunks so that busy_warps x splits reaches
    target_warps; no split is empty."""
    chunks = k // CHUNK_K
    splits = max(1, min(chunks, -(-target_warps // max(1, busy_warps))))
    per_split = -(-chunks // splits)
    return -(-chunks // per_split), per_split * CHUNK_K // 16


def plan_mma(k: int, n: int, target_warps: int = TARGET_WARPS) -> MmaTiles:
    """The linear's k split: (n / 32) warps per split (two n16 tiles per warp at few rows)."""
    return MmaTiles(*chunk_splits(k, n // 32, target_warps))


def m_tiles(rows: int) -> int:
    """m16 tiles per block: 1, 2, 4 or 8 (up to 128 rows)."""
    mt = 1
    while mt * 16 < rows and mt < 8:
        mt *= 2
    return mt


def fuses_rotation(rows: int, k: int, n: int) -> bool:
    """Depends on (k, n) and rows only; both ways give the same bytes."""
    return rows <= (FUSED_ROTATION_ROWS_SMALL if k * n < SMALL_WEIGHT else FUSED_ROTATION_ROWS_LARGE)


def variant_for(rows: int, k: int, n: int) -> tuple:
    """(m16 tiles per block, rotates x in the kernel) of a call with `rows` rows: what run launches."""
    return m_tiles(rows), fuses_rotation(rows, k, n)


def prefetch_for(rows: int, k: int, n: int, K: float, tiles: MmaTiles | None = None) -> int:
    """PF of the planned kernel: a one-chunk split's words all loaded up front where they fit in registers (two words
    per tile) and the grid is small enough for the extra registers (a few blocks per SM); PREFETCH otherwise. tiles:
    the call's split, plan_mma(k, n) when not given."""
    tiles, mt = tiles or plan_mma(k, n), m_tiles(rows)
    blocks = n // (16 * WARPS * tiles_per_warp(mt)) * tiles.splits
    whole = tiles.ktiles_per_split == WHOLE_SPLIT_PREFETCH and mt == 1 and words_per_lane(K) <= 2
    return WHOLE_SPLIT_PREFETCH if whole and blocks <= WHOLE_SPLIT_MAX_BLOCKS else PREFETCH


def cluster_splits(nt: int, splits: int, groups: int, capable: bool = True) -> int:
    """CLUSTER_SPLITS of trellis_mma.cu: the splits of each of `groups` 128-column groups as one cluster that sums
    their partials in shared memory (blocks of 128 columns, 2..MAX_CLUSTER splits, grids of at most
    CLUSTER_MAX_BLOCKS blocks), else 0 (partials via L2); both give the same bytes. EXL3MOE_LINEAR_CLUSTER=0 never
    clusters, =1 wherever the splits fit one cluster. capable: the device has clusters (clusters_on)."""
    mode = os.environ.get("EXL3MOE_LINEAR_CLUSTER")
    if mode == "0" or not capable or WARPS * nt * 16 != 128 or not 2 <= splits <= MAX_CLUSTER:
        return 0
    return splits if mode == "1" or groups * splits <= CLUSTER_MAX_BLOCKS else 0


def clusters_on(device: torch.device) -> bool:
    """Thread-block clusters exist from sm_90."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device)[0] >= 9


def one_wave_min_blocks(fuse_in: bool, prefetch: int, blocks: int, sms: int) -> int:
    """MIN_BLOCKS of trellis_mma.cu: a few-row call that rotates x itself (PF PREFETCH) with more than
    ONE_WAVE_MIN_BLOCKS - 1 and at most ONE_WAVE_MIN_BLOCKS blocks per SM gets registers for that many, so that it
    runs in one wave (ptxas gives some formats 80 registers: 6 per SM); 0 (no bound) otherwise."""
    fits = (ONE_WAVE_MIN_BLOCKS - 1) * sms < blocks <= ONE_WAVE_MIN_BLOCKS * sms
    return ONE_WAVE_MIN_BLOCKS if fuse_in and prefetch == PREFETCH and fits else 0


def launch_bounds(nt: int, fuse_in: bool, prefetch: int, splits: int, groups: int, device: torch.device) -> tuple:
    """(CLUSTER_SPLITS, MIN_BLOCKS) of a trellis_mma call of one row block: `groups` column blocks x `splits`."""
    cluster = cluster_splits(nt, splits, groups, clusters_on(device))
    return cluster, one_wave_min_blocks(fuse_in, prefetch, groups * splits, nvrtc.sm_count(device))


def mma_defers_reduce(mt: int, cluster: int, groups: int, sms: int) -> bool:
    """Whether a trellis_mma call of mt m16 tiles over `groups` (128-column groups x row blocks) leaves its split
    reduction to reduce_splits: from 2 m16 tiles where the groups' last arrivals would occupy under half the SMs
    (measured faster there, slower on one row block of 4096x14336); never where clusters sum the splits.
    EXL3MOE_MMA_SPLIT_REDUCE=0 / 1 forces it off / on (clusters aside). Both give the same bytes."""
    env = os.environ.get("EXL3MOE_MMA_SPLIT_REDUCE")
    return not cluster and env != "0" and (env == "1" or (mt >= 2 and 2 * groups < sms))


@functools.lru_cache(maxsize=None)
def chain_capable(device: torch.device) -> bool:
    """Programmatic dependent launches (griddepcontrol) exist from sm_90."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device)[0] >= 9


def linear_chains(rows: int, device: torch.device) -> bool:
    """Whether a call of `rows` rows (up to MAX_CHAINED_ROWS) launches its kernels as programmatic dependents of the
    kernel before each (sm_90): its first kernel (trellis_mma where it rotates x, else rotate_input) waits for the
    stream's previous kernel before it reads x or writes its workspace, and the matmul and reduce_splits follow the
    same way. Measured 0.74-0.99x back to back over the benchmark shapes at 1-128 rows; 0.98x at 8 rows on the large
    weights where their kernels let dependents launch only as their blocks exit (chain_late; 1.03-1.06x with the
    earlier trigger). EXL3MOE_LINEAR_CHAIN=0 turns it off. Both give the same bytes."""
    return rows <= MAX_CHAINED_ROWS and os.environ.get("EXL3MOE_LINEAR_CHAIN") != "0" and chain_capable(device)


def late_rotation(rows: int) -> bool:
    """Whether a chained call of `rows` rows through rotate_input runs one m16 tile (5..16 rows: weights of 16M
    entries or more rotate up to 4 themselves), whose rotate_input and trellis_mma trigger at exit (chain_late)."""
    return rows <= 16


def chain_late(fuse_in: bool, blocks: int, device: torch.device, rows: int) -> bool:
    """Whether a chained trellis_mma (and its rotate_input) lets dependents launch only as its blocks exit (CHAIN_LATE)
    instead of once they run: calls that rotate x themselves on grids of more than one and at most
    ONE_WAVE_MIN_BLOCKS - 1 blocks per SM, and 5..16 rows after rotate_input. Dependents launched while such a grid
    runs took its SMs unevenly (measured 0.92-1.13x, late 0.97-1.00x)."""
    if not fuse_in:
        return late_rotation(rows)
    sms = nvrtc.sm_count(device)
    return sms < blocks <= (ONE_WAVE_MIN_BLOCKS - 1) * sms


def mma_chain(blocks: int, device: torch.device, rows: int = 1) -> int | None:
    """For a trellis_mma call of `rows` rows that chains (linear_chains), the k-tiles of trellis words its blocks ask
    L2 for before they wait for the previous kernel (CHAIN_KT): 8 on grids of at most one block per SM, none above
    (there the prefetch slowed the running kernel); None for a plain launch."""
    if not linear_chains(rows, device):
        return None
    return CHAIN_PREFETCH_KTILES if blocks <= nvrtc.sm_count(device) else 0


def mma_variant(w, mt: int, fuse_in: bool, prefetch: int, tiles: MmaTiles, device: torch.device,
                nt: int | None = None, row_blocks: int = 1) -> tuple:
    """(nt, cluster, min_blocks, defer, chain, late) of a trellis_mma call of `row_blocks` blocks of mt m16 tiles:
    launch bounds (one row block only), reduce_splits summing its partials, mma_chain's prefetch depth (None for a
    plain launch) and chain_late."""
    nt = nt or tiles_per_warp(mt)
    groups = w.trellis.shape[1] // (WARPS * nt)
    cluster, min_blocks = launch_bounds(nt, fuse_in, prefetch, tiles.splits, groups, device) if row_blocks == 1 \
        else (0, 0)
    defer = mma_defers_reduce(mt, cluster, w.trellis.shape[1] // 8 * row_blocks, nvrtc.sm_count(device))
    blocks = groups * tiles.splits * row_blocks
    chain = mma_chain(blocks, device, 16 * mt)
    late = chain is not None and chain_late(fuse_in, blocks, device, 16 * mt)
    return nt, cluster, min_blocks, defer, chain, late


def uses_ws(rows: int, k: int, n: int, device: torch.device) -> bool:
    """Whether a call of `rows` (<= 128) pre-rotated rows runs on the warp-specialized kernel (sm_90 exactly: it
    uses wgmma; EXL3MOE_WS=0 keeps trellis_mma, EXL3MOE_WS_MIN_ROWS moves the row threshold). Both kernels give the
    same bytes, so the choice may depend on anything."""
    weights = k * n
    default = WS_MIN_ROWS if weights < MID_WEIGHT else WS_MIN_ROWS_MID if weights < SMALL_WEIGHT else WS_MIN_ROWS_LARGE
    min_rows = int(os.environ.get("EXL3MOE_WS_MIN_ROWS") or default)
    return (os.environ.get("EXL3MOE_WS", "1") != "0" and rows >= min_rows and device.type == "cuda"
            and torch.cuda.get_device_capability(device) == (9, 0))


def ws_x_tma(k: int, n: int, K: float, codebook: str, x: torch.Tensor | None = None) -> bool:
    """trellis_ws stages x by TMA (X_TMA) where x's rows are 16-byte aligned (None: rows of a workspace, always),
    for weights of SMALL_WEIGHT entries or more in MUL1 or at K 1, 2, 4 and 8 (smaller weights, and MCG and 3INST
    at K 3, 5 and 6, measured slower with it); EXL3MOE_WS_X_TMA=0 keeps cp.async everywhere, 1 takes TMA
    everywhere."""
    aligned = x is None or (x.data_ptr() % 16 == 0 and x.stride(0) % 8 == 0 and x.stride(1) == 1)
    env = os.environ.get("EXL3MOE_WS_X_TMA")
    measured_faster = k * n >= SMALL_WEIGHT and (codebook == "mul1" or K in (1, 2, 4, 8))
    return aligned and env != "0" and (env == "1" or measured_faster)


def ws_paired(k: int, n: int, splits: int, sms: int) -> bool:
    """trellis_ws with paired producers (one wgmma m64n128k16 per k-tile, WS_PAIRED_STAGES stages) for weights of
    SMALL_WEIGHT entries or more whose blocks each run every split (measured faster there, slower on the other
    shapes); EXL3MOE_WS_PAIRED=0 / 1 forces it either way."""
    env = os.environ.get("EXL3MOE_WS_PAIRED")
    return env != "0" and (env == "1" or (k * n >= SMALL_WEIGHT and ws_whole(splits, n, sms)))


def ws_defers_reduce(splits: int, n: int, sms: int) -> bool:
    """Whether trellis_ws blocks that do not run every split leave the reduction to reduce_splits (many blocks,
    measured faster on every such shape) instead of each column group's last arrival (one block per 128 columns);
    EXL3MOE_WS_SPLIT_REDUCE=0 keeps the last arrival. Both give the same bytes."""
    return not ws_whole(splits, n, sms) and os.environ.get("EXL3MOE_WS_SPLIT_REDUCE") != "0"


def ws_splits_per_block(splits: int, col_blocks: int, sms: int) -> int:
    """Consecutive splits per trellis_ws block: as many as keep the blocks of one row block within one wave."""
    override = int(os.environ.get("EXL3MOE_WS_SPB") or 0)
    if override > 0:
        return min(override, splits)
    groups = max(1, sms // max(1, col_blocks))
    return -(-splits // groups)


def ws_whole(splits: int, n: int, sms: int) -> bool:
    """Whether each trellis_ws block of an n-column weight runs every split (and keeps their sum itself)."""
    return ws_splits_per_block(splits, n // 128, sms) >= splits


def ws_launches_early(device: torch.device) -> bool:
    """trellis_ws (sm_90 only) right after rotate_input launches as its programmatic dependent: its producers decode
    while rotate_input runs, and its consumers wait for it (griddepcontrol.wait) before they read x.
    EXL3MOE_LINEAR_EARLY=0 launches it after rotate_input is done."""
    return device.type == "cuda" and os.environ.get("EXL3MOE_LINEAR_EARLY", "1") != "0"


def ws_variant(x: torch.Tensor, w, tiles: MmaTiles, after_rotate: bool = False) -> tuple:
    """(splits per block, x by TMA, paired producers, reduce_splits sums, early launch) of a trellis_ws call over
    x's rows; after_rotate: the stream's last kernel is the rotate_input that wrote x."""
    k, n, sms = x.shape[1], w.trellis.shape[1] * 16, nvrtc.sm_count(x.device)
    return (ws_splits_per_block(tiles.splits, n // 128, sms), ws_x_tma(k, n, w.K, w.codebook, x),
            ws_paired(k, n, tiles.splits, sms), ws_defers_reduce(tiles.splits, n, sms),
            after_rotate and ws_launches_early(x.device))


def prompt_on_ws(rows: int, k: int, n: int, splits: int, device: torch.device) -> bool:
    """Whether a call of more than 128 rows runs trellis_ws over 128-row blocks (each block decoding its weight
    again) instead of decoding W once for the split-ordered GEMM: weights whose blocks each run all of the plan's
    `splits` (no partials) up to PROMPT_WS_MAX_ROWS rows, measured faster there; both give the same bytes."""
    return (rows <= PROMPT_WS_MAX_ROWS and os.environ.get("EXL3MOE_PROMPT_WS") != "0"
            and uses_ws(rows, k, n, device) and ws_whole(splits, n, nvrtc.sm_count(device)))
