"""ExpertSet: the routed experts of one MoE layer, one EXL3Weight per expert and projection."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..errors import ContractError, FormatError
from .weight import EXL3Weight

ACTIVATIONS = ("silu", "gelu", "relu2")
GATED = {"silu": True, "gelu": True, "relu2": False}


@dataclass(eq=False)
class ResidualStage:
    """An additive residual stage: per-expert residual trellises on the base rotations, scaled per projection.

    `gate`, `up`, `down` are per-expert lists (None = no residual for that expert); `scales` is float32 [E, 3].
    """

    gate: list | None
    up: list
    down: list
    scales: torch.Tensor


@dataclass(eq=False)
class ExpertSet:
    """Routed experts: gate/up (hidden -> intermediate) and down (intermediate -> hidden) per expert.

    Experts may differ in K and codebook per expert and per projection; shapes are uniform.
    `gate` is None for the non-gated relu2 activation. `limit` clamps as in exllamav3's act_limit.
    """

    gate: list | None
    up: list
    down: list
    activation: str = "silu"
    limit: float | None = None
    stages: list = field(default_factory=list)
    name: str = "experts"

    def __post_init__(self) -> None:
        self.validate()

    @property
    def num_experts(self) -> int:
        return len(self.up)

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
            if len(ws) != len(self.up):
                raise FormatError(f"{n}.{proj}", f"has {len(ws)} experts, up has {len(self.up)}")
            for e, w in enumerate(ws):
                if not isinstance(w, EXL3Weight):
                    raise FormatError(f"{n}.{proj}[{e}]", f"must be an EXL3Weight, got {type(w).__name__}")
        hidden, inter = self.hidden_size, self.intermediate_size
        want = {"gate": (hidden, inter), "up": (hidden, inter), "down": (inter, hidden)}
        for proj, ws in self.projections().items():
            for e, w in enumerate(ws):
                if (w.in_features, w.out_features) != want[proj]:
                    raise FormatError(f"{n}.{proj}[{e}]", f"in/out features {w.in_features}x{w.out_features} "
                                      f"differ from the set's {want[proj][0]}x{want[proj][1]}")
                if w.device != self.device:
                    raise FormatError(f"{n}.{proj}[{e}]", f"on {w.device}, the set is on {self.device}")
        if self.limit is not None and not (self.limit > 0 and self.limit < float("inf")):
            raise FormatError(f"{n}.limit", f"must be a positive finite number, got {self.limit}")

    def to(self, device) -> "ExpertSet":
        mv = lambda ws: None if ws is None else [w.to(device) for w in ws]  # noqa: E731
        return ExpertSet(mv(self.gate), mv(self.up), mv(self.down), self.activation, self.limit,
                         list(self.stages), self.name)


def check_shared(shared, experts: ExpertSet) -> None:
    """A shared (always-on) expert: an ExpertSet of one expert on the routed experts' hidden size and device."""
    if not isinstance(shared, ExpertSet):
        raise ContractError("shared", f"must be an ExpertSet, got {type(shared).__name__}")
    if shared.num_experts != 1:
        raise ContractError("shared", f"must hold exactly one expert, got {shared.num_experts}")
    if shared.hidden_size != experts.hidden_size or shared.device != experts.device:
        raise ContractError("shared", f"hidden size {shared.hidden_size} on {shared.device} differs from the "
                            f"routed experts' {experts.hidden_size} on {experts.device}")
