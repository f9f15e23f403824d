"""A bitshift trellis ring (state width, bits per position, value of each state) and its Viterbi passes in torch.

Positions p = 0..T-1 form a ring. State s(p) has L bits; s(p) = ((s(p-1) << D(p)) | symbol) mod 2^L, with
s(-1) = s(T-1). The node after position p is the low L - D(p+1) bits of s(p), which are also the high bits of
s(p+1). A pass keeps, per tile, the best cost of every node and updates it with all 2^L states at each step.
"""

from __future__ import annotations

import os
from functools import cached_property

import torch

from ..errors import ContractError
from ..format.bitstream import state_ends
from .phases import count as count_phase
from .phases import part

INF = float("inf")
# "auto": Triton passes on CUDA, torch elsewhere; "torch" or "triton" force one (EXL3MOE_QUANT_BACKEND).
BACKEND = os.environ.get("EXL3MOE_QUANT_BACKEND", "auto")
# Triton pass kernels: "global" (node costs through a history in global memory, trellis_triton) or "onchip" (node
# costs carried on chip, trellis_onchip; rings of one step width, else "global") (EXL3MOE_QUANT_SEARCH).
SEARCH = os.environ.get("EXL3MOE_QUANT_SEARCH", "global")


class Ring:
    """L-bit states, steps[p] = D(p) new bits at position p, values[s] = the reconstruction of state s."""

    def __init__(self, L: int, steps: tuple, values: torch.Tensor, dtype: torch.dtype = torch.float32):
        if values.numel() != 1 << L:
            raise ValueError(f"values must have 2^L = {1 << L} entries, got {values.numel()}")
        if any(d < 1 for d in steps) or any(steps[p] + steps[(p + 1) % len(steps)] > L for p in range(len(steps))):
            raise ValueError("every D(p) must be >= 1 and D(p) + D(p+1) <= L")
        if sum(steps) < L:
            raise ValueError(f"the ring must hold at least L = {L} bits, got {sum(steps)}")
        self.L = L
        self.steps = tuple(int(d) for d in steps)
        self.values = values.to(dtype)
        self.dtype = dtype
        self._tables: dict = {}

    @property
    def T(self) -> int:
        return len(self.steps)

    @property
    def device(self) -> torch.device:
        return self.values.device

    def D(self, p: int) -> int:
        return self.steps[p % self.T]

    def node_bits(self, p: int) -> int:
        """Width of the node after position p (the low bits of s(p) that s(p+1) keeps)."""
        return self.L - self.D(p + 1)

    def backward_table(self, D: int) -> torch.Tensor:
        """values in the order [symbol, node before]: entry (y << (L-D)) | n is the state (n << D) | y."""
        if D not in self._tables:
            r = torch.arange(1 << self.L, device=self.device)
            states = ((r & ((1 << (self.L - D)) - 1)) << D) | (r >> (self.L - D))
            self._tables[D] = self.values[states].contiguous()
        return self._tables[D]

    @cached_property
    def node_count(self) -> int:
        return 1 << (self.L - self.D(0))


def format_ring(K: float, values: torch.Tensor, dtype: torch.dtype = torch.float32) -> Ring:
    """The EXL3 tile ring: 16-bit states, 256 positions, D(p) = floor((p+1)K) - floor(pK)."""
    ends = (0,) + state_ends(int(K * 2))
    return Ring(16, tuple(ends[p + 1] - ends[p] for p in range(256)), values, dtype)


