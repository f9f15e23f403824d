"""The linear's warp-specialized kernel (cuda/trellis_ws.cu, sm_90a): producer warps decode the trellis into a ring
of shared-memory stages, consumer warpgroups run wgmma over rotated x. Compiled and launched in the variant given
(ops/linear_planning.py chooses it); the ring layout here is shared with the MoE's warp-specialized kernels."""

from __future__ import annotations

import torch

from . import nvrtc
from .trellis_decode import CODEBOOK_ID
from .trellis_mma import OUT_DTYPE_ID, PREFETCH

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


def launch_ws(x: torch.Tensor, w, partials: torch.Tensor, counters: torch.Tensor, out: torch.Tensor, tiles,
              splits_per_block: int, x_tma: bool, paired: bool, defer: bool, early: bool) -> None:
    """One trellis_ws launch over x's pre-rotated rows: blocks of 128 columns x splits_per_block consecutive splits x
    128 rows; x_tma: x staged by TMA; paired: 12 paired producers; defer: reduce_splits sums the partials (the caller
    launches it); early: a programmatic dependent of the stream's previous kernel."""
    rows, k = x.shape
    tiles_n = w.trellis.shape[1]
    grid = (tiles_n // 8, -(-tiles.splits // splits_per_block), -(-rows // 128))
    nvrtc.launch(ws_kernel(w.K, w.codebook, x.device, x_tma, paired, defer), grid, ws_threads(paired),
                 [x, w.trellis, partials, w.svh, w.bias, out, OUT_DTYPE_ID[out.dtype], counters, rows, tiles_n * 16,
                  tiles_n, k // 16, tiles.ktiles_per_split, x.stride(0), out.stride(0), tiles.splits, splits_per_block,
                  *([nvrtc.x_tensor_map(x, rows, k, x.stride(0))] if x_tma else [])],
                 shared=ws_shared_bytes(x_tma, paired), early=early)
