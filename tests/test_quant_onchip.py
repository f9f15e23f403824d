"""The on-chip trellis passes (quant/trellis_onchip.py) give the torch passes' bits (interpreter here; GPU compiled)."""

import json
import os
import subprocess
import sys

import pytest
import torch

from exl3moe.quant import trellis, trellis_onchip
from exl3moe.quant.ring_search import search_ring
from exl3moe.quant.tiles import tile_ring

pytestmark = [pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available(),
                                 reason="Triton needs a GPU or TRITON_INTERPRET=1")]
pytestmark += [pytest.mark.gpu] if torch.cuda.is_available() else []
pytestmark += [pytest.mark.usefixtures("one_torch_thread")]
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _searches(monkeypatch, run, searches=("torch", "global", "onchip")):
    """run() under the torch passes, then each Triton search."""
    out = []
    for search in searches:
        monkeypatch.setattr(trellis, "BACKEND", "torch" if search == "torch" else "triton")
        monkeypatch.setattr(trellis, "SEARCH", "global" if search == "torch" else search)
        out.append(run())
    return out


def _assert_all_equal(outs):
    for other in outs[1:]:
        for a, b in zip(outs[0], other):
            assert torch.equal(a, b)


def _small_ring(D, T, L=8):
    g = torch.Generator().manual_seed(D)
    values = torch.randn(1 << L, generator=g).half().float().to(DEVICE)  # fp16-exact: the kernel reads fp16
    return trellis.Ring(L, (D,) * T, values), torch.randn(3, T, generator=g).to(DEVICE)


def _passes(ring, targets, T):
    g = torch.Generator().manual_seed(7)
    nodes = lambda p: 1 << ring.node_bits(p)  # noqa: E731  (the nodes after position p)
    start_costs = torch.randn(3, nodes(4), generator=g).to(DEVICE)
    start_costs[1, 3:] = float("inf")  # a forced start, as a seam search has
    end_costs = torch.randn(3, nodes(T + 2), generator=g).to(DEVICE)
    free_end = torch.randn(3, nodes(T - 2), generator=g).to(DEVICE)

    def run():
        m, kept = trellis.forward(ring, targets, 5, T, start_costs, keep=True)
        back_states, back_node = trellis.traceback(ring, targets, kept, 5, T, m.argmin(-1), stop=3)
        free, _ = trellis.forward(ring, targets, 1, T - 2, torch.zeros(3, nodes(0), device=DEVICE))
        g, kept_b = trellis.backward(ring, targets, 3, T, end_costs, keep=True)
        fwd_states, fwd_node = trellis.trace_forward(ring, targets, kept_b, 3, T, g.argmin(-1))
        g_free, _ = trellis.backward(ring, targets, 2, T - 3, -free_end)
        return m, back_states, back_node, free, g, fwd_states, fwd_node, g_free
    return run


@pytest.mark.parametrize("tiles", [1, 2])
@pytest.mark.parametrize("D, T", [(1, 16), (2, 24), (3, 12), (4, 8)])
def test_passes_and_tracebacks_match_torch(monkeypatch, D, T, tiles):
    monkeypatch.setattr(trellis_onchip, "TILES", tiles)
    ring, targets = _small_ring(D, T)
    _assert_all_equal(_searches(monkeypatch, _passes(ring, targets, T)))


@pytest.mark.parametrize("tiles", [1, 2])
def test_a_forward_and_a_backward_side_by_side_match_torch(monkeypatch, tiles):
    """One launch of both passes (the seam bound's pairs), and of both walks back, gives what each gives alone."""
    monkeypatch.setattr(trellis_onchip, "TILES", tiles)
    ring, targets = _small_ring(2, 20)
    g = torch.Generator().manual_seed(9)
    costs = [torch.randn(3, ring.node_count, generator=g).to(DEVICE) for _ in range(2)]

    def run():
        (m, kept_f), (b, kept_b) = trellis.forward_and_backward(ring, targets, (10, 10, costs[0], True),
                                                                (0, 12, costs[1], True))
        (m2, _), (b2, _) = trellis.forward_and_backward(ring, targets, (0, 7, costs[1], False),
                                                        (7, 13, costs[0], False))
        (fwd_states, fwd_node), (back_states, back_node) = trellis.trace_both(
            ring, targets, (kept_b, 0, 12, b.argmin(-1)), (kept_f, 10, 10, m.argmin(-1)))
        return (m, b, m2, b2, trellis.traceback(ring, targets, kept_f, 10, 10, m.argmin(-1))[0],
                trellis.trace_forward(ring, targets, kept_b, 0, 12, b.argmin(-1))[0], fwd_states, fwd_node,
                back_states, back_node)
    _assert_all_equal(_searches(monkeypatch, run))


def test_ring_search_matches_torch(monkeypatch):
    ring, targets = _small_ring(2, 32)
    outs = _searches(monkeypatch, lambda: (lambda r: (r.states, r.cost))(search_ring(ring, targets)))
    _assert_all_equal(outs)


def test_full_tile_search_matches_torch(monkeypatch):
    """The exact ring search of two 16-bit K4 tiles: every half pass, forced seam and traceback of search_ring."""
    ring = tile_ring(4, "mcg", torch.device(DEVICE))
    targets = 1.1 * torch.randn(2, 256, generator=torch.Generator().manual_seed(5)).to(DEVICE)
    outs = _searches(monkeypatch, lambda: (lambda r: (r.states, r.cost))(search_ring(ring, targets)),
                     ("torch", "onchip"))
    _assert_all_equal(outs)


