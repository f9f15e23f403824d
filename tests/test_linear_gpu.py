"""Full-shape linear checks on a CUDA GPU: accuracy vs float64, row invariance, graph capture."""

import pytest
import torch

from exl3moe import ContractError, EXL3Weight
from exl3moe.format.weight import decode
from exl3moe.kernels.trellis_dense import decode_dense
from exl3moe.ops.linear import LinearPlan, linear
from exl3moe.ops.modules import EXL3Linear
from helpers import capture_allocation_free

pytestmark = pytest.mark.gpu


def make_weight(k, n, K, codebook, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    trellis = torch.randint(-32768, 32767, (k // 16, n // 16, int(16 * K)), dtype=torch.int16, device="cuda",
                            generator=g)
    sign = lambda m: torch.where(torch.rand(m, device="cuda", generator=g) < 0.5, -1.0, 1.0)  # noqa: E731
    suh = (sign(k) * (0.5 + torch.rand(k, device="cuda", generator=g))).half()
    svh = (sign(n) * (0.5 + torch.rand(n, device="cuda", generator=g))).half()
    bias = torch.randn(n, device="cuda", generator=g).half()
    return EXL3Weight(trellis, suh, svh, codebook, bias)


def rel_l2(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


@pytest.mark.parametrize("K,codebook", [(4, "mcg"), (4, "mul1"), (2, "3inst"), (2.5, "mul1"), (8, "mcg")])
@pytest.mark.parametrize("rows", [1, 7, 64, 128, 300])
def test_full_shape_matches_float64(K, codebook, rows):
    w = make_weight(4096, 14336, K, codebook)
    x = torch.randn(rows, 4096, device="cuda").half()
    ref = x.double() @ w.dense(torch.float64) + w.bias.double()
    for dtype in (torch.float16, torch.bfloat16, torch.float32):
        y = linear(x, w, out_dtype=dtype)
        assert y.dtype == dtype
        limit = 2e-3 if dtype != torch.bfloat16 else 6e-3
        assert rel_l2(y, ref) < limit, (dtype, rel_l2(y, ref))


@pytest.mark.parametrize("K,codebook", [(4, "mcg"), (3, "mul1")])
def test_row_bytes_do_not_depend_on_row_count(K, codebook):
    w = make_weight(2048, 768, K, codebook, seed=1)
    x = torch.randn(128, 2048, device="cuda").half()
    full = linear(x, w)
    for rows in range(1, 129):
        y = linear(x[:rows], w)
        assert torch.equal(y.view(torch.int16), full[:rows].view(torch.int16)), rows


@pytest.mark.parametrize("k,n,K,codebook,rows", [(4096, 1408, 4, "mul1", 37), (2048, 768, 3, "mcg", 300)])
def test_graph_capture_and_replay_allocates_nothing(k, n, K, codebook, rows):
    w = make_weight(k, n, K, codebook, seed=rows)
    plan = LinearPlan(w, rows)
    assert plan.dense_path == (rows > 128)
    runner = plan.bind(plan.allocate())
    x = torch.randn(rows, k, device="cuda").half()
    out = torch.empty(rows, n, device="cuda", dtype=torch.float16)
    runner.run(x, out)
    first = torch.cuda.CUDAGraph()
    with torch.cuda.graph(first):  # cuBLAS (above 128 rows) takes its workspace for the capture stream once
        runner.run(x, out)
    graph = capture_allocation_free(lambda: runner.run(x, out), out)
    x.copy_(torch.randn(rows, k, device="cuda").half())
    out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    assert rel_l2(out, x.double() @ w.dense(torch.float64) + w.bias.double()) < 2e-3
    assert torch.equal(out, linear(x, w))


def allocations() -> int:
    torch.cuda.synchronize()
    return torch.cuda.memory_stats()["allocation.all.allocated"]


def test_bad_out_or_x_raises_before_allocating():
    w = make_weight(2048, 768, 4, "mcg", seed=41)
    module = EXL3Linear(w, 8)
    x, out = torch.randn(4, 2048, device="cuda").half(), torch.empty(4, 768, device="cuda").half()
    bad_outs = [torch.empty(4, 767, device="cuda").half(), torch.empty(4, 768, device="cuda", dtype=torch.int32),
                torch.empty(768, 4, device="cuda").half().t(), torch.empty(4, 768).half()]
    bad_xs = [x.float(), torch.randn(4096, device="cuda").half()[::2], x[:, :1024], x.cpu()]
    cases = [(lambda b=b: linear(x, w, out=b), "out") for b in bad_outs]
    cases += [(lambda b=b: module(x, out=b), "out") for b in bad_outs]
    cases += [(lambda b=b: linear(b, w, out=out), "x") for b in bad_xs]
    cases += [(lambda b=b: module(b, out=out), "x") for b in bad_xs]
    before = allocations()
    for call, name in cases:
        with pytest.raises(ContractError) as err:
            call()
        assert err.value.name == name, str(err.value)
    assert allocations() == before, "validation allocated, so it ran after a plan, bind or launch"


def replays_new_inputs(call, x, out, w):
    """Capture `call` (after one capture that gives cuBLAS its capture-stream workspace), replay it on new inputs
    copied into x over a NaN-filled out, and check it gives the bytes of an uncaptured call."""
    first = torch.cuda.CUDAGraph()
    with torch.cuda.graph(first):
        call()
    graph = capture_allocation_free(call, out)
    x.copy_(torch.randn(*x.shape, device="cuda").half())
    expected = linear(x, w)
    out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out.view(torch.int16), expected.view(torch.int16))
    assert rel_l2(out, x.double() @ w.dense(torch.float64) + w.bias.double()) < 2e-3


@pytest.mark.parametrize("k,n,K,codebook,rows", [(4096, 1408, 4, "mul1", 1), (4096, 1408, 3, "mcg", 37),
                                                 (2048, 768, 2.5, "mul1", 128), (2048, 768, 4, "mcg", 300)])
def test_linear_with_out_allocates_nothing_after_one_call_and_replays(k, n, K, codebook, rows):
    w = make_weight(k, n, K, codebook, seed=43)
    x = torch.randn(rows, k, device="cuda").half()
    out = torch.empty(rows, n, device="cuda", dtype=torch.float16)
    linear(x, w, out=out)   # plans once for this weight and binds the shared workspace
    before = allocations()
    assert linear(x, w, out=out) is out
    assert allocations() == before
    replays_new_inputs(lambda: linear(x, w, out=out), x, out, w)


@pytest.mark.parametrize("k,n,K,codebook,rows", [(4096, 1408, 4, "mcg", 1), (2048, 768, 3, "mul1", 100)])
def test_module_forward_with_out_replays(k, n, K, codebook, rows):
    w = make_weight(k, n, K, codebook, seed=47)
    module = EXL3Linear(w, 128)
    x = torch.randn(rows, k, device="cuda").half()
    out = torch.empty(rows, n, device="cuda", dtype=torch.float16)
    module(x, out=out)
    before = allocations()
    assert module(x, out=out) is out
    assert allocations() == before
    replays_new_inputs(lambda: module(x, out=out), x, out, w)


ALL_RATES = [(K, cb) for cb in ("3inst", "mcg", "mul1") for K in range(1, 9)] + [(1.5, "mul1"), (2.5, "mul1"),
                                                                                  (3.5, "mul1")]


@pytest.mark.parametrize("backend", ["cuda", "triton"])
@pytest.mark.parametrize("K,codebook", ALL_RATES)
def test_every_rate_on_both_backends(K, codebook, backend, monkeypatch):
    monkeypatch.setenv("EXL3MOE_CUDA_KERNELS", "1" if backend == "cuda" else "0")
    w = make_weight(1024, 512, K, codebook, seed=3)
    plan = LinearPlan(w, 40)
    assert (plan.mma is not None) == (backend == "cuda")
    runner = plan.bind(plan.allocate())
    x = torch.randn(40, 1024, device="cuda").half()
    ref = x.double() @ w.dense(torch.float64) + w.bias.double()
    for rows in (1, 17, 40):
        out = torch.empty(rows, 512, device="cuda", dtype=torch.float16)
        runner.run(x[:rows], out)
        assert rel_l2(out, ref[:rows]) < 2e-3, (rows, rel_l2(out, ref[:rows]))


@pytest.mark.parametrize("K,codebook", ALL_RATES)
def test_cuda_dense_decode_is_bit_exact(K, codebook):
    w = make_weight(640, 384, K, codebook, seed=5)  # 40 k-tiles: each column in three warp ranges, the last partial
    dense = torch.full((640, 384), float("nan"), device="cuda", dtype=torch.float16)
    decode_dense(w, dense)
    expected = decode(w.trellis.cpu(), K, codebook)
    assert torch.equal(dense.cpu().view(torch.int16), expected.view(torch.int16))


@pytest.mark.parametrize("k,n,spb,dtype", [(4096, 1408, "", torch.float16), (4096, 1408, "3", torch.float32),
                                           (4096, 1408, "99", torch.float16), (2048, 768, "99", torch.float32),
                                           (2048, 768, "5", torch.bfloat16), (4096, 14336, "", torch.float16),
                                           (14336, 4096, "", torch.bfloat16)])
@pytest.mark.parametrize("split_reduce", ["0", "1"])
def test_warp_specialized_kernel_gives_trellis_mma_bytes(k, n, spb, dtype, split_reduce, monkeypatch):
    from exl3moe.ops.linear_planning import uses_ws

    assert uses_ws(128, k, n, torch.device("cuda")), "the H200 runs 128 rows of every weight on trellis_ws"
    w = make_weight(k, n, 4, "mcg", seed=7)
    x = torch.randn(128, k, device="cuda").half()
    monkeypatch.setenv("EXL3MOE_WS", "0")
    expected = {rows: linear(x[:rows], w, out_dtype=dtype) for rows in (20, 40, 65, 100, 128)}
    monkeypatch.setenv("EXL3MOE_WS", "1")
    monkeypatch.setenv("EXL3MOE_WS_SPB", spb)
    monkeypatch.setenv("EXL3MOE_WS_SPLIT_REDUCE", split_reduce)   # partials summed by reduce_splits or in-kernel
    monkeypatch.setenv("EXL3MOE_WS_MIN_ROWS", "17")  # 17..64 rows too, against the 2- and 4-m-tile kernels
    for rows, ref in expected.items():
        y = linear(x[:rows], w, out_dtype=dtype)
        assert torch.equal(y.view(torch.uint8), ref.view(torch.uint8)), rows


@pytest.mark.parametrize("k,n,K,codebook", [(4096, 14336, 4, "mcg"), (14336, 4096, 3, "mul1"), (2048, 768, 6, "3inst"),
                                             (4096, 1408, 8, "mcg"), (1408, 4096, 2, "mul1")])
@pytest.mark.parametrize("tma", ["0", "1"])
def test_paired_producers_give_trellis_mma_bytes(k, n, K, codebook, tma, monkeypatch):
    """trellis_ws on 12 paired producers (EXL3MOE_WS_PAIRED=1) and on 16 give trellis_mma's bytes."""
    w = make_weight(k, n, K, codebook, seed=11)
    x = torch.randn(128, k, device="cuda").half()
    monkeypatch.setenv("EXL3MOE_WS", "0")
    expected = {rows: linear(x[:rows], w) for rows in (20, 65, 128)}
    monkeypatch.setenv("EXL3MOE_WS", "1")
    monkeypatch.setenv("EXL3MOE_WS_X_TMA", tma)
    monkeypatch.setenv("EXL3MOE_WS_MIN_ROWS", "17")
    for paired in ("0", "1"):
        monkeypatch.setenv("EXL3MOE_WS_PAIRED", paired)
        for rows, ref in expected.items():
            assert torch.equal(linear(x[:rows], w).view(torch.int16), ref.view(torch.int16)), (paired, rows)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("paired", ["0", "1"])
def test_whole_split_blocks_give_trellis_mma_bytes(dtype, paired, monkeypatch):
    """trellis_ws blocks that run every split (their running sum in shared memory) give trellis_mma's bytes, with a
    bias, in every output dtype, into an output aligned and one element off."""
    w = make_weight(2048, 768, 3, "mcg", seed=23)
    x = torch.randn(128, 2048, device="cuda").half()
    monkeypatch.setenv("EXL3MOE_WS", "0")
    expected = {rows: linear(x[:rows], w, out_dtype=dtype) for rows in (17, 64, 100, 128)}
    monkeypatch.setenv("EXL3MOE_WS", "1")
    monkeypatch.setenv("EXL3MOE_WS_SPB", "99")
    monkeypatch.setenv("EXL3MOE_WS_PAIRED", paired)
    monkeypatch.setenv("EXL3MOE_WS_MIN_ROWS", "17")
    for rows, ref in expected.items():
        for offset in (0, 1):
            out = torch.full((rows * 768 + offset,), float("nan"), device="cuda", dtype=dtype)[offset:].view(rows, 768)
            linear(x[:rows], w, out=out)
            assert torch.equal(out.view(torch.uint8), ref.view(torch.uint8)), (rows, offset)


@pytest.mark.parametrize("k,n,rows,cluster,depth", [(2048, 768, 1, None, 8), (2048, 768, 8, None, 8),
                                                     (2048, 768, 1, "0", 8), (2048, 768, 8, "0", 8),
                                                     (4096, 14336, 1, None, 0), (4096, 14336, 4, None, 0),
                                                     (2048, 768, 32, None, None), (2048, 768, 100, None, None),
                                                     (4096, 14336, 8, None, None), (4096, 14336, 64, None, None),
                                                     (4096, 1408, 1, None, 0), (4096, 1408, 8, None, 0)])
def test_chained_calls_that_feed_each_other_give_unchained_bytes(k, n, rows, cluster, depth, monkeypatch):
    """Calls launched after the previous kernel (CHAIN: L2 prefetches of `depth` k-tiles, then griddepcontrol.wait;
    None: a chained rotate_input and the kernels after it) where each reads the output the one before it writes, and
    a layer runs twice on one workspace: the bytes of launches that wait for completion, eagerly and in a captured
    graph replayed over NaN-filled outputs."""
    from exl3moe.ops.linear_planning import fuses_rotation, linear_chains, mma_chain, plan_mma

    if cluster:
        monkeypatch.setenv("EXL3MOE_LINEAR_CLUSTER", cluster)
    g = torch.Generator(device="cuda").manual_seed(29)
    layers = []
    for k_in, n_out, K, codebook in ((k, n, 4, "mcg"), (n, k, 3, "mul1")):
        w = make_weight(k_in, n_out, K, codebook, seed=k_in)
        w = EXL3Weight(w.trellis, w.suh, (w.svh.float() / (1.25 * k_in**0.5)).half(), codebook, w.bias)   # norm kept
        tiles = plan_mma(k_in, n_out)
        if depth is None:
            assert not fuses_rotation(rows, k_in, n_out) and linear_chains(rows, w.trellis.device)
        else:
            assert mma_chain(n_out // 128 * tiles.splits, w.trellis.device) == depth, (k_in, n_out)
        plan = LinearPlan(w, rows)
        layers.append(plan.bind(plan.allocate()))
    x = torch.randn(rows, k, device="cuda", generator=g).half()
    outs = [torch.empty(rows, width, device="cuda").half() for width in (n, k, n, k)]

    def run():
        h = x
        for i, out in enumerate(outs):
            h = layers[i % 2].run(h, out)

    monkeypatch.setenv("EXL3MOE_LINEAR_CHAIN", "0")
    run()
    expected = [out.clone() for out in outs]
    monkeypatch.delenv("EXL3MOE_LINEAR_CHAIN")
    for plan in (layer.plan for layer in layers):
        LinearPlan(plan.weight, rows)   # compiles the chained variants before the capture
    run()
    assert all(torch.equal(a.view(torch.int16), b.view(torch.int16)) for a, b in zip(outs, expected))
    graph = capture_allocation_free(run, outs[0])
    for out in outs:
        out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    assert all(torch.equal(a.view(torch.int16), b.view(torch.int16)) for a, b in zip(outs, expected))
    assert all(torch.isfinite(a).all() for a in expected)


@pytest.mark.parametrize("rows", [1, 32])
def test_chained_calls_after_a_copy_or_another_streams_event_read_the_fresh_input(rows, monkeypatch):
    """A chained call whose input comes from a memcpy, or from a kernel on another stream through an event, reads the
    new input, eagerly and in a captured graph (the programmatic launch relaxes only a kernel-to-kernel order)."""
    w = make_weight(2048, 768, 4, "mcg", seed=31)
    plan = LinearPlan(w, rows)
    runner = plan.bind(plan.allocate())
    g = torch.Generator(device="cuda").manual_seed(37)
    src, x, out = (torch.randn(rows, 2048, device="cuda", generator=g).half(), torch.zeros(rows, 2048, device="cuda")
                   .half(), torch.empty(rows, 768, device="cuda").half())
    monkeypatch.setenv("EXL3MOE_LINEAR_CHAIN", "0")
    expected = linear(src, w)
    monkeypatch.delenv("EXL3MOE_LINEAR_CHAIN")
    LinearPlan(w, rows)   # the chained variants, compiled before any capture
    side = torch.cuda.Stream()

    def by_copy():
        runner.run(x, out)   # a chained kernel just before the copy
        x.copy_(src)
        runner.run(x, out)

    def by_event():
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            x.copy_(src * 1)   # a kernel on the other stream
        torch.cuda.current_stream().wait_stream(side)
        runner.run(x, out)

    for call in (by_copy, by_event):
        x.zero_()
        call()
        torch.cuda.synchronize()
        assert torch.equal(out.view(torch.int16), expected.view(torch.int16)), call.__name__
        x.zero_()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            call()
        x.zero_()
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out.view(torch.int16), expected.view(torch.int16)), call.__name__


@pytest.mark.parametrize("k,n,K,codebook,dtype", [(14336, 4096, 3, "mul1", torch.float16),
                                                   (4096, 1408, 4, "mcg", torch.bfloat16),
                                                   (2048, 768, 6, "3inst", torch.float32)])
def test_split_reduce_kernel_gives_the_last_arrival_bytes(k, n, K, codebook, dtype, monkeypatch):
    """trellis_mma's partials summed by reduce_splits give the bytes of each column group's last arrival."""
    w = make_weight(k, n, K, codebook, seed=17)
    x = torch.randn(64, k, device="cuda").half()
    monkeypatch.setenv("EXL3MOE_WS", "0")   # trellis_mma at every row count
    monkeypatch.setenv("EXL3MOE_MMA_SPLIT_REDUCE", "0")
    expected = {rows: linear(x[:rows], w, out_dtype=dtype) for rows in (1, 17, 40, 64)}
    monkeypatch.setenv("EXL3MOE_MMA_SPLIT_REDUCE", "1")
    for rows, ref in expected.items():
        assert torch.equal(linear(x[:rows], w, out_dtype=dtype).view(torch.uint8), ref.view(torch.uint8)), rows


@pytest.mark.parametrize("k,n,K,codebook,dtype", [
    (768, 2048, 4, "mcg", torch.float16), (768, 2048, 3, "mul1", torch.bfloat16),
    (768, 2048, 6, "3inst", torch.float32), (4096, 14336, 4, "mcg", torch.float16),
    (2048, 768, 3, "mcg", torch.float16), (1408, 4096, 4, "mul1", torch.bfloat16)])
def test_cluster_reduction_gives_the_same_bytes(k, n, K, codebook, dtype, monkeypatch):
    """The splits of a 128-column group summed in a cluster's shared memory (6, 8, 16 and 11 splits: portable and
    non-portable sizes): the bytes of the L2 reduction."""
    from exl3moe.ops.linear_planning import cluster_splits, plan_mma

    w = make_weight(k, n, K, codebook, seed=11)
    x = torch.randn(32, k, device="cuda").half()
    monkeypatch.setenv("EXL3MOE_LINEAR_CLUSTER", "0")
    expected = {rows: linear(x[:rows], w, out_dtype=dtype) for rows in (1, 3, 8, 16, 17, 32)}
    monkeypatch.setenv("EXL3MOE_LINEAR_CLUSTER", "1")
    assert cluster_splits(2, plan_mma(k, n).splits, n // 128) > 0, "this shape's split runs as a cluster"
    for rows, ref in expected.items():
        y = linear(x[:rows], w, out_dtype=dtype)
        assert torch.equal(y.view(torch.uint8), ref.view(torch.uint8)), rows
