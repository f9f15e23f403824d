"""The EXL3 linear in one CUDA C++ launch (cuda/trellis_mma.cu): each lane decodes its mma.sync B fragments.

For few rows the kernel also rotates x (fuses_rotation); above, x comes rotated (fp16) from rotate_input.
Splits write fp32 partials and the last block of each 128-column group reduces them in split order and
applies the output Hadamard, svh and bias; in small grids on sm_90 the group's splits form one thread-block cluster
and sum from each other's shared memory instead, in the same order. The k split depends on (k, n) only, so a row's
bytes never depend on the batch.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass

import torch

from . import nvrtc
from .trellis_decode import CODEBOOK_ID

WARPS = 4
CHUNK_K = 128  # inputs per staged x chunk; splits are whole chunks
TARGET_WARPS = 4096  # warps in flight at one row: enough loads outstanding to cover DRAM latency
PREFETCH = 4
PAIR_SCALAR_MAX_MT = 2
MAX_GRID_Y = 65535
# Rows up to which the matmul kernel rotates x itself (above, rotate_input does, one launch more): small
# weights are launch-bound, large ones pay for rotating many rows in every block.
FUSED_ROTATION_ROWS_SMALL, FUSED_ROTATION_ROWS_LARGE, SMALL_WEIGHT = 16, 4, 1 << 24


PORTABLE_CLUSTER, MAX_CLUSTER = 8, 16  # thread-block clusters of sm_90: above 8 blocks a non-portable size
# Grids up to this many blocks sum their splits in a cluster; larger ones keep the L2 reduction (co-scheduling a
# cluster's blocks costs more there than the reduction saves).
CLUSTER_MAX_BLOCKS = 384
ONE_WAVE_MIN_BLOCKS = 7
CHAIN_PREFETCH_KTILES = 8  # trellis words per warp asked of L2 by a chained call on a grid of <= 1 block per SM


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


def tiles_per_warp(mt: int) -> int:
    """n16 tiles per warp in blocks of mt m16 tiles: two (128-column blocks) up to 2, one above."""
    return 2 if mt <= 2 else 1


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


def words_per_lane(K: float) -> int:
    """Trellis<2K, .>::NW of trellis_core.cuh: 32-bit words a lane loads per tile."""
    k2 = int(K * 2)
    s0, span = k2 // 2, 4 * k2 - k2 // 2 + 16
    first = ((s0 - 16) % 32) if k2 % 8 == 0 else 31
    return (first + span + 31) // 32


WHOLE_SPLIT_PREFETCH, WHOLE_SPLIT_MAX_BLOCKS = CHUNK_K // 16, 512


def prefetch_for(rows: int, k: int, n: int, K: float, tiles: MmaTiles | None = None) -> int:
    """PF of the planned kernel: a one-chunk split's words all loaded up front where they fit in registers (two words
    per tile) and the grid is small enough for the extra registers (a few blocks per SM); PREFETCH otherwise. tiles:
    the call's split, plan_mma(k, n) when not given."""
    tiles, mt = tiles or plan_mma(k, n), m_tiles(rows)
    blocks = n // (16 * WARPS * tiles_per_warp(mt)) * tiles.splits
    whole = tiles.ktiles_per_split == WHOLE_SPLIT_PREFETCH and mt == 1 and words_per_lane(K) <= 2
    return WHOLE_SPLIT_PREFETCH if whole and blocks <= WHOLE_SPLIT_MAX_BLOCKS else PREFETCH


def pair_scalar(mt: int) -> int:
    """The decode's pair-sum variant (PAIR_SCALAR in trellis_core.cuh) for blocks of mt m16 tiles: half the sums go
    to the FMA pipe where the ALU pipe bounds the loop (few rows); every variant decodes the same bits."""
    return 3 if mt <= PAIR_SCALAR_MAX_MT else 0


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


MAX_CHAINED_ROWS = 128   # calls of up to this many rows chain their launches (above: the dense path)


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


