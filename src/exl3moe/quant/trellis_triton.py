"""Triton versions of the trellis passes and tracebacks: one program per tile walks every step of a pass.

Node costs live in a per-tile history (every step's input kept, or two slots reused); a program evaluates each
step's 2^L states in blocks of GROUP predecessors x NODES nodes and meets its own threads at a barrier before the
next step reads what this one wrote.
History loads bypass L1 (.cg): what another thread stored before the barrier is read from L2.
The float operations are those of the torch passes (subtract, multiply, add, minimum; no fused multiply-add), so
both give the same bits, and traceback recomputes a choice from the stored costs as the torch traceback does.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .trellis import Ring

STATES = 4096    # states evaluated per iteration: GROUP predecessors (or symbols) x NODES nodes
WARPS = 8
ARG_BLOCK = 256  # >= 2^max D: the candidates of one traceback step


def _steps(ring: Ring, device: torch.device) -> torch.Tensor:
    key = ("steps", str(device))
    if key not in ring._tables:
        ring._tables[key] = torch.tensor(ring.steps, dtype=torch.int32, device=device)
    return ring._tables[key]


@triton.jit
def _step(targets, steps, tile, T, start, i):
    """Position, bits D of the position, bits E of the next, and the tile's target there."""
    p = (start + i) % T
    return p, tl.load(steps + p), tl.load(steps + (p + 1) % T), tl.load(targets + tile * T + p)


@triton.jit
def _forward_kernel(targets, values, steps, hist, T, start, count, slots, stride_tile, stride_slot,
                    L: tl.constexpr, GROUP: tl.constexpr, NODES: tl.constexpr):
    tile = tl.program_id(0).to(tl.int64)
    base = hist + tile * stride_tile
    for i in range(count):
        p, D, E, w = _step(targets, steps, tile, T, start, i)
        before = base + (i % slots) * stride_slot
        after = base + ((i + 1) % slots) * stride_slot
        nodes = 1 << (L - E)
        for c in range(0, nodes, NODES):
            node = c + tl.arange(0, NODES)
            best = tl.full((NODES,), float("inf"), tl.float32)
            for h in range(0, 1 << E, GROUP):
                high = h + tl.arange(0, GROUP)
                live = (high[:, None] < (1 << E)) & (node[None, :] < nodes)
                state = (high[:, None] << (L - E)) | node[None, :]
                d = tl.load(values + state, mask=live, other=0.0) - w
                cost = d * d + tl.load(before + (state >> D), mask=live, other=0.0, cache_modifier=".cg")
                best = tl.minimum(best, tl.min(tl.where(live, cost, float("inf")), axis=0))
            tl.store(after + node, best, mask=node < nodes)
        tl.debug_barrier()


@triton.jit
def _backward_kernel(targets, values, steps, hist, T, start, count, slots, stride_tile, stride_slot,
                     L: tl.constexpr, GROUP: tl.constexpr, NODES: tl.constexpr):
    tile = tl.program_id(0).to(tl.int64)
    base = hist + tile * stride_tile
    for j in range(count):
        i = count - 1 - j
        p, D, E, w = _step(targets, steps, tile, T, start, i)
        after = base + ((i + 1) % slots) * stride_slot
        before = base + (i % slots) * stride_slot
        nodes = 1 << (L - D)
        low = (1 << (L - E)) - 1
        for c in range(0, nodes, NODES):
            node = c + tl.arange(0, NODES)
            best = tl.full((NODES,), float("inf"), tl.float32)
            for y in range(0, 1 << D, GROUP):
                symbol = y + tl.arange(0, GROUP)
                live = (symbol[:, None] < (1 << D)) & (node[None, :] < nodes)
                state = (node[None, :] << D) | symbol[:, None]
                d = tl.load(values + state, mask=live, other=0.0) - w
                cost = d * d + tl.load(after + (state & low), mask=live, other=0.0, cache_modifier=".cg")
                best = tl.minimum(best, tl.min(tl.where(live, cost, float("inf")), axis=0))
            tl.store(before + node, best, mask=node < nodes)
        tl.debug_barrier()


@triton.jit
def _traceback_kernel(targets, values, steps, hist, last_node, states, T, start, count, stop, stride_tile,
                      stride_slot, L: tl.constexpr, ARG_BLOCK: tl.constexpr):
    tile = tl.program_id(0).to(tl.int64)
    base = hist + tile * stride_tile
    node = tl.load(last_node + tile).to(tl.int32)
    high = tl.arange(0, ARG_BLOCK)
    for j in range(count - stop):
        i = count - 1 - j
        p, D, E, w = _step(targets, steps, tile, T, start, i)
        live = high < (1 << E)
        option = (high << (L - E)) | node
        d = tl.load(values + option, mask=live, other=0.0) - w
        cost = d * d + tl.load(base + i * stride_slot + (option >> D), mask=live, other=0.0)
        cost = tl.where(live, cost, float("inf"))
        state = (tl.argmin(cost, axis=0).to(tl.int32) << (L - E)) | node
        tl.store(states + tile * (count - stop) + (i - stop), state.to(tl.int64))
        node = state >> D


