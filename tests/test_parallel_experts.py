"""Expert and tensor parallel routed experts over gloo (2 processes on the CPU): the ranks' partial outputs,
all-reduced, equal the single-process layer and the float64 oracle."""

import os
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from exl3moe import reference
from exl3moe.errors import ContractError
from exl3moe.ops.moe import fused_experts
from exl3moe.parallel.experts import expert_range, expert_shard, local_ids, tensor_shard

from helpers import free_port, random_experts

E, HIDDEN, INTER, TOP_K, TOKENS = 5, 128, 384, 2, 6


def layer():
    """The same layer and routing in every process (fixed seeds): mixed K and codebooks, intermediate of 3 blocks."""
    g = torch.Generator().manual_seed(7)
    experts = random_experts(E, HIDDEN, INTER, K=[4, 2, 3, 2.5, 4], codebook=["mcg", "3inst", "mul1", "mul1", "mcg"],
                             generator=g)
    hidden = (torch.randn(TOKENS, HIDDEN, generator=g) * 0.5).half()
    weights, ids = torch.softmax(torch.randn(TOKENS, E, generator=g), -1).topk(TOP_K, dim=-1)
    return experts, hidden, ids, weights / weights.sum(-1, keepdim=True)


def rank_output(mode: str, rank: int, world: int) -> torch.Tensor:
    experts, hidden, ids, weights = layer()
    if mode == "ep":
        first, stop = expert_range(E, rank, world)
        return fused_experts(hidden, expert_shard(experts, rank, world), local_ids(ids, first, stop - first),
                             weights, out_dtype=torch.float32)
    return fused_experts(hidden, tensor_shard(experts, rank, world), ids, weights, out_dtype=torch.float32)


def worker(rank: int, world: int, port: int, mode: str, result: str) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        out = rank_output(mode, rank, world)
        dist.all_reduce(out)
        if rank == 0:
            torch.save(out, result)
    finally:
        dist.destroy_process_group()


def rel_l2(a, b) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


@pytest.mark.parametrize("mode", ["ep", "tp"])
def test_sharded_layer_over_two_gloo_ranks_equals_one_process(mode, tmp_path):
    result = str(tmp_path / "out.pt")
    mp.spawn(worker, args=(2, free_port(), mode, result), nprocs=2, join=True)
    sharded = torch.load(result)
    experts, hidden, ids, weights = layer()
    single = fused_experts(hidden, experts, ids, weights, out_dtype=torch.float32)
    assert rel_l2(sharded, single) < 1e-5
    assert rel_l2(sharded, reference.moe(hidden, experts, ids, weights)) < 2e-3


def test_local_ids_send_other_ranks_ids_outside_the_shard():
    ids = torch.tensor([[0, 4], [2, 3], [1, 2]])
    assert local_ids(ids, 2, 2).tolist() == [[2, 2], [0, 1], [2, 0]]


def test_expert_ranges_are_contiguous_and_uneven_where_needed():
    assert [expert_range(5, r, 2) for r in range(2)] == [(0, 3), (3, 5)]
    with pytest.raises(ContractError, match="world"):
        expert_range(2, 0, 3)


def test_tensor_shard_refuses_a_world_that_leaves_a_rank_without_a_block():
    experts, *_ = layer()
    with pytest.raises(ContractError, match="leaves a rank with none"):
        tensor_shard(experts, 0, 4)


def test_checkpoint_reads_only_the_ranks_experts(fixtures_dir, monkeypatch):
    from exl3moe.format.checkpoint import CheckpointReader, open_checkpoint

    reader = open_checkpoint(os.path.join(fixtures_dir, "tiny_qwen3_moe_exl3"))
    prefix = "model.layers.1.mlp"
    whole = reader.experts(prefix)
    read, linear = [], CheckpointReader.linear

    def recording(self, key, device=None):
        read.append(key)
        return linear(self, key, device)

    monkeypatch.setattr(CheckpointReader, "linear", recording)
    shard = reader.experts(prefix, shard=(1, 3))
    first, stop = expert_range(whole.num_experts, 1, 3)
    assert (first, stop) == (6, 11)
    assert sorted({key.split(".experts.")[1].split(".")[0] for key in read}) == sorted(map(str, range(first, stop)))
    expected = expert_shard(whole, 1, 3)
    for got, want in zip(shard.down + shard.up + shard.gate, expected.down + expected.up + expected.gate):
        assert torch.equal(got.trellis, want.trellis) and torch.equal(got.svh, want.svh)
    with pytest.raises(ContractError, match="world"):
        reader.experts(prefix, shard=(0, 17))


def test_an_expert_shard_plans_its_work_as_its_whole_layer():
    """A shard keeps the layer's expert count (layer_experts), so its splits, route-block rows and wide-block choices
    are one process's: its experts' rows get one process's bytes."""
    from exl3moe.ops.moe_planning import gate_up_splits, moe_mma_layout, route_block_rows, wide_route_blocks

    whole = random_experts(8, 256, 128, K=3, codebook="mcg", generator=torch.Generator().manual_seed(9))
    shard = expert_shard(whole, 1, 4)
    assert (shard.num_experts, shard.planned_experts) == (2, 8)
    assert expert_shard(shard, 0, 2).planned_experts == 8, "a shard of a shard plans as the whole layer"
    for slots in (2, 16, 64, 512):
        for block_m in (16, 32, 128):
            a, b = moe_mma_layout(whole, slots, block_m), moe_mma_layout(shard, slots, block_m)
            assert (a.gate_up_splits, a.gate_up_ktiles, a.down_splits, a.down_ktiles) == \
                (b.gate_up_splits, b.gate_up_ktiles, b.down_splits, b.down_ktiles), (slots, block_m)
        assert route_block_rows(slots, shard.planned_experts) == route_block_rows(slots, whole.num_experts)
        assert wide_route_blocks(shard, slots, slots) == wide_route_blocks(whole, slots, slots)
    assert gate_up_splits(shard.planned_experts, 256, 128) == gate_up_splits(8, 256, 128)
    for bad in (1, 2.5, True):
        with pytest.raises(ContractError, match="layer_experts"):
            shard.replace(layer_experts=bad)


def test_a_tensor_shard_splits_gate_up_as_its_whole_layer():
    """A tensor-parallel shard keeps the layer's intermediate width (layer_intermediate), so gate/up sum k in one
    process's splits and its slice of the intermediate has one process's bytes; down's k is the shard's own."""
    from exl3moe.ops.moe_planning import moe_mma_layout

    whole = random_experts(8, 512, 768, K=3, codebook="mcg", generator=torch.Generator().manual_seed(4))
    shard = tensor_shard(whole, 1, 2)
    assert (shard.intermediate_size, shard.planned_intermediate) == (384, 768)
    assert tensor_shard(expert_shard(whole, 0, 2), 1, 2).planned_intermediate == 768
    assert expert_shard(shard, 0, 2).planned_intermediate == 768, "an expert shard of a tensor shard keeps the width"
    for slots in (1, 8, 64, 512):
        for block_m in (16, 32, 128):
            a, b = moe_mma_layout(whole, slots, block_m), moe_mma_layout(shard, slots, block_m)
            assert (a.gate_up_splits, a.gate_up_ktiles) == (b.gate_up_splits, b.gate_up_ktiles), (slots, block_m)
    for bad in (383, 400, 2.5, True):
        with pytest.raises(ContractError, match="layer_intermediate"):
            whole.replace(layer_intermediate=bad)
