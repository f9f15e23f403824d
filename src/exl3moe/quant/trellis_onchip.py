"""Trellis passes with the node costs kept on chip across steps (rings of one step width D, L >= 2D).

A program owns TILES tiles and carries their 2^(L-D) node costs from step to step as a register tensor (Triton moves
it through shared memory when it reshapes it); nothing per step goes to global memory except, when a traceback
follows, the step's input costs (the History of trellis_triton, so its tracebacks read them unchanged). The fp16
codebook is read once per pass and shared by the TILES tiles. Two independent passes (or trellis_triton's two
tracebacks) can run side by side in one launch, a program per tile and pass.

States split as s = (h << (L-D)) | (b << D) | y with h, y in [0, 2^D) and b in [0, 2^(L-2D)), so that a forward
step is cost[h, b, y] = (v[s] - w)^2 + m[h, b] and m'[b, y] = min_h (the next m is its row-major reshape), and a
backward step, laid out [y, a, b] so that the minimum stays in each thread, is cost[y, a, b] = (v[s] - w)^2 + g[y, b]
and g'[a, b] = min_y (the next g is its reshape to [b, y], transposed). The float operations are those of the torch
passes (subtract, multiply, add, minimum; no fused multiply-add), so all three give the same bits.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from .trellis import Ring
from .trellis_triton import ARG_BLOCK, History, _steps, _trace_forward_kernel, _traceback_kernel

# Tiles per program: 1 for latency (a strip of few tiles), more to share the codebook held per program (more spills).
TILES = int(os.environ.get("EXL3MOE_QUANT_ONCHIP_TILES", "1"))
WARPS = 32


def supports(ring: Ring) -> bool:
    """One step width D everywhere and L >= 2D (every integer K of the format ring)."""
    D = ring.steps[0]
    return all(d == D for d in ring.steps) and ring.L >= 2 * D


def _values_f16(ring: Ring, device: torch.device) -> torch.Tensor:
    """The codebook in fp16 when every value is exactly an fp16 (the format's tables), else None."""
    key = ("values_f16", str(device))
    if key not in ring._tables:
        half = ring.values.to(device).to(torch.float16)
        ring._tables[key] = half if torch.equal(half.to(ring.values.dtype), ring.values.to(device)) else None
    return ring._tables[key]


@triton.jit
def _layout(L: tl.constexpr, D: tl.constexpr, TILES: tl.constexpr):
    """(high [H], middle [B] bit ranges, tile offsets [TILES])."""
    return tl.arange(0, 1 << D), tl.arange(0, 1 << (L - 2 * D)), tl.arange(0, TILES)


@triton.jit
def _forward_walk(targets, values, hist, B_tiles, T, start, count, slots, stride_tile, stride_slot, block,
                  L: tl.constexpr, D: tl.constexpr, TILES: tl.constexpr, KEEP: tl.constexpr):
    H: tl.constexpr = 1 << D
    B: tl.constexpr = 1 << (L - 2 * D)
    h, b, t = _layout(L, D, TILES)
    tile = block.to(tl.int64) * TILES + t
    live = tile < B_tiles
    nodes = (hist + tile * stride_tile)[:, None, None] + (h[:, None] * B + b[None, :])[None, :, :]  # m[h, b]
    mask = live[:, None, None]
    m = tl.load(nodes, mask=mask, other=0.0)
    state = (h[:, None, None] << (L - D)) | (b[None, :, None] << D) | h[None, None, :]  # [h, b, y]
    v = tl.load(values + state).to(tl.float32)[None, :, :, :]
    for i in range(count):
        w = tl.load(targets + tile * T + (start + i) % T, mask=live, other=0.0)
        if KEEP:
            tl.store(nodes + (i % slots) * stride_slot, m, mask=mask)
        d = v - w[:, None, None, None]
        cost = d * d + m[:, :, :, None]
        m = tl.reshape(tl.min(cost, axis=1), (TILES, H, B))
    tl.store(nodes + (count % slots) * stride_slot, m, mask=mask)


@triton.jit
def _backward_walk(targets, values, hist, B_tiles, T, start, count, slots, stride_tile, stride_slot, block,
                   L: tl.constexpr, D: tl.constexpr, TILES: tl.constexpr, KEEP: tl.constexpr):
    H: tl.constexpr = 1 << D
    B: tl.constexpr = 1 << (L - 2 * D)
    y, b, t = _layout(L, D, TILES)
    tile = block.to(tl.int64) * TILES + t
    live = tile < B_tiles
    nodes = (hist + tile * stride_tile)[:, None, None] + (b[None, :] * H + y[:, None])[None, :, :]  # g[y, b]
    mask = live[:, None, None]
    g = tl.load(nodes + (count % slots) * stride_slot, mask=mask, other=0.0)
    state = (y[None, :, None] << (L - D)) | (b[None, None, :] << D) | y[:, None, None]  # [y, a, b]
    v = tl.load(values + state).to(tl.float32)[None, :, :, :]
    for j in range(count):
        i = count - 1 - j
        w = tl.load(targets + tile * T + (start + i) % T, mask=live, other=0.0)
        if KEEP:
            tl.store(nodes + ((i + 1) % slots) * stride_slot, g, mask=mask)
        d = v - w[:, None, None, None]
        cost = d * d + g[:, :, None, :]
        g = tl.permute(tl.reshape(tl.min(cost, axis=1), (TILES, B, H)), (0, 2, 1))
    tl.store(nodes, g, mask=mask)


@triton.jit
def _onchip_forward_kernel(targets, values, hist, B_tiles, T, start, count, slots, stride_tile, stride_slot,
                           L: tl.constexpr, D: tl.constexpr, TILES: tl.constexpr, KEEP: tl.constexpr):
    _forward_walk(targets, values, hist, B_tiles, T, start, count, slots, stride_tile, stride_slot,
                  tl.program_id(0), L, D, TILES, KEEP)


@triton.jit
def _onchip_backward_kernel(targets, values, hist, B_tiles, T, start, count, slots, stride_tile, stride_slot,
                            L: tl.constexpr, D: tl.constexpr, TILES: tl.constexpr, KEEP: tl.constexpr):
    _backward_walk(targets, values, hist, B_tiles, T, start, count, slots, stride_tile, stride_slot,
                   tl.program_id(0), L, D, TILES, KEEP)


@triton.jit
def _onchip_pair_kernel(targets, values, hist_f, hist_b, B_tiles, T, start_f, count_f, slots_f, stride_tile_f,
                        stride_slot_f, start_b, count_b, slots_b, stride_tile_b, stride_slot_b, L: tl.constexpr,
                        D: tl.constexpr, TILES: tl.constexpr, KEEP_F: tl.constexpr, KEEP_B: tl.constexpr):
    """Programs of axis 1 = 0 walk a forward pass, those of axis 1 = 1 a backward pass, side by side."""
    if tl.program_id(1) == 0:
        _forward_walk(targets, values, hist_f, B_tiles, T, start_f, count_f, slots_f, stride_tile_f, stride_slot_f,
                      tl.program_id(0), L, D, TILES, KEEP_F)
    else:
        _backward_walk(targets, values, hist_b, B_tiles, T, start_b, count_b, slots_b, stride_tile_b, stride_slot_b,
                       tl.program_id(0), L, D, TILES, KEEP_B)


@triton.jit
def _trace_pair_kernel(targets, values, steps, hist_f, first_node, states_f, start_f, count_f, stride_tile_f,
                       stride_slot_f, hist_b, last_node, states_b, start_b, count_b, stride_tile_b, stride_slot_b, T,
                       L: tl.constexpr, ARG_BLOCK: tl.constexpr):
    """Programs of axis 1 = 0 follow a backward pass forward, those of axis 1 = 1 walk a forward pass back."""
    if tl.program_id(1) == 0:
        _trace_forward_kernel(targets, values, steps, hist_f, first_node, states_f, T, start_f, count_f, stride_tile_f,
                              stride_slot_f, L, ARG_BLOCK)
    else:
        _traceback_kernel(targets, values, steps, hist_b, last_node, states_b, T, start_b, count_b, 0, stride_tile_b,
                          stride_slot_b, L, ARG_BLOCK)


def _values(ring: Ring, device: torch.device) -> torch.Tensor:
    values = _values_f16(ring, device)
    return ring.values if values is None else values


def _launch(kernel, ring: Ring, targets: torch.Tensor, history: History, start: int, count: int, keep: bool):
    values = _values(ring, targets.device)
    B = targets.shape[0]
    kernel[(triton.cdiv(B, TILES),)](targets, values, history.data, B, ring.T, start, count, history.slots,
                                     history.data.stride(0), history.data.stride(1), L=ring.L, D=ring.steps[0],
                                     TILES=TILES, KEEP=keep, num_warps=WARPS, enable_fp_fusion=False)


def forward(ring: Ring, targets: torch.Tensor, start: int, count: int, init: torch.Tensor, keep: bool = False):
    """As trellis.forward; returns (final node costs, History or None)."""
    history = History(ring, targets.shape[0], count, keep, targets.device)
    history.slot(0, init.shape[1]).copy_(init)
    _launch(_onchip_forward_kernel, ring, targets.contiguous(), history, start, count, keep)
    return history.slot(count, init.shape[1]).clone(), (history if keep else None)


def backward(ring: Ring, targets: torch.Tensor, start: int, count: int, final: torch.Tensor, keep: bool = False):
    """As trellis.backward; returns (costs before `start`, History or None)."""
    history = History(ring, targets.shape[0], count, keep, targets.device)
    history.slot(count, final.shape[1]).copy_(final)
    _launch(_onchip_backward_kernel, ring, targets.contiguous(), history, start, count, keep)
    return history.slot(0, final.shape[1]).clone(), (history if keep else None)


def forward_and_backward(ring: Ring, targets: torch.Tensor, forward_part: tuple, backward_part: tuple):
    """As trellis.forward_and_backward: both passes in one launch, each tile's two walks on two programs."""
    targets = targets.contiguous()
    B = targets.shape[0]
    (start_f, count_f, init, keep_f), (start_b, count_b, final, keep_b) = forward_part, backward_part
    hist_f = History(ring, B, count_f, keep_f, targets.device)
    hist_f.slot(0, init.shape[1]).copy_(init)
    hist_b = History(ring, B, count_b, keep_b, targets.device)
    hist_b.slot(count_b, final.shape[1]).copy_(final)
    _onchip_pair_kernel[(triton.cdiv(B, TILES), 2)](
        targets, _values(ring, targets.device), hist_f.data, hist_b.data, B, ring.T,
        start_f, count_f, hist_f.slots, hist_f.data.stride(0), hist_f.data.stride(1),
        start_b, count_b, hist_b.slots, hist_b.data.stride(0), hist_b.data.stride(1),
        L=ring.L, D=ring.steps[0], TILES=TILES, KEEP_F=keep_f, KEEP_B=keep_b, num_warps=WARPS, enable_fp_fusion=False)
    return ((hist_f.slot(count_f, init.shape[1]).clone(), hist_f if keep_f else None),
            (hist_b.slot(0, final.shape[1]).clone(), hist_b if keep_b else None))


def trace_both(ring: Ring, targets: torch.Tensor, forward_part: tuple, back_part: tuple):
    """As trellis.trace_both: trace_forward and traceback in one launch, each tile's two walks on two programs."""
    (hist_f, start_f, count_f, first_node), (hist_b, start_b, count_b, last_node) = forward_part, back_part
    B = first_node.shape[0]
    states_f = torch.empty(B, count_f, dtype=torch.int64, device=first_node.device)
    states_b = torch.empty(B, count_b, dtype=torch.int64, device=last_node.device)
    _trace_pair_kernel[(B, 2)](targets.contiguous(), ring.values, _steps(ring, targets.device),
                               hist_f.data, first_node.contiguous(), states_f, start_f, count_f,
                               hist_f.data.stride(0), hist_f.data.stride(1),
                               hist_b.data, last_node.contiguous(), states_b, start_b, count_b,
                               hist_b.data.stride(0), hist_b.data.stride(1), ring.T, L=ring.L, ARG_BLOCK=ARG_BLOCK,
                               enable_fp_fusion=False)
    end = states_f[:, -1] & ((1 << ring.node_bits(start_f + count_f - 1)) - 1)
    return (states_f, end), (states_b, states_b[:, 0] >> ring.D(start_b) if count_b else last_node)