def _squared_error(values: torch.Tensor, target: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """(values - target)^2 as two rounded float ops, so that traceback recomputes the same bits."""
    torch.sub(values, target, out=out)
    return out.square_()


def _forward_torch(ring: Ring, targets: torch.Tensor, start: int, count: int, init: torch.Tensor,
                   keep: bool = False):
    """Viterbi over positions start .. start+count-1 (mod T) from node costs `init` [B, 2^(L-D(start))].

    Returns (costs of the nodes after the last position, inputs): inputs[i] is the node-cost vector that step i
    started from, kept if `keep` (traceback recomputes the step's choice from it), else None.
    """
    B = targets.shape[0]
    L = ring.L
    m = init
    inputs = [None] * count
    cost = torch.empty(B, 1 << L, dtype=ring.dtype, device=targets.device)
    for i in range(count):
        p = (start + i) % ring.T
        D, E = ring.D(p), ring.D(p + 1)
        if keep:
            inputs[i] = m
        _squared_error(ring.values, targets[:, p, None], cost)
        cost.view(B, 1 << (L - D), 1 << D).add_(m[:, :, None])
        m = cost.view(B, 1 << E, 1 << (L - E)).amin(dim=1)
    return m, (inputs if keep else None)


def _backward_torch(ring: Ring, targets: torch.Tensor, start: int, count: int, final: torch.Tensor, keep: bool = False):
    """Best costs of positions start .. start+count-1 from each node before `start`, given `final` [B, nodes] the
    cost of the node after the last position. Returns (costs [B, 2^(L-D(start))], inputs): inputs[i] is the
    node-cost vector after step i that step i was computed from (all steps if keep, else None)."""
    B = targets.shape[0]
    L = ring.L
    g = final
    inputs = [None] * count
    cost = torch.empty(B, 1 << L, dtype=ring.dtype, device=targets.device)
    for i in reversed(range(count)):
        p = (start + i) % ring.T
        D, E = ring.D(p), ring.D(p + 1)
        if keep:
            inputs[i] = g
        _squared_error(ring.backward_table(D), targets[:, p, None], cost)
        after = g.view(B, 1 << (L - D - E), 1 << D).transpose(1, 2).contiguous()
        cost.view(B, 1 << D, 1 << E, 1 << (L - D - E)).add_(after[:, :, None, :])
        g = cost.view(B, 1 << D, 1 << (L - D)).amin(dim=1)
    return g, (inputs if keep else None)


def _trace_forward_torch(ring: Ring, targets: torch.Tensor, inputs: list, start: int, count: int,
                  first_node: torch.Tensor):
    """Follow a backward pass from `first_node` [B] (the node before `start`), choosing at each step the symbol of
    least cost again; returns (states [B, count], node after the last position)."""
    B = first_node.shape[0]
    L = ring.L
    node = first_node.to(torch.int64)
    states = torch.empty(B, count, dtype=torch.int64, device=first_node.device)
    rows = torch.arange(B, device=first_node.device)[:, None]
    for i in range(count):
        p = (start + i) % ring.T
        D, E = ring.D(p), ring.D(p + 1)
        options = (node[:, None] << D) | torch.arange(1 << D, device=node.device)
        cost = _squared_error(ring.values[options], targets[:, p, None], torch.empty_like(options, dtype=ring.dtype))
        cost.add_(inputs[i][rows, options & ((1 << (L - E)) - 1)])
        state = options.gather(1, cost.argmin(1, keepdim=True)).squeeze(1)
        states[:, i] = state
        node = state & ((1 << (L - E)) - 1)
    return states, node


def _traceback_torch(ring: Ring, targets: torch.Tensor, inputs: list, start: int, count: int, last_node: torch.Tensor,
              stop: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Walk a forward pass back from `last_node` [B] over steps count-1 .. stop, choosing at each step the state of
    least cost again; returns (states [B, count - stop] in step order, node before step `stop`)."""
    B = last_node.shape[0]
    L = ring.L
    node = last_node.to(torch.int64)
    states = torch.empty(B, count - stop, dtype=torch.int64, device=last_node.device)
    rows = torch.arange(B, device=last_node.device)[:, None]
    for i in reversed(range(stop, count)):
        p = (start + i) % ring.T
        D, E = ring.D(p), ring.D(p + 1)
        options = (torch.arange(1 << E, device=node.device) << (L - E)) | node[:, None]
        cost = _squared_error(ring.values[options], targets[:, p, None], torch.empty_like(options, dtype=ring.dtype))
        cost.add_(inputs[i][rows, options >> D])
        state = options.gather(1, cost.argmin(1, keepdim=True)).squeeze(1)
        states[:, i - stop] = state
        node = state >> D
    return states, node


def _count_pass(targets: torch.Tensor, count: int) -> None:
    """pass_steps: steps one after another (the latency); tile_steps: steps x tiles (the work)."""
    count_phase("pass_steps", count)
    count_phase("tile_steps", count * targets.shape[0])


def uses_triton(ring: Ring, targets: torch.Tensor) -> bool:
    """Triton passes for float32 rings: on CUDA unless BACKEND is "torch"; anywhere when it is "triton"."""
    if ring.dtype != torch.float32 or BACKEND == "torch":
        return False
    return BACKEND == "triton" or targets.is_cuda


def _triton_module(ring: Ring):
    """The pass kernels SEARCH selects (trellis_onchip only for rings it supports)."""
    from . import trellis_triton
    if SEARCH == "onchip":
        from . import trellis_onchip
        if trellis_onchip.supports(ring):
            return trellis_onchip
    elif SEARCH != "global":
        raise ContractError("EXL3MOE_QUANT_SEARCH", f"must be 'global' or 'onchip', got {SEARCH!r}")
    return trellis_triton


def forward(ring: Ring, targets: torch.Tensor, start: int, count: int, init: torch.Tensor,
            keep: bool = False):
    """Viterbi over positions start .. start+count-1 (mod T) from node costs `init` [B, 2^(L-D(start))].

    Returns (costs of the nodes after the last position, kept inputs for traceback or None).
    """
    _count_pass(targets, count)
    with part("passes"):
        if uses_triton(ring, targets):
            return _triton_module(ring).forward(ring, targets, start, count, init, keep)
        return _forward_torch(ring, targets, start, count, init, keep)


def backward(ring: Ring, targets: torch.Tensor, start: int, count: int, final: torch.Tensor, keep: bool = False):
    """Best costs of positions start .. start+count-1 from each node before `start` given `final`, the cost of
    each node after the last position; returns (costs [B, 2^(L-D(start))], kept inputs for trace_forward or None).
    """
    _count_pass(targets, count)
    with part("passes"):
        if uses_triton(ring, targets):
            return _triton_module(ring).backward(ring, targets, start, count, final, keep)
        return _backward_torch(ring, targets, start, count, final, keep)


def forward_and_backward(ring: Ring, targets: torch.Tensor, forward_part: tuple, backward_part: tuple):
    """(forward(ring, targets, *forward_part), backward(ring, targets, *backward_part)) for two independent passes,
    each part (start, count, costs, keep); with the on-chip search both run in one launch, side by side."""
    module = _triton_module(ring) if uses_triton(ring, targets) else None
    if module is None or not hasattr(module, "forward_and_backward"):
        return forward(ring, targets, *forward_part), backward(ring, targets, *backward_part)
    count_phase("pass_steps", max(forward_part[1], backward_part[1]))
    count_phase("tile_steps", (forward_part[1] + backward_part[1]) * targets.shape[0])
    with part("passes"):
        return module.forward_and_backward(ring, targets, forward_part, backward_part)


def traceback(ring: Ring, targets: torch.Tensor, inputs, start: int, count: int, last_node: torch.Tensor,
              stop: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Walk a forward pass back from `last_node` over steps count-1 .. stop: (states in step order, node before
    step `stop`)."""
    count_phase("traceback_steps", count - stop)
    with part("tracebacks"):
        if not isinstance(inputs, list):
            from . import trellis_triton
            return trellis_triton.traceback(ring, targets, inputs, start, count, last_node, stop)
        return _traceback_torch(ring, targets, inputs, start, count, last_node, stop)


def trace_forward(ring: Ring, targets: torch.Tensor, inputs, start: int, count: int, first_node: torch.Tensor):
    """Follow a backward pass from `first_node` (the node before `start`): (states, node after the last)."""
    count_phase("traceback_steps", count)
    with part("tracebacks"):
        if not isinstance(inputs, list):
            from . import trellis_triton
            return trellis_triton.trace_forward(ring, targets, inputs, start, count, first_node)
        return _trace_forward_torch(ring, targets, inputs, start, count, first_node)


def trace_both(ring: Ring, targets: torch.Tensor, forward_part: tuple, back_part: tuple):
    """(trace_forward(ring, targets, *forward_part), traceback(ring, targets, *back_part)) for two independent walks,
    parts (inputs, start, count, node); with the on-chip search both run in one launch, side by side."""
    module = _triton_module(ring) if uses_triton(ring, targets) else None
    kept = not isinstance(forward_part[0], list) and not isinstance(back_part[0], list)
    if module is None or not kept or not hasattr(module, "trace_both"):
        return trace_forward(ring, targets, *forward_part), traceback(ring, targets, *back_part)
    count_phase("traceback_steps", max(forward_part[2], back_part[2]))
    with part("tracebacks"):
        return module.trace_both(ring, targets, forward_part, back_part)


def one_hot_start(ring: Ring, nodes: torch.Tensor) -> torch.Tensor:
    """Initial costs that force the node before position 0 to `nodes` [B]."""
    init = torch.full((nodes.shape[0], ring.node_count), INF, dtype=ring.dtype, device=nodes.device)
    init[torch.arange(nodes.shape[0], device=nodes.device), nodes] = 0
    return init


def path_cost(ring: Ring, targets: torch.Tensor, states: torch.Tensor) -> torch.Tensor:
    """Sum over positions of (value(state) - target)^2, in the ring's dtype, [B]."""
    return (ring.values[states] - targets.to(ring.dtype)).square().sum(-1)


def ring_consistent(ring: Ring, states: torch.Tensor) -> torch.Tensor:
    """[B] bool: every s(p) keeps the low L - D(p) bits of s(p-1) as its high bits, around the ring."""
    prev = torch.roll(states, 1, dims=-1)
    D = torch.tensor(ring.steps, device=states.device)
    keep = ring.L - D
    return (((prev & ((1 << keep) - 1)) == (states >> D))).all(-1)
