"""Float64 oracle of a routed MoE layer over EXL3 experts (routing combine, activations, shared expert, stages).

Per token t and top-k slot j (summed in slot order j = 0, 1, ...):

    out[t] += topk_weights[t, j] * down_e(act(gate_e(x_t), up_e(x_t)))      e = topk_ids[t, j]

Slots whose id lies outside [0, E) contribute nothing (expert-parallel callers mark remote experts so).
A `shared` ExpertSet of one expert is added to every token with weight 1.

Activations, with g = gate projection and u = up projection (float64 throughout):

    silu   h = silu(g) * u                    silu(g) = g * sigmoid(g)
    gelu   h = gelu_tanh(g) * u               gelu_tanh(g) = 0.5 g (1 + tanh(0.7978845608 (g + 0.044715 g^3)))
    relu2  h = relu(u)^2                      non-gated: no gate projection

Clamp limit L (ExpertSet.limit; None = off), as exllamav3's act_limit in its fused gate/up step: after the
activation, u is clamped to [-L, L] and the activated gate a = act(g) is clamped from above to min(a, L)
(no lower bound), then h = a * u. For the non-gated relu2 the same rule with the activated value
relu(u) in the gate's place gives h = min(relu(u), L) * clamp(u, -L, L) = min(relu(u), L)^2.

Additive residual stages: each ResidualStage s holds per-expert residual weights R_s (None = absent) and
scales[e, p] (p: 0 gate, 1 up, 2 down). Projection p of expert e computes
base(x) + sum_s scales[s][e, p] * R_s(x), each R_s evaluated as its own dense float64 weight (with its bias,
if any); absent residuals and zero scales are skipped. `stages` defaults to experts.stages and applies to
the routed experts only; the shared expert uses its own `shared.stages`.
"""

from __future__ import annotations

import torch

from ..errors import ContractError, FormatError
from ..format.experts import ExpertSet, ResidualStage, check_shared
from ..format.weight import EXL3Weight
from .linear import INPUT_DTYPES, apply_dense, dense_with_bias
from .route_pack import bucket_ids, check_topk_ids

PROJECTIONS = ("gate", "up", "down")
GELU_TANH_COEF = 0.7978845608
GELU_CUBIC_COEF = 0.044715


def silu(x: torch.Tensor) -> torch.Tensor:
    return x * torch.sigmoid(x)


def gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    return 0.5 * x * (1.0 + torch.tanh(GELU_TANH_COEF * (x + GELU_CUBIC_COEF * x * x * x)))


def activate(gate: torch.Tensor | None, up: torch.Tensor, activation: str, limit: float | None) -> torch.Tensor:
    """The intermediate h from gate and up projections (float64), with the optional clamp limit."""
    if activation == "relu2":
        act = torch.relu(up)
        return (act if limit is None else act.clamp(max=limit)) ** 2
    act = silu(gate) if activation == "silu" else gelu_tanh(gate)
    if limit is not None:
        act = act.clamp(max=limit)
        up = up.clamp(-limit, limit)
    return act * up


def _check_stage(stage: ResidualStage, index: int, experts: ExpertSet) -> None:
    name = f"{experts.name}.stages[{index}]"
    if not isinstance(stage, ResidualStage):
        raise FormatError(name, f"must be a ResidualStage, got {type(stage).__name__}")
    E = experts.num_experts
    scales = stage.scales
    if not isinstance(scales, torch.Tensor) or not scales.dtype.is_floating_point or tuple(scales.shape) != (E, 3):
        raise FormatError(f"{name}.scales", f"must be a floating tensor [{E}, 3], got "
                          f"{getattr(scales, 'dtype', type(scales).__name__)} {list(getattr(scales, 'shape', []))}")
    if not bool(torch.isfinite(scales).all()):
        raise FormatError(f"{name}.scales", "must be finite")
    base = {"gate": experts.gate, "up": experts.up, "down": experts.down}
    for proj in PROJECTIONS:
        residuals = getattr(stage, proj)
        if residuals is None:
            continue
        if len(residuals) != E:
            raise FormatError(f"{name}.{proj}", f"has {len(residuals)} entries, the set has {E} experts")
        for e, r in enumerate(residuals):
            if r is None:
                continue
            if base[proj] is None:
                raise FormatError(f"{name}.{proj}[{e}]", f"residual given but {experts.name} has no {proj}")
            if not isinstance(r, EXL3Weight):
                raise FormatError(f"{name}.{proj}[{e}]", f"must be an EXL3Weight or None, got {type(r).__name__}")
            want = (base[proj][e].in_features, base[proj][e].out_features)
            if (r.in_features, r.out_features) != want or r.device != experts.device:
                raise FormatError(f"{name}.{proj}[{e}]", f"must be {want[0]}x{want[1]} on {experts.device}, got "
                                  f"{r.in_features}x{r.out_features} on {r.device}")


