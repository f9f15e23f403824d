"""Split rules of exl3moe.parallel.split: shards of whole 128-wide Hadamard blocks give the whole layer's output."""

import pytest
import torch

from exl3moe import reference
from exl3moe.errors import ContractError
from exl3moe.parallel.split import block_ranges, column_shard, input_slice, row_shard

from helpers import random_weight


@pytest.mark.parametrize("blocks,world,expected", [
    (11, 2, [(0, 6), (6, 11)]),                   # GLM-4.5-Air's expert width 1408: 6 + 5 blocks
    (4, 4, [(0, 1), (1, 2), (2, 3), (3, 4)]),
    (5, 3, [(0, 2), (2, 4), (4, 5)]),
])
def test_block_ranges_cover_every_block_once(blocks, world, expected):
    assert block_ranges(blocks, world, "w") == expected


@pytest.mark.parametrize("world", [1, 2, 3])
@pytest.mark.parametrize("K,codebook", [(4, "mcg"), (2.5, "mul1"), (3, "3inst")])
def test_column_shards_concatenate_to_the_whole_output(world, K, codebook):
    g = torch.Generator().manual_seed(world)
    w = random_weight(256, 384, K, codebook, bias=True, generator=g)
    x = torch.randn(5, 256, generator=g).half()
    whole = reference.linear(x, w)
    parts = [reference.linear(x, column_shard(w, r, world)) for r in range(world)]
    assert [p.shape[1] for p in parts] == [(stop - first) * 128 for first, stop in block_ranges(3, world, "w")]
    torch.testing.assert_close(torch.cat(parts, dim=1), whole, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("world", [1, 2, 3])
@pytest.mark.parametrize("K,codebook", [(4, "mcg"), (1.5, "mul1")])
def test_row_shards_sum_to_the_whole_output(world, K, codebook):
    g = torch.Generator().manual_seed(10 + world)
    w = random_weight(384, 256, K, codebook, bias=True, generator=g)
    x = torch.randn(7, 384, generator=g).half()
    whole = reference.linear(x, w)
    parts = [reference.linear(x[:, input_slice(r, world, 384)].contiguous(), row_shard(w, r, world))
             for r in range(world)]
    assert sum(row_shard(w, r, world).bias is not None for r in range(world)) == 1
    torch.testing.assert_close(sum(parts), whole, rtol=1e-9, atol=1e-9)


def test_a_world_that_leaves_a_rank_without_a_block_is_refused():
    w = random_weight(256, 384, 4, "mcg", name="layers.0.down_proj")
    with pytest.raises(ContractError, match=r"layers\.0\.down_proj \(rows\).*world of 3 leaves a rank with none"):
        row_shard(w, 0, 3)
    with pytest.raises(ContractError, match=r"columns"):
        column_shard(w, 0, 4)


@pytest.mark.parametrize("rank,world", [(2, 2), (-1, 2), (0, 0), (True, 2), (0, 1.5)])
def test_bad_rank_or_world_is_refused(rank, world):
    w = random_weight(256, 256, 4, "mcg")
    with pytest.raises(ContractError):
        column_shard(w, rank, world)