@pytest.mark.parametrize("codebook, K", [("mcg", 4), ("3inst", 1), ("mul1", 8)])
def test_format_ring_steps_match_torch(monkeypatch, codebook, K):
    """The full 16-bit ring: three forward and three backward steps from random costs, kept for traceback."""
    ring = tile_ring(K, codebook, torch.device(DEVICE))
    assert trellis_onchip.supports(ring)
    g = torch.Generator().manual_seed(3)
    targets = torch.randn(2, 256, generator=g).to(DEVICE)
    costs = torch.rand(2, ring.node_count, generator=g).to(DEVICE)

    def run():
        m, kept = trellis.forward(ring, targets, 254, 3, costs, keep=True)
        g_back, _ = trellis.backward(ring, targets, 100, 3, costs)
        return m, trellis.traceback(ring, targets, kept, 254, 3, m.argmin(-1))[0], g_back
    _assert_all_equal(_searches(monkeypatch, run))


def test_rings_of_mixed_widths_fall_back_to_the_global_kernels(monkeypatch):
    ring, targets = _small_ring(1, 24)
    mixed = trellis.Ring(8, (1, 2) * 12, ring.values)
    assert not trellis_onchip.supports(mixed) and trellis_onchip.supports(ring)
    assert not trellis_onchip.supports(tile_ring(2.5, "mul1", torch.device(DEVICE)))
    _assert_all_equal(_searches(monkeypatch, _passes(mixed, targets, 24)))


@pytest.mark.gpu   # a whole encoding: compiled kernels only
def test_an_encoding_gives_the_same_trellis_with_both_searches(monkeypatch):
    from exl3moe.quant import quantize_weight
    g = torch.Generator().manual_seed(11)
    W, X = torch.randn(256, 256, generator=g), torch.randn(1024, 256, generator=g)
    out = []
    for search in ("global", "onchip"):
        monkeypatch.setattr(trellis, "SEARCH", search)
        out.append(quantize_weight(W.cuda(), (X.T @ X / 1024).cuda(), K=3, scale_tiles=16))
    assert torch.equal(out[0][0].trellis, out[1][0].trellis)
    assert out[0][1].proxy_error == out[1][1].proxy_error


def test_an_unknown_search_is_refused(monkeypatch):
    ring, targets = _small_ring(2, 8)
    monkeypatch.setattr(trellis, "BACKEND", "triton")
    monkeypatch.setattr(trellis, "SEARCH", "fast")
    with pytest.raises(ValueError, match="EXL3MOE_QUANT_SEARCH"):
        trellis.forward(ring, targets, 0, 8, torch.zeros(3, ring.node_count, device=DEVICE))


COMPILE_CHECK = """
import json, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from exl3moe.quant import trellis_onchip
walk = (("start", "i32"), ("count", "i32"), ("slots", "i32"), ("stride_tile", "i64"), ("stride_slot", "i64"))
name, D, keep = sys.argv[1], int(sys.argv[2]), sys.argv[3] == "1"
if name == "_trace_pair_kernel":
    walks = {s: (("hist" + s, "*fp32"), (node, "*i64"), ("states" + s, "*i64"), ("start" + s, "i32"),
                 ("count" + s, "i32"), ("stride_tile" + s, "i64"), ("stride_slot" + s, "i64"))
             for s, node in (("_f", "first_node"), ("_b", "last_node"))}
    head = (("targets", "*fp32"), ("values", "*fp32"), ("steps", "*i32"))
    signature = dict(head + walks["_f"] + walks["_b"] + (("T", "i32"),))
    constants = {"L": 16, "ARG_BLOCK": trellis_onchip.ARG_BLOCK}
elif name == "_onchip_pair_kernel":
    head = (("targets", "*fp32"), ("values", "*fp16"), ("hist_f", "*fp32"), ("hist_b", "*fp32"), ("B_tiles", "i32"),
            ("T", "i32"))
    signature = dict(head + tuple((n + s, t) for s in ("_f", "_b") for n, t in walk))
    constants = {"L": 16, "D": D, "TILES": 1, "KEEP_F": keep, "KEEP_B": keep}
else:
    head = (("targets", "*fp32"), ("values", "*fp16"), ("hist", "*fp32"), ("B_tiles", "i32"), ("T", "i32"))
    signature = dict(head + walk)
    constants = {"L": 16, "D": D, "TILES": 1, "KEEP": keep}
signature.update({c: "constexpr" for c in constants})
source = ASTSource(getattr(trellis_onchip, name), signature, constants)
kernel = triton.compile(source, target=GPUTarget("cuda", 90, 32),
                        options={"num_warps": 4 if name == "_trace_pair_kernel" else trellis_onchip.WARPS,
                                 "enable_fp_fusion": False})
print(json.dumps({"fma": kernel.asm["ptx"].count("fma.rn.f32"), "cubin": len(kernel.asm["cubin"]) > 0}))
"""


@pytest.mark.parametrize("name, D, keep", [("_onchip_forward_kernel", 4, "1"), ("_onchip_backward_kernel", 2, "0"),
                                           ("_onchip_backward_kernel", 8, "1"), ("_onchip_pair_kernel", 1, "1"),
                                           ("_trace_pair_kernel", 4, "1")])
def test_passes_compile_for_sm90_without_fused_multiply_add(name, D, keep, tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(TRITON_CACHE_DIR=str(tmp_path), PYTHONPATH=os.pathsep.join(sys.path))
    run = subprocess.run([sys.executable, "-c", COMPILE_CHECK, name, str(D), keep], env=env, capture_output=True,
                         text=True, timeout=300)
    if run.returncode and "ptxas" in run.stderr and "not found" in run.stderr:
        pytest.skip(f"no ptxas for sm_90 here: {run.stderr[-300:]}")
    assert run.returncode == 0, run.stderr[-3000:]
    assert json.loads(run.stdout.strip().splitlines()[-1]) == {"fma": 0, "cubin": True}
