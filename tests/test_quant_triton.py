"""The Triton trellis passes give the torch passes' bits (run here under TRITON_INTERPRET=1, on the GPU compiled)."""

import os

import pytest
import torch

from exl3moe.quant import trellis
from exl3moe.quant.ring_search import search_ring
from exl3moe.quant.tiles import tile_ring

# On a GPU machine these run compiled with the gpu tests; elsewhere under the interpreter with the CPU tests.
pytestmark = [pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available(),
                                 reason="Triton needs a GPU or TRITON_INTERPRET=1")]
pytestmark += [pytest.mark.gpu] if torch.cuda.is_available() else []
pytestmark += [pytest.mark.usefixtures("one_torch_thread")]
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _both(monkeypatch, run):
    """run() under the torch backend, then under the Triton backend."""
    out = []
    for backend in ("torch", "triton"):
        monkeypatch.setattr(trellis, "BACKEND", backend)
        out.append(run())
    return out


def _small_ring(steps):
    g = torch.Generator().manual_seed(len(steps))
    return trellis.Ring(8, steps, torch.randn(256, generator=g).to(DEVICE)), torch.randn(3, len(steps), generator=g)


@pytest.mark.parametrize("steps", [(2,) * 24, (1, 2) * 12, (3,) * 12])
def test_passes_and_tracebacks_match_torch(monkeypatch, steps):
    ring, targets = _small_ring(steps)
    targets = targets.to(DEVICE)
    T = len(steps)
    start_costs = torch.randn(3, 1 << (8 - ring.D(5)), generator=torch.Generator().manual_seed(1)).to(DEVICE)
    end_costs = torch.randn(3, 1 << ring.node_bits(T + 2), generator=torch.Generator().manual_seed(2)).to(DEVICE)

    def run():
        m, kept = trellis.forward(ring, targets, 5, T, start_costs, keep=True)
        back_states, back_node = trellis.traceback(ring, targets, kept, 5, T, m.argmin(-1), stop=3)
        free, _ = trellis.forward(ring, targets, 1, T - 2, torch.zeros(3, 1 << (8 - ring.D(1)), device=DEVICE))
        g, kept_b = trellis.backward(ring, targets, 3, T, end_costs, keep=True)
        fwd_states, fwd_node = trellis.trace_forward(ring, targets, kept_b, 3, T, g.argmin(-1))
        return m, back_states, back_node, free, g, fwd_states, fwd_node

    torch_out, triton_out = _both(monkeypatch, run)
    for a, b in zip(torch_out, triton_out):
        assert torch.equal(a, b)


def test_ring_search_matches_torch(monkeypatch):
    ring, targets = _small_ring((1, 2) * 16)
    targets = targets.to(DEVICE)
    torch_result, triton_result = _both(monkeypatch, lambda: search_ring(ring, targets))
    assert torch.equal(torch_result.states, triton_result.states)
    assert torch.equal(torch_result.cost, triton_result.cost)


@pytest.mark.parametrize("codebook, K", [("mcg", 4), ("mul1", 8), ("mul1", 1.5)])
def test_format_ring_steps_match_torch(monkeypatch, codebook, K):
    ring = tile_ring(K, codebook, torch.device(DEVICE))
    targets = torch.randn(1, 256, generator=torch.Generator().manual_seed(3)).to(DEVICE)
    start_costs = torch.rand(1, ring.node_count, generator=torch.Generator().manual_seed(4)).to(DEVICE)
    torch_out, triton_out = _both(monkeypatch, lambda: trellis.forward(ring, targets, 254, 3, start_costs)[0])
    assert torch.equal(torch_out, triton_out)


COMPILE_CHECK = """
import json, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from exl3moe.quant import trellis_triton
signature = {"targets": "*fp32", "values": "*fp32", "steps": "*i32", "hist": "*fp32", "T": "i32", "start": "i32",
             "count": "i32", "slots": "i32", "stride_tile": "i64", "stride_slot": "i64", "L": "constexpr",
             "GROUP": "constexpr", "NODES": "constexpr"}
source = ASTSource(getattr(trellis_triton, sys.argv[1]), signature, {"L": 16, "GROUP": 16, "NODES": 256})
ptx = triton.compile(source, target=GPUTarget("cuda", 90, 32),
                     options={"num_warps": trellis_triton.WARPS, "enable_fp_fusion": False}).asm["ptx"]
counts = {"fma": ptx.count("fma.rn.f32"), "barriers": ptx.count("bar.sync"), "l2_loads": ptx.count("ld.global.cg")}
print(json.dumps(counts))
"""


@pytest.mark.parametrize("name", ["_forward_kernel", "_backward_kernel"])
def test_passes_compile_for_sm90_without_fused_multiply_add(name, tmp_path):
    """Compiled by Triton's own ptxas for the H200 (in a process without the interpreter): plain mul/add (the torch
    bits), one barrier per step, history loads from L2."""
    import json
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(TRITON_CACHE_DIR=str(tmp_path), PYTHONPATH=os.pathsep.join(sys.path))
    run = subprocess.run([sys.executable, "-c", COMPILE_CHECK, name], env=env, capture_output=True, text=True,
                         timeout=300)
    if run.returncode and "ptxas" in run.stderr and "not found" in run.stderr:
        pytest.skip(f"no ptxas for sm_90 here: {run.stderr[-300:]}")
    assert run.returncode == 0, run.stderr[-3000:]
    found = json.loads(run.stdout.strip().splitlines()[-1])
    assert found == {"fma": 0, "barriers": 1, "l2_loads": found["l2_loads"]} and found["l2_loads"] > 0
