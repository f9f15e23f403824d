"""Device tables of an ExpertSet for the fused MoE kernels: validation and layout (ABI version 1).

A caller that builds these tables itself (an engine with its own weight storage) must follow this
layout exactly. E = experts, S = residual stages, I = intermediate size, H = hidden size; projection
index p: 0 gate, 1 up, 2 down; entry (p, e) lives at flat index p * E + e, stage entry (s, p, e) at
(s * 3 + p) * E + e.

    trellis_addr   int64   [3, E]     data_ptr() of projection p's trellis (int16 [k/16, n/16, 16K]),
                                      4-byte aligned; 0 for the gate of a non-gated set
    suh_addr       int64   [3, E]     data_ptr() of its suh (fp16 [k]); 0 when absent
    svh_addr       int64   [3, E]     data_ptr() of its svh (fp16 [n]); 0 when absent
    k2             int32   [3, E]     2K (2..16; 3, 5, 7 for K = 1.5, 2.5, 3.5)
    codebook       int32   [3, E]     0 3inst, 1 mcg, 2 mul1
    stage_addr     int64   [S, 3, E]  data_ptr() of the residual trellis; 0 when the residual is absent
    stage_k2       int32   [S, 3, E]  2K of the residual (any valid value when absent)
    stage_codebook int32   [S, 3, E]  codebook id of the residual
    stage_scale    float32 [S, 3, E]  residual scale; 0 means skip (and must be 0 for absent residuals);
                                      otherwise 2^-40 <= |scale| <= 2^40
    bias_gate_up   float32 [2, E, I]  gate (0) and up (1) bias, base plus scaled residual biases; or None
    bias_down      float32 [E, H]     down bias, likewise; or None

A residual stage shares its base's suh and svh (checked here), so projection p of expert e computes
((x * suh) Hk) (W_inner + sum_s scale[s, p, e] R_inner[s, p, e]) Hn * svh + bias.
When S = 0 the stage tables are allocated with S = 1 and all scales 0 (kernels read nothing from them).

The address tables hold raw pointers and do NOT keep the tensors alive: the ExpertSet does, and it
must outlive every plan built from it (MoEPlan keeps a reference to it for that reason). The bias
tables are values owned by the MoETables object. ExpertSet and its weights are frozen (format/frozen.py); a
plan is validated against them when made, `bind` refuses weights whose tensors changed since (fingerprints), and
`run` checks nothing more (its cost would grow with the experts): change tensors in place between a plan and its
runs only with values of the same layout.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..errors import ContractError
from ..format.bitstream import k_from_last_dim
from ..format.codebook import CODEBOOK_ID
from ..format.experts import ExpertSet, ResidualStage
from ..format.weight import EXL3Weight
from ..kernels.moe_experts import ACTIVATION_ID

MOE_ADDITIVE_ABI_VERSION = 1
MIN_STAGE_SCALE = 2.0 ** -40  # nonzero stage scales lie in [2^-40, 2^40]: the CUDA kernels compute acc / scale
PROJECTIONS = ("gate", "up", "down")
EMPTY_STAGE_K2 = 2  # the 2K written for a stage entry of zero scale (codebook 0, address 0): never read


@dataclass(eq=False)
class MoETables:
    """The device tables of one ExpertSet (layout in the module docstring) and the shapes they describe."""

    num_experts: int
    hidden_size: int
    intermediate_size: int
    num_stages: int
    gated: bool
    activation: str
    limit: float | None
    trellis_addr: torch.Tensor
    suh_addr: torch.Tensor
    svh_addr: torch.Tensor
    k2: torch.Tensor
    codebook: torch.Tensor
    stage_addr: torch.Tensor
    stage_k2: torch.Tensor
    stage_codebook: torch.Tensor
    stage_scale: torch.Tensor
    bias_gate_up: torch.Tensor | None
    bias_down: torch.Tensor | None
    max_k2_gate_up: int
    max_k2_down: int
    gate_up_suh_aligned: bool   # every gate and up suh starts 16-byte aligned (vector loads in moe_rotate_input)


def _check_tensor(t: torch.Tensor, name: str, dtype: torch.dtype, device: torch.device) -> None:
    if not isinstance(t, torch.Tensor):
        raise ContractError(name, f"must be a tensor, got {type(t).__name__}")
    if t.dtype != dtype:
        raise ContractError(name, f"must be {dtype}, got {t.dtype}")
    if t.device != device:
        raise ContractError(name, f"is on {t.device}, the experts are on {device}")
    if not t.is_contiguous():
        raise ContractError(name, "must be contiguous")


def check_weight(w: EXL3Weight, name: str, shape: tuple, device: torch.device) -> int:
    """Check one projection weight (metadata only) and return its 2K."""
    if not isinstance(w, EXL3Weight):
        raise ContractError(name, f"must be an EXL3Weight, got {type(w).__name__}")
    _check_tensor(w.trellis, f"{name}.trellis", torch.int16, device)
    if w.trellis.dim() != 3 or (w.in_features, w.out_features) != shape:
        raise ContractError(f"{name}.trellis", f"must describe a {shape[0]}x{shape[1]} weight, got shape "
                            f"{list(w.trellis.shape)}")
    if w.trellis.data_ptr() % 4:
        raise ContractError(f"{name}.trellis", "data must be 4-byte aligned (kernels read int32 words)")
    K = k_from_last_dim(w.trellis.shape[-1], f"{name}.trellis")
    if not isinstance(w.codebook, str) or w.codebook not in CODEBOOK_ID:
        raise ContractError(f"{name}.codebook", f"must be one of {tuple(CODEBOOK_ID)}, got {w.codebook!r}")
    if K != int(K) and w.codebook != "mul1":
        raise ContractError(f"{name}.trellis", f"half-integer K={K} needs the mul1 codebook, got {w.codebook}")
    _check_tensor(w.suh, f"{name}.suh", torch.float16, device)
    _check_tensor(w.svh, f"{name}.svh", torch.float16, device)
    if w.suh.numel() != shape[0] or w.svh.numel() != shape[1]:
        raise ContractError(name, f"suh/svh must have {shape[0]}/{shape[1]} elements, got "
                            f"{w.suh.numel()}/{w.svh.numel()}")
    if w.bias is not None:
        _check_tensor(w.bias, f"{name}.bias", torch.float16, device)
        if w.bias.numel() != shape[1]:
            raise ContractError(f"{name}.bias", f"must have {shape[1]} elements, got {w.bias.numel()}")
    return int(K * 2)


def _same_scale(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.data_ptr() == b.data_ptr() or (a.shape == b.shape and bool(torch.equal(a, b)))


def outside_stage_range(scales: torch.Tensor) -> torch.Tensor:
    """Where a nonzero stage scale lies outside [2^-40, 2^40] in magnitude (the kernels divide by it)."""
    magnitude = scales.abs()
    return (scales != 0) & ((magnitude < MIN_STAGE_SCALE) | (magnitude > 1 / MIN_STAGE_SCALE))


def _check_stage(stage: ResidualStage, s: int, experts: ExpertSet, shapes: dict) -> torch.Tensor:
    """Check a residual stage and return its scales as float32 [E, 3] on the CPU."""
    name = f"{experts.name}.stages[{s}]"
    E = experts.num_experts
    if not isinstance(stage, ResidualStage):
        raise ContractError(name, f"must be a ResidualStage, got {type(stage).__name__}")
    scales = stage.scales
    if not isinstance(scales, torch.Tensor) or not scales.dtype.is_floating_point or tuple(scales.shape) != (E, 3):
        raise ContractError(f"{name}.scales", f"must be a floating tensor [{E}, 3], got "
                            f"{getattr(scales, 'dtype', type(scales).__name__)} {list(getattr(scales, 'shape', []))}")
    scales = scales.detach().to("cpu", torch.float32)
    if not bool(torch.isfinite(scales).all()):
        raise ContractError(f"{name}.scales", "must be finite")
    if bool(outside_stage_range(scales).any()):
        raise ContractError(f"{name}.scales", "nonzero scales must lie within [2^-40, 2^40] in magnitude "
                            "(kernels divide by them)")
    for p, proj in enumerate(PROJECTIONS):
        residuals = getattr(stage, proj)
        if residuals is None:
            continue
        if len(residuals) != E:
            raise ContractError(f"{name}.{proj}", f"has {len(residuals)} entries, the set has {E} experts")
        bases = getattr(experts, proj)
        for e, r in enumerate(residuals):
            if r is None:
                continue
            if bases is None:
                raise ContractError(f"{name}.{proj}[{e}]", f"residual given but {experts.name} has no {proj}")
            check_weight(r, f"{name}.{proj}[{e}]", shapes[proj], experts.device)
            if not (_same_scale(r.suh, bases[e].suh) and _same_scale(r.svh, bases[e].svh)):
                raise ContractError(f"{name}.{proj}[{e}]", "a residual must share its base's suh and svh")
    return scales


def check_expert_set(experts: ExpertSet, name: str = "experts") -> list:
    """Validate an ExpertSet for the kernels (metadata only, plus stage scales); return each stage's scales."""
    if not isinstance(experts, ExpertSet):
        raise ContractError(name, f"must be an ExpertSet, got {type(experts).__name__}")
    H, I = experts.hidden_size, experts.intermediate_size
    shapes = {"gate": (H, I), "up": (H, I), "down": (I, H)}
    for proj, weights in experts.projections().items():
        if len(weights) != experts.num_experts:
            raise ContractError(f"{experts.name}.{proj}", f"has {len(weights)} experts, up has {experts.num_experts}")
        for e, w in enumerate(weights):
            check_weight(w, f"{experts.name}.{proj}[{e}]", shapes[proj], experts.device)
    if experts.activation not in ACTIVATION_ID:
        raise ContractError(f"{experts.name}.activation", f"must be one of {tuple(ACTIVATION_ID)}")
    scales = [_check_stage(stage, s, experts, shapes) for s, stage in enumerate(experts.stages)]
    experts.ensure_valid()   # the rest of the construction rules, where anything changed since (format/frozen.py)
    return scales


