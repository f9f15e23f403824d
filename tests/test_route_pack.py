"""route_pack kernels against torch (bincount + stable argsort), on both paths, with poisoned buffer tails."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from exl3moe.kernels.route_pack import route_pack, route_pack_max_blocks, route_pack_workspace_numel

POISON = -12345
# Poisoned elements past each buffer's end; any write there is a bug.
TAIL = 9


def expected_route_pack(topk_ids: torch.Tensor, num_experts: int, block_m: int,
                        expert_order: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    """What route_pack must write, from torch alone (blocks listed in expert_order when given)."""
    flat = topk_ids.reshape(-1).to(torch.int64)
    mapped = torch.where((flat >= 0) & (flat < num_experts), flat, torch.full_like(flat, num_experts))
    counts = torch.bincount(mapped, minlength=num_experts + 1)
    offsets = torch.cat([counts.new_zeros(1), torch.cumsum(counts, 0)])
    order = torch.arange(num_experts) if expert_order is None else expert_order.cpu().long()
    blocks = (counts[order] + block_m - 1) // block_m
    position = torch.repeat_interleave(torch.arange(num_experts), blocks)
    block_expert = order[position]
    first_block = torch.cumsum(blocks, 0) - blocks
    block_in_expert = torch.arange(block_expert.numel()) - first_block[position]
    block_start = offsets[block_expert] + block_in_expert * block_m
    return {
        "counts": counts,
        "offsets": offsets,
        "sorted_slots": torch.argsort(mapped, stable=True),
        "block_expert": block_expert,
        "block_start": block_start,
        "num_blocks": torch.tensor([block_expert.numel()]),
    }


def poisoned(numel: int, device: str) -> torch.Tensor:
    return torch.full((numel + TAIL,), POISON, dtype=torch.int32, device=device)


def run_route_pack(topk_ids, num_experts, block_m=16, max_blocks=None, expert_order=None,
                   **path) -> dict[str, torch.Tensor]:
    """Launch into views of poisoned buffers; return the full buffers (views plus tails)."""
    num_slots, device = topk_ids.numel(), topk_ids.device
    max_blocks = max_blocks or route_pack_max_blocks(num_slots, num_experts, block_m)
    lengths = {
        "counts": num_experts + 1,
        "offsets": num_experts + 2,
        "sorted_slots": num_slots,
        "block_expert": max_blocks,
        "block_start": max_blocks,
        "num_blocks": 1,
        "workspace": route_pack_workspace_numel(num_slots, num_experts, **path),
    }
    full = {name: poisoned(n, device) for name, n in lengths.items()}
    views = {name: full[name][:n] for name, n in lengths.items()}
    route_pack(topk_ids, num_experts, **views, block_m=block_m, expert_order=expert_order, **path)
    return {name: (full[name], n) for name, n in lengths.items()}


def check_route_pack(topk_ids, num_experts, block_m=16, max_blocks=None, expert_order=None, **path) -> None:
    got = run_route_pack(topk_ids, num_experts, block_m, max_blocks, expert_order, **path)
    want = expected_route_pack(topk_ids.cpu(), num_experts, block_m, expert_order)
    num_slots = topk_ids.numel()
    for name, (buffer, length) in got.items():
        buffer = buffer.cpu().to(torch.int64)
        assert (buffer[length:] == POISON).all(), f"{name} written past its end"
        if name == "workspace":
            continue
        if name in ("block_expert", "block_start"):
            live = want[name].numel()
            filler = -1 if name == "block_expert" else num_slots
            assert (buffer[live:length] == filler).all(), f"{name} past num_blocks is not {filler}"
            buffer = buffer[:live]
        else:
            buffer = buffer[:length]
        assert torch.equal(buffer, want[name]), f"{name}: got {buffer.tolist()[:40]} want {want[name].tolist()[:40]}"


def random_ids(tokens, top_k, num_experts, dtype, generator, invalid_share=0.1):
    """Ids mostly in [0, E), with some E, E+5, -1, -7."""
    ids = torch.randint(0, num_experts, (tokens, top_k), generator=generator)
    invalid = torch.tensor([num_experts, num_experts + 5, -1, -7])
    pick = invalid[torch.randint(0, 4, (tokens, top_k), generator=generator)]
    use_invalid = torch.rand(tokens, top_k, generator=generator) < invalid_share
    return torch.where(use_invalid, pick, ids).to(dtype)


# Forced many-slot path with small chunks, so several chunks run even at interpreter sizes.
CHUNKED = {"small_max_slots": 0, "chunk_slots": 128}


@pytest.mark.parametrize("num_experts", [1, 8, 128, 130])
@pytest.mark.parametrize("top_k", [1, 2, 4, 8])
@pytest.mark.parametrize("tokens", [1, 2, 7, 33, 300, 1000])
def test_matches_torch(tokens, top_k, num_experts):
    generator = torch.Generator().manual_seed(tokens * 1000 + top_k * 10 + num_experts)
    dtype = torch.int64 if (tokens + top_k + num_experts) % 2 else torch.int32
    ids = random_ids(tokens, top_k, num_experts, dtype, generator)
    check_route_pack(ids, num_experts, block_m=16)


@pytest.mark.parametrize(
    "path", [{}, CHUNKED, {"small_max_slots": 0, "chunk_slots": 16}], ids=["one", "chunked", "c16"]
)
@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("block_m", [16, 64])
@pytest.mark.parametrize("tokens,top_k,num_experts", [(1, 1, 1), (7, 2, 8), (33, 8, 130), (300, 4, 128)])
def test_paths_dtypes_block_sizes(tokens, top_k, num_experts, block_m, dtype, path):
    generator = torch.Generator().manual_seed(tokens + top_k + num_experts)
    check_route_pack(random_ids(tokens, top_k, num_experts, dtype, generator, 0.2), num_experts, block_m, **path)


@pytest.mark.parametrize("path", [{}, CHUNKED], ids=["one", "chunked"])
def test_route_blocks_of_192_rows(path):
    """Route blocks need only a multiple of 16 rows: 192-row blocks (sm_90's widest) over experts of 0 to ~400 rows."""
    generator = torch.Generator().manual_seed(192)
    check_route_pack(random_ids(300, 8, 12, torch.int32, generator, 0.2), 12, block_m=192, **path)


@pytest.mark.parametrize("path", [{}, CHUNKED], ids=["one", "chunked"])
@pytest.mark.parametrize(
    "case",
    ["all_one_expert", "all_invalid", "few_experts", "extreme_ids", "last_expert", "no_tokens", "exact_blocks"],
)
def test_edge_cases(case, path):
    generator = torch.Generator().manual_seed(7)
    num_experts, tokens, top_k, dtype = 130, 97, 4, torch.int64
    if case == "all_one_expert":
        ids = torch.full((tokens, top_k), 3)
    elif case == "all_invalid":
        ids = torch.tensor([num_experts, num_experts + 5, -1, -7]).repeat(tokens, 1)
    elif case == "few_experts":
        ids = torch.tensor([5, 17, 129])[torch.randint(0, 3, (tokens, top_k), generator=generator)]
    elif case == "extreme_ids":
        extremes = torch.tensor([2**40, -(2**40), 2**63 - 1, -(2**63), 0, 129, 130, -1])
        ids = extremes.repeat(tokens, 1)[:, :top_k].contiguous()
    elif case == "last_expert":
        ids = torch.full((tokens, top_k), num_experts - 1)
    elif case == "no_tokens":
        ids = torch.zeros((0, top_k))
    else:
        # Every expert gets exactly 128 rows: a multiple of both block sizes.
        ids, num_experts = (torch.arange(384) // 32 % 3).reshape(96, top_k), 3
    check_route_pack(ids.to(dtype), num_experts, block_m=16, **path)
    check_route_pack(ids.to(dtype).clamp(-(2**31), 2**31 - 1).to(torch.int32), num_experts, block_m=64, **path)


@pytest.mark.parametrize("path", [{}, CHUNKED], ids=["one", "chunked"])
def test_block_bound_is_reached_without_overflow(path):
    """route_pack_max_blocks = ceil(N / block_m) + min(E, N): one row on each of N experts, and block_m + 1 rows
    on each of E experts (two blocks each), both fit exactly the tables it sizes."""
    one_each = torch.randperm(64, generator=torch.Generator().manual_seed(5))[:24].reshape(3, 8)
    check_route_pack(one_each.to(torch.int32), 64, block_m=16, **path)
    assert route_pack_max_blocks(24, 64, 16) == 26
    two_each = (torch.arange(17 * 8) % 8).reshape(17, 8)
    check_route_pack(two_each.to(torch.int64), 8, block_m=16, **path)
    assert route_pack_max_blocks(17 * 8, 8, 16) == 17


@pytest.mark.parametrize("path", [{}, CHUNKED], ids=["one", "chunked"])
def test_extra_block_capacity_is_filled(path):
    generator = torch.Generator().manual_seed(3)
    ids = random_ids(40, 8, 16, torch.int32, generator)
    check_route_pack(ids, 16, block_m=32, max_blocks=route_pack_max_blocks(320, 16, 32) + 50, **path)


@pytest.mark.parametrize("path", [{}, CHUNKED], ids=["one", "chunked"])
@pytest.mark.parametrize("block_m", [16, 64])
@pytest.mark.parametrize("tokens,top_k,num_experts", [(1, 1, 1), (7, 2, 8), (33, 8, 130), (300, 4, 128)])
def test_block_table_in_expert_order(tokens, top_k, num_experts, block_m, path):
    """With expert_order, blocks follow it; counts, offsets and sorted slots are the unordered ones."""
    generator = torch.Generator().manual_seed(tokens * 7 + num_experts)
    ids = random_ids(tokens, top_k, num_experts, torch.int64, generator, 0.2)
    order = torch.randperm(num_experts, generator=generator).to(torch.int32)
    check_route_pack(ids, num_experts, block_m, expert_order=order, **path)
    reversed_order = torch.arange(num_experts - 1, -1, -1, dtype=torch.int32)
    got = run_route_pack(ids, num_experts, block_m, expert_order=reversed_order, **path)
    experts = got["block_expert"][0][: got["num_blocks"][0][0]]
    assert torch.equal(experts, experts.sort(descending=True).values)


@settings(max_examples=40, deadline=None)
@given(
    tokens=st.integers(0, 70),
    top_k=st.integers(1, 16),
    num_experts=st.integers(1, 40),
    dtype=st.sampled_from([torch.int32, torch.int64]),
    block_m=st.sampled_from([16, 32, 64]),
    chunk_slots=st.sampled_from([None, 16, 64]),
    seed=st.integers(0, 2**31 - 1),
)
def test_property_random_shapes(tokens, top_k, num_experts, dtype, block_m, chunk_slots, seed):
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(-10, num_experts + 10, (tokens, top_k), generator=generator).to(dtype)
    path = {} if chunk_slots is None else {"small_max_slots": 0, "chunk_slots": chunk_slots}
    check_route_pack(ids, num_experts, block_m, **path)


@pytest.mark.gpu
@pytest.mark.parametrize(
    "tokens,top_k,num_experts,block_m",
    [(4096, 8, 128, 64), (16, 8, 128, 16), (512, 8, 512, 16), (100_000, 16, 512, 64)],
)
def test_gpu_large_and_cuda_graph_replay(tokens, top_k, num_experts, block_m):
    generator = torch.Generator().manual_seed(tokens)
    first = random_ids(tokens, top_k, num_experts, torch.int64, generator, 0.01).cuda()
    second = random_ids(tokens, top_k, num_experts, torch.int64, generator, 0.01).cuda()
    check_route_pack(first, num_experts, block_m)
    num_slots = tokens * top_k
    max_blocks = route_pack_max_blocks(num_slots, num_experts, block_m)
    static_ids = first.clone()
    buffers = {
        "counts": torch.empty(num_experts + 1, dtype=torch.int32, device="cuda"),
        "offsets": torch.empty(num_experts + 2, dtype=torch.int32, device="cuda"),
        "sorted_slots": torch.empty(num_slots, dtype=torch.int32, device="cuda"),
        "block_expert": torch.empty(max_blocks, dtype=torch.int32, device="cuda"),
        "block_start": torch.empty(max_blocks, dtype=torch.int32, device="cuda"),
        "num_blocks": torch.empty(1, dtype=torch.int32, device="cuda"),
        "workspace": torch.empty(route_pack_workspace_numel(num_slots, num_experts), dtype=torch.int32, device="cuda"),
    }
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        route_pack(static_ids, num_experts, **buffers, block_m=block_m)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        route_pack(static_ids, num_experts, **buffers, block_m=block_m)
    for ids in (second, first):
        static_ids.copy_(ids)
        graph.replay()
        torch.cuda.synchronize()
        want = expected_route_pack(ids.cpu(), num_experts, block_m)
        live = want["block_expert"].numel()
        for name in ("counts", "offsets", "sorted_slots", "num_blocks"):
            assert torch.equal(buffers[name].cpu().long(), want[name]), name
        assert torch.equal(buffers["block_expert"][:live].cpu().long(), want["block_expert"])
        assert torch.equal(buffers["block_start"][:live].cpu().long(), want["block_start"])
        assert (buffers["block_expert"][live:] == -1).all()
    replayed = {name: buffer.clone() for name, buffer in buffers.items()}
    graph.replay()
    torch.cuda.synchronize()
    for name in ("counts", "offsets", "sorted_slots", "block_expert", "block_start", "num_blocks"):
        assert torch.equal(buffers[name], replayed[name]), f"{name} differs between replays"
