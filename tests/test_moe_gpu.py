"""Full-shape fused MoE on a CUDA GPU: accuracy vs float64, graph capture and replay, batch invariance."""

import pytest
import torch

from exl3moe import EXL3Weight, ExpertSet
from exl3moe.kernels import moe_mma_source
from exl3moe.ops import moe_planning
from exl3moe.ops import fused_experts, moe_plan
from exl3moe.reference import moe
from helpers import capture_allocation_free

pytestmark = pytest.mark.gpu

QWEN3 = dict(hidden=2048, inter=768, experts=128, top_k=8)


def random_weight(k, n, K, codebook, g, name):
    trellis = torch.randint(-32768, 32768, (k // 16, n // 16, int(16 * K)), dtype=torch.int32, device="cuda",
                            generator=g).to(torch.int16)
    sign = lambda m: torch.where(torch.rand(m, device="cuda", generator=g) < 0.5, -1.0, 1.0)  # noqa: E731
    suh = (sign(k) * (0.5 + torch.rand(k, device="cuda", generator=g))).half()
    svh = (sign(n) * (0.5 + torch.rand(n, device="cuda", generator=g))).half()
    return EXL3Weight(trellis, suh, svh, codebook, name=name)


def random_experts(E, H, I, Ks, codebooks, seed, activation="silu", name="experts"):
    g = torch.Generator(device="cuda").manual_seed(seed)
    make = lambda p, k, n: [random_weight(k, n, Ks[e % len(Ks)], codebooks[e % len(codebooks)], g,  # noqa: E731
                                          f"{name}.{p}[{e}]") for e in range(E)]
    gate = make("gate", H, I) if activation != "relu2" else None
    return ExpertSet(gate, make("up", H, I), make("down", I, H), activation, name=name)


@pytest.fixture(scope="module")
def qwen3_layer():
    """Qwen3-30B-A3B MoE shape with a mixed layer: K 3/4/2/6 and all three codebooks."""
    return random_experts(QWEN3["experts"], QWEN3["hidden"], QWEN3["inter"], [4, 3, 2, 6, 2.5],
                          ["mcg", "3inst", "mul1", "mcg", "mul1"], seed=0)


def routing(T, E, top_k, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    ids = torch.rand(T, E, device="cuda", generator=g).argsort(-1)[:, :top_k].contiguous()
    weights = torch.softmax(torch.randn(T, top_k, device="cuda", generator=g), -1)
    return ids, weights


def rel_l2(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def bits(t):
    return t.view(torch.int16) if t.element_size() == 2 else t.view(torch.int32)


@pytest.mark.parametrize("T", [1, 4, 64, 300])
def test_qwen3_shape_matches_float64(qwen3_layer, T):
    x = (torch.randn(T, QWEN3["hidden"], device="cuda") / 32).half()
    ids, weights = routing(T, QWEN3["experts"], QWEN3["top_k"], T)
    ref = moe(x, qwen3_layer, ids, weights)
    assert ref.abs().max() < 6e4, "test data must stay inside the fp16 range"
    for dtype, limit in ((torch.float16, 2e-3), (torch.bfloat16, 6e-3), (torch.float32, 2e-3)):
        out = fused_experts(x, qwen3_layer, ids, weights, out_dtype=dtype)
        assert out.dtype == dtype and rel_l2(out, ref) < limit, (dtype, rel_l2(out, ref))


def test_many_tokens_chunked_with_shared_expert(qwen3_layer):
    """1024 tokens: the many-slot route pack, two workspace chunks, and a shared expert of its own width."""
    T = 1024
    shared = random_experts(1, QWEN3["hidden"], 1024, [4], ["mcg"], seed=5, name="shared")
    x = (torch.randn(T, QWEN3["hidden"], device="cuda") / 32).bfloat16()
    ids, weights = routing(T, QWEN3["experts"], QWEN3["top_k"], 6)
    ids[::7, 3] = -1
    plan = moe_plan(qwen3_layer, T, QWEN3["top_k"], shared=shared, slot_capacity=4096)
    assert plan.chunk_tokens == 512
    out = torch.empty(T, QWEN3["hidden"], device="cuda", dtype=torch.bfloat16)
    plan.bind(plan.allocate()).run(x, ids, weights, out)
    assert rel_l2(out, moe(x, qwen3_layer, ids, weights, shared)) < 6e-3


def test_graph_capture_and_replay_with_new_ids(qwen3_layer):
    T, top_k, H = 64, QWEN3["top_k"], QWEN3["hidden"]
    plan = moe_plan(qwen3_layer, T, top_k, out_dtype=torch.float16)
    runner = plan.bind(plan.allocate())
    x = (torch.randn(T, H, device="cuda") / 32).half()
    ids, weights = routing(T, QWEN3["experts"], top_k, 1)
    out = torch.empty(T, H, device="cuda", dtype=torch.float16)
    runner.run(x, ids, weights, out)
    assert_replays_give_eager_bytes(runner, x, ids, weights, out, (2, 3))


def assert_replays_give_eager_bytes(runner, x, ids, weights, out, seeds):
    """Capture runner.run on these buffers, then per seed: new inputs copied in, a replay, and out's bytes equal to a
    fresh eager run's."""
    T, H = x.shape
    graph = capture_allocation_free(lambda: runner.run(x, ids, weights, out), out)
    for seed in seeds:
        new_ids, new_weights = routing(T, QWEN3["experts"], ids.shape[1], seed)
        new_x = (torch.randn(T, H, device="cuda") / 32).half()
        x.copy_(new_x)
        ids.copy_(new_ids)
        weights.copy_(new_weights)
        graph.replay()
        eager = torch.empty_like(out)
        runner.run(new_x, new_ids, new_weights, eager)
        torch.cuda.synchronize()
        assert torch.equal(bits(out), bits(eager)), seed


@pytest.mark.parametrize("T", [1, 16])
def test_replays_of_calls_whose_every_id_lives_elsewhere_between_ordinary_ones(qwen3_layer, T):
    """A captured call whose ids all lie outside [0, E) writes zeros and leaves the workspace as it found it: the
    next replay with real ids gives a fresh eager run's bytes (an early down never completes before its gate/up)."""
    top_k, H, E = QWEN3["top_k"], QWEN3["hidden"], QWEN3["experts"]
    plan = moe_plan(qwen3_layer, T, top_k, out_dtype=torch.float16)
    runner = plan.bind(plan.allocate())
    x = (torch.randn(T, H, device="cuda") / 32).half()
    real, weights = routing(T, E, top_k, 50 + T)
    ids = real.clone()
    out = torch.empty(T, H, device="cuda", dtype=torch.float16)
    assert_elsewhere_replays_write_zeros(runner, x, ids, real, weights, out, E, 3)


def assert_elsewhere_replays_write_zeros(runner, x, ids, real, weights, out, num_experts, rounds):
    """Capture runner.run on these buffers; `rounds` times, a replay with every id outside [0, E) writes zeros and a
    replay with the `real` ids gives an eager run's bytes."""
    expected = bits(runner.run(x, real, weights, torch.empty_like(out))).clone()
    graph = capture_allocation_free(lambda: runner.run(x, ids, weights, out), out)
    for _ in range(rounds):
        ids.fill_(num_experts + 5)
        graph.replay()
        torch.cuda.synchronize()
        assert not out.any()
        ids.copy_(real)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(bits(out), expected)


def test_split_route_blocks_under_replay_with_new_ids_and_ids_that_live_elsewhere(qwen3_layer):
    """A captured call of split route blocks (4096 Qwen3 tokens, both kernels of each projection chained): replays
    with new ids give fresh eager runs' bytes; one whose ids all lie outside [0, E) (both tables empty) writes zeros,
    and the next replay with real ids gives the eager bytes again."""
    T, top_k, H, E = 4096, QWEN3["top_k"], QWEN3["hidden"], QWEN3["experts"]
    plan = moe_plan(qwen3_layer, T, top_k, out_dtype=torch.float16)
    assert plan.wide_mma is not None and plan.wide_mma.split_peer == 2, "split route blocks, chained"
    runner = plan.bind(plan.allocate())
    x = (torch.randn(T, H, device="cuda") / 32).half()
    real, weights = routing(T, E, top_k, 130)
    ids = real.clone()
    out = torch.empty(T, H, device="cuda", dtype=torch.float16)
    runner.run(x, ids, weights, out)
    assert_replays_give_eager_bytes(runner, x, ids, weights, out, (131, 132))
    ids.copy_(real)
    assert_elsewhere_replays_write_zeros(runner, x, ids, real, weights, out, E, 2)


@pytest.mark.parametrize("T", [1, 16])
def test_replays_with_a_shared_expert_give_eager_bytes(qwen3_layer, T):
    """A shared expert chained to the routed one (its gate/up after the routed down in packed plans, the routed
    gate/up after its down in direct ones, each launched early): captured calls replayed with new inputs give a fresh
    eager run's bytes, round after round."""
    top_k, H, E = QWEN3["top_k"], QWEN3["hidden"], QWEN3["experts"]
    shared = random_experts(1, H, QWEN3["inter"], [4], ["mcg"], seed=70, name="shared")
    plan = moe_plan(qwen3_layer, T, top_k, shared=shared, out_dtype=torch.float16)
    runner = plan.bind(plan.allocate())
    x = (torch.randn(T, H, device="cuda") / 32).half()
    ids, weights = routing(T, E, top_k, 71)
    out = torch.empty(T, H, device="cuda", dtype=torch.float16)
    runner.run(x, ids, weights, out)
    assert rel_l2(out, moe(x, qwen3_layer, ids, weights, shared)) < 2e-3
    assert_replays_give_eager_bytes(runner, x, ids, weights, out, range(72, 76))


@pytest.mark.parametrize("T, block_m, backend", [(300, 32, "0"), (200, 16, "1"), (300, 32, "1"), (600, 64, "1"),
                                                 (1024, 128, "1")])
def test_deterministic_and_batch_invariant_at_full_shape(qwen3_layer, T, block_m, backend, monkeypatch):
    """Every route-block size of the CUDA kernels, and the Triton kernels ("0")."""
    monkeypatch.setenv("EXL3MOE_CUDA_KERNELS", backend)
    top_k, H = QWEN3["top_k"], QWEN3["hidden"]
    plan = moe_plan(qwen3_layer, T, top_k, block_m=block_m)
    assert (plan.mma is not None) == (backend == "1")
    runner = plan.bind(plan.allocate())
    x = (torch.randn(T, H, device="cuda") / 32).half()
    ids, weights = routing(T, QWEN3["experts"], top_k, 4)
    run = lambda n: runner.run(x[:n], ids[:n], weights[:n],  # noqa: E731
                               torch.empty(n, H, device="cuda", dtype=torch.float16))
    full = run(T)
    assert torch.equal(bits(full), bits(run(T)))
    for n in (1, 2, 17, 64, T - 1):
        part = run(n)
        rows = (bits(part) != bits(full[:n])).any(-1).nonzero().flatten().tolist()
        assert not rows, (n, rows[:8], (part.float() - full[:n].float()).abs().max().item())


@pytest.mark.parametrize("T, block_m", [(16, 16), (64, 16), (300, 32), (600, 64)])
def test_splits_inside_route_blocks_give_the_bytes_of_splits_outermost(qwen3_layer, T, block_m, monkeypatch):
    """Packed grids with a route block's splits along y (its route blocks along z) give the bytes of grids with the
    splits outermost, call after call."""
    top_k, H = QWEN3["top_k"], QWEN3["hidden"]
    x = (torch.randn(T, H, device="cuda") / 32).half()
    ids, weights = routing(T, QWEN3["experts"], top_k, 40 + T)
    ids[::3, 5] = -1
    outs = {}
    for inner in ("1", "0"):
        monkeypatch.setenv("EXL3MOE_MOE_SPLIT_INNER", inner)
        plan = moe_plan(qwen3_layer, T, top_k, block_m=block_m)
        assert plan.mma.split_inner == (inner == "1")
        runner = plan.bind(plan.allocate())
        outs[inner] = [bits(runner.run(x, ids, weights, torch.empty(T, H, device="cuda", dtype=torch.float16)))
                       for _ in range(2)]
    assert all(torch.equal(out, outs["0"][0]) for out in outs["1"] + outs["0"])


@pytest.mark.parametrize("x_dtype", [torch.float16, torch.bfloat16])
def test_cuda_and_triton_experts_match_float64(x_dtype, monkeypatch):
    """Routed and shared experts on both backends; 200 tokens take 64-row shared blocks (pre-rotated rows)."""
    E, H, I, top_k = 16, 512, 384, 4
    layer = random_experts(E, H, I, [4, 2, 3.5, 8], ["mcg", "3inst", "mul1", "mcg"], seed=7)
    shared = random_experts(1, H, 640, [3], ["mul1"], seed=8, name="shared")
    for T in (1, 7, 40, 200):
        x = (torch.randn(T, H, device="cuda") / 8).to(x_dtype)
        ids, weights = routing(T, E, top_k, 10 + T)
        ids[::5, 1] = -1
        ref = moe(x, layer, ids, weights, shared)
        for backend in ("1", "0"):
            monkeypatch.setenv("EXL3MOE_CUDA_KERNELS", backend)
            plan = moe_plan(layer, T, top_k, shared=shared)
            assert (plan.mma is not None) == (plan.shared_mma is not None) == (backend == "1")
            out = torch.empty(T, H, device="cuda", dtype=torch.float16)
            plan.bind(plan.allocate()).run(x, ids, weights, out)
            assert rel_l2(out, ref) < 2e-3, (T, backend, rel_l2(out, ref))


def residual_stage(experts, scales, K, codebook, seed):
    """A residual stage on every expert and projection, sharing each base weight's suh/svh."""
    from exl3moe import ResidualStage
    g = torch.Generator(device="cuda").manual_seed(seed)

    def residuals(bases):
        return [EXL3Weight(torch.randint(-32768, 32768, w.trellis.shape[:2] + (int(16 * K),), dtype=torch.int32,
                                         device="cuda", generator=g).to(torch.int16), w.suh, w.svh, codebook)
                for w in bases]
    return ResidualStage(residuals(experts.gate), residuals(experts.up), residuals(experts.down),
                         scales.to("cuda", torch.float32))


def test_stage_hot_swap_under_one_captured_graph(qwen3_layer):
    """Capture once; replay base -> stage set A -> stage set B -> base: each equals a fresh eager run."""
    T, top_k, H, E = 16, QWEN3["top_k"], QWEN3["hidden"], QWEN3["experts"]
    g = torch.Generator(device="cuda").manual_seed(30)
    set_a = [residual_stage(qwen3_layer, torch.rand(E, 3, device="cuda", generator=g) * 0.1, 2, "mcg", 31)]
    quarter = torch.zeros(E, 3, device="cuda")
    quarter[::4] = 0.1
    set_b = [residual_stage(qwen3_layer, quarter, 2, "mcg", 32), residual_stage(qwen3_layer, quarter, 3, "mul1", 33)]
    plan = moe_plan(qwen3_layer, T, top_k, out_dtype=torch.float16, stage_capacity=2, max_stage_bits=3,
                    stage_codebooks=["mcg", "mul1"])
    runner = plan.bind(plan.allocate())
    x = (torch.randn(T, H, device="cuda", generator=g) / 32).half()
    ids, weights = routing(T, E, top_k, 7)
    out = torch.empty(T, H, device="cuda", dtype=torch.float16)
    runner.run(x, ids, weights, out)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        runner.run(x, ids, weights, out)
    results = []
    for stages in ([], set_a, set_b, []):
        plan.load_stages(stages)
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        with_stages = ExpertSet(qwen3_layer.gate, qwen3_layer.up, qwen3_layer.down, "silu", stages=stages)
        eager = fused_experts(x, with_stages, ids, weights, out_dtype=torch.float16)
        assert rel_l2(out, moe(x, with_stages, ids, weights)) < 2e-3
        results.append(out.clone())
        assert torch.equal(bits(out), bits(eager))
    assert not torch.equal(results[0], results[1]) and not torch.equal(results[1], results[2])
    assert torch.equal(bits(results[0]), bits(results[3]))


def with_bias(ws, g):
    """The weights with random fp16 biases."""
    return [EXL3Weight(w.trellis, w.suh, w.svh, w.codebook,
                       (torch.randn(w.out_features, device="cuda", generator=g) * 0.1).half(), w.name) for w in ws]


def test_cuda_experts_with_gelu_clamp_bias_and_stages_match_float64():
    """The CUDA kernels' optional parts at every route-block size: gelu with a clamp, biases on base and
    residuals, two stages of different K and codebook, one with zero scales on some experts."""
    from exl3moe import ResidualStage
    E, H, I, top_k = 16, 512, 384, 4
    g = torch.Generator(device="cuda").manual_seed(40)
    base = random_experts(E, H, I, [4, 3, 2.5], ["mcg", "3inst", "mul1"], seed=41, activation="gelu")

    def residuals(ws, K, codebook, bias):
        out = [EXL3Weight(torch.randint(-32768, 32768, w.trellis.shape[:2] + (int(16 * K),), dtype=torch.int32,
                                        device="cuda", generator=g).to(torch.int16), w.suh, w.svh, codebook)
               for w in ws]
        return with_bias(out, g) if bias else out

    layer = ExpertSet(with_bias(base.gate, g), with_bias(base.up, g), with_bias(base.down, g), "gelu", limit=6.0)
    sparse = torch.rand(E, 3, device="cuda", generator=g) * 0.2
    sparse[::3] = 0.0
    stages = [ResidualStage(residuals(layer.gate, 2, "mcg", True), residuals(layer.up, 2, "mcg", True),
                            residuals(layer.down, 2, "mcg", True), sparse),
              ResidualStage(residuals(layer.gate, 1.5, "mul1", False), None, residuals(layer.down, 3, "3inst", False),
                            torch.rand(E, 3, device="cuda", generator=g) * 0.1)]
    layer = ExpertSet(layer.gate, layer.up, layer.down, "gelu", limit=6.0, stages=stages)
    for T, block_m in ((1, 16), (9, 32), (40, 64), (70, 128)):
        x = (torch.randn(T, H, device="cuda", generator=g) / 4).half()
        ids, weights = routing(T, E, top_k, 50 + T)
        plan = moe_plan(layer, T, top_k, block_m=block_m, out_dtype=torch.float16)
        assert plan.mma is not None
        out = torch.empty(T, H, device="cuda", dtype=torch.float16)
        plan.bind(plan.allocate()).run(x, ids, weights, out)
        ref = moe(x, layer, ids, weights)
        assert rel_l2(out, ref) < 2e-3, (T, block_m, rel_l2(out, ref))


def test_packed_kernels_of_many_formats_read_their_biases_ahead():
    """Packed 16- and 32-row kernels of five formats, which read their epilogue vectors once per block
    (PACKED_EPILOGUE_AHEAD), with biases on every projection and gelu with a clamp: within 2e-3 of float64."""
    E, H, I, top_k = 16, 512, 384, 4
    g = torch.Generator(device="cuda").manual_seed(60)
    base = random_experts(E, H, I, [4, 3, 2.5, 6, 2], ["mcg", "3inst", "mul1", "mcg", "mul1"], seed=61,
                          activation="gelu")
    layer = ExpertSet(with_bias(base.gate, g), with_bias(base.up, g), with_bias(base.down, g), "gelu", limit=6.0)
    for T, block_m in ((6, 16), (30, 32)):
        plan = moe_plan(layer, T, top_k, block_m=block_m, out_dtype=torch.float16)
        assert plan.mma is not None and not plan.mma.direct
        for name in ("moe_gate_up_mma", "moe_down_mma"):
            assert ("PACKED_EPILOGUE_AHEAD", 1) in moe_mma_source.kernel_source(plan.mma, name)[0], (T, name)
        x = (torch.randn(T, H, device="cuda", generator=g) / 4).half()
        ids, weights = routing(T, E, top_k, 70 + T)
        out = torch.empty(T, H, device="cuda", dtype=torch.float16)
        plan.bind(plan.allocate()).run(x, ids, weights, out)
        assert rel_l2(out, moe(x, layer, ids, weights)) < 2e-3, T


@pytest.mark.parametrize("block_m", [16, 32])
def test_union_stage_passes_give_the_bytes_of_separate_switches(block_m, monkeypatch):
    """A K4 base with K1 and K2 MCG stages (one sparse): packed 16-row kernels that run base and stages through one
    switch (UNION_STAGES) and 32-row ones held to 5 blocks per SM give the bytes of the kernels without either,
    within 2e-3 of float64."""
    from exl3moe import ResidualStage
    from exl3moe.kernels.moe_mma_source import stage_min_blocks, union_stages
    E, H, I, top_k, T = 16, 512, 384, 4, 20
    g = torch.Generator(device="cuda").manual_seed(60)
    base = random_experts(E, H, I, [4], ["mcg"], seed=61)

    def residuals(ws, K):
        return [EXL3Weight(torch.randint(-32768, 32768, w.trellis.shape[:2] + (int(16 * K),), dtype=torch.int32,
                                         device="cuda", generator=g).to(torch.int16), w.suh, w.svh, "mcg") for w in ws]

    sparse = torch.rand(E, 3, device="cuda", generator=g) * 0.2
    sparse[::3] = 0.0
    stages = [ResidualStage(residuals(base.gate, 2), residuals(base.up, 2), residuals(base.down, 2), sparse),
              ResidualStage(residuals(base.gate, 1), None, residuals(base.down, 1),
                            torch.rand(E, 3, device="cuda", generator=g) * 0.1)]
    layer = ExpertSet(base.gate, base.up, base.down, "silu", stages=stages)
    x = (torch.randn(T, H, device="cuda", generator=g) / 4).half()
    ids, weights = routing(T, E, top_k, 62)
    outs = {}
    for union in ("1", "0"):
        monkeypatch.setenv("EXL3MOE_MOE_UNION_STAGES", union)
        plan = moe_plan(layer, T, top_k, block_m=block_m, out_dtype=torch.float16)
        assert plan.mma is not None and plan.block_m == block_m and not plan.mma.direct
        assert (union_stages(plan.mma) if block_m == 16 else stage_min_blocks(plan.mma) == 5) == (union == "1")
        outs[union] = torch.empty(T, H, device="cuda", dtype=torch.float16)
        plan.bind(plan.allocate()).run(x, ids, weights, outs[union])
    assert torch.equal(bits(outs["1"]), bits(outs["0"]))
    assert rel_l2(outs["1"], moe(x, layer, ids, weights)) < 2e-3


@pytest.mark.parametrize("T, block_m", [(12, 16), (30, 16), (2, None), (6, None), (40, 32)])
def test_stage_blocks_keep_each_tokens_bytes_and_the_base_bytes_without_an_active_stage(T, block_m, monkeypatch):
    """Stages in blocks of their own (packed 16-row plans by default; direct, small packed and 32-row plans with the
    rule widened), with a stage on gate, up and down of some experts, on up or on down alone of others, none on the
    rest: within 2e-3 of float64, a token's bytes equal alone and in the batch, and a token whose experts have no
    active stage gets the bytes of the plan that runs base and stages in one accumulator."""
    import os
    from exl3moe import ResidualStage
    if block_m != 16:   # the kernels support every mma.sync plan; the default rule takes 16-row packed ones only
        monkeypatch.setattr(moe_planning, "stage_blocks", lambda plan: bool(plan.stage_formats) and not plan.ws
                            and os.environ.get("EXL3MOE_MOE_STAGE_BLOCKS") != "0")
    E, H, I, top_k = 16, 512, 384, 4
    g = torch.Generator(device="cuda").manual_seed(80)
    base = random_experts(E, H, I, [4], ["mcg"], seed=81)

    def residuals(ws, K):
        return [EXL3Weight(torch.randint(-32768, 32768, w.trellis.shape[:2] + (int(16 * K),), dtype=torch.int32,
                                         device="cuda", generator=g).to(torch.int16), w.suh, w.svh, "mcg") for w in ws]

    every, up_only, down_only = (torch.zeros(E, 3, device="cuda") for _ in range(3))
    every[0::4], up_only[1::4, 1], down_only[2::4, 2] = 0.1, 0.2, 0.15
    stages = [ResidualStage(residuals(base.gate, 2), residuals(base.up, 2), residuals(base.down, 2), every + up_only),
              ResidualStage(None, None, residuals(base.down, 1), down_only)]
    layer = ExpertSet(base.gate, base.up, base.down, "silu", stages=stages)
    x = (torch.randn(T, H, device="cuda", generator=g) / 4).half()
    ids, weights = routing(T, E, top_k, 82)
    ids[0] = torch.tensor([3, 7, 11, 15], device="cuda")   # experts without an active stage
    outs = {}
    for setting in ("1", "0"):
        monkeypatch.setenv("EXL3MOE_MOE_STAGE_BLOCKS", setting)
        plan = moe_plan(layer, T, top_k, block_m=block_m, out_dtype=torch.float16)
        assert plan.mma is not None and plan.mma.stage_blocks == (setting == "1")
        runner = plan.bind(plan.allocate())
        outs[setting] = torch.empty(T, H, device="cuda", dtype=torch.float16)
        runner.run(x, ids, weights, outs[setting])
        assert rel_l2(outs[setting], moe(x, layer, ids, weights)) < 2e-3, setting
        for t in sorted({0, T // 2, T - 1}):
            alone = torch.empty(1, H, device="cuda", dtype=torch.float16)
            runner.run(x[t:t + 1], ids[t:t + 1], weights[t:t + 1], alone)
            assert torch.equal(bits(alone[0]), bits(outs[setting][t])), (setting, t)
    assert torch.equal(bits(outs["1"][0]), bits(outs["0"][0]))


def test_direct_route_small_calls(qwen3_layer, monkeypatch):
    """A direct plan (raised here to 64 slots) skips the route pack and combines in down: float64 agreement with a
    shared expert and remote ids, fp16 / bf16 / fp32 output, batch invariance inside the plan, and graph replay."""
    monkeypatch.setattr(moe_planning, "DIRECT_MAX_SLOTS", 64)
    monkeypatch.setattr(moe_planning, "DIRECT_MAX_SLOTS_MIXED", 64)
    top_k, H, E = QWEN3["top_k"], QWEN3["hidden"], QWEN3["experts"]
    shared = random_experts(1, H, 768, [4], ["mcg"], seed=60, name="shared")
    plan = moe_plan(qwen3_layer, 8, top_k, shared=shared)
    assert plan.mma is not None and plan.mma.direct
    runner = plan.bind(plan.allocate())
    x = (torch.randn(8, H, device="cuda") / 32).half()
    ids, weights = routing(8, E, top_k, 61)
    ids[1, :] = -1
    ids[2, 3] = E
    for dtype, limit in ((torch.float16, 2e-3), (torch.bfloat16, 6e-3), (torch.float32, 2e-3)):
        out = torch.full((8, H), float("nan"), device="cuda", dtype=dtype)
        runner.run(x, ids, weights, out)
        assert rel_l2(out, moe(x, qwen3_layer, ids, weights, shared)) < limit, dtype
    full = runner.run(x, ids, weights, torch.empty(8, H, device="cuda", dtype=torch.float16))
    for n in (1, 3, 7):
        part = runner.run(x[:n], ids[:n], weights[:n], torch.empty(n, H, device="cuda", dtype=torch.float16))
        assert torch.equal(bits(part), bits(full[:n])), n
    out = torch.empty(8, H, device="cuda", dtype=torch.float16)
    graph = capture_allocation_free(lambda: runner.run(x, ids, weights, out), out)
    new_ids, _ = routing(8, E, top_k, 62)
    ids.copy_(new_ids)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(bits(out), bits(runner.run(x, ids, weights, torch.empty_like(out))))


@pytest.mark.parametrize("K", [4, 3, 2])
def test_one_format_direct_down_reads_its_combine_ahead(K):
    """A one-format direct plan's down reads its combine's ids and weights before the arrival (K3 with registers for
    8 blocks per SM, the bound dropped where it spills; K4 and K2, whose calls here fit one wave, for 7, gate/up
    too): float64 agreement with remote ids, int32 / int64 ids, fp16 / bf16 / fp32 weights, a shared expert, top_k
    10 (slots past the read-ahead), and row bytes independent of the batch."""
    from exl3moe.kernels.moe_mma_source import direct_down_defines
    E, H, I = 16, 512, 384
    layer = random_experts(E, H, I, [K], ["mcg"], seed=70)
    shared = random_experts(1, H, 256, [4], ["mcg"], seed=71, name="shared")
    for top_k, T in ((4, 4), (10, 1)):
        plan = moe_plan(layer, T, top_k, shared=shared)
        down = dict(direct_down_defines(plan.mma))
        assert plan.mma.direct and down["COMBINE_AHEAD"] == 8 and down["MIN_BLOCKS"] == (8 if K == 3 else 7)
        runner = plan.bind(plan.allocate())
        x = (torch.randn(T, H, device="cuda") / 8).half()
        ids, weights = routing(T, E, top_k, 72)
        ids[0, 1] = -1
        ids[T - 1, top_k - 1] = E + 3
        for id_dtype in (torch.int32, torch.int64):
            for w in (weights.half(), weights.bfloat16(), weights):
                out = torch.full((T, H), float("nan"), device="cuda")
                runner.run(x, ids.to(id_dtype), w, out)
                assert rel_l2(out, moe(x, layer, ids, w, shared)) < 2e-3, (top_k, id_dtype, w.dtype)
        full = runner.run(x, ids, weights, torch.empty(T, H, device="cuda", dtype=torch.float16))
        one = runner.run(x[-1:], ids[-1:], weights[-1:], torch.empty(1, H, device="cuda", dtype=torch.float16))
        assert torch.equal(bits(one), bits(full[-1:])), top_k


def test_warp_specialized_experts_give_mma_sync_bytes(qwen3_layer, monkeypatch):
    """128-row route blocks on trellis_ws's mainloop (sm_90) against mma.sync, with a sparse residual stage."""
    T, top_k, H, E = 300, QWEN3["top_k"], QWEN3["hidden"], QWEN3["experts"]
    assert moe_planning.uses_ws(128, torch.device("cuda")), "the H200 runs 128-row route blocks warp-specialized"
    g = torch.Generator(device="cuda").manual_seed(60)
    quarter = torch.zeros(E, 3, device="cuda")
    quarter[::4] = 0.1
    layer = ExpertSet(qwen3_layer.gate, qwen3_layer.up, qwen3_layer.down, "silu",
                      stages=[residual_stage(qwen3_layer, quarter, 2, "mcg", 61)])
    x = (torch.randn(T, H, device="cuda", generator=g) / 32).half()
    ids, weights = routing(T, E, top_k, 62)
    outs = {}
    for ws in ("0", "1"):
        monkeypatch.setenv("EXL3MOE_MOE_WS", ws)
        plan = moe_plan(layer, T, top_k, block_m=128, out_dtype=torch.float16)
        assert plan.mma.ws == (ws == "1")
        outs[ws] = torch.empty(T, H, device="cuda", dtype=torch.float16)
        plan.bind(plan.allocate()).run(x, ids, weights, outs[ws])
    assert torch.equal(bits(outs["0"]), bits(outs["1"]))
    assert rel_l2(outs["1"], moe(x, layer, ids, weights)) < 2e-3


def ws_settings_give_the_same_bytes(qwen3_layer, shape, monkeypatch, env, values, planned, seed, nan=False,
                                    block_m=128, T=300):
    """Runs a plan of `block_m` rows (None: the plan's choice) of the Qwen3 layer (or a 16-expert layer of odd chunk
    counts: hidden 1152, inter 640) over T tokens with a residual stage on a quarter of the experts under each value
    of environment setting `env`: planned(plan, value) holds for each plan, the outputs' bytes agree, and they
    match float64. nan: the workspace starts as NaN."""
    base = qwen3_layer if shape == "qwen3" else random_experts(16, 1152, 640, [4, 3, 6], ["mcg", "mul1", "3inst"],
                                                               seed)
    E, H, top_k = len(base.down), base.hidden_size, 8
    quarter = torch.zeros(E, 3, device="cuda")
    quarter[seed % 4::4] = 0.1
    layer = ExpertSet(base.gate, base.up, base.down, "silu", stages=[residual_stage(base, quarter, 2, "mcg", seed + 1)])
    x = (torch.randn(T, H, device="cuda", generator=torch.Generator(device="cuda").manual_seed(seed + 2)) / 32).half()
    ids, weights = routing(T, E, top_k, seed + 3)
    outs = []
    for value in values:
        monkeypatch.setenv(env, value)
        plan = moe_plan(layer, T, top_k, block_m=block_m, out_dtype=torch.float16)
        assert plan.mma.ws and planned(plan, value), value
        workspace = plan.allocate().fill_(0xFF) if nan else plan.allocate()   # 0xFFFF: fp16 NaN
        outs.append(torch.empty(T, H, device="cuda", dtype=torch.float16))
        plan.bind(workspace).run(x, ids, weights, outs[-1])
    assert all(torch.equal(bits(outs[0]), bits(out)) for out in outs[1:])
    assert rel_l2(outs[-1], moe(x, layer, ids, weights)) < 2e-3


@pytest.mark.parametrize("shape", ["qwen3", "odd-chunks"])
def test_whole_chunk_ring_stages_give_the_bytes_of_four_k_tile_stages(qwen3_layer, shape, monkeypatch):
    """Ring stages of 8 k-tiles (EXL3MOE_MOE_WS_STAGE_KT=8; odd stage counts per range in the odd-chunk layer) give
    the bytes of 4-k-tile stages, with a sparse residual stage."""
    ws_settings_give_the_same_bytes(qwen3_layer, shape, monkeypatch, "EXL3MOE_MOE_WS_STAGE_KT", ("4", "8"),
                                    lambda plan, kt: plan.mma.ws_stage_ktiles == int(kt), 70)


@pytest.mark.parametrize("shape", ["qwen3", "odd-chunks"])
def test_x_chunks_by_tma_give_the_bytes_of_cp_async_beside_nan_rows(qwen3_layer, shape, monkeypatch):
    """x chunks by TMA (EXL3MOE_MOE_X_TMA) give the bytes of per-thread copies, with a sparse residual stage and NaN
    in every workspace row no position wrote (TMA reads the rows after a block's, which no output may see)."""
    ws_settings_give_the_same_bytes(qwen3_layer, shape, monkeypatch, "EXL3MOE_MOE_X_TMA", ("0", "1"),
                                    lambda plan, tma: plan.mma.x_tma == (tma == "1"), 81, nan=True)


@pytest.mark.parametrize("shape", ["qwen3", "odd-chunks"])
@pytest.mark.parametrize("tma", ["0", "1"])
def test_paired_producers_give_the_bytes_of_sixteen_beside_nan_rows(qwen3_layer, shape, tma, monkeypatch):
    """12 paired producers (two tile columns each; wgmma m64n128k16 consumers) give the bytes of 16 producers of one
    column, with x by cp.async and by TMA."""
    monkeypatch.setenv("EXL3MOE_MOE_X_TMA", tma)
    ws_settings_give_the_same_bytes(qwen3_layer, shape, monkeypatch, "EXL3MOE_MOE_WS_PAIRED", ("0", "1"),
                                    lambda plan, paired: plan.mma.ws_paired == (paired == "1"), 90 + int(tma),
                                    nan=True)


@pytest.mark.parametrize("shape, T", [("qwen3", 2304), ("odd-chunks", 300)])
@pytest.mark.parametrize("tma", ["0", "1"])
def test_192_row_blocks_give_the_bytes_of_128_row_blocks_beside_nan_rows(qwen3_layer, shape, T, tma, monkeypatch):
    """192-row route blocks (three consumer warpgroups, 8 paired producers), which plans take at 128 to 176 rows per
    expert, give the bytes of 128-row blocks, with x by cp.async and by TMA (the 16-expert layer's down in one split
    by a lower warp target)."""
    monkeypatch.setenv("EXL3MOE_MOE_X_TMA", tma)
    monkeypatch.setenv("EXL3MOE_MOE_SPLIT_ROUTE", "0")
    if shape == "odd-chunks":
        monkeypatch.setattr(moe_planning, "TARGET_WARPS", 1)
    ws_settings_give_the_same_bytes(qwen3_layer, shape, monkeypatch, "EXL3MOE_MOE_WS_192", ("0", "1"),
                                    lambda plan, wide: plan.mma.block_m == (192 if wide == "1" else 128)
                                    and plan.mma.ws_down, 110 + int(tma), nan=True, block_m=None, T=T)


@pytest.mark.parametrize("shape, T", [("qwen3", 2048), ("qwen3", 4096), ("odd-chunks", 300)])
@pytest.mark.parametrize("tma", ["0", "1"])
def test_split_route_blocks_give_the_bytes_of_128_row_blocks_beside_nan_rows(qwen3_layer, shape, T, tma,
                                                                            monkeypatch):
    """A chunk's experts split between 192- and 128-row blocks (route_split: one or the other at ~128 rows per
    expert, two narrow or one of each at ~256; the 16-expert layer of three formats in its format order) give the
    bytes of 128-row blocks alone, with x by cp.async and by TMA and a sparse residual stage."""
    monkeypatch.setenv("EXL3MOE_MOE_X_TMA", tma)
    monkeypatch.setenv("EXL3MOE_MOE_WS_192", "0")
    if shape == "odd-chunks":
        monkeypatch.setattr(moe_planning, "TARGET_WARPS", 1)
    ws_settings_give_the_same_bytes(qwen3_layer, shape, monkeypatch, "EXL3MOE_MOE_SPLIT_ROUTE", ("0", "1"),
                                    lambda plan, split: plan.mma.block_m == 128 and plan.mma.ws_down
                                    and (plan.wide_mma is not None) == (split == "1"), 120 + int(tma), nan=True,
                                    block_m=None, T=T)


def butterfly_rotation(rows: torch.Tensor, suh: torch.Tensor) -> torch.Tensor:
    """fp16(Hn128(rows * suh) / sqrt(128)) in fp32 with the kernels' butterflies: bits 0..6 of the index in order."""
    v = rows.float() * suh.float()
    shape = v.shape
    for m in (1, 2, 4, 8, 16, 32, 64):
        pairs = v.reshape(-1, 2, m)
        v = torch.stack((pairs[:, 0] + pairs[:, 1], pairs[:, 0] - pairs[:, 1]), 1)
    return (v.reshape(shape) * torch.tensor(0.08838834764831845, dtype=torch.float32)).half()


@pytest.mark.parametrize("layout", ["aligned", "offset", "strided"])
def test_pre_rotated_inputs_are_the_butterfly_bits(qwen3_layer, layout):
    """moe_rotate_input's rows equal the butterfly rotation bit for bit, with 16-byte loads or element loads."""
    T, top_k, H, E = 300, QWEN3["top_k"], QWEN3["hidden"], QWEN3["experts"]
    g = torch.Generator(device="cuda").manual_seed(70)
    dense = (torch.randn(T, H, device="cuda", generator=g) / 32).half()
    if layout == "offset":   # 8 bytes past a 16-byte boundary
        x = torch.empty(T * H + 4, device="cuda", dtype=torch.float16)[4:].view(T, H)
    elif layout == "strided":   # rows 2 H + 4 elements apart
        x = torch.empty(T, 2 * H + 4, device="cuda", dtype=torch.float16)[:, :H]
    else:
        x = torch.empty(T, H, device="cuda", dtype=torch.float16)
    x.copy_(dense)
    ids, weights = routing(T, E, top_k, 71)
    plan = moe_plan(qwen3_layer, T, top_k, block_m=128, out_dtype=torch.float16)
    assert plan.mma.pre_rotate
    runner = plan.bind(plan.allocate())
    launches = runner.chunk_launches(x, ids, weights, torch.empty(T, H, device="cuda", dtype=torch.float16))
    launches["route_pack"]()
    launches["rotate"]()
    slots = runner._ws["sorted_slots"][:T * top_k].long()
    x_rot = runner._ws["mma_x_rot"].view(2, plan.slot_capacity, H)[:, :T * top_k]
    experts = ids.flatten()[slots]
    for p, weights_p in enumerate((qwen3_layer.gate, qwen3_layer.up)):
        suh = torch.stack([w.suh for w in weights_p])[experts]
        expected = butterfly_rotation(dense[slots // top_k], suh)
        assert torch.equal(bits(x_rot[p]), bits(expected)), (p, (x_rot[p] != expected).any(-1).sum().item())
