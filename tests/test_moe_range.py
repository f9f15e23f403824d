"""The MoE on tokens of any magnitude (issue: numerically safe intermediates), under the Triton interpreter and on the
torch path: hidden rows from 1e-6 to the input dtype's largest finite value (the issue's hidden x 0.01 / 0.003 /
0.001, a bf16 token of 2e6, a clamp limit of 1e-20), each token within 2e-3 of float64 (bf16 output: plus its own
rounding) wherever float64's result is finite in the output dtype, above its subnormals; ordinary tokens keep their
bytes beside extreme ones."""

import os

import pytest
import torch

from exl3moe.ops import fused_experts, moe_plan
from exl3moe.reference import moe
from helpers import random_experts

E, H, I, TOP_K = 4, 256, 128, 2
MAGNITUDES = {torch.float16: [1e-6, 1e-3, 3e-3, 1e-2, 1.0, 6000.0, 65504.0],
              torch.bfloat16: [1e-6, 1e-3, 1.0, 2e6, 1e30, 3.3e38]}
LIMIT = {torch.float16: 2e-3, torch.bfloat16: 6e-3, torch.float32: 2e-3}
FINITE = {torch.float16: 65504.0, torch.bfloat16: 3.38e38, torch.float32: 3.4e38}
OUTPUT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def tokens_of_magnitudes(dtype, seed, below=float("inf")):
    """Two random tokens per magnitude (their largest |value|) below `below`, then one token of 2e6 in an ordinary
    bf16 row."""
    g = torch.Generator().manual_seed(seed)
    rows = []
    for m in [m for m in MAGNITUDES[dtype] if m < below]:
        r = torch.randn(2, H, generator=g, dtype=torch.float64)
        rows.append((r / r.abs().max() * m).clamp(-FINITE[dtype], FINITE[dtype]))
    if dtype == torch.bfloat16:
        row = torch.randn(1, H, generator=g, dtype=torch.float64) * 0.5
        row[0, 7] = 2e6
        rows.append(row)
    return torch.cat(rows).to(dtype)


def routing(T, seed):
    g = torch.Generator().manual_seed(seed)
    weights, ids = torch.softmax(torch.randn(T, E, generator=g), -1).topk(TOP_K, -1)
    return ids.to(torch.int32), weights / weights.sum(-1, keepdim=True)


def checked_tokens(out, ref, out_dtype, label):
    """Assert every token whose float64 result the output dtype holds to the bound; return how many were."""
    checked = 0
    for t in range(ref.shape[0]):
        biggest = ref[t].abs().max()
        if not torch.isfinite(biggest) or biggest >= FINITE[out_dtype] or biggest < torch.finfo(out_dtype).tiny * 1024:
            continue   # not representable to the bound in the output dtype itself
        err = ((out[t].double() - ref[t]).norm() / ref[t].norm()).item()
        assert err < LIMIT[out_dtype], (label, out_dtype, t, err)
        checked += 1
    return checked


def check_range(in_dtype, activation, limit, shared, below, device, label):
    """Every output dtype of fused_experts on `device` within the bound of float64, for most tokens."""
    g = torch.Generator().manual_seed(11)
    experts = random_experts(E, H, I, K=[4, 3, 2, 4], codebook=["mcg", "3inst", "mul1", "mcg"], activation=activation,
                             limit=limit, generator=g)
    shared_expert = random_experts(1, H, I, K=3, codebook="mcg", generator=g, name="shared") if shared else None
    hidden = tokens_of_magnitudes(in_dtype, 12, below)
    ids, weights = routing(hidden.shape[0], 13)
    ref = moe(hidden, experts, ids, weights, shared=shared_expert)
    if device != "cpu":
        experts, hidden, ids, weights = experts.to(device), hidden.to(device), ids.to(device), weights.to(device)
        shared_expert = shared_expert.to(device) if shared else None
        assert moe_plan(experts, hidden.shape[0], TOP_K, shared_expert).mma is None, "the Triton experts"
    checked = 0
    for out_dtype in OUTPUT_DTYPES:
        out = fused_experts(hidden, experts, ids, weights, shared=shared_expert, out_dtype=out_dtype)
        checked += checked_tokens(out.cpu(), ref, out_dtype, label)
    assert checked >= hidden.shape[0], "most tokens' results are finite in the output dtypes"


# A limit of 1e-20 makes h = act(gate) * 1e-20: for |gate| >> 1 act(gate) is far smaller than gate's rounding error (an
# ill-conditioned layer, whatever the intermediates' range), so that case takes tokens up to 1e-2 (gates below 1).
CASES = [(torch.float16, "silu", None, True, float("inf")), (torch.bfloat16, "silu", None, True, float("inf")),
         (torch.float16, "gelu", 1e-20, False, 0.1), (torch.bfloat16, "silu", 8.0, False, float("inf"))]


@pytest.mark.parametrize("in_dtype,activation,limit,shared,below", CASES)
def test_tokens_of_any_magnitude_stay_within_the_bound(kernel_path, in_dtype, activation, limit, shared, below):
    check_range(in_dtype, activation, limit, shared, below, "cpu", kernel_path)


@pytest.mark.gpu
@pytest.mark.parametrize("in_dtype,activation,limit,shared,below", CASES)
def test_triton_experts_on_the_gpu_stay_within_the_bound(monkeypatch, in_dtype, activation, limit, shared, below):
    monkeypatch.setenv("EXL3MOE_CUDA_KERNELS", "0")   # the Triton experts, as on GPUs without cuda-bindings
    check_range(in_dtype, activation, limit, shared, below, "cuda", "triton on the gpu")


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="needs TRITON_INTERPRET=1 (the torch path's "
                    "BLAS sums depend on the row count)")
def test_ordinary_tokens_keep_their_bytes_beside_extreme_ones():
    g = torch.Generator().manual_seed(21)
    experts = random_experts(E, H, I, K=[3, 4, 2, 3], codebook="mcg", generator=g)
    shared_expert = random_experts(1, H, I, K=4, codebook="mul1", generator=g, name="shared")
    hidden = (torch.randn(6, H, generator=g) * 0.5).half()
    ids, weights = routing(6, 22)
    plan = moe_plan(experts, 6, TOP_K, shared_expert, torch.float32)
    runner = plan.bind(plan.allocate())
    alone = runner.run(hidden[:3], ids[:3], weights[:3], torch.empty(3, H))
    hidden[3:] = torch.tensor([1e-6, 6000.0, 3e-5]).half()[:, None] * hidden[3:].sign()
    mixed = runner.run(hidden, ids, weights, torch.empty(6, H))
    assert torch.equal(mixed[:3], alone) and torch.isfinite(mixed).all()
    ref = moe(hidden, experts, ids, weights, shared=shared_expert)
    assert checked_tokens(mixed, ref, torch.float32, "mixed") == 6
