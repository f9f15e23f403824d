"""What users call: validate -> plan -> bind -> run."""

from .moe import MoEPlan, MoERunner, fused_experts, moe_plan
from .moe_module import EXL3MoE
from .router import Router, sigmoid_topk, softmax_topk
from .tables import MOE_ADDITIVE_ABI_VERSION, MoETables, build_tables

__all__ = ["EXL3MoE", "MOE_ADDITIVE_ABI_VERSION", "MoEPlan", "MoERunner", "MoETables", "Router", "build_tables",
           "fused_experts", "moe_plan", "sigmoid_topk", "softmax_topk"]
