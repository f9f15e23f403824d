"""Which kernels run where, as the ops decide it: CUDA C++ (NVRTC) where nvrtc.available(device), Triton on other
GPUs; on a CPU the Triton interpreter (TRITON_INTERPRET=1) or torch. A plan records its own choice (`plan.mma`):
MoE layers the CUDA experts do not cover (ungated activations, wide stages) run Triton on the same GPU."""

from __future__ import annotations

import importlib.util
import os

import torch

from .kernels import nvrtc
from .kernels.trellis_decode import interpreting

CUDA = "CUDA C++"
TRITON = "Triton"
INTERPRETER = "Triton interpreter"
TORCH = "torch"


def device_backend(device: torch.device) -> str:
    """The kernels a plan made on `device` uses by default."""
    if device.type == "cuda":
        return CUDA if nvrtc.available(device) else TRITON
    return INTERPRETER if interpreting() else TORCH


def plan_backend(plan) -> str:
    """The kernels a LinearPlan or MoEPlan runs (its CUDA C++ part is `plan.mma`, None where it runs Triton)."""
    if plan.device.type != "cuda":
        return device_backend(plan.device)
    return CUDA if getattr(plan, "mma", None) is not None else TRITON


def why_not_cuda(device: torch.device) -> str:
    """Why a GPU runs Triton rather than the CUDA C++ kernels."""
    if os.environ.get("EXL3MOE_CUDA_KERNELS", "1") == "0":
        return "EXL3MOE_CUDA_KERNELS=0"
    if importlib.util.find_spec("cuda") is None or importlib.util.find_spec("cuda.bindings") is None:
        return "cuda-bindings is not installed: pip install 'exl3moe[cuda]'"
    major, minor = torch.cuda.get_device_capability(device)
    return f"sm_{major}{minor}: the CUDA C++ kernels need sm_80 or newer"


def describe(device: torch.device) -> str:
    """One line: which kernels run on `device`, on which GPU, and why where it is not the fastest path."""
    backend = device_backend(device)
    if device.type == "cuda":
        major, minor = torch.cuda.get_device_capability(device)
        gpu = f"{torch.cuda.get_device_name(device)} (sm_{major}{minor})"
        if backend == CUDA:
            return f"CUDA C++ kernels compiled by NVRTC on {gpu}"
        return f"Triton kernels on {gpu} ({why_not_cuda(device)})"
    if backend == INTERPRETER:
        return "the Triton kernels in the Triton interpreter on the CPU (TRITON_INTERPRET=1; slow, for tests)"
    return "torch on the CPU, fp32 arithmetic (no kernels; TRITON_INTERPRET=1 runs the Triton kernels instead)"
