"""Fused MoE at the Qwen3 shape on a CUDA GPU, where the other GPU tests leave gaps: gate, up and down of one expert
in their own formats, K = 2..8 in one layer, every token on one expert, graph replay of the Triton experts, and
refusals that reach no device memory."""

import pytest
import torch

from exl3moe import ContractError, EXL3Weight, ExpertSet
from exl3moe.ops import moe_plan
from exl3moe.reference import moe
from test_moe_coverage import INTEGER_WIDTHS, INTEGER_WIDTH_CODEBOOKS, projection_experts
from test_moe_gpu import (QWEN3, assert_replays_give_eager_bytes, bits, qwen3_layer, random_experts,  # noqa: F401
                          random_weight, rel_l2, routing)

pytestmark = pytest.mark.gpu

E, H, I, TOP_K = QWEN3["experts"], QWEN3["hidden"], QWEN3["inter"], QWEN3["top_k"]


@pytest.fixture(scope="module")
def projection_layer():
    """The Qwen3 shape with each expert's gate, up and down in their own widths and codebooks."""
    g = torch.Generator(device="cuda").manual_seed(200)
    return projection_experts(lambda k, n, K, cb, name: random_weight(k, n, K, cb, g, name), E, H, I)


@pytest.fixture(scope="module")
def integer_widths_layer():
    """The Qwen3 shape with experts of every integer width, K = 2..8, in all three codebooks."""
    return random_experts(E, H, I, INTEGER_WIDTHS, INTEGER_WIDTH_CODEBOOKS, seed=210)


def hidden_states(T: int, seed: int) -> torch.Tensor:
    return (torch.randn(T, H, device="cuda", generator=torch.Generator(device="cuda").manual_seed(seed)) / 32).half()


def run_plan(plan, x, ids, weights) -> torch.Tensor:
    out = torch.empty(x.shape[0], H, device="cuda", dtype=torch.float16)
    return plan.bind(plan.allocate()).run(x, ids, weights, out)


@pytest.mark.parametrize("backend", ["1", "0"])
@pytest.mark.parametrize("T", [1, 16, 300])
def test_projections_of_one_expert_in_their_own_formats_match_float64(projection_layer, T, backend, monkeypatch):
    """Gate, up and down of every expert in three different widths (a half-integer mul1 among them) and codebooks,
    on the CUDA experts ("1") and the Triton ones ("0")."""
    monkeypatch.setenv("EXL3MOE_CUDA_KERNELS", backend)
    plan = moe_plan(projection_layer, T, TOP_K)
    assert (plan.mma is not None) == (backend == "1")
    x = hidden_states(T, 201 + T)
    ids, weights = routing(T, E, TOP_K, 202 + T)
    out = run_plan(plan, x, ids, weights)
    err = rel_l2(out, moe(x, projection_layer, ids, weights))
    assert err < 2e-3, err


