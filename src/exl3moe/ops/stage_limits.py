"""Which residual stages a MoE plan accepts: the widest residual K and the residual codebooks.

Each accepted (K, codebook) is one more mainloop compiled into the CUDA experts, and costs registers in every
launch, so a plan accepts what its caller names (or its own stages use), not everything.
"""

from __future__ import annotations

from ..errors import ContractError
from ..format.experts import ExpertSet
from ..format.codebook import CODEBOOK_ID
from .tables import PROJECTIONS

# Residual 2K a plan with stage slots accepts when neither max_stage_bits nor its stages say more (K = 2).
DEFAULT_STAGE_K2 = 4
# Residual codebooks of a plan whose caller and stages name none: MCG, the usual residual codebook.
DEFAULT_STAGE_CODEBOOKS = ("mcg",)


def widest_residual_k2(stages: list) -> int:
    return max([0] + [int(2 * r.K) for st in stages for p in PROJECTIONS for r in (getattr(st, p) or [])
                      if r is not None])


def stage_k2_limit(experts: ExpertSet, stage_capacity: int, max_stage_bits: float) -> int:
    """Widest residual 2K a plan accepts: max_stage_bits (default K = 2) or its widest residual; 0 without stages."""
    if not max(stage_capacity, len(experts.stages)):
        return 0
    return max(int(2 * max_stage_bits) or DEFAULT_STAGE_K2, widest_residual_k2(experts.stages))


def residual_codebooks(stages: list) -> set:
    return {r.codebook for st in stages for p in PROJECTIONS for r in (getattr(st, p) or []) if r is not None}


def stage_codebook_set(experts: ExpertSet, stage_codebooks) -> tuple:
    """Codebooks a plan's residuals may use: stage_codebooks (covering its own stages), else its stages', else
    DEFAULT_STAGE_CODEBOOKS."""
    used = residual_codebooks(experts.stages)
    if stage_codebooks is None:
        return tuple(sorted(used)) or DEFAULT_STAGE_CODEBOOKS
    if (isinstance(stage_codebooks, str) or not isinstance(stage_codebooks, (list, tuple)) or not stage_codebooks
            or any(c not in CODEBOOK_ID for c in stage_codebooks)):
        raise ContractError("stage_codebooks", f"must be a non-empty list of {sorted(CODEBOOK_ID)}, "
                            f"got {stage_codebooks!r}")
    if used - set(stage_codebooks):
        raise ContractError("stage_codebooks", f"must include the codebooks of the plan's stages {sorted(used)}, "
                            f"got {list(stage_codebooks)}")
    return tuple(sorted(set(stage_codebooks)))
