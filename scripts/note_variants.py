"""Note, without a GPU, the CUDA kernel variants that the benchmarks and probes compile on an sm_90 GPU (as
nvrtc.kernel would, under EXL3MOE_CACHE_DIR/variants), so that scripts/warm_cache.py can build them here first."""

import functools
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "bench"))
from moe import LAYERS, SHAPES, TOKENS  # noqa: E402

from exl3moe import EXL3Weight, ExpertSet, ResidualStage  # noqa: E402
from exl3moe.kernels import nvrtc  # noqa: E402
from exl3moe.kernels.moe_mma_config import WIDE_BLOCK_M  # noqa: E402
from exl3moe.ops import linear_planning, moe_planning  # noqa: E402
from exl3moe.ops import linear as linear_ops  # noqa: E402
from exl3moe.ops.linear import LinearPlan  # noqa: E402
from exl3moe.ops.moe import moe_plan  # noqa: E402

LINEAR_SHAPES = [(4096, 14336), (14336, 4096), (2048, 768), (768, 2048), (4096, 1408), (1408, 4096)]
LINEAR_RATES = [(K, cb) for K in (2, 3, 4, 6, 8) for cb in ("mcg", "mul1", "3inst")]
# The linear GPU tests' shapes, at every rate (tests/test_linear_gpu.py, tests/test_linear_rates_gpu.py).
TEST_SHAPES = [(2048, 768), (4096, 1408)]
ALL_RATES = [(K, cb) for cb in ("3inst", "mcg", "mul1") for K in range(1, 9)] + [(1.5, "mul1"), (2.5, "mul1"),
                                                                                  (3.5, "mul1")]


def pretend_sm90() -> None:
    """Plans choose the CUDA kernels as on an H200; nvrtc.kernel only notes each variant."""
    nvrtc.available = lambda device: True
    torch.cuda.get_device_capability = lambda device=None: (9, 0)

    def kernel(file, name, defines, device_index, prelude="", arch_suffix=""):
        nvrtc.record_variant(file, {**dict(defines), **nvrtc.extra_defines()}, prelude, f"sm_90{arch_suffix}")
        return file, name
    nvrtc.kernel = kernel
    nvrtc.allow_non_portable_clusters = lambda func: None
    nvrtc.local_bytes = lambda func: 1   # note both variants of a launch bound that may spill
    linear_planning.clusters_on = lambda device: True
    linear_planning.chain_capable = lambda device: True
    linear_ops.uses_ws = lambda rows, k, n, device: rows >= (32 if k * n < (1 << 24) else 64)
    moe_planning.uses_ws = lambda block_m, device: block_m in (128, WIDE_BLOCK_M)
    moe_planning.early_launch = lambda device: os.environ.get("EXL3MOE_MOE_EARLY_DOWN", "1") != "0"
    nvrtc.sm_count = lambda device: 132


@functools.lru_cache(maxsize=None)
def weight(k: int, n: int, K: float, codebook: str) -> EXL3Weight:
    """Zero trellis, unit scales: plans read only shapes, widths and codebooks (shared between experts)."""
    return EXL3Weight(torch.zeros(k // 16, n // 16, int(16 * K), dtype=torch.int16), torch.ones(k).half(),
                      torch.ones(n).half(), codebook)


def layer(hidden, inter, E, Ks, codebook="mcg", stages=()):
    proj = lambda k, n: [weight(k, n, Ks[e % len(Ks)], codebook) for e in range(E)]  # noqa: E731
    return ExpertSet(proj(hidden, inter), proj(hidden, inter), proj(inter, hidden), "silu", stages=list(stages))


def stage_layer(hidden, inter, E):
    """The stage benchmark's plans: a K4 MCG base with one K2 MCG stage (its plans do not read the scales)."""
    base = layer(hidden, inter, E, [4])
    residual = lambda bases: [weight(w.in_features, w.out_features, 2, "mcg") for w in bases]  # noqa: E731
    stage = ResidualStage(residual(base.gate), residual(base.up), residual(base.down), torch.full((E, 3), 0.1))
    return layer(hidden, inter, E, [4], stages=[stage])


def main(moe_only: bool = False) -> None:
    pretend_sm90()
    for (k, n), (K, cb) in ((s, r) for s in ([] if moe_only else LINEAR_SHAPES) for r in LINEAR_RATES):
        for rows in (1, 8, 32, 128, 512):
            LinearPlan(weight(k, n, K, cb), rows)
    for (k, n), (K, cb) in ((s, r) for s in ([] if moe_only else TEST_SHAPES) for r in ALL_RATES):
        LinearPlan(weight(k, n, K, cb), 512)   # every fused variant, and the dense path's
    for name, (hidden, inter, E, top_k) in SHAPES.items():
        for Ks in LAYERS.values():
            experts = layer(hidden, inter, E, Ks)
            shared = layer(hidden, inter, 1, Ks[:1]) if name == "glm-4.5-air" else None
            for T in TOKENS:
                moe_plan(experts, T, top_k)
                if shared is not None:
                    moe_plan(experts, T, top_k, shared=shared)
    hidden, inter, E, top_k = SHAPES["qwen3-30b-a3b"]
    for T in TOKENS:
        moe_plan(stage_layer(hidden, inter, E), T, top_k)
    directory = os.path.join(nvrtc.cache_dir(), "variants")
    print(f"{len(os.listdir(directory))} variants noted in {directory}")


if __name__ == "__main__":
    main(moe_only="--moe-only" in sys.argv[1:])
