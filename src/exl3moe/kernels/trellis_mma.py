"""The EXL3 linear in one CUDA C++ launch (cuda/trellis_mma.cu): each lane decodes its mma.sync B fragments.

For few rows the kernel also rotates x (FUSE_IN); above, x comes rotated (fp16) from rotate_input.
Splits write fp32 partials and the last block of each 128-column group reduces them in split order and
applies the output Hadamard, svh and bias; in small grids on sm_90 the group's splits form one thread-block cluster
and sum from each other's shared memory instead, in the same order (or reduce_splits does, DEFER_REDUCE).
This module compiles and launches the variant it is given; ops/linear_planning.py chooses it.
"""

from __future__ import annotations

import torch

from . import nvrtc
from .trellis_decode import CODEBOOK_ID

WARPS = 4
CHUNK_K = 128  # inputs per staged x chunk; splits are whole chunks
PREFETCH = 4
PAIR_SCALAR_MAX_MT = 2
MAX_GRID_Y = 65535
PORTABLE_CLUSTER, MAX_CLUSTER = 8, 16  # thread-block clusters of sm_90: above 8 blocks a non-portable size
SPLIT_REDUCE_ROWS = 8   # rows per reduce_splits block
OUT_DTYPE_ID = {torch.float16: 0, torch.bfloat16: 1, torch.float32: 2}


def tiles_per_warp(mt: int) -> int:
    """n16 tiles per warp in blocks of mt m16 tiles: two (128-column blocks) up to 2, one above."""
    return 2 if mt <= 2 else 1


def words_per_lane(K: float) -> int:
    """Trellis<2K, .>::NW of trellis_core.cuh: 32-bit words a lane loads per tile."""
    k2 = int(K * 2)
    s0, span = k2 // 2, 4 * k2 - k2 // 2 + 16
    first = ((s0 - 16) % 32) if k2 % 8 == 0 else 31
    return (first + span + 31) // 32


def pair_scalar(mt: int) -> int:
    """The decode's pair-sum variant (PAIR_SCALAR in trellis_core.cuh) for blocks of mt m16 tiles: half the sums go
    to the FMA pipe where the ALU pipe bounds the loop (few rows); every variant decodes the same bits."""
    return 3 if mt <= PAIR_SCALAR_MAX_MT else 0


def counter_count(n: int, max_rows: int) -> int:
    """int32 arrival counters the kernel needs (zeroed once; the kernel resets each after use)."""
    return (n // 128) * -(-min(max_rows, 128) // 16)


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


def launch_mma(func, nt: int, mt: int, x: torch.Tensor, w, partials: torch.Tensor, counters: torch.Tensor,
               out: torch.Tensor, tiles, early: bool) -> None:
    """One trellis_mma launch of a compiled variant (blocks of mt m16 tiles and nt n16 tiles per warp) over x's rows;
    tiles: the k split (splits, ktiles_per_split); early: a programmatic dependent of the stream's previous kernel."""
    rows, k = x.shape
    tiles_n = w.trellis.shape[1]
    grid = (tiles_n // (WARPS * nt), tiles.splits, -(-rows // (16 * mt)))
    nvrtc.launch(func, grid, WARPS * 32, [x, int(x.dtype == torch.bfloat16), w.suh, w.trellis, partials, w.svh, w.bias,
                                          out, OUT_DTYPE_ID[out.dtype], counters, rows, tiles_n * 16, tiles_n, k // 16,
                                          tiles.ktiles_per_split, x.stride(0), out.stride(0), tiles.splits],
                 early=early)


# rotate_input's and reduce_splits' module needs some trellis defines; these are arbitrary.
ROTATE_DEFINES = (("K2", 8), ("CB", 1), ("MT", 1), ("NT", 2), ("PF", PREFETCH), ("WARPS", WARPS), ("FUSE_IN", 1))


def rotate_defines(chain: bool, late: bool = False) -> tuple:
    return ROTATE_DEFINES + ((("CHAIN", 1),) if chain else ()) + ((("CHAIN_LATE", 1),) if chain and late else ())


def rotate_kernel(device: torch.device, chain: bool = False, late: bool = False):
    """rotate_input's CUfunction (chain: the variant that waits for the previous kernel first; late: that lets its
    dependents launch only as its blocks exit)."""
    return nvrtc.kernel("trellis_mma.cu", "rotate_input", rotate_defines(chain, late), device.index or 0)


def launch_rotate(x: torch.Tensor, suh: torch.Tensor, xh: torch.Tensor, chain: bool = False,
                  late: bool = False) -> torch.Tensor:
    """xh [rows, k] fp16 = Hn128(x * suh), bit-identical to trellis_mma's own rotation of up to 16 rows; chain: a
    programmatic dependent launch of the stream's previous kernel; late: its dependents launch as its blocks exit."""
    rows, k = x.shape
    func = rotate_kernel(x.device, chain, late)
    for r0 in range(0, rows, MAX_GRID_Y):  # grid y counts rows
        part = min(MAX_GRID_Y, rows - r0)
        nvrtc.launch(func, (-(-k // 512), part, 1), 128, [x[r0:r0 + part], int(x.dtype == torch.bfloat16), suh,
                                                         xh[r0:r0 + part], k, x.stride(0)],
                     early=chain)
    return xh


def reduce_kernel(device: torch.device, chain: bool = False):
    """reduce_splits' CUfunction (in rotate_input's module; chain: the variant that waits for the previous kernel)."""
    return nvrtc.kernel("trellis_mma.cu", "reduce_splits", rotate_defines(chain), device.index or 0)


def launch_reduce(partials: torch.Tensor, w, out: torch.Tensor, rows: int, splits: int, chain: bool = False) -> None:
    """out = Hn(sum of the split partials, in split order) * svh + bias, on blocks of SPLIT_REDUCE_ROWS rows; chain:
    a programmatic dependent of the matmul before it."""
    n = w.trellis.shape[1] * 16
    nvrtc.launch(reduce_kernel(out.device, chain), (n // 128, -(-rows // SPLIT_REDUCE_ROWS), 1), 128,
                 [partials, w.svh, w.bias, out, OUT_DTYPE_ID[out.dtype], rows, n, out.stride(0), splits,
                  SPLIT_REDUCE_ROWS], early=chain)
