"""What a transformers model built from an EXL3 checkpoint's config needs from it, checked from headers alone.

plan_load walks a model built on the meta device and decides, per module, where its weights come from:
routed-expert blocks -> EXL3MoE (experts, router, shared expert and its gate), quantized nn.Linear ->
EXL3Linear, every other parameter and persistent buffer -> a plain stored tensor. Every name, shape and
dtype is checked against the safetensors headers here, so a bad checkpoint is refused (FormatError) before
any tensor is read or any device memory is touched.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from torch import nn

from ..errors import FormatError
from ..format.checkpoint import EXPERT_RE, CheckpointReader
from ..ops.router import NUM_EXPERTS_KEYS
from .architectures import SHARED_EXPERT_CHILDREN, SHARED_GATE_CHILD, candidate_keys, is_moe_block

PLAIN_DTYPES = ("F16", "BF16", "F32")
ROLE_NAMES = {"gate": ("gate_proj", "w1"), "up": ("up_proj", "w3"), "down": ("down_proj", "w2")}


@dataclass
class LoadPlan:
    """Module path -> checkpoint key for each replacement, and the plain tensors to load (tied names together)."""

    reader: CheckpointReader
    model_type: str
    linears: dict = field(default_factory=dict)
    moe_blocks: dict = field(default_factory=dict)
    tensors: list = field(default_factory=list)   # [(checkpoint key, [parameter or buffer paths sharing it])]

    @property
    def replaced(self) -> list:
        return list(self.linears) + list(self.moe_blocks)


class _Planner:
    def __init__(self, reader: CheckpointReader, model_type: str):
        self.reader, self.model_type = reader, model_type
        self.linears = {info.key: info for info in reader.linears()}
        self.prefixes = {key.rsplit(".", depth)[0] for key in reader.keys() for depth in range(1, key.count(".") + 1)}
        self.expert_ids: dict = {}
        for m in filter(None, map(EXPERT_RE.match, self.linears)):
            self.expert_ids.setdefault(m["prefix"], set()).add(int(m["index"]))

    def resolve(self, name: str) -> str:
        """The checkpoint name of module path `name` (the transformers name unless only an alias is stored)."""
        candidates = candidate_keys(self.model_type, name)
        return next((key for key in candidates if key in self.prefixes or key in self.linears), name)

    def entry(self, key: str, shape: tuple, what: str):
        if key not in self.reader:
            raise FormatError(key, f"missing from the checkpoint ({what})")
        entry = self.reader.entry(key)
        if entry.dtype not in PLAIN_DTYPES:
            raise FormatError(key, f"in {entry.shard}: must be {', '.join(PLAIN_DTYPES)}, got {entry.dtype}")
        if tuple(entry.shape) != tuple(shape):
            raise FormatError(key, f"in {entry.shard}: has shape {list(entry.shape)}, the config makes {what} "
                              f"{list(shape)}")
        return entry

    def linear(self, key: str, in_features: int, out_features: int, has_bias: bool, what: str) -> None:
        info = self.linears.get(key)
        if info is None:
            raise FormatError(f"{key}.trellis", f"missing: the config makes {what} a {in_features}x{out_features} "
                              "linear and the checkpoint holds no EXL3 weight for it")
        if (info.in_features, info.out_features) != (in_features, out_features):
            raise FormatError(f"{key}.trellis", f"holds a {info.in_features}x{info.out_features} linear (in x out), "
                              f"the config makes {what} {in_features}x{out_features}")
        stored_bias = f"{key}.bias" in self.reader
        if stored_bias != has_bias:
            rule = "stored, but the config's module has no bias" if stored_bias else "missing: the config's module has one"
            raise FormatError(f"{key}.bias", rule)

    def role_key(self, base: str, role: str, what: str) -> str:
        found = [f"{base}.{name}" for name in ROLE_NAMES[role] if f"{base}.{name}" in self.linears]
        if not found:
            raise FormatError(f"{base}.{ROLE_NAMES[role][0]}.trellis", f"missing: {what} needs its {role} projection")
        return found[0]

    def moe_block(self, name: str, block: nn.Module) -> str:
        """Check one routed-expert block against the checkpoint; returns its checkpoint prefix."""
        prefix = self.resolve(name)
        gate_up = getattr(block.experts, "gate_up_proj", None)
        down = getattr(block.experts, "down_proj", None)
        if gate_up is None or down is None or gate_up.dim() != 3:
            raise FormatError(name, f"transformers' {type(block.experts).__name__} does not hold gate_up_proj / "
                              "down_proj expert tensors; this transformers version is not supported")
        E, H, inter = gate_up.shape[0], gate_up.shape[2], gate_up.shape[1] // 2
        stored = sorted(self.expert_ids.get(prefix, ()))
        if stored != list(range(E)):
            missing = sorted(set(range(E)) - set(stored))
            rule = f"expert {missing[0]} missing" if missing else f"holds experts {stored[0]}..{stored[-1]}"
            raise FormatError(f"{prefix}.experts", f"{rule}; the config has {E} routed experts")
        for e in range(E):
            base = f"{prefix}.experts.{e}"
            for role, (k, n) in (("gate", (H, inter)), ("up", (H, inter)), ("down", (inter, H))):
                self.linear(self.role_key(base, role, f"expert {e} of {name}"), k, n, False, f"{name} expert {e} {role}")
        self.entry(f"{prefix}.gate.weight", (E, H), f"the router of {name}")
        self.router_config(E)
        if getattr(block.gate, "e_score_correction_bias", None) is not None:
            self.entry(f"{prefix}.gate.e_score_correction_bias", (E,), f"the router correction bias of {name}")
        self.shared_expert(name, block, prefix, H)
        return prefix

    def router_config(self, E: int) -> None:
        """config.json's expert count and top-k against the E experts stored (the Router checks the rest)."""
        config = self.reader.config
        for key in NUM_EXPERTS_KEYS:
            if key in config and config[key] != E:
                raise FormatError(f"config.json:{key}", f"is {config[key]!r}, the checkpoint stores {E} experts per layer")
        top_k = config.get("num_experts_per_tok")
        if isinstance(top_k, bool) or not isinstance(top_k, int) or not 1 <= top_k <= E:
            raise FormatError("config.json:num_experts_per_tok", f"must be an int in [1, {E}], got {top_k!r}")

    def shared_expert(self, name: str, block: nn.Module, prefix: str, H: int) -> None:
        children = [c for c in SHARED_EXPERT_CHILDREN if getattr(block, c, None) is not None]
        stored = [c for c in SHARED_EXPERT_CHILDREN if f"{prefix}.{c}" in self.prefixes]
        if not children:
            if stored:
                raise FormatError(f"{prefix}.{stored[0]}", f"stored, but {self.model_type}'s {name} has no shared expert")
            return
        child = getattr(block, children[0])
        for role in ("gate", "up", "down"):
            module = getattr(child, ROLE_NAMES[role][0])
            key = self.role_key(f"{prefix}.{children[0]}", role, f"the shared expert of {name}")
            self.linear(key, module.in_features, module.out_features, module.bias is not None,
                        f"{name}.{children[0]}.{role}")
        gate_key = f"{prefix}.{SHARED_GATE_CHILD}.weight"
        if getattr(block, SHARED_GATE_CHILD, None) is not None:
            self.entry(gate_key, (1, H), f"the shared expert gate of {name}")
        elif gate_key in self.reader:
            raise FormatError(gate_key, f"stored, but {self.model_type}'s shared expert is not gated")


