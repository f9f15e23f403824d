"""A bitshift trellis ring (state width, bits per position, value of each state) and its Viterbi passes in torch.

Positions p = 0..T-1 form a ring. State s(p) has L bits; s(p) = ((s(p-1) << D(p)) | symbol) mod 2^L, with
s(-1) = s(T-1). The node after position p is the low L - D(p+1) bits of s(p), which are also the high bits of
s(p+1). A pass keeps, per tile, the best cost of every node and updates it with all 2^L states at each step.
"""

from __future__ import annotations

from functools import cached_property

import torch

from ..format.bitstream import state_ends

INF = float("inf")


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

    def forward_table(self, D: int, E: int) -> torch.Tensor:
        """values in the order [n_p, o_hi]: entry (n << E) | h is the state (h << (L-E)) | n."""
        if (D, E) not in self._tables:
            r = torch.arange(1 << self.L, device=self.device)
            states = ((r & ((1 << E) - 1)) << (self.L - E)) | (r >> E)
            self._tables[(D, E)] = self.values[states].contiguous()
        return self._tables[(D, E)]

    @cached_property
    def node_count(self) -> int:
        return 1 << (self.L - self.D(0))


def format_ring(K: float, values: torch.Tensor, dtype: torch.dtype = torch.float32) -> Ring:
    """The EXL3 tile ring: 16-bit states, 256 positions, D(p) = floor((p+1)K) - floor(pK)."""
    ends = (0,) + state_ends(int(K * 2))
    return Ring(16, tuple(ends[p + 1] - ends[p] for p in range(256)), values, dtype)


def forward(ring: Ring, targets: torch.Tensor, start: int, count: int, init: torch.Tensor,
            keep_from: int | None = None, snapshot_at: int | None = None):
    """Viterbi over positions start .. start+count-1 (mod T) from node costs `init` [B, 2^(L-D(start))].

    Returns (costs of the nodes after the last position, decisions, snapshot): decisions[i] (uint8 [B, nodes],
    the high bits of the best state into each node) for steps i >= keep_from, else None; snapshot = the node costs
    after step `snapshot_at`.
    """
    B = targets.shape[0]
    L = ring.L
    m = init
    decisions = [None] * count
    snapshot = None
    cost = torch.empty(B, 1 << L, dtype=ring.dtype, device=targets.device)
    for i in range(count):
        p = (start + i) % ring.T
        D, E = ring.D(p), ring.D(p + 1)
        torch.sub(ring.forward_table(D, E), targets[:, p, None], out=cost)
        cost.square_()
        prev = m.view(B, 1 << E, 1 << (L - D - E)).transpose(1, 2).unsqueeze(2)
        cost.view(B, 1 << (L - D - E), 1 << D, 1 << E).add_(prev)
        grouped = cost.view(B, 1 << (L - E), 1 << E)
        if keep_from is not None and i >= keep_from:
            m, arg = grouped.min(dim=-1)
            decisions[i] = arg.to(torch.uint8)
        else:
            m = grouped.amin(dim=-1)
        if i == snapshot_at:
            snapshot = m.clone()
    return m, decisions, snapshot


def backward(ring: Ring, targets: torch.Tensor, start: int, count: int, final: torch.Tensor, keep: bool = False):
    """Best costs of positions start .. start+count-1 from each node before `start`, given `final` [B, nodes] the
    cost of the node after the last position. Returns (costs [B, 2^(L-D(start))], decisions): decisions[i] (uint8
    [B, nodes], the best symbol of step i from each node before it) if keep, else None."""
    B = targets.shape[0]
    L = ring.L
    g = final
    decisions = [None] * count
    cost = torch.empty(B, 1 << L, dtype=ring.dtype, device=targets.device)
    for i in reversed(range(count)):
        p = (start + i) % ring.T
        D, E = ring.D(p), ring.D(p + 1)
        torch.sub(ring.values, targets[:, p, None], out=cost)
        cost.square_()
        cost.view(B, 1 << E, 1 << (L - E)).add_(g[:, None, :])
        grouped = cost.view(B, 1 << (L - D), 1 << D)
        if keep:
            g, arg = grouped.min(dim=-1)
            decisions[i] = arg.to(torch.uint8)
        else:
            g = grouped.amin(dim=-1)
    return g, (decisions if keep else None)


def trace_forward(ring: Ring, decisions: list, start: int, count: int, first_node: torch.Tensor):
    """Follow backward-pass decisions from `first_node` [B] (the node before `start`); returns (states [B, count],
    node after the last position)."""
    B = first_node.shape[0]
    node = first_node.to(torch.int64)
    states = torch.empty(B, count, dtype=torch.int64, device=first_node.device)
    rows = torch.arange(B, device=first_node.device)
    for i in range(count):
        p = (start + i) % ring.T
        D, E = ring.D(p), ring.D(p + 1)
        state = (node << D) | decisions[i][rows, node].to(torch.int64)
        states[:, i] = state
        node = state & ((1 << (ring.L - E)) - 1)
    return states, node


def traceback(ring: Ring, decisions: list, start: int, count: int, last_node: torch.Tensor,
              stop: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Walk decisions of steps count-1 .. stop back from `last_node` [B]; returns (states [B, count - stop] in step
    order, node before step `stop`)."""
    B = last_node.shape[0]
    L = ring.L
    node = last_node.to(torch.int64)
    states = torch.empty(B, count - stop, dtype=torch.int64, device=last_node.device)
    rows = torch.arange(B, device=last_node.device)
    for i in reversed(range(stop, count)):
        p = (start + i) % ring.T
        D, E = ring.D(p), ring.D(p + 1)
        high = decisions[i][rows, node].to(torch.int64)
        state = (high << (L - E)) | node
        states[:, i - stop] = state
        node = state >> D
    return states, node


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
