"""Device-side MoE routers: fp32 logits, top-k selection and routing weights, all torch ops.

No host syncs and no data-dependent shapes, so a router call can be captured in a CUDA graph (its
temporaries come from torch's caching allocator, which uses the graph's private pool under capture).

    softmax_topk   probs = softmax(logits); top-k of probs; renormalised over the k when normalize
                   (Qwen2/3-MoE with norm_topk_prob, Mixtral).
    sigmoid_topk   scores = sigmoid(logits); selection on scores + correction_bias, restricted to the
                   topk_group best groups (group score = sum of its best 2 biased scores) when n_group > 1;
                   weights = the unbiased scores of the selected experts, normalised to sum 1 when
                   normalize, times routed_scaling_factor (DeepSeek-V3, GLM-4.5).

Ids come out int32 [T, k] in descending order of the selection score; weights fp32 [T, k]. Ties are broken
by torch.topk, which is deterministic for a fixed input on a given device (CPU and CUDA may differ).
Experts outside the kept groups are masked with -inf (vLLM's grouped_topk), never selected.
"""

from __future__ import annotations

import torch
from torch import nn

from ..errors import ContractError, FormatError
from ..kernels.router_logits import router_logits_kernel
from ..kernels.trellis_decode import interpreting
from .rowwise import matmul_by_rows

ROUTER_KINDS = ("softmax", "sigmoid")
# Added to the normaliser as DeepSeek-V3's reference does, so an all-zero selection divides safely.
NORM_EPS = 1e-20
# Model types whose routing rule is known, with their scoring function and norm_topk_prob default.
MODEL_DEFAULTS = {
    "mixtral": ("softmax", True), "qwen2_moe": ("softmax", False), "qwen3_moe": ("softmax", False),
    "deepseek_v3": ("sigmoid", True), "glm4_moe": ("sigmoid", True),
}
# Config keys holding the routed-expert count, by model family.
NUM_EXPERTS_KEYS = ("num_experts", "num_local_experts", "n_routed_experts")
TOPK_METHODS = ("greedy", "noaux_tc")
# Router parameter -> the config key it comes from, so refusals name what the user can fix.
CONFIG_NAMES = {"top_k": "num_experts_per_tok"}


def router_logits(hidden: torch.Tensor, gate_weight: torch.Tensor) -> torch.Tensor:
    """fp32 logits [T, E] = hidden [T, H] @ gate_weight [E, H].T in fp32, each token's sums in an order that does not
    depend on the other tokens: a Triton kernel on GPUs and under the interpreter, else matmul_by_rows."""
    if hidden.stride(-1) != 1:
        hidden = hidden.contiguous()
    if hidden.is_cuda or interpreting():
        out = torch.empty(hidden.shape[0], gate_weight.shape[0], dtype=torch.float32, device=hidden.device)
        return router_logits_kernel(hidden, gate_weight, out)
    return matmul_by_rows(hidden.float(), gate_weight.float().t())


def _check_top_k(top_k, num_experts: int) -> None:
    if isinstance(top_k, bool) or not isinstance(top_k, int) or not 1 <= top_k <= num_experts:
        raise ContractError("top_k", f"must be an int in [1, {num_experts}], got {top_k!r}")