@pytest.mark.parametrize("T", [1, 4, 64, 300])
def test_every_integer_width_in_one_layer_matches_float64(integer_widths_layer, T):
    plan = moe_plan(integer_widths_layer, T, TOP_K)
    assert plan.mma is not None
    assert sorted({k2 // 2 for k2 in plan.tables.k2.flatten().tolist()}) == INTEGER_WIDTHS
    x = hidden_states(T, 211 + T)
    ids, weights = routing(T, E, TOP_K, 212 + T)
    out = run_plan(plan, x, ids, weights)
    assert rel_l2(out, moe(x, integer_widths_layer, ids, weights)) < 2e-3


def routing_through(expert: int, T: int, seed: int) -> tuple:
    """routing() with `expert` moved into slot 0 of every token (the expert it displaces takes its old slot)."""
    ids, weights = routing(T, E, TOP_K, seed)
    holds = ids == expert
    ids[holds] = ids[:, :1].expand_as(ids)[holds]
    ids[:, 0] = expert
    return ids, weights


@pytest.mark.parametrize("T, slot_capacity, block_m", [(600, 2048, None), (600, 2048, 128), (2048, None, None)])
def test_every_token_on_one_expert(qwen3_layer, T, slot_capacity, block_m):  # noqa: F811
    """Expert 7 in every token's slot 0: per chunk it holds more rows than a route block (chunks of 256 tokens in
    32- or 128-row blocks; one chunk of 2048 rows in 192- and 128-row blocks), within 2e-3 of float64, a token's
    bytes the same alone and in the call, and a chunked call's bytes those of one chunk."""
    plan = moe_plan(qwen3_layer, T, TOP_K, slot_capacity=slot_capacity, block_m=block_m, out_dtype=torch.float16)
    chunk = plan.chunk_tokens
    assert plan.mma is not None and chunk > plan.block_m and (chunk < T) == (slot_capacity is not None)
    assert (plan.wide_mma is not None) == (T == 2048), "2048 tokens split the expert's rows into two block sizes"
    x = hidden_states(T, 220 + T)
    ids, weights = routing_through(7, T, 221 + T)
    runner = plan.bind(plan.allocate())
    full = runner.run(x, ids, weights, torch.empty(T, H, device="cuda", dtype=torch.float16))
    assert rel_l2(full, moe(x, qwen3_layer, ids, weights)) < 2e-3
    for t in sorted({0, chunk - 1, min(chunk, T - 1), T - 1}):
        alone = runner.run(x[t:t + 1], ids[t:t + 1], weights[t:t + 1],
                           torch.empty(1, H, device="cuda", dtype=torch.float16))
        assert torch.equal(bits(alone[0]), bits(full[t])), t
    if chunk < T:
        whole = run_plan(moe_plan(qwen3_layer, T, TOP_K, block_m=plan.block_m), x, ids, weights)
        assert torch.equal(bits(whole), bits(full))


@pytest.mark.parametrize("activation, T", [("silu", 4), ("silu", 64), ("relu2", 64)])
def test_graph_replays_of_the_triton_experts(qwen3_layer, activation, T, monkeypatch):  # noqa: F811
    """The Triton experts (EXL3MOE_CUDA_KERNELS=0 for silu, whose 4 tokens split gate/up over the hidden size;
    relu2 never runs the CUDA ones) captured once: replays with new inputs copied into the captured buffers give a
    fresh eager run's bytes and stay within 2e-3 of float64."""
    if activation == "silu":
        monkeypatch.setenv("EXL3MOE_CUDA_KERNELS", "0")
        layer = qwen3_layer
    else:
        layer = random_experts(E, H, I, [4, 3, 2.5], ["mcg", "3inst", "mul1"], seed=230, activation="relu2")
    plan = moe_plan(layer, T, TOP_K, out_dtype=torch.float16)
    assert plan.mma is None
    runner = plan.bind(plan.allocate())
    x = hidden_states(T, 231)
    ids, weights = routing(T, E, TOP_K, 232)
    out = torch.empty(T, H, device="cuda", dtype=torch.float16)
    runner.run(x, ids, weights, out)   # compiles the Triton kernels outside the capture
    assert_replays_give_eager_bytes(runner, x, ids, weights, out, (233, 234))
    assert rel_l2(out, moe(x, layer, ids, weights)) < 2e-3


def refused_without_allocating(call, name: str) -> None:
    """call() raises a ContractError naming `name`, and the caching allocator saw no allocation on the way."""
    before = torch.cuda.memory_stats()["allocation.all.allocated"]
    with pytest.raises(ContractError) as info:
        call()
    assert info.value.name == name, info.value
    assert torch.cuda.memory_stats()["allocation.all.allocated"] == before, name


def with_weight(layer: ExpertSet, proj: str, e: int, **tensors) -> ExpertSet:
    """The layer with projection `proj` of expert e given other tensors after construction, past its own checks
    (object.__setattr__, as a caller could)."""
    w = getattr(layer, proj)[e]
    changed = EXL3Weight(w.trellis, w.suh, w.svh, w.codebook, w.bias, w.name)
    weights = {p: list(getattr(layer, p)) for p in ("gate", "up", "down")}
    weights[proj][e] = changed
    changed_layer = ExpertSet(weights["gate"], weights["up"], weights["down"], layer.activation, layer.limit,
                              name=layer.name)
    for field, t in tensors.items():
        object.__setattr__(changed, field, t)
    return changed_layer


def test_refused_plans_bindings_and_runs_touch_no_device_memory(qwen3_layer, monkeypatch):  # noqa: F811
    """moe_plan, bind and run validate everything before the device: each refusal allocates nothing, and a refused
    run leaves its output and workspace bytes as they were."""
    trellis = qwen3_layer.gate[3].trellis
    misaligned = torch.empty(trellis.numel() + 1, dtype=torch.int16, device="cuda")[1:].view(trellis.shape)
    shared = random_experts(1, H, I, [4], ["mcg"], seed=240, name="shared")
    plans = [   # (experts, moe_plan arguments, the refused name), every tensor made before the count starts
        (with_weight(qwen3_layer, "up", 100, svh=qwen3_layer.up[100].svh.float()), {}, "experts.up[100].svh"),
        (with_weight(qwen3_layer, "down", 5, suh=qwen3_layer.down[5].suh.cpu()), {}, "experts.down[5].suh"),
        (with_weight(qwen3_layer, "gate", 3, trellis=misaligned), {}, "experts.gate[3].trellis"),
        (qwen3_layer, {"shared": random_experts(1, 1024, I, [4], ["mcg"], seed=241, name="shared")}, "shared"),
        (qwen3_layer, {"shared": with_weight(shared, "down", 0, svh=shared.down[0].svh.float())},
         "shared.down[0].svh"),
        (qwen3_layer, {"block_m": 24}, "block_m"),
        (qwen3_layer, {"slot_capacity": TOP_K - 1}, "slot_capacity"),
        (qwen3_layer, {"out_dtype": torch.int8}, "out_dtype"),
    ]
    for layer, kwargs, name in plans:
        refused_without_allocating(lambda: moe_plan(layer, 16, TOP_K, **kwargs), name)
    with monkeypatch.context() as env:
        env.setenv("EXL3MOE_MOE_WS_STAGES", "2")
        refused_without_allocating(lambda: moe_plan(qwen3_layer, 300, TOP_K), "EXL3MOE_MOE_WS_STAGES")

    T = 16
    plan = moe_plan(qwen3_layer, T, TOP_K, out_dtype=torch.float16)
    size = plan.workspace_bytes
    for workspace in (torch.empty(size - 1, dtype=torch.uint8, device="cuda"),
                      torch.empty(size // 4 + 1, dtype=torch.int32, device="cuda"),
                      torch.empty(size + 16, dtype=torch.uint8, device="cuda")[8:],
                      torch.empty(size, dtype=torch.uint8)):
        refused_without_allocating(lambda: plan.bind(workspace), "workspace")

    workspace = plan.allocate()
    runner = plan.bind(workspace)
    x = hidden_states(T, 242)
    ids, weights = routing(T, E, TOP_K, 243)
    out = torch.full((T, H), float("nan"), device="cuda", dtype=torch.float16)
    runs = [((x, ids.float(), weights, out), "topk_ids"), ((x, ids[:, :4].contiguous(), weights, out), "topk_ids"),
            ((x, ids.t().contiguous().t(), weights, out), "topk_ids"),
            ((x, ids, weights.double(), out), "topk_weights"),
            ((x, ids, weights, out.float()), "out"), ((x, ids, weights, out[:8]), "out"),
            ((x.cpu(), ids, weights, out), "hidden"), ((x.float(), ids, weights, out), "hidden"),
            ((hidden_states(T + 1, 244), ids, weights, out), "hidden")]
    untouched = workspace.clone()
    torch.cuda.synchronize()
    for args, name in runs:
        refused_without_allocating(lambda: runner.run(*args), name)
    torch.cuda.synchronize()
    assert out.isnan().all() and torch.equal(workspace, untouched), "a refused run launched a kernel"
