"""A linear call of up to 128 rows on the CUDA C++ kernels: the variant linear_planning chooses for its rows,
compiled (cached) and launched through kernels/trellis_mma.py and kernels/trellis_ws.py. Validates nothing."""

from __future__ import annotations

import torch

from ..kernels.trellis_mma import launch_mma, launch_reduce, launch_rotate, mma_kernel, reduce_kernel
from ..kernels.trellis_ws import launch_ws
from .linear_planning import (MmaTiles, late_rotation, linear_chains, mma_variant, prefetch_for, uses_ws,
                              variant_for, ws_variant)


def call_kernel(w, mt: int, fuse_in: bool, prefetch: int, tiles: MmaTiles, device: torch.device,
                nt: int | None = None, row_blocks: int = 1) -> tuple:
    """(CUfunction, nt, defer, chain) that a trellis_mma call of this variant launches, with its launch bounds (one
    row block); defer: reduce_splits sums its partials; chain: mma_chain's prefetch depth, None for a plain launch."""
    nt, cluster, min_blocks, defer, chain, late = mma_variant(w, mt, fuse_in, prefetch, tiles, device, nt, row_blocks)
    if defer:
        reduce_kernel(device, linear_chains(16 * mt, device))
    return mma_kernel(w.K, w.codebook, mt, device, fuse_in, prefetch, nt, cluster, min_blocks, defer, chain,
                      late) + (defer, chain)


def rotate_input(x: torch.Tensor, suh: torch.Tensor, xh: torch.Tensor, chain: bool = False) -> torch.Tensor:
    """xh [rows, k] fp16 = Hn128(x * suh), bit-identical to the kernel's own rotation of up to 16 rows; chain: a
    programmatic dependent launch of the stream's previous kernel (linear_chains)."""
    return launch_rotate(x, suh, xh, chain, chain and late_rotation(x.shape[0]))


def reduce_splits(partials: torch.Tensor, w, out: torch.Tensor, rows: int, splits: int) -> None:
    """out = Hn(sum of the split partials, in split order) * svh + bias; chained (a programmatic dependent of the
    matmul before it) where the call's rotation is (linear_chains)."""
    launch_reduce(partials, w, out, rows, splits, linear_chains(rows, out.device))


def _launch_ws(x, w, partials, counters, out, tiles: MmaTiles, after_rotate: bool = False) -> None:
    spb, x_tma, paired, defer, early = ws_variant(x, w, tiles, after_rotate)
    launch_ws(x, w, partials, counters, out, tiles, spb, x_tma, paired, defer, early)
    if defer:
        reduce_splits(partials, w, out, x.shape[0], tiles.splits)


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
    launch_mma(func, nt, mt, x, w, partials, counters, out, tiles, chain is not None)
    if defer:
        reduce_splits(partials, w, out, rows, tiles.splits)
    return out