def _inside(name: str, roots: list) -> bool:
    return any(name == root or name.startswith(root + ".") for root in roots)


def _tied_ids(model: nn.Module) -> set:
    """ids of parameters reachable under more than one name (tied embeddings)."""
    seen, tied = set(), set()
    for _, param in model.named_parameters(remove_duplicate=False):
        (tied if id(param) in seen else seen).add(id(param))
    return tied


def plan_load(model: nn.Module, reader: CheckpointReader, model_type: str) -> LoadPlan:
    """Decide and check (headers only) where every weight of `model` (built on meta) comes from."""
    planner = _Planner(reader, model_type)
    plan = LoadPlan(reader, model_type)
    for name, module in model.named_modules():
        if is_moe_block(module) and not _inside(name, plan.replaced):
            plan.moe_blocks[name] = planner.moe_block(name, module)
    tied = _tied_ids(model)
    for name, module in model.named_modules():
        if not isinstance(module, nn.Linear) or _inside(name, plan.replaced):
            continue
        key = planner.resolve(name)
        if key in planner.linears or (f"{key}.weight" not in reader and id(module.weight) not in tied):
            planner.linear(key, module.in_features, module.out_features, module.bias is not None, name)
            plan.linears[name] = key
    shared: dict = {}
    for name, module in model.named_modules():
        if _inside(name, plan.replaced):
            continue
        persistent = [(b, t) for b, t in module._buffers.items() if b not in module._non_persistent_buffers_set]
        for leaf, tensor in list(module._parameters.items()) + persistent:
            if tensor is not None:
                shared.setdefault(id(tensor), (tensor, []))[1].append(f"{name}.{leaf}" if name else leaf)
    for tensor, names in shared.values():
        keys = [planner.resolve(n.rsplit(".", 1)[0]) + "." + n.rsplit(".", 1)[1] for n in names]
        stored = [k for k in keys if k in reader]
        key = stored[0] if stored else keys[0]
        planner.entry(key, tuple(tensor.shape), names[0])
        plan.tensors.append((key, names))
    return plan