def _fold_bias(experts: ExpertSet, proj: str, p: int, stage_scales: list) -> torch.Tensor | None:
    """float32 [E, n]: base bias plus scaled residual biases, or None when no weight has a bias."""
    bases = getattr(experts, proj)
    if bases is None:
        return None
    parts = [(1.0, w.bias, e) for e, w in enumerate(bases)]
    for stage, scales in zip(experts.stages, stage_scales):
        residuals = getattr(stage, proj) or []
        parts += [(float(scales[e, p]), r.bias, e) for e, r in enumerate(residuals) if r is not None]
    if all(bias is None for _, bias, _ in parts):
        return None
    out = torch.zeros(experts.num_experts, bases[0].out_features, dtype=torch.float32)
    for scale, bias, e in parts:
        if bias is not None and scale != 0.0:
            out[e] += scale * bias.detach().to("cpu", torch.float32)
    return out


def build_tables(experts: ExpertSet, name: str = "experts", stage_capacity: int = 0) -> MoETables:
    """Validate `experts` and build its device tables on the experts' device (one host-to-device copy each).

    `stage_capacity` reserves that many stage slots (zero scales) so stages can be loaded in place later.
    """
    stage_scales = check_expert_set(experts, name)
    E, S = experts.num_experts, max(len(experts.stages), stage_capacity)
    device = experts.device
    addr = torch.zeros(3, 3, E, dtype=torch.int64)
    fmt = torch.zeros(2, 3, E, dtype=torch.int32)
    stage_addr = torch.zeros(max(S, 1), 3, E, dtype=torch.int64)
    stage_fmt = torch.zeros(2, max(S, 1), 3, E, dtype=torch.int32)
    stage_fmt[0] = EMPTY_STAGE_K2
    stage_scale = torch.zeros(max(S, 1), 3, E, dtype=torch.float32)
    for p, proj in enumerate(PROJECTIONS):
        for e, w in enumerate(getattr(experts, proj) or []):
            addr[:, p, e] = torch.tensor([w.trellis.data_ptr(), w.suh.data_ptr(), w.svh.data_ptr()])
            fmt[:, p, e] = torch.tensor([int(w.K * 2), CODEBOOK_ID[w.codebook]])
        for s, (stage, scales) in enumerate(zip(experts.stages, stage_scales)):
            for e, r in enumerate(getattr(stage, proj) or []):
                if r is None or float(scales[e, p]) == 0.0:
                    continue
                stage_addr[s, p, e] = r.trellis.data_ptr()
                stage_fmt[:, s, p, e] = torch.tensor([int(r.K * 2), CODEBOOK_ID[r.codebook]])
                stage_scale[s, p, e] = scales[e, p]
    max_k2 = [int(fmt[0, p].max()) for p in range(3)]
    stage_max = [max(stage_fmt[0, :, p][stage_scale[:, p] != 0].tolist(), default=0) for p in range(3)]
    biases = [_fold_bias(experts, proj, p, stage_scales) for p, proj in enumerate(PROJECTIONS)]
    bias_gate_up = None
    if biases[0] is not None or biases[1] is not None:
        zero = torch.zeros(E, experts.intermediate_size, dtype=torch.float32)
        bias_gate_up = torch.stack([b if b is not None else zero for b in biases[:2]]).to(device)
    return MoETables(
        num_experts=E, hidden_size=experts.hidden_size, intermediate_size=experts.intermediate_size,
        num_stages=S, gated=experts.gated, activation=experts.activation, limit=experts.limit,
        trellis_addr=addr[0].to(device), suh_addr=addr[1].to(device), svh_addr=addr[2].to(device),
        k2=fmt[0].to(device), codebook=fmt[1].to(device),
        stage_addr=stage_addr.to(device), stage_k2=stage_fmt[0].to(device), stage_codebook=stage_fmt[1].to(device),
        stage_scale=stage_scale.to(device), bias_gate_up=bias_gate_up,
        bias_down=None if biases[2] is None else biases[2].to(device),
        max_k2_gate_up=max(max_k2[0], max_k2[1], stage_max[0], stage_max[1]),
        max_k2_down=max(max_k2[2], stage_max[2]),
        gate_up_suh_aligned=bool((addr[1, :2] % 16 == 0).all()),
    )
