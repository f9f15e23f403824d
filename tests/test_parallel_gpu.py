"""The GPU kernels sharded over two processes on one GPU (gloo over CUDA tensors) at the Qwen3-30B-A3B shape: routed
experts by EP and by TP (768 = 3 + 3 blocks), attention q by columns and o by rows; all-reduced fp32 outputs within
1e-5 relative L2 of one process and 2e-3 of float64, a rank's bytes equal run to run."""

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from exl3moe import EXL3Weight, ExpertSet, reference
from exl3moe.ops import fused_experts
from exl3moe.ops.linear import linear
from exl3moe.parallel.experts import expert_range, expert_shard, local_ids, tensor_shard
from exl3moe.parallel.split import column_shard, input_slice, row_shard

from helpers import free_port

pytestmark = pytest.mark.gpu

E, HIDDEN, INTER, TOP_K, HEADS = 128, 2048, 768, 8, 32 * 128


def random_weight(k, n, K, codebook, g, name):
    trellis = torch.randint(-32768, 32768, (k // 16, n // 16, int(16 * K)), dtype=torch.int32, device="cuda",
                            generator=g).to(torch.int16)
    sign = lambda m: torch.where(torch.rand(m, device="cuda", generator=g) < 0.5, -1.0, 1.0)  # noqa: E731
    suh = (sign(k) * (0.5 + torch.rand(k, device="cuda", generator=g))).half()
    svh = (sign(n) * (0.5 + torch.rand(n, device="cuda", generator=g)) / 64).half()
    return EXL3Weight(trellis, suh, svh, codebook, name=name)


def layer(T: int) -> tuple:
    """The same experts, attention weights, input and routing in every process (seeded on the GPU)."""
    g = torch.Generator(device="cuda").manual_seed(0)
    Ks, books = [4, 3, 2, 2.5], ["mcg", "3inst", "mcg", "mul1"]
    make = lambda p, k, n: [random_weight(k, n, Ks[e % 4], books[e % 4], g, f"{p}[{e}]") for e in range(E)]  # noqa: E731
    experts = ExpertSet(make("gate", HIDDEN, INTER), make("up", HIDDEN, INTER), make("down", INTER, HIDDEN), "silu")
    q = random_weight(HIDDEN, HEADS, 4, "mcg", g, "q_proj")
    o = random_weight(HEADS, HIDDEN, 4, "mcg", g, "o_proj")
    x = (torch.randn(T, HIDDEN, device="cuda", generator=g) / 4).half()
    ids = torch.rand(T, E, device="cuda", generator=g).argsort(-1)[:, :TOP_K].contiguous().to(torch.int32)
    weights = torch.softmax(torch.randn(T, TOP_K, device="cuda", generator=g), -1)
    attn = (torch.randn(T, HEADS, device="cuda", generator=g) / 4).half()
    return experts, q, o, x, ids, weights, attn


def rank_outputs(rank: int, world: int, T: int) -> dict:
    experts, q, o, x, ids, weights, attn = layer(T)
    first, stop = expert_range(E, rank, world)
    ep = fused_experts(x, expert_shard(experts, rank, world), local_ids(ids, first, stop - first), weights,
                       out_dtype=torch.float32)
    tp = fused_experts(x, tensor_shard(experts, rank, world), ids, weights, out_dtype=torch.float32)
    q_cols = linear(x, column_shard(q, rank, world), out_dtype=torch.float32)
    o_rows = linear(attn[:, input_slice(rank, world, HEADS)].contiguous(), row_shard(o, rank, world),
                    out_dtype=torch.float32)
    return {"ep": ep, "tp": tp, "q": q_cols, "o": o_rows}


def worker(rank: int, world: int, port: int, T: int, result: str) -> None:
    torch.cuda.set_device(0)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        first, again = rank_outputs(rank, world, T), rank_outputs(rank, world, T)
        repeat = all(torch.equal(first[k], again[k]) for k in first)
        for key in ("ep", "tp", "o"):
            dist.all_reduce(first[key])
        pieces = [torch.empty_like(first["q"]) for _ in range(world)]
        dist.all_gather(pieces, first["q"])
        first["q"] = torch.cat(pieces, dim=1)
        if rank == 0:
            torch.save({**{k: v.cpu() for k, v in first.items()}, "repeat": repeat}, result)
    finally:
        dist.destroy_process_group()


def rel_l2(a, b) -> float:
    return ((a.double().cpu() - b.double().cpu()).norm() / b.double().cpu().norm()).item()


@pytest.mark.parametrize("T", [1, 64])
def test_two_processes_on_one_gpu_match_one_process_and_float64(T, tmp_path):
    result = str(tmp_path / "out.pt")
    mp.spawn(worker, args=(2, free_port(), T, result), nprocs=2, join=True)
    got = torch.load(result)
    assert got["repeat"]
    experts, q, o, x, ids, weights, attn = layer(T)
    single = fused_experts(x, experts, ids, weights, out_dtype=torch.float32)
    exact = reference.moe(x, experts, ids, weights)
    for mode in ("ep", "tp"):
        assert rel_l2(got[mode], single) < 1e-5, mode
        assert rel_l2(got[mode], exact) < 2e-3, mode
    assert rel_l2(got["q"], linear(x, q, out_dtype=torch.float32)) < 1e-5
    assert rel_l2(got["q"], reference.linear(x, q)) < 2e-3
    assert rel_l2(got["o"], linear(attn, o, out_dtype=torch.float32)) < 1e-5
    assert rel_l2(got["o"], reference.linear(attn, o)) < 2e-3