class _DenseCache:
    """Decodes each (projection, expert) once per call: base plus scaled residuals, float64."""

    def __init__(self, experts: ExpertSet, stages: list):
        self.experts = experts
        self.stages = stages
        self.entries: dict = {}

    def get(self, proj: str, e: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        key = (proj, e)
        if key not in self.entries:
            self.entries[key] = self._build(proj, e)
        return self.entries[key]

    def _build(self, proj: str, e: int):
        weight, bias = dense_with_bias(getattr(self.experts, proj)[e])
        p = PROJECTIONS.index(proj)
        for stage in self.stages:
            residuals = getattr(stage, proj)
            residual = None if residuals is None else residuals[e]
            scale = float(stage.scales[e, p])
            if residual is None or scale == 0.0:
                continue
            r_weight, r_bias = dense_with_bias(residual)
            weight = weight + scale * r_weight
            if r_bias is not None:
                bias = scale * r_bias if bias is None else bias + scale * r_bias
        return weight, bias

    def expert_forward(self, x64: torch.Tensor, e: int) -> torch.Tensor:
        """down(act(gate(x), up(x))) of expert e for rows x64 [rows, H], float64."""
        experts = self.experts
        up = apply_dense(x64, *self.get("up", e))
        gate = apply_dense(x64, *self.get("gate", e)) if experts.gated else None
        h = activate(gate, up, experts.activation, experts.limit)
        return apply_dense(h, *self.get("down", e))


def _check_call(hidden, experts, topk_ids, topk_weights) -> None:
    if not isinstance(experts, ExpertSet):
        raise ContractError("experts", f"must be an ExpertSet, got {type(experts).__name__}")
    if not isinstance(hidden, torch.Tensor) or hidden.dtype not in INPUT_DTYPES:
        raise ContractError("hidden", f"must be an fp16/bf16/fp32/fp64 tensor, got {getattr(hidden, 'dtype', hidden)}")
    if hidden.dim() != 2 or hidden.shape[1] != experts.hidden_size:
        raise ContractError("hidden", f"must be [tokens, {experts.hidden_size}], got shape {list(hidden.shape)}")
    check_topk_ids(topk_ids)
    if topk_ids.shape[0] != hidden.shape[0]:
        raise ContractError("topk_ids", f"has {topk_ids.shape[0]} rows, hidden has {hidden.shape[0]} tokens")
    if not isinstance(topk_weights, torch.Tensor) or not topk_weights.dtype.is_floating_point:
        raise ContractError("topk_weights", "must be a floating tensor")
    if topk_weights.shape != topk_ids.shape:
        raise ContractError("topk_weights", f"shape {list(topk_weights.shape)} differs from topk_ids "
                            f"{list(topk_ids.shape)}")
    for name, t in (("hidden", hidden), ("topk_ids", topk_ids), ("topk_weights", topk_weights)):
        if t.device != experts.device:
            raise ContractError(name, f"on {t.device}, the experts are on {experts.device}")


def moe(hidden: torch.Tensor, experts: ExpertSet, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
        shared: ExpertSet | None = None, stages: list | None = None) -> torch.Tensor:
    """The exact routed MoE output in float64 [T, H] (see the module docstring for every rule)."""
    _check_call(hidden, experts, topk_ids, topk_weights)
    stages = list(experts.stages if stages is None else stages)
    for i, stage in enumerate(stages):
        _check_stage(stage, i, experts)
    if shared is not None:
        check_shared(shared, experts)
        for i, stage in enumerate(shared.stages):
            _check_stage(stage, i, shared)
    T, top_k = topk_ids.shape
    E = experts.num_experts
    x64 = hidden.to(torch.float64)
    weights64 = topk_weights.to(torch.float64)
    ids = bucket_ids(topk_ids, E).reshape(T, top_k)
    per_slot = torch.zeros(T, top_k, experts.hidden_size, dtype=torch.float64, device=hidden.device)
    cache = _DenseCache(experts, stages)
    for e in torch.unique(ids).tolist():
        if e == E:
            continue
        tokens, slots = torch.nonzero(ids == e, as_tuple=True)
        y = cache.expert_forward(x64[tokens], e)
        per_slot[tokens, slots] = weights64[tokens, slots, None] * y
    out = torch.zeros(T, experts.hidden_size, dtype=torch.float64, device=hidden.device)
    for j in range(top_k):
        out += per_slot[:, j]
    if shared is not None and T > 0:
        out += _DenseCache(shared, list(shared.stages)).expert_forward(x64, 0)
    return out