@triton.jit
def _trace_forward_kernel(targets, values, steps, hist, first_node, states, T, start, count, stride_tile,
                          stride_slot, L: tl.constexpr, ARG_BLOCK: tl.constexpr):
    tile = tl.program_id(0).to(tl.int64)
    base = hist + tile * stride_tile
    node = tl.load(first_node + tile).to(tl.int32)
    symbol = tl.arange(0, ARG_BLOCK)
    for i in range(count):
        p, D, E, w = _step(targets, steps, tile, T, start, i)
        live = symbol < (1 << D)
        option = (node << D) | symbol
        d = tl.load(values + option, mask=live, other=0.0) - w
        cost = d * d + tl.load(base + (i + 1) * stride_slot + (option & ((1 << (L - E)) - 1)), mask=live,
                               other=0.0)
        cost = tl.where(live, cost, float("inf"))
        state = (node << D) | tl.argmin(cost, axis=0).to(tl.int32)
        tl.store(states + tile * count + i, state.to(tl.int64))
        node = state & ((1 << (L - E)) - 1)


class History:
    """Node costs of a pass: slot i is the input of step i (forward) or the cost after step i-1 (backward)."""

    def __init__(self, ring: Ring, B: int, count: int, keep: bool, device: torch.device):
        self.slots = count + 1 if keep else 2
        self.data = torch.empty(B, self.slots, 1 << (ring.L - min(ring.steps)), dtype=torch.float32, device=device)

    def slot(self, i: int, width: int) -> torch.Tensor:
        return self.data[:, i % self.slots, :width]


def blocks(ring: Ring) -> tuple[int, int]:
    """(GROUP, NODES): every step has at least 2^min D predecessors per node and 2^(L - max D) nodes."""
    group = min(16, 1 << min(ring.steps))
    return group, min(STATES // group, 1 << (ring.L - max(ring.steps)))


def _launch(kernel, ring: Ring, targets: torch.Tensor, history: History, start: int, count: int):
    group, nodes = blocks(ring)
    kernel[(targets.shape[0],)](targets, ring.values, _steps(ring, targets.device), history.data, ring.T, start,
                                count, history.slots, history.data.stride(0), history.data.stride(1), L=ring.L,
                                GROUP=group, NODES=nodes, num_warps=WARPS, enable_fp_fusion=False)


def forward(ring: Ring, targets: torch.Tensor, start: int, count: int, init: torch.Tensor,
            keep: bool = False):
    """As trellis.forward; returns (final node costs, History or None)."""
    history = History(ring, targets.shape[0], count, keep, targets.device)
    history.slot(0, init.shape[1]).copy_(init)
    _launch(_forward_kernel, ring, targets.contiguous(), history, start, count)
    final = history.slot(count, 1 << ring.node_bits(start + count - 1)).clone()
    return final, (history if keep else None)


def backward(ring: Ring, targets: torch.Tensor, start: int, count: int, final: torch.Tensor, keep: bool = False):
    """As trellis.backward; returns (costs before `start`, History or None)."""
    history = History(ring, targets.shape[0], count, keep, targets.device)
    history.slot(count, final.shape[1]).copy_(final)
    _launch(_backward_kernel, ring, targets.contiguous(), history, start, count)
    return history.slot(0, 1 << (ring.L - ring.D(start))).clone(), (history if keep else None)


def traceback(ring: Ring, targets: torch.Tensor, history: History, start: int, count: int, last_node: torch.Tensor,
              stop: int = 0):
    B = last_node.shape[0]
    states = torch.empty(B, count - stop, dtype=torch.int64, device=last_node.device)
    _traceback_kernel[(B,)](targets.contiguous(), ring.values, _steps(ring, targets.device), history.data,
                            last_node.contiguous(), states, ring.T, start, count, stop, history.data.stride(0),
                            history.data.stride(1), L=ring.L, ARG_BLOCK=ARG_BLOCK, enable_fp_fusion=False)
    node = states[:, 0] >> ring.D(start + stop) if count > stop else last_node
    return states, node


def trace_forward(ring: Ring, targets: torch.Tensor, history: History, start: int, count: int,
                  first_node: torch.Tensor):
    B = first_node.shape[0]
    states = torch.empty(B, count, dtype=torch.int64, device=first_node.device)
    _trace_forward_kernel[(B,)](targets.contiguous(), ring.values, _steps(ring, targets.device), history.data,
                                first_node.contiguous(), states, ring.T, start, count, history.data.stride(0),
                                history.data.stride(1), L=ring.L, ARG_BLOCK=ARG_BLOCK, enable_fp_fusion=False)
    return states, states[:, -1] & ((1 << ring.node_bits(start + count - 1)) - 1)
