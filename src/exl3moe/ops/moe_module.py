"""EXL3MoE: a routed MoE layer of an EXL3 checkpoint as an nn.Module (router, routed experts, shared expert).

forward(hidden [..., H], out=None) = routed(hidden) (+ shared(hidden), scaled per token by
sigmoid(hidden . shared_gate) when a Qwen2-MoE-style `shared_expert_gate` is present).

Plans are made (and so everything validated) at construction for calls of up to `max_tokens` tokens; the
workspace is allocated by the first call and reused. A call with more tokens re-plans for that many and
allocates a new workspace. Modules with equal plan layouts on one device share it (ops/workspaces.py);
`share_workspace=False` gives a module its own. CUDA-graph capture: make one warm-up call first (Triton
compiles, the workspace is allocated), then capture calls with T <= max_tokens and `out` given; the router's
small temporaries come from torch's caching allocator (the graph's private pool under capture); nothing
syncs with the host.

A gated shared expert runs as its own one-expert plan (top-1, id 0, weight = the sigmoid gate) into fp32
scratch, added to the routed fp32 result before the single cast into `out`. Without a gate the shared expert
rides in the routed plan (weight 1, added in the fused combine).

The device is fixed at build time (`from_checkpoint(device=...)` or the ExpertSet's); `.to()` would move only
the router's buffers, and the next call would then refuse the mismatch with ContractError.
"""

from __future__ import annotations

import torch
from torch import nn

from ..errors import ContractError, FormatError
from ..format.experts import ExpertSet
from .contracts import check_matrix
from .moe import OUTPUT_DTYPES, moe_plan
from .router import Router, router_logits
from .workspaces import shared_buffer, workspace_for

# HF hidden_act values and the ExpertSet activation each maps to (gelu* -> the tanh form the kernels compute).
ACTIVATION_NAMES = {"silu": "silu", "swish": "silu", "relu2": "relu2"}
SHARED_GATE_NAME = "shared_expert_gate.weight"


def activation_from_config(config: dict) -> str:
    """The ExpertSet activation for config['hidden_act']; FormatError naming hidden_act otherwise."""
    act = config.get("hidden_act")
    if not isinstance(act, str):
        raise FormatError("hidden_act", f"missing from config.json or not a string: {act!r}")
    if act.startswith("gelu"):
        return "gelu"
    if act not in ACTIVATION_NAMES:
        raise FormatError("hidden_act", f"must be silu, swish, relu2 or gelu*, got {act!r}")
    return ACTIVATION_NAMES[act]


def _check_parts(experts, router, shared, shared_gate) -> None:
    if not isinstance(experts, ExpertSet):
        raise ContractError("experts", f"must be an ExpertSet, got {type(experts).__name__}")
    if not isinstance(router, Router):
        raise ContractError("router", f"must be a Router, got {type(router).__name__}")
    if (router.num_experts, router.hidden_size) != (experts.num_experts, experts.hidden_size):
        raise ContractError("router.weight", f"is [{router.num_experts}, {router.hidden_size}], the experts are "
                            f"{experts.num_experts} of hidden size {experts.hidden_size}")
    if router.weight.device != experts.device:
        raise ContractError("router.weight", f"is on {router.weight.device}, the experts are on {experts.device}")
    if shared_gate is None:
        return
    if shared is None:
        raise ContractError("shared_gate", "given without a shared expert")
    H = experts.hidden_size
    if not isinstance(shared_gate, torch.Tensor) or not shared_gate.dtype.is_floating_point or shared_gate.numel() != H:
        raise ContractError("shared_gate", f"must be a floating tensor of {H} values ([H] or [1, H]), got "
                            f"{list(getattr(shared_gate, 'shape', []))}")
    if shared_gate.device != experts.device:
        raise ContractError("shared_gate", f"is on {shared_gate.device}, the experts are on {experts.device}")


