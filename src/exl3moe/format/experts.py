"""ExpertSet: the routed experts of one MoE layer, one EXL3Weight per expert and projection."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..errors import ContractError, FormatError
from .frozen import Frozen
from .weight import EXL3Weight

ACTIVATIONS = ("silu", "gelu", "relu2")
GATED = {"silu": True, "gelu": True, "relu2": False}


def _weights(value, name: str, optional_entries: bool) -> tuple | None:
    """A list or tuple of EXL3Weight (or None where optional_entries) as a tuple; None stays None."""
    if value is None:
        return None
    if not isinstance(value, (list, tuple)):
        raise FormatError(name, f"must be a list of EXL3Weight, got {type(value).__name__}")
    for e, w in enumerate(value):
        if not (isinstance(w, EXL3Weight) or (optional_entries and w is None)):
            raise FormatError(f"{name}[{e}]", f"must be an EXL3Weight{' or None' if optional_entries else ''}, "
                              f"got {type(w).__name__}")
    return tuple(value)


def _held(*lists) -> tuple:
    """The validated records in `lists` (whatever else they hold is for validate() to refuse)."""
    return tuple(r for ws in lists if isinstance(ws, (list, tuple)) for r in ws if isinstance(r, Frozen))


@dataclass(eq=False)
class ResidualStage(Frozen):
    """An additive residual stage: per-expert residual trellises on the base rotations, scaled per projection.

    `gate`, `up`, `down` are per-expert lists (None = no residual for that expert), held as tuples; `scales` is
    float32 [E, 3]. Frozen once validated: `stage.replace(down=...)` makes a modified copy (format/frozen.py).
    Whether it fits an ExpertSet (E, shapes, shared scales) is checked where it is used (plans, the reference).
    """

    gate: list | None
    up: list | None
    down: list | None
    scales: torch.Tensor
    name: str = "stage"

    def _normalize(self) -> None:
        for proj in ("gate", "up", "down"):
            object.__setattr__(self, proj, _weights(getattr(self, proj), f"{self.name}.{proj}", True))

    def _members(self) -> tuple:
        return _held(self.gate, self.up, self.down)

    def validate(self) -> None:
        lists = {proj: getattr(self, proj) for proj in ("gate", "up", "down") if getattr(self, proj) is not None}
        first = next(iter(lists), None)
        for proj, ws in lists.items():
            _weights(ws, f"{self.name}.{proj}", True)
            if len(ws) != len(lists[first]):
                raise FormatError(f"{self.name}.{proj}", f"has {len(ws)} entries, {first} has {len(lists[first])}")
        if not isinstance(self.scales, torch.Tensor) or not self.scales.dtype.is_floating_point:
            raise FormatError(f"{self.name}.scales", f"must be a floating tensor [E, 3], got "
                              f"{getattr(self.scales, 'dtype', type(self.scales).__name__)}")


@dataclass(eq=False)
class ExpertSet(Frozen):
    """Routed experts: gate/up (hidden -> intermediate) and down (intermediate -> hidden) per expert.

    Experts may differ in K and codebook per expert and per projection; shapes are uniform.
    `gate` is None for the non-gated relu2 activation. `limit` clamps as in exllamav3's act_limit.
    Lists are held as tuples and the set is frozen once validated: `experts.replace(stages=[...])` makes a
    modified copy (format/frozen.py). The plans check the stages against the set.
    """

    gate: list | None
    up: list
    down: list
    activation: str = "silu"
    limit: float | None = None
    stages: list = ()
    name: str = "experts"
    layer_experts: int | None = None   # an expert-parallel shard's whole layer: plans split work as for that layer
    layer_intermediate: int | None = None   # a tensor-parallel shard's whole width: gate/up split k as for the layer

    def _normalize(self) -> None:
        for proj in ("gate", "up", "down"):
            object.__setattr__(self, proj, _weights(getattr(self, proj), f"{self.name}.{proj}", False))
        if not isinstance(self.stages, (list, tuple)):
            raise FormatError(f"{self.name}.stages", f"must be a list of ResidualStage, got "
                              f"{type(self.stages).__name__}")
        object.__setattr__(self, "stages", tuple(self.stages))

    def _members(self) -> tuple:
        return _held(self.gate, self.up, self.down, self.stages)

    @property
    def num_experts(self) -> int:
        return len(self.up)

    @property
    def planned_experts(self) -> int:
        """The expert count the plans size their work for: the whole layer's (layer_experts) for a shard."""
        return self.layer_experts or self.num_experts

    @property
    def planned_intermediate(self) -> int:
        """The intermediate width gate/up's k splits are sized for: the whole layer's (layer_intermediate) for a
        tensor-parallel shard, so its intermediate has one process's bytes."""
        return self.layer_intermediate or self.intermediate_size

    @property
    def hidden_size(self) -> int:
        return self.up[0].in_features

    @property
    def intermediate_size(self) -> int:
        return self.up[0].out_features

    @property
    def gated(self) -> bool:
        return self.gate is not None

    @property
    def device(self) -> torch.device:
        return self.up[0].device

    def projections(self) -> dict:
        """{"gate": [...], "up": [...], "down": [...]} with gate omitted when not gated."""
        out = {"up": self.up, "down": self.down}
        if self.gate is not None:
            out = {"gate": self.gate, **out}
        return out

    def validate(self) -> None:
        n = self.name
        if self.activation not in ACTIVATIONS:
            raise FormatError(f"{n}.activation", f"must be one of {ACTIVATIONS}, got {self.activation!r}")
        if GATED[self.activation] != (self.gate is not None):
            rule = "needs gate weights" if GATED[self.activation] else "is non-gated: gate must be None"
            raise FormatError(f"{n}.gate", f"activation {self.activation} {rule}")
        if not self.up:
            raise FormatError(f"{n}.up", "an ExpertSet needs at least one expert")
        for proj, ws in self.projections().items():
            _weights(ws, f"{n}.{proj}", False)
            if len(ws) != len(self.up):
                raise FormatError(f"{n}.{proj}", f"has {len(ws)} experts, up has {len(self.up)}")
        hidden, inter = self.hidden_size, self.intermediate_size
        want = {"gate": (hidden, inter), "up": (hidden, inter), "down": (inter, hidden)}
        for proj, ws in self.projections().items():
            for e, w in enumerate(ws):
                if (w.in_features, w.out_features) != want[proj]:
                    raise FormatError(f"{n}.{proj}[{e}]", f"in/out features {w.in_features}x{w.out_features} "
                                      f"differ from the set's {want[proj][0]}x{want[proj][1]}")
                if w.device != self.device:
                    raise FormatError(f"{n}.{proj}[{e}]", f"on {w.device}, the set is on {self.device}")
        count = self.layer_experts
        if count is not None and (isinstance(count, bool) or not isinstance(count, int) or count < len(self.up)):
            raise ContractError(f"{n}.layer_experts", f"must be None or an int of at least the set's {len(self.up)} "
                                f"experts, got {count!r}")
        width = self.layer_intermediate
        if width is not None and (isinstance(width, bool) or not isinstance(width, int) or width < inter
                                  or width % 128):
            raise ContractError(f"{n}.layer_intermediate", f"must be None or a multiple of 128 of at least the set's "
                                f"intermediate size {inter}, got {width!r}")
        limit = self.limit
        if limit is not None and (isinstance(limit, bool) or not isinstance(limit, (int, float))
                                  or not 0 < limit < math.inf):
            raise ContractError(f"{n}.limit", f"must be None or a positive finite number, got {limit!r}")

    def to(self, device) -> "ExpertSet":
        mv = lambda ws: None if ws is None else [w.to(device) for w in ws]  # noqa: E731
        return ExpertSet(mv(self.gate), mv(self.up), mv(self.down), self.activation, self.limit, self.stages,
                         self.name, self.layer_experts, self.layer_intermediate)


def check_shared(shared, experts: ExpertSet) -> None:
    """A shared (always-on) expert: an ExpertSet of one expert on the routed experts' hidden size and device."""
    if not isinstance(shared, ExpertSet):
        raise ContractError("shared", f"must be an ExpertSet, got {type(shared).__name__}")
    if shared.num_experts != 1:
        raise ContractError("shared", f"must hold exactly one expert, got {shared.num_experts}")
    if shared.hidden_size != experts.hidden_size or shared.device != experts.device:
        raise ContractError("shared", f"hidden size {shared.hidden_size} on {shared.device} differs from the "
                            f"routed experts' {experts.hidden_size} on {experts.device}")
