"""What users call: validate -> plan -> bind -> run."""

from .moe import MoEPlan, MoERunner, fused_experts, moe_plan
from .tables import MOE_ADDITIVE_ABI_VERSION, MoETables, build_tables

__all__ = ["MOE_ADDITIVE_ABI_VERSION", "MoEPlan", "MoERunner", "MoETables", "build_tables", "fused_experts",
           "moe_plan"]
