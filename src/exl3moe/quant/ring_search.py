"""The exact tail-biting optimum of a trellis ring per tile, batched over tiles.

The seam node o joins position T-1 to position 0. Cutting the ring at h = T/2 into a head (0..h-1) and a tail
(h..T-1), every potential phi over the cut nodes x gives a lower bound of the best ring path through seam o:
LB(o) = min_x [head(o -> x) + phi(x)] + min_x [tail(x -> o) - phi(x)]  (docs/quant.md).
The seam of least bound is the ring optimum when its head and tail meet at one cut node; otherwise it is searched
with the seam forced (an upper bound U) and so is every other seam with LB(o) < U.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .phases import phase
from .trellis import INF, Ring, forward, forward_and_backward, one_hot_start, path_cost, trace_both, traceback

# Bounds and costs are float sums in different orders; a seam is skipped only when its bound exceeds U by this margin.
BOUND_SLACK = 2.0 ** -14


@dataclass
class RingResult:
    states: torch.Tensor     # int64 [B, T], s(p) of the best ring path
    cost: torch.Tensor       # [B], its sum of squared errors
    forced: int = 0          # tiles whose bound path did not close at the cut (searched with the seam forced)
    seams_searched: int = 0  # forced-seam passes beyond that one
    improved: int = 0        # tiles whose optimum was not the seam of least bound


def free_cost(ring: Ring, targets: torch.Tensor) -> torch.Tensor:
    """[B] the best cost over paths with a free start and end (a lower bound of the ring optimum)."""
    init = torch.zeros(targets.shape[0], ring.node_count, dtype=ring.dtype, device=targets.device)
    m, _ = forward(ring, targets.to(ring.dtype), 0, ring.T, init)
    return m.amin(-1)


def forced_seam(ring: Ring, targets: torch.Tensor, seams: torch.Tensor, with_path: bool):
    """Best ring path with the seam node forced to `seams` [B]: (cost [B], states [B, T] or None)."""
    m, inputs = forward(ring, targets, 0, ring.T, one_hot_start(ring, seams), keep=with_path)
    cost = m[torch.arange(seams.shape[0], device=seams.device), seams]
    if not with_path:
        return cost, None
    states, _ = traceback(ring, targets, inputs, 0, ring.T, seams)
    return cost, states


def bound_paths(ring: Ring, targets: torch.Tensor):
    """Seam bounds with phi = (best free-end tail from x - best free-start head into x) / 2.

    Returns (bounds [B, nodes], seam of least bound [B], its path [B, T], whether head and tail meet at the cut [B]).
    """
    B, T, h = targets.shape[0], ring.T, ring.T // 2
    free = torch.zeros(B, ring.node_count, dtype=ring.dtype, device=targets.device)
    (head_in, _), (tail_out, _) = forward_and_backward(ring, targets, (0, h, free, False), (h, T - h, free, False))
    phi = (tail_out - head_in) / 2
    (tail, tail_inputs), (head, head_inputs) = forward_and_backward(ring, targets, (h, T - h, -phi, True),
                                                                    (0, h, phi, True))
    bounds = head + tail
    seam = bounds.argmin(-1)
    (head_states, head_end), (tail_states, tail_start) = trace_both(ring, targets, (head_inputs, 0, h, seam),
                                                                    (tail_inputs, h, T - h, seam))
    return bounds, seam, torch.cat((head_states, tail_states), 1), head_end == tail_start


def search_ring(ring: Ring, targets: torch.Tensor, exact: bool = True, chunk: int = 64) -> RingResult:
    """The ring optimum of every row of `targets` [B, T] (exact=False: the seam of least bound, forced if needed)."""
    targets = targets.to(ring.dtype)
    with phase("search_bound"):
        bounds, seam, states, closed = bound_paths(ring, targets)
        result = RingResult(states, path_cost(ring, targets, states))
        cost = result.cost
        open_tiles = (~closed).nonzero().flatten()
        if open_tiles.numel():
            cost[open_tiles], states[open_tiles] = forced_seam(ring, targets[open_tiles], seam[open_tiles], True)
            result.forced = open_tiles.numel()
    if exact:
        with phase("search_seams"):
            _search_other_seams(ring, targets, bounds, seam, result, chunk)
    result.cost = path_cost(ring, targets, result.states)
    return result


def _search_other_seams(ring: Ring, targets: torch.Tensor, bounds: torch.Tensor, seam: torch.Tensor,
                        result: RingResult, chunk: int) -> None:
    cost = result.cost
    nodes = bounds.shape[1]
    bounds[torch.arange(bounds.shape[0], device=bounds.device), seam] = INF
    candidates = (bounds < (cost * (1 + BOUND_SLACK))[:, None]).flatten().nonzero().flatten()
    candidates = candidates[bounds.flatten()[candidates].argsort()]
    best_seam = seam.clone()
    while candidates.numel():
        live = bounds.flatten()[candidates] < (cost * (1 + BOUND_SLACK))[candidates // nodes]
        candidates = candidates[live]
        batch, candidates = candidates[:chunk], candidates[chunk:]
        if not batch.numel():
            break
        tile, node = batch // nodes, batch % nodes
        found, _ = forced_seam(ring, targets[tile], node, with_path=False)
        result.seams_searched += batch.numel()
        least = torch.full_like(cost, INF).scatter_reduce(0, tile, found, "amin")
        better = (found == least[tile]) & (found < cost[tile])
        first = torch.full_like(best_seam, nodes).scatter_reduce(0, tile[better], node[better], "amin")
        improved = first < nodes
        best_seam[improved] = first[improved]  # among equal costs, the lowest seam: the same bytes on every run
        torch.minimum(cost, least, out=cost)
    changed = (best_seam != seam).nonzero().flatten()
    if changed.numel():
        _, result.states[changed] = forced_seam(ring, targets[changed], best_seam[changed], with_path=True)
        result.improved = changed.numel()
