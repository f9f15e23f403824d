"""Tensor and expert parallel exl3moe.hf models over gloo (processes spawned on the CPU): from_pretrained(tp=, ep=)
reads a rank's slices; its fp16 logits equal the single-process model's under EP and are within 1e-3 relative L2
under TP (the fp32 partial sums add in another order, so a few fp16 activations round one step apart: about 5e-4
here, the fp16 resolution; layer outputs in fp32 stay within 1e-5, test_parallel_verify.py); a rank's bytes repeat run
to run, a token's bytes do not depend on the batch; shard_model gives the same bytes from a loaded model."""

import os
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import transformers  # noqa: F401  (the hf extra)

import exl3moe.hf as hf
from exl3moe.errors import ContractError
from exl3moe.parallel.layout import ParallelLayout, make_layout
from exl3moe.parallel.model import linear_slices, shard_model
from exl3moe.parallel.modules import ReducedMoE, RowParallelLinear

from helpers import free_port, synthetic_checkpoints

pytestmark = pytest.mark.usefixtures("torch_path_one_thread")

COMMON = dict(hidden_size=256, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=4, vocab_size=256, head_dim=64, max_position_embeddings=128)
CONFIGS = {
    "qwen2_moe": dict(moe_intermediate_size=256, num_experts=5, num_experts_per_tok=2,
                      shared_expert_intermediate_size=256, attention_bias=True),
    "glm4_moe": dict(moe_intermediate_size=256, n_routed_experts=4, num_experts_per_tok=2, first_k_dense_replace=1,
                     n_group=2, topk_group=1, n_shared_experts=1, routed_scaling_factor=2.5),
    "llama": {},
}
# (model type, tp, ep) run by the two-rank workers; the four-rank worker runs qwen2_moe at TP2 x EP2.
TWO_RANKS = [("qwen2_moe", 2, 1), ("qwen2_moe", 1, 2), ("glm4_moe", 2, 1), ("glm4_moe", 1, 2), ("llama", 2, 1)]
FOUR_RANKS = [("qwen2_moe", 2, 2)]
IDS = torch.randint(0, COMMON["vocab_size"], (3, 7), generator=torch.Generator().manual_seed(3))


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    return synthetic_checkpoints(tmp_path_factory, CONFIGS, COMMON, K=3)


def rank_results(path: str, tp: int, ep: int) -> dict:
    """Logits of the rank's shard (lazily loaded) and what the determinism and in-place checks found."""
    model = hf.from_pretrained(path, device="cpu", max_batch_tokens=32, tp=tp, ep=ep)
    kinds = sorted({type(m).__name__ for m in model.modules() if isinstance(m, (RowParallelLinear, ReducedMoE))})
    with torch.no_grad():
        logits = model(IDS).logits
        again = model(IDS).logits
        alone = model(IDS[1:2]).logits
        in_place = shard_model(hf.from_pretrained(path, device="cpu", max_batch_tokens=32), make_layout(tp, ep))
        shard_logits = in_place(IDS).logits
    return {"logits": logits, "repeat": torch.equal(logits, again), "batch": torch.equal(logits[1:2], alone),
            "in_place": torch.equal(logits, shard_logits), "kinds": kinds}


def worker(rank: int, world: int, port: int, cases: list, paths: dict, result_dir: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        results = {case: rank_results(paths[case[0]], case[1], case[2]) for case in cases}
        torch.save(results, os.path.join(result_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def rel_l2(a, b) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def spawn(world: int, cases: list, paths: dict, tmp_path) -> list:
    mp.spawn(worker, args=(world, free_port(), cases, paths, str(tmp_path)), nprocs=world, join=True)
    return [torch.load(tmp_path / f"rank{r}.pt") for r in range(world)]


def single_process_logits(path: str) -> torch.Tensor:
    with torch.no_grad():
        return hf.from_pretrained(path, device="cpu", max_batch_tokens=32)(IDS).logits


@pytest.mark.parametrize("world,cases", [(2, TWO_RANKS), (4, FOUR_RANKS)], ids=["two-ranks", "four-ranks-tp2xep2"])
def test_sharded_models_match_one_process(checkpoints, tmp_path, world, cases):
    ranks = spawn(world, cases, checkpoints, tmp_path)
    for case in cases:
        model_type, tp, ep = case
        single = single_process_logits(checkpoints[model_type])
        for rank, results in enumerate(ranks):
            got = results[case]
            assert rel_l2(got["logits"], single) < (1e-3 if tp > 1 else 1e-5), (case, rank)
            assert got["repeat"] and got["in_place"], (case, rank)
            assert got["batch"], (case, rank)
            assert torch.equal(got["logits"], ranks[0][case]["logits"]), (case, rank)
            expected = ({"RowParallelLinear"} if tp > 1 else set()) | ({"ReducedMoE"} if model_type != "llama" else set())
            assert set(got["kinds"]) == expected, (case, rank)


def test_heads_that_do_not_fill_whole_blocks_are_refused(checkpoints):
    """4 key-value heads of 64 over 4 ranks leave a rank 64 columns: refused, naming the module."""
    model = hf.from_pretrained(checkpoints["llama"], device="cpu", max_batch_tokens=8)
    with pytest.raises(ContractError, match=r"model\.layers\.0\.self_attn\.k_proj.*not whole 128-wide blocks"):
        linear_slices(model, ParallelLayout(tp=4, ep=1, rank=0))
    slices = linear_slices(model, ParallelLayout(tp=2, ep=1, rank=1))
    assert {k: (v.axis, v.start, v.stop) for k, v in slices.items() if ".layers.0." in k} == {
        "model.layers.0.self_attn.q_proj": ("columns", 128, 256), "model.layers.0.self_attn.k_proj": ("columns", 128, 256),
        "model.layers.0.self_attn.v_proj": ("columns", 128, 256), "model.layers.0.self_attn.o_proj": ("rows", 128, 256),
        "model.layers.0.mlp.gate_proj": ("columns", 128, 256), "model.layers.0.mlp.up_proj": ("columns", 128, 256),
        "model.layers.0.mlp.down_proj": ("rows", 128, 256)}


def test_tp_without_a_process_group_is_refused(checkpoints):
    with pytest.raises(ContractError, match="initialized torch.distributed process group"):
        hf.from_pretrained(checkpoints["llama"], device="cpu", tp=2)
    with pytest.raises(ContractError, match="ep"):
        hf.from_pretrained(checkpoints["llama"], device="cpu", tp=2, ep=0)