def call_kernel(w, mt: int, fuse_in: bool, prefetch: int, tiles: MmaTiles, device: torch.device,
                nt: int | None = None, row_blocks: int = 1) -> tuple:
    """(CUfunction, nt, defer, chain) that a trellis_mma call of this variant launches, with its launch bounds (one
    row block); defer: reduce_splits sums its partials; chain: mma_chain's prefetch depth, None for a plain launch."""
    nt = nt or tiles_per_warp(mt)
    groups = w.trellis.shape[1] // (WARPS * nt)
    bounds = launch_bounds(nt, fuse_in, prefetch, tiles.splits, groups, device) if row_blocks == 1 else (0, 0)
    defer = mma_defers_reduce(mt, bounds[0], w.trellis.shape[1] // 8 * row_blocks, nvrtc.sm_count(device))
    blocks = groups * tiles.splits * row_blocks
    chain = mma_chain(blocks, device, 16 * mt)
    late = chain is not None and chain_late(fuse_in, blocks, device, 16 * mt)
    if defer:
        reduce_kernel(device, linear_chains(16 * mt, device))
    return mma_kernel(w.K, w.codebook, mt, device, fuse_in, prefetch, nt, *bounds, defer, chain, late) + (defer, chain)


def mma_kernel(K: float, codebook: str, mt: int, device: torch.device, fuse_in: bool, prefetch: int = PREFETCH,
               nt: int | None = None, cluster: int = 0, min_blocks: int = 0, defer_reduce: bool = False,
               chain: int | None = None, late: bool = False):
    """(CUfunction, n16 tiles per warp) of one variant; compiling it if needed."""
    nt = nt or tiles_per_warp(mt)
    defines = (("K2", int(K * 2)), ("CB", CODEBOOK_ID[codebook]), ("MT", mt), ("NT", nt), ("PF", prefetch),
               ("WARPS", WARPS), ("FUSE_IN", int(fuse_in)), ("PAIR_SCALAR", pair_scalar(mt)))
    defines += (("CLUSTER_SPLITS", cluster),) if cluster else ()
    defines += (("MIN_BLOCKS", min_blocks),) if min_blocks else ()
    defines += (("DEFER_REDUCE", 1),) if defer_reduce else ()
    defines += (("CHAIN", 1), ("CHAIN_KT", chain)) if chain is not None else ()
    defines += (("CHAIN_LATE", 1),) if late else ()
    func = nvrtc.kernel("trellis_mma.cu", "trellis_mma", defines, device.index or 0)
    if cluster > PORTABLE_CLUSTER:
        nvrtc.allow_non_portable_clusters(func)
    return func, nt


DENSE_KTILES = 4  # k-tiles per warp of trellis_dense, their words all loaded before the first decode


def dense_kernel(K: float, codebook: str, device: torch.device, name: str = "trellis_dense"):
    """The CUfunction `name` of trellis_dense.cu (trellis_dense or dense_epilogue) for (K, codebook)."""
    defines = (("K2", int(K * 2)), ("CB", CODEBOOK_ID[codebook]), ("DENSE_KTILES", DENSE_KTILES))
    return nvrtc.kernel("trellis_dense.cu", name, defines, device.index or 0)


def decode_dense(w, dense: torch.Tensor) -> torch.Tensor:
    """dense [k, n] fp16 <- W_inner of w, the same bits as format.decode."""
    ktiles, tiles_n = w.trellis.shape[:2]
    grid = (-(-tiles_n // 4), -(-ktiles // DENSE_KTILES), 1)
    nvrtc.launch(dense_kernel(w.K, w.codebook, dense.device), grid, 128, [w.trellis, dense, tiles_n, ktiles])
    return dense


def dense_epilogue(y: torch.Tensor, w, out: torch.Tensor) -> torch.Tensor:
    """out [rows, n] = Hn128(y) * svh + bias blockwise, y fp32 [rows, n] contiguous (rows < 2^31)."""
    rows, n = y.shape
    func = dense_kernel(w.K, w.codebook, y.device, "dense_epilogue")
    nvrtc.launch(func, (rows, -(-n // 512), 1), 128, [y, w.svh, w.bias, out, OUT_DTYPE_ID[out.dtype], n, out.stride(0)])
    return out


# rotate_input's and reduce_splits' module needs some trellis defines; these are arbitrary.
ROTATE_DEFINES = (("K2", 8), ("CB", 1), ("MT", 1), ("NT", 2), ("PF", PREFETCH), ("WARPS", WARPS), ("FUSE_IN", 1))


def rotate_kernel(device: torch.device, chain: bool = False, late: bool = False):
    """rotate_input's CUfunction (chain: the variant that waits for the previous kernel first; late: that lets its
    dependents launch only as its blocks exit)."""
    return nvrtc.kernel("trellis_mma.cu", "rotate_input", rotate_defines(chain, late), device.index or 0)


def rotate_defines(chain: bool, late: bool = False) -> tuple:
    return ROTATE_DEFINES + ((("CHAIN", 1),) if chain else ()) + ((("CHAIN_LATE", 1),) if chain and late else ())


def rotate_input(x: torch.Tensor, suh: torch.Tensor, xh: torch.Tensor, chain: bool = False) -> torch.Tensor:
    """xh [rows, k] fp16 = Hn128(x * suh), bit-identical to the kernel's own rotation of up to 16 rows; chain: a
    programmatic dependent launch of the stream's previous kernel (linear_chains)."""
    rows, k = x.shape
    func = rotate_kernel(x.device, chain, chain and late_rotation(rows))
    for r0 in range(0, rows, MAX_GRID_Y):  # grid y counts rows
        part = min(MAX_GRID_Y, rows - r0)
        nvrtc.launch(func, (-(-k // 512), part, 1), 128, [x[r0:r0 + part], int(x.dtype == torch.bfloat16), suh,
                                                         xh[r0:r0 + part], k, x.stride(0)],
                     early=chain)
    return xh


def counter_count(n: int, max_rows: int) -> int:
    """int32 arrival counters the kernel needs (zeroed once; the kernel resets each after use)."""
    return (n // 128) * -(-min(max_rows, 128) // 16)


OUT_DTYPE_ID = {torch.float16: 0, torch.bfloat16: 1, torch.float32: 2}

WS_STAGES, WS_STAGE_KTILES = 3, 4  # trellis_ws: ring stages of 4 k-tiles
WS_PAIR_SCALAR = 1   # trellis_ws producers' pair sums: scalar HADDs and a PRMT pack
WS_PAIRED_STAGES = 5   # the linear's ring with paired producers, which wait for a stage before they decode it


def ws_threads(paired: bool = False, rows: int = 128) -> int:
    """Threads of a trellis_ws block: 16 producer warps, or 12 paired ones (two tile columns each), and 8 consumers;
    blocks of 192 rows: 8 paired producers and 12 consumers."""
    if rows == 192:
        return (8 + 12) * 32
    return ((12 if paired else 16) + 8) * 32


# trellis_ws.cuh's dynamic shared memory (WsShared): ring stages, alignment slack, two x chunks of `rows` rows, the
# barriers; the linear adds its running sum (128 rows of 136 fp32).
def ws_ring_shared_bytes(stages: int = WS_STAGES, stage_ktiles: int = WS_STAGE_KTILES, rows: int = 128) -> int:
    return stages * stage_ktiles * 8 * 32 * 16 + 1024 + 2 * rows * 256 + 2 * stages * 8


# Calls from this many rows (x rotated) run on trellis_ws: weights under MID_WEIGHT entries, under SMALL_WEIGHT, larger.
WS_MIN_ROWS, WS_MIN_ROWS_MID, WS_MIN_ROWS_LARGE, MID_WEIGHT = 32, 33, 64, 1 << 22


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


def ws_shared_bytes(x_tma: bool, paired: bool) -> int:
    """trellis_ws's dynamic shared memory: the ring, x chunks and barriers, and the running sum."""
    return (ws_ring_shared_bytes(WS_PAIRED_STAGES if paired else WS_STAGES) + 128 * 136 * 4
            + (2 * 8 if x_tma else 0))


def ws_kernel(K: float, codebook: str, device: torch.device, x_tma: bool = False, paired: bool = False,
              defer_reduce: bool = False):
    defines = (("K2", int(K * 2)), ("CB", CODEBOOK_ID[codebook]), ("PF", PREFETCH),
               ("STAGES", WS_PAIRED_STAGES if paired else WS_STAGES), ("STAGE_KT", WS_STAGE_KTILES),
               ("PAIR_SCALAR", WS_PAIR_SCALAR)) + ((("X_TMA", 1),) if x_tma else ())
    defines += (("WS_PRODUCERS", 12),) if paired else ()
    defines += (("DEFER_REDUCE", 1),) if defer_reduce else ()
    return nvrtc.kernel("trellis_ws.cu", "trellis_ws", defines, device.index or 0, arch_suffix="a")


SPLIT_REDUCE_ROWS = 8   # rows per reduce_splits block


def reduce_kernel(device: torch.device, chain: bool = False):
    """reduce_splits' CUfunction (in rotate_input's module; chain: the variant that waits for the previous kernel)."""
    return nvrtc.kernel("trellis_mma.cu", "reduce_splits", rotate_defines(chain), device.index or 0)


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


def _launch_ws(x, w, partials, counters, out, tiles: MmaTiles, after_rotate: bool = False) -> None:
    rows, k = x.shape
    tiles_n, sms = w.trellis.shape[1], nvrtc.sm_count(x.device)
    spb = ws_splits_per_block(tiles.splits, tiles_n // 8, sms)
    grid = (tiles_n // 8, -(-tiles.splits // spb), -(-rows // 128))
    x_tma = ws_x_tma(k, tiles_n * 16, w.K, w.codebook, x)
    paired = ws_paired(k, tiles_n * 16, tiles.splits, sms)
    defer = ws_defers_reduce(tiles.splits, tiles_n * 16, sms)
    nvrtc.launch(ws_kernel(w.K, w.codebook, x.device, x_tma, paired, defer), grid, ws_threads(paired),
                 [x, w.trellis, partials, w.svh, w.bias, out, OUT_DTYPE_ID[out.dtype], counters, rows, tiles_n * 16,
                  tiles_n, k // 16, tiles.ktiles_per_split, x.stride(0), out.stride(0), tiles.splits, spb,
                  *([nvrtc.x_tensor_map(x, rows, k, x.stride(0))] if x_tma else [])],
                 shared=ws_shared_bytes(x_tma, paired), early=after_rotate and ws_launches_early(x.device))
    if defer:
        reduce_splits(partials, w, out, rows, tiles.splits)


def reduce_splits(partials: torch.Tensor, w, out: torch.Tensor, rows: int, splits: int) -> None:
    """out = Hn(sum of the split partials, in split order) * svh + bias, on blocks of SPLIT_REDUCE_ROWS rows; chained
    (a programmatic dependent of the matmul before it) where the call's rotation is (linear_chains)."""
    n = w.trellis.shape[1] * 16
    chain = linear_chains(rows, out.device)
    nvrtc.launch(reduce_kernel(out.device, chain), (n // 128, -(-rows // SPLIT_REDUCE_ROWS), 1), 128,
                 [partials, w.svh, w.bias, out, OUT_DTYPE_ID[out.dtype], rows, n, out.stride(0), splits,
                  SPLIT_REDUCE_ROWS], early=chain)


def trellis_mma(x: torch.Tensor, w, partials: torch.Tensor, counters: torch.Tensor, out: torch.Tensor,
                tiles: MmaTiles, prefetch: int | None = None, nt: int | None = None,
                mt: int | None = None, after_rotate: bool = False) -> torch.Tensor:
    """out [rows, n] = Hn(x_rot @ W_inner) * svh + bias, x_rot = Hn(x * suh) rotated here when
    fuses_rotation(rows, k, n), else x is the rotated fp16 input; partials [splits, rows, n] fp32 scratch.
    prefetch, nt and mt override the planned variant (for probes); after_rotate: the stream's last kernel is the
    rotate_input that wrote x."""
    rows, k = x.shape
    tiles_n = w.trellis.shape[1]
    planned_mt, fuse_in = variant_for(rows, k, tiles_n * 16)
    mt = mt or planned_mt
    planned_pf = prefetch_for(rows, k, tiles_n * 16, w.K, tiles)
    planned = mt == planned_mt and prefetch in (None, planned_pf) and nt is None
    prefetch = prefetch or planned_pf
    if planned and not fuse_in and uses_ws(rows, k, tiles_n * 16, x.device):
        _launch_ws(x, w, partials, counters, out, tiles, after_rotate)
        return out
    func, nt, defer, chain = call_kernel(w, mt, fuse_in, prefetch, tiles, x.device, nt, -(-rows // (16 * mt)))
    grid = (tiles_n // (WARPS * nt), tiles.splits, -(-rows // (16 * mt)))
    nvrtc.launch(func, grid, WARPS * 32, [x, int(x.dtype == torch.bfloat16), w.suh, w.trellis, partials, w.svh, w.bias,
                                          out, OUT_DTYPE_ID[out.dtype], counters, rows, tiles_n * 16, tiles_n, k // 16,
                                          tiles.ktiles_per_split, x.stride(0), out.stride(0), tiles.splits],
                 early=chain is not None)
    if defer:
        reduce_splits(partials, w, out, rows, tiles.splits)
    return out
