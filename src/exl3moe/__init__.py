"""exl3moe: EXL3 (QTIP trellis) linear and routed-MoE layers for NVIDIA GPUs, with float64 oracles."""

from . import reference
from .errors import ContractError, FormatError
from .format import EXL3Weight, ExpertSet, ResidualStage, decode, open_checkpoint, write_checkpoint
from .ops.linear import LinearPlan, dense_weight, linear, linear_plan
from .ops.modules import EXL3Linear
from .ops.moe import MoEPlan, fused_experts, moe_plan
from .ops.moe_module import EXL3MoE
from .ops.router import Router, sigmoid_topk, softmax_topk
from .ops.tables import MOE_ADDITIVE_ABI_VERSION

__version__ = "0.1.0"
__all__ = ["ContractError", "EXL3Linear", "EXL3MoE", "Router", "sigmoid_topk", "softmax_topk", "EXL3Weight",
           "ExpertSet", "FormatError", "LinearPlan", "MOE_ADDITIVE_ABI_VERSION", "MoEPlan", "ResidualStage", "decode",
           "dense_weight", "fused_experts", "linear", "linear_plan", "moe_plan", "open_checkpoint", "reference",
           "write_checkpoint", "__version__"]