class EXL3MoE(nn.Module):
    """Router -> plan/bind/run over EXL3 experts, with a cached workspace for calls of up to `max_tokens` tokens."""

    def __init__(self, experts: ExpertSet, router: Router, shared: ExpertSet | None = None,
                 shared_gate: torch.Tensor | None = None, max_tokens: int = 64, out_dtype: torch.dtype | None = None,
                 share_workspace: bool = True):
        super().__init__()
        _check_parts(experts, router, shared, shared_gate)
        if out_dtype is not None and out_dtype not in OUTPUT_DTYPES:
            raise ContractError("out_dtype", f"must be float16, bfloat16 or float32, got {out_dtype}")
        self.experts, self.router, self.shared, self.out_dtype = experts, router, shared, out_dtype
        self.share_workspace = bool(share_workspace)
        gate = None if shared_gate is None else shared_gate.detach().float().reshape(-1, 1).contiguous()
        self.register_buffer("shared_gate", gate)
        self._make_plans(max_tokens)

    @classmethod
    def from_checkpoint(cls, reader, prefix: str, device: torch.device | str | None = None, max_tokens: int = 64,
                        out_dtype: torch.dtype | None = None) -> "EXL3MoE":
        """The MoE layer `prefix` (e.g. model.layers.0.mlp): routed experts, router, shared expert and its gate."""
        config = reader.config
        activation = activation_from_config(config)
        experts = reader.experts(prefix, activation, device=device)
        router = Router.from_config(config, reader, prefix, device)
        shared = reader.shared_expert(prefix, activation, device=device)
        gate_key = f"{prefix}.{SHARED_GATE_NAME}"
        shared_gate = None
        if gate_key in reader:
            if shared is None:
                raise FormatError(gate_key, "present but the layer has no shared expert")
            shared_gate = reader.tensor(gate_key, device)
            if tuple(shared_gate.shape) != (1, experts.hidden_size) or not shared_gate.dtype.is_floating_point:
                raise FormatError(gate_key, f"must be a floating [1, {experts.hidden_size}] matrix, got "
                                  f"{shared_gate.dtype} {list(shared_gate.shape)}")
        return cls(experts, router, shared, shared_gate, max_tokens, out_dtype)

    @property
    def hidden_size(self) -> int:
        return self.experts.hidden_size

    @property
    def max_tokens(self) -> int:
        return self.plan.max_tokens

    def _make_plans(self, max_tokens: int) -> None:
        """Validate and plan for up to max_tokens tokens; the workspace follows on the next call."""
        gated = self.shared_gate is not None
        routed_dtype = torch.float32 if gated else self.out_dtype
        self.plan = moe_plan(self.experts, max_tokens, self.router.top_k, None if gated else self.shared, routed_dtype)
        self.shared_plan = moe_plan(self.shared, max_tokens, 1, out_dtype=torch.float32) if gated else None
        self._runners = None

    def _bind(self) -> None:
        """Workspace(s) for the plans and, with a gated shared expert, the fp32 scratch and its constant ids."""
        plans = [self.plan] + ([self.shared_plan] if self.shared_plan is not None else [])
        self._workspaces = [workspace_for(plan, self.share_workspace) for plan in plans]
        self._runners = [plan.bind(workspace) for plan, workspace in zip(plans, self._workspaces)]
        self._scratch = {}
        if self.shared_plan is not None:
            T, H, device = self.plan.max_tokens, self.hidden_size, self.experts.device
            sums = shared_buffer((str(device), "gated shared expert sums", T, H),
                                 lambda: torch.empty(2, T, H, dtype=torch.float32, device=device), self.share_workspace)
            ids = shared_buffer((str(device), "gated shared expert ids", T),
                                lambda: torch.zeros(T, 1, dtype=torch.int32, device=device), self.share_workspace)
            self._workspaces += [sums, ids]
            self._scratch = {"routed": sums[0], "shared": sums[1], "shared_ids": ids}

    def _check_out(self, hidden: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
        dtype = self.out_dtype or hidden.dtype
        if out is None:
            return torch.empty(hidden.shape, dtype=dtype, device=hidden.device)
        allowed = OUTPUT_DTYPES if self.out_dtype is None else (self.out_dtype,)
        if not isinstance(out, torch.Tensor) or out.shape != hidden.shape or out.dtype not in allowed:
            raise ContractError("out", f"must be a {allowed} tensor of shape {list(hidden.shape)}, got "
                                f"{getattr(out, 'dtype', type(out).__name__)} {list(getattr(out, 'shape', []))}")
        return out

    def forward(self, hidden: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        H = self.hidden_size
        if not isinstance(hidden, torch.Tensor) or hidden.dim() < 1 or hidden.shape[-1] != H:
            raise ContractError("hidden", f"must be a [..., {H}] tensor, got {list(getattr(hidden, 'shape', []))}")
        out = self._check_out(hidden, out)
        x = hidden.reshape(-1, H)
        try:
            out_rows = out.view(-1, H)
        except RuntimeError:
            raise ContractError("out", "must be viewable as [tokens, H] (contiguous rows)") from None
        T = x.shape[0]
        check_matrix(out_rows, "out", T, H, "hidden's tokens", "the hidden size", "disjoint")
        if T == 0:
            return out
        if T > self.plan.max_tokens:
            self._make_plans(T)
        if self._runners is None:
            self._bind()
        topk_ids, topk_weights = self.router(x)
        if self.shared_plan is None:
            self._runners[0].run(x, topk_ids, topk_weights, out_rows)
            return out
        routed, shared = self._scratch["routed"][:T], self._scratch["shared"][:T]
        self._runners[0].run(x, topk_ids, topk_weights, routed)
        gate = torch.sigmoid(router_logits(x, self.shared_gate.t()))
        self._runners[1].run(x, self._scratch["shared_ids"][:T], gate, shared)
        out_rows.copy_(routed.add_(shared))
        return out

    def extra_repr(self) -> str:
        e = self.experts
        shared = "none" if self.shared is None else ("gated" if self.shared_gate is not None else "always-on")
        return (f"experts={e.num_experts}, hidden={e.hidden_size}, intermediate={e.intermediate_size}, "
                f"top_k={self.router.top_k}, router={self.router.kind}, activation={e.activation}, shared={shared}, "
                f"max_tokens={self.plan.max_tokens}")