def softmax_topk(logits: torch.Tensor, top_k: int, normalize: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids int32 [T, k], weights fp32 [T, k]): top-k of softmax(logits), renormalised over the k when normalize."""
    _check_top_k(top_k, logits.shape[-1])
    probs = torch.softmax(logits.float(), dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1, sorted=True)
    if normalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return ids.to(torch.int32), weights


def check_groups(num_experts: int, top_k: int, n_group: int, topk_group: int) -> None:
    """The grouped selection's shape rules (ContractError naming the parameter)."""
    _check_top_k(top_k, num_experts)
    for name, value in (("n_group", n_group), ("topk_group", topk_group)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ContractError(name, f"must be an int >= 1, got {value!r}")
    if n_group == 1:
        return
    if num_experts % n_group or num_experts // n_group < 2:
        raise ContractError("n_group", f"must divide the {num_experts} experts into groups of >= 2, got {n_group}")
    if topk_group > n_group:
        raise ContractError("topk_group", f"must be <= n_group {n_group}, got {topk_group}")
    if top_k > topk_group * (num_experts // n_group):
        raise ContractError("top_k", f"{top_k} exceeds the {topk_group} kept groups' "
                            f"{topk_group * (num_experts // n_group)} experts")


def sigmoid_topk(logits: torch.Tensor, top_k: int, correction_bias: torch.Tensor | None = None, n_group: int = 1,
                 topk_group: int = 1, routed_scaling_factor: float = 1.0,
                 normalize: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids int32 [T, k], weights fp32 [T, k]) by DeepSeek-V3's rule (see the module docstring)."""
    T, E = logits.shape
    check_groups(E, top_k, n_group, topk_group)
    scores = torch.sigmoid(logits.float())
    biased = scores if correction_bias is None else scores + correction_bias.float()
    if n_group > 1:
        grouped = biased.view(T, n_group, E // n_group)
        group_scores = grouped.topk(2, dim=-1, sorted=False).values.sum(dim=-1)
        kept = torch.topk(group_scores, topk_group, dim=-1, sorted=False).indices
        keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, kept, True)
        biased = grouped.masked_fill(~keep[:, :, None], float("-inf")).view(T, E)
    ids = torch.topk(biased, top_k, dim=-1, sorted=True).indices
    weights = scores.gather(1, ids)
    if normalize:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + NORM_EPS)
    if routed_scaling_factor != 1.0:
        weights = weights * routed_scaling_factor
    return ids.to(torch.int32), weights


class Router(nn.Module):
    """A MoE gate: weight [E, H] (kept as fp32) and the routing rule; forward(hidden [T, H]) -> (ids, weights)."""

    def __init__(self, weight: torch.Tensor, top_k: int, kind: str = "softmax", normalize: bool = True,
                 correction_bias: torch.Tensor | None = None, n_group: int = 1, topk_group: int = 1,
                 routed_scaling_factor: float = 1.0):
        super().__init__()
        if not isinstance(weight, torch.Tensor) or not weight.dtype.is_floating_point or weight.dim() != 2:
            what = f"{getattr(weight, 'dtype', type(weight).__name__)} {list(getattr(weight, 'shape', []))}"
            raise ContractError("router.weight", f"must be a floating [E, H] tensor, got {what}")
        if kind not in ROUTER_KINDS:
            raise ContractError("router.kind", f"must be one of {ROUTER_KINDS}, got {kind!r}")
        E = weight.shape[0]
        if kind == "sigmoid":
            check_groups(E, top_k, n_group, topk_group)
        else:
            _check_top_k(top_k, E)
            if correction_bias is not None or n_group != 1:
                raise ContractError("router.kind", "softmax routing takes no correction bias and no groups")
        if correction_bias is not None:
            if not isinstance(correction_bias, torch.Tensor) or tuple(correction_bias.shape) != (E,):
                raise ContractError("correction_bias", f"must be a tensor [{E}], got "
                                    f"{list(getattr(correction_bias, 'shape', []))}")
            if correction_bias.device != weight.device:
                raise ContractError("correction_bias", f"is on {correction_bias.device}, the weight on {weight.device}")
        if not isinstance(routed_scaling_factor, (int, float)) or not routed_scaling_factor > 0:
            raise ContractError("routed_scaling_factor", f"must be a positive number, got {routed_scaling_factor!r}")
        self.register_buffer("weight", weight.detach().float().contiguous())
        bias = None if correction_bias is None else correction_bias.detach().float().contiguous()
        self.register_buffer("correction_bias", bias)
        self.kind, self.top_k, self.normalize = kind, top_k, bool(normalize)
        self.n_group, self.topk_group = n_group, topk_group
        self.routed_scaling_factor = float(routed_scaling_factor)

    @property
    def num_experts(self) -> int:
        return self.weight.shape[0]

    @property
    def hidden_size(self) -> int:
        return self.weight.shape[1]

    def forward(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if hidden.shape[-1] != self.hidden_size:
            raise ContractError("hidden", f"last dim must be {self.hidden_size}, got shape {list(hidden.shape)}")
        logits = router_logits(hidden.reshape(-1, self.hidden_size), self.weight)
        if self.kind == "softmax":
            ids, weights = softmax_topk(logits, self.top_k, self.normalize)
            if self.routed_scaling_factor != 1.0:
                weights = weights * self.routed_scaling_factor
            return ids, weights
        return sigmoid_topk(logits, self.top_k, self.correction_bias, self.n_group, self.topk_group,
                            self.routed_scaling_factor, self.normalize)

    @classmethod
    def from_config(cls, config: dict, reader, prefix: str, device=None) -> "Router":
        """The router of MoE layer `prefix` from HF config keys and `<prefix>.gate.weight` (+ correction bias)."""
        model_type = config.get("model_type")
        kind_default, norm_default = MODEL_DEFAULTS.get(model_type, ("softmax", None))
        top_k = _config_int(config, "num_experts_per_tok", None)
        kind = config.get("scoring_func", kind_default)
        if kind not in ROUTER_KINDS:
            raise FormatError("scoring_func", f"must be one of {ROUTER_KINDS}, got {kind!r}")
        normalize = config.get("norm_topk_prob", norm_default)
        if model_type == "mixtral":
            normalize = True  # Mixtral renormalises always and has no such key
        if not isinstance(normalize, bool):
            raise FormatError("norm_topk_prob", f"must be true or false for model_type {model_type!r}, "
                              f"got {normalize!r}")
        method = config.get("topk_method")
        if method is not None and method not in TOPK_METHODS:
            raise FormatError("topk_method", f"must be one of {TOPK_METHODS}, got {method!r}")
        n_group = _config_int(config, "n_group", 1)
        topk_group = _config_int(config, "topk_group", 1)
        scale = config.get("routed_scaling_factor", 1.0)
        if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not scale > 0:
            raise FormatError("routed_scaling_factor", f"must be a positive number, got {scale!r}")
        weight = _gate_tensor(reader, f"{prefix}.gate.weight", device)
        E = weight.shape[0] if weight.dim() == 2 else -1
        if weight.dim() != 2 or not weight.dtype.is_floating_point:
            raise FormatError(f"{prefix}.gate.weight", f"must be a floating [E, H] matrix, got {weight.dtype} "
                              f"{list(weight.shape)}")
        for key in NUM_EXPERTS_KEYS:
            if key in config and config[key] != E:
                raise FormatError(key, f"is {config[key]!r}, {prefix}.gate.weight has {E} experts")
        bias_key = f"{prefix}.gate.e_score_correction_bias"
        bias = _gate_tensor(reader, bias_key, device) if bias_key in reader else None
        if bias is not None and (tuple(bias.shape) != (E,) or not bias.dtype.is_floating_point):
            raise FormatError(bias_key, f"must be a floating vector [{E}], got {bias.dtype} {list(bias.shape)}")
        if method == "noaux_tc" and bias is None:
            raise FormatError(bias_key, "missing: topk_method noaux_tc needs the correction bias")
        if kind == "softmax" and (bias is not None or n_group != 1):
            raise FormatError("scoring_func", "softmax routing with n_group > 1 or a correction bias is not supported")
        try:
            return cls(weight, top_k, kind, normalize, bias, n_group, topk_group, float(scale))
        except ContractError as err:
            raise FormatError(CONFIG_NAMES.get(err.name, err.name), err.rule) from None


def _config_int(config: dict, key: str, default) -> int:
    value = config.get(key, default)
    if value is None:
        raise FormatError(key, "missing from config.json")
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise FormatError(key, f"must be an int >= 1, got {value!r}")
    return value


def _gate_tensor(reader, key: str, device) -> torch.Tensor:
    if key not in reader:
        raise FormatError(key, "missing from the checkpoint")
    return reader.tensor(key, device)
