"""Random EXL3 weights and expert sets for tests.

Every int16 bit pattern is a valid trellis, so a random trellis with random fp16 scales
(sign x U(0.5, 1.5), like real checkpoints) is a valid EXL3Weight that exercises every decode path.
All functions take an optional torch.Generator for reproducibility; tensors are made on the CPU.
"""

from __future__ import annotations

import socket

import torch

from exl3moe import EXL3Weight, ExpertSet, ResidualStage


def _generator(generator: torch.Generator | None, seed: int = 0) -> torch.Generator:
    return generator if generator is not None else torch.Generator().manual_seed(seed)


def random_scales(length: int, generator: torch.Generator | None = None) -> torch.Tensor:
    """fp16 [length]: random sign x uniform magnitude in [0.5, 1.5)."""
    g = _generator(generator)
    sign = torch.randint(0, 2, (length,), generator=g) * 2 - 1
    magnitude = 0.5 + torch.rand(length, generator=g, dtype=torch.float64)
    return (sign * magnitude).to(torch.float16)


def random_trellis(k: int, n: int, K: float, generator: torch.Generator | None = None) -> torch.Tensor:
    """int16 [k/16, n/16, 16K] of uniformly random words."""
    g = _generator(generator)
    return torch.randint(-32768, 32768, (k // 16, n // 16, int(16 * K)), generator=g, dtype=torch.int64).to(torch.int16)


def random_weight(k: int, n: int, K: float = 4, codebook: str = "3inst", bias: bool = False,
                  generator: torch.Generator | None = None, name: str = "weight") -> EXL3Weight:
    """A random valid EXL3Weight with in_features k and out_features n (multiples of 128)."""
    g = _generator(generator)
    trellis = random_trellis(k, n, K, g)
    suh, svh = random_scales(k, g), random_scales(n, g)
    b = (torch.randn(n, generator=g, dtype=torch.float64) * 0.5).to(torch.float16) if bias else None
    return EXL3Weight(trellis, suh, svh, codebook, b, name)


def _per_expert(value, E: int, what: str) -> list:
    values = list(value) if isinstance(value, (list, tuple)) else [value] * E
    if len(values) != E:
        raise ValueError(f"{what}: expected {E} per-expert values, got {len(values)}")
    return values


def random_experts(E: int, hidden: int, inter: int, K=4, codebook="3inst", activation: str = "silu",
                   limit: float | None = None, bias: bool = False, generator: torch.Generator | None = None,
                   name: str = "experts") -> ExpertSet:
    """A random ExpertSet of E experts; K and codebook are one value for all or a per-expert list."""
    g = _generator(generator)
    Ks, codebooks = _per_expert(K, E, "K"), _per_expert(codebook, E, "codebook")

    def make(proj: str, k: int, n: int) -> list:
        return [random_weight(k, n, Ks[e], codebooks[e], bias, g, f"{name}.{proj}[{e}]") for e in range(E)]

    gate = make("gate", hidden, inter) if activation != "relu2" else None
    return ExpertSet(gate, make("up", hidden, inter), make("down", inter, hidden), activation, limit, [], name)


def random_stage(experts: ExpertSet, scales: torch.Tensor, K: float = 2, codebook: str = "3inst",
                 generator: torch.Generator | None = None) -> ResidualStage:
    """A residual stage for every expert and projection, sharing each base weight's suh/svh (as stages do)."""
    g = _generator(generator)

    def residuals(bases: list | None) -> list | None:
        if bases is None:
            return None
        return [EXL3Weight(random_trellis(w.in_features, w.out_features, K, g), w.suh, w.svh, codebook,
                           name=f"{w.name}.residual") for w in bases]

    return ResidualStage(residuals(experts.gate), residuals(experts.up), residuals(experts.down),
                         scales.to(torch.float32))


def load_moe_fixture(fixtures_dir: str, name: str) -> tuple:
    """(tensors, metadata, ExpertSet) of an exllamav3 MoE fixture (`exllamav3_moe_mcg_k4`, `exllamav3_moe_mul1_k3`)."""
    import os

    from safetensors import safe_open
    from safetensors.torch import load_file

    path = os.path.join(fixtures_dir, name + ".safetensors")
    with safe_open(path, "pt") as f:
        meta = f.metadata()
    tensors = load_file(path)

    def proj(e: int, key: str, scale_in: str, scale_out: str) -> EXL3Weight:
        return EXL3Weight(tensors[f"e{e}.{key}"], tensors[f"e{e}.{scale_in}"], tensors[f"e{e}.{scale_out}"],
                          meta["cb"], name=f"e{e}.{key}")

    E = int(meta["E"])
    experts = ExpertSet(*[[proj(e, k, i, o) for e in range(E)] for k, i, o in
                          (("g", "gs", "gv"), ("u", "us", "uv"), ("d", "ds", "dv"))], meta["act"])
    return tensors, meta, experts


def capture_allocation_free(call, scratch):
    """Capture `call` into a CUDA graph (after a warm-up capture that touches `scratch`), assert that capturing
    allocated nothing, and return the graph."""
    torch.cuda.synchronize()
    warm_up = torch.cuda.CUDAGraph()
    with torch.cuda.graph(warm_up):
        scratch.add_(0)
    before = torch.cuda.memory_allocated()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        call()
    assert torch.cuda.memory_allocated() == before
    return graph


def free_port() -> int:
    """A free TCP port on the loopback for a spawned process group's rendezvous."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def synthetic_checkpoints(tmp_path_factory, configs: dict, common: dict, K: float) -> dict:
    """model_type -> the path of a random-trellis checkpoint (exl3moe.hf.synthetic, MCG at K) for each config."""
    from exl3moe.hf.synthetic import write_synthetic_checkpoint
    made = {}
    for model_type, extra in configs.items():
        path = str(tmp_path_factory.mktemp(model_type))
        write_synthetic_checkpoint(path, dict(model_type=model_type, **common, **extra), K=K, codebook="mcg")
        made[model_type] = path
    return made
