"""route_split's wide and narrow block tables against a brute-force choice per expert, with poisoned tails."""

from __future__ import annotations

import pytest
import torch

from exl3moe.kernels.route_pack import route_pack, route_pack_max_blocks, route_pack_workspace_numel
from exl3moe.kernels.route_split import (NARROW_COST, NARROW_ROWS, WIDE_COST, WIDE_ROWS, route_split,
                                         route_split_max_blocks)

POISON, TAIL = -777, 5


def cheapest_split(rows: int) -> tuple:
    """(wide, narrow) blocks covering `rows` at least cost, ties to fewer narrow blocks: for every narrow count (up to
    5 past 3000 rows: three narrow blocks never beat two wide ones), the fewest wide blocks that cover the rest."""
    narrow_counts = range(rows // NARROW_ROWS + 2) if rows < 3000 else range(6)
    pairs = [(max(0, -(-(rows - NARROW_ROWS * b) // WIDE_ROWS)), b) for b in narrow_counts]
    return min(pairs, key=lambda p: (WIDE_COST * p[0] + NARROW_COST * p[1], p[1]))


def expected_tables(counts: torch.Tensor, offsets: torch.Tensor, order: list) -> tuple:
    wide, narrow = [], []
    for e in order:
        a, b = cheapest_split(int(counts[e]))
        wide += [(e, int(offsets[e]) + WIDE_ROWS * j) for j in range(a)]
        narrow += [(e, int(offsets[e]) + WIDE_ROWS * a + NARROW_ROWS * j) for j in range(b)]
    return wide, narrow


def pack(ids: torch.Tensor, num_experts: int) -> tuple:
    """route_pack's counts and offsets of ids (its 128-row table and sorted slots into scratch)."""
    slots, device = ids.numel(), ids.device
    empty = lambda n: torch.empty(n, dtype=torch.int32, device=device)
    counts, offsets = empty(num_experts + 1), empty(num_experts + 2)
    max_blocks = route_pack_max_blocks(slots, num_experts, NARROW_ROWS)
    route_pack(ids, num_experts, counts, offsets, empty(slots), empty(max_blocks), empty(max_blocks), empty(1),
               empty(route_pack_workspace_numel(slots, num_experts)), block_m=NARROW_ROWS)
    return counts, offsets


def run_split(ids: torch.Tensor, num_experts: int, expert_order=None):
    slots = ids.numel()
    counts, offsets = pack(ids, num_experts)
    wide_n, narrow_n = route_split_max_blocks(slots, num_experts)
    full = {name: torch.full((n + TAIL,), POISON, dtype=torch.int32, device=ids.device) for name, n in
            (("wide_expert", wide_n), ("wide_start", wide_n), ("narrow_expert", narrow_n),
             ("narrow_start", narrow_n))}
    lengths = {"wide_expert": wide_n, "wide_start": wide_n, "narrow_expert": narrow_n, "narrow_start": narrow_n}
    route_split(counts, offsets, slots, *(full[k][:lengths[k]] for k in lengths), expert_order=expert_order)
    for name, n in lengths.items():
        assert (full[name][n:] == POISON).all(), f"{name} written past its end"
    return counts, offsets, full, lengths


def check_split(ids: torch.Tensor, num_experts: int, expert_order=None) -> None:
    counts, offsets, full, lengths = run_split(ids, num_experts, expert_order)
    check_tables(ids, counts, offsets, full, lengths, expert_order)


def check_tables(ids, counts, offsets, tables, lengths, expert_order=None) -> None:
    order = expert_order.tolist() if expert_order is not None else list(range(len(counts) - 1))
    want_wide, want_narrow = expected_tables(counts.cpu(), offsets.cpu(), order)
    for kind, want in (("wide", want_wide), ("narrow", want_narrow)):
        n = lengths[kind + "_expert"]
        experts, starts = tables[kind + "_expert"].cpu(), tables[kind + "_start"].cpu()
        assert len(want) <= n, f"{kind} table of {n} entries is too short for {len(want)} blocks"
        got = list(zip(experts[:len(want)].tolist(), starts[:len(want)].tolist()))
        assert got == want, f"{kind}: got {got[:12]} want {want[:12]}"
        assert (experts[len(want):n] == -1).all(), f"{kind}_expert past its blocks is not -1"
        assert (starts[len(want):n] == ids.numel()).all(), f"{kind}_start past its blocks is not N"


@pytest.mark.parametrize("rows,split", [(0, (0, 0)), (1, (0, 1)), (128, (0, 1)), (129, (1, 0)), (192, (1, 0)),
                                        (193, (0, 2)), (256, (0, 2)), (257, (1, 1)), (320, (1, 1)),
                                        (321, (2, 0)), (384, (2, 0)), (448, (1, 2)), (449, (2, 1))])
def test_cheapest_split_edges(rows, split):
    """The block counts the H200 cost ratio gives at the edges of each choice (brute force, used by every test)."""
    assert cheapest_split(rows) == split


@pytest.mark.parametrize("rows_per_expert", [[0, 1, 128, 129, 192, 193], [256, 257, 320, 321, 600, 5],
                                             [448, 449, 0, 0, 1000, 130]])
def test_every_choice_of_blocks(rows_per_expert):
    """Experts whose rows sit on each edge of the choice; both tables, every live entry and the filler past them."""
    ids = torch.cat([torch.full((r,), e, dtype=torch.int32) for e, r in enumerate(rows_per_expert)])
    ids = ids[torch.randperm(ids.numel(), generator=torch.Generator().manual_seed(1))]
    check_split(ids.reshape(-1, 1), len(rows_per_expert))


@pytest.mark.parametrize("tokens,top_k,num_experts", [(1, 1, 1), (40, 8, 4), (300, 8, 16), (700, 4, 3)])
def test_random_routes_with_invalid_ids(tokens, top_k, num_experts):
    generator = torch.Generator().manual_seed(tokens)
    ids = torch.randint(-2, num_experts + 2, (tokens, top_k), generator=generator)
    check_split(ids, num_experts)


def test_expert_order():
    """With expert_order both tables list blocks in that order; the rows stay those of the unordered pack."""
    generator = torch.Generator().manual_seed(5)
    ids = torch.randint(0, 6, (400, 4), generator=generator)
    check_split(ids, 6, torch.tensor([3, 0, 5, 1, 4, 2], dtype=torch.int32))


def test_table_lengths_are_reached():
    """route_split_max_blocks is tight enough to be reached: 129 rows on every expert fill the wide table, 193
    rows on every expert (two narrow blocks each) the narrow one."""
    assert route_split_max_blocks(129 * 4, 4) == (4, 4 + 4)
    check_split(torch.arange(129 * 4).remainder(4).reshape(-1, 1), 4)
    assert route_split_max_blocks(193 * 3, 3)[1] == 6
    check_split(torch.arange(193 * 3).remainder(3).reshape(-1, 1), 3)


def test_bounds_hold_for_every_row_count():
    """Per expert of r rows: at most one wide block per 129 rows, at most (r + 63) // 192 wide blocks and at most
    two narrow blocks, two only past 128 rows (what route_split_max_blocks sums)."""
    for rows in range(1, 3000):
        a, b = cheapest_split(rows)
        assert a <= rows // (NARROW_ROWS + 1) and a <= (rows + WIDE_ROWS - NARROW_ROWS - 1) // WIDE_ROWS, rows
        assert b <= (2 if rows > NARROW_ROWS else 1), rows


@pytest.mark.gpu
@pytest.mark.parametrize("tokens,top_k,num_experts", [(4096, 8, 128), (3072, 8, 128), (100_000, 16, 512)])
def test_gpu_tables_and_cuda_graph_replay(tokens, top_k, num_experts):
    """On the GPU, captured once and replayed over new ids (the second a skewed routing): both tables as the
    brute-force choice says, each time."""
    generator = torch.Generator().manual_seed(tokens)
    uniform = torch.randint(0, num_experts, (tokens, top_k), generator=generator)
    skewed = (torch.rand(tokens, top_k, generator=generator) ** 3 * num_experts).long()
    slots = uniform.numel()
    wide_n, narrow_n = route_split_max_blocks(slots, num_experts)
    lengths = {"wide_expert": wide_n, "wide_start": wide_n, "narrow_expert": narrow_n, "narrow_start": narrow_n}
    tables = {name: torch.full((n,), POISON, dtype=torch.int32, device="cuda") for name, n in lengths.items()}
    counts, offsets = pack(uniform.cuda(), num_experts)
    side = torch.cuda.Stream()   # compiled before the capture
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        route_split(counts, offsets, slots, *tables.values())
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        route_split(counts, offsets, slots, *tables.values())
    for ids in (skewed, uniform):
        new_counts, new_offsets = pack(ids.cuda(), num_experts)
        counts.copy_(new_counts)
        offsets.copy_(new_offsets)
        graph.replay()
        torch.cuda.synchronize()
        check_tables(ids, counts, offsets, tables, lengths)


def test_the_choice_does_not_hang_on_the_cost_ratio():
    """Any 192-row block cost from 1.05x to 1.5x a 128-row one chooses the blocks WIDE_COST : NARROW_COST does."""
    def choice(rows, ratio):
        pairs = [(max(0, -(-(rows - NARROW_ROWS * b) // WIDE_ROWS)), b) for b in range(rows // NARROW_ROWS + 2)]
        return min(pairs, key=lambda p: (ratio * p[0] + p[1], p[1]))
    for ratio in (1.05, 1.2, 1.45, 1.5):
        assert all(choice(rows, ratio) == cheapest_split(rows) for rows in range(2000)), ratio
