"""The warp-specialized kernels' ring ordering under load: the linear (trellis_ws) and a MoE layer (ws gate/up and the
persistent ws down) captured in a CUDA graph and replayed thousands of times while another stream copies large
buffers back and forth; every replay's output must be the first one's bytes, and the first must match float64."""

import os
import sys

import pytest
import torch

from exl3moe.ops.linear import LinearPlan
from exl3moe.ops.moe import moe_plan
from exl3moe.reference import linear as linear_reference
from exl3moe.reference import moe as moe_reference
from helpers import random_experts, random_weight

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "scripts"))
from sanitize import Launches  # noqa: E402

pytestmark = pytest.mark.gpu

HAMMER_BYTES = 512 << 20   # each copy of the other stream: 1 GiB of memory traffic
HAMMER_EVERY = 4           # replays per hammer copy (a copy outlasts several replays, so the stream stays busy)


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16)


def rel_l2(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.double() - ref).norm() / ref.norm()).item()


def replay_under_load(graph: torch.cuda.CUDAGraph, out: torch.Tensor, replays: int) -> int:
    """Replay `graph` `replays` times, a hammer copy on another stream every HAMMER_EVERY replays, counting the
    16-bit words of `out` that differ from the first replay's; returns the count (synchronised once, at the end)."""
    src = torch.empty(HAMMER_BYTES, dtype=torch.uint8, device="cuda").fill_(7)
    dst = torch.empty_like(src)
    hammer = torch.cuda.Stream()
    graph.replay()
    first = out.clone()
    differing = torch.zeros((), dtype=torch.int64, device="cuda")
    for i in range(replays):
        if i % HAMMER_EVERY == 0:
            with torch.cuda.stream(hammer):
                (dst if i % (2 * HAMMER_EVERY) == 0 else src).copy_(src if i % (2 * HAMMER_EVERY) == 0 else dst)
        graph.replay()
        differing += (bits(out) != bits(first)).sum()
    torch.cuda.synchronize()
    assert torch.equal(bits(out), bits(first))
    return int(differing.item())


def captured(call) -> torch.cuda.CUDAGraph:
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        call()
    return graph


def test_ws_linear_replays_keep_their_bytes_under_memory_load():
    """64 rows of a 4096 x 4096 K4 weight (trellis_ws from 64 rows at this size), 20000 replays."""
    g = torch.Generator().manual_seed(11)
    w = random_weight(4096, 4096, 4, "mcg", bias=True, generator=g).to("cuda")
    x = torch.randn(64, 4096, generator=g).half().cuda()
    out = torch.empty(64, 4096, dtype=torch.float16, device="cuda")
    with Launches() as launches:
        plan = LinearPlan(w, 64)   # compiles outside the capture
        runner = plan.bind(plan.allocate())
        runner.run(x, out)
    assert launches.ran("trellis_ws", {}), sorted({n for n, _ in launches.launched})
    err = rel_l2(out, linear_reference(x, w))
    assert err < 2e-3, err
    eager = out.clone()
    graph = captured(lambda: runner.run(x, out))
    assert replay_under_load(graph, out, 20000) == 0
    assert torch.equal(bits(out), bits(eager))


def test_ws_moe_replays_keep_their_bytes_under_memory_load():
    """1024 tokens top-4 over 64 experts (H 1024, I 512, K4 MCG and K3 3INST): 128-row route blocks, gate/up in one
    k split (8 ring stages per block, so the ring wraps in turns of different warps) and the persistent ws down;
    5000 replays."""
    E, H, I, top_k, T = 64, 1024, 512, 4, 1024
    g = torch.Generator().manual_seed(12)
    experts = random_experts(E, H, I, [4, 3] * (E // 2), ["mcg", "3inst"] * (E // 2), generator=g).to("cuda")
    x = (torch.randn(T, H, generator=g) / 32).half().cuda()
    ids = torch.rand(T, E, generator=g).argsort(-1)[:, :top_k].to(torch.int32).contiguous().cuda()
    weights = torch.softmax(torch.randn(T, top_k, generator=g), -1).cuda()
    out = torch.empty(T, H, dtype=torch.float16, device="cuda")
    with Launches() as launches:
        plan = moe_plan(experts, T, top_k, out_dtype=torch.float16)
        runner = plan.bind(plan.allocate())
        runner.run(x, ids, weights, out)
    launched = sorted({n for n, _ in launches.launched})
    assert launches.ran("moe_gate_up_mma", {"WS": "1"}) and launches.ran("moe_down_ws", {}), launched
    err = rel_l2(out, moe_reference(x, experts, ids, weights))
    assert err < 2e-3, err
    eager = out.clone()
    graph = captured(lambda: runner.run(x, ids, weights, out))
    assert replay_under_load(graph, out, 5000) == 0
    assert torch.equal(bits(out), bits(eager))
