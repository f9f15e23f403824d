"""CUDA C++ kernels compiled at run time with NVRTC (cuda-python's `cuda.bindings`), launched on torch's stream.

Optional: without `cuda.bindings`, or with EXL3MOE_CUDA_KERNELS=0, callers use the Triton kernels instead.
EXL3MOE_NVRTC_DEFINES="NAME=1,OTHER=2" adds -D options to every compile (for kernel experiments).
"""

from __future__ import annotations

import ctypes
import functools
import os
from importlib import resources

import torch

from .trellis_decode import interpreting


@functools.lru_cache(maxsize=1)
def _bindings():
    try:
        from cuda.bindings import driver, nvrtc
    except ImportError:
        return None
    return driver, nvrtc


def available(device: torch.device) -> bool:
    """True when CUDA C++ kernels can run on `device` (sm_80 or newer, cuda.bindings importable)."""
    if os.environ.get("EXL3MOE_CUDA_KERNELS", "1") == "0" or interpreting() or device.type != "cuda":
        return False
    if _bindings() is None:
        return False
    return torch.cuda.get_device_capability(device)[0] >= 8


def _check(result, what: str):
    err, *rest = result
    if int(err) != 0:
        raise RuntimeError(f"{what} failed: {err}")
    return rest[0] if len(rest) == 1 else rest


def compile_cubin(source: str, defines: dict, arch: str) -> bytes:
    """Compile CUDA C++ source to a cubin for `arch` (e.g. "sm_90")."""
    _, nvrtc = _bindings()
    prog = _check(nvrtc.nvrtcCreateProgram(source.encode(), b"kernel.cu", 0, [], []), "nvrtcCreateProgram")
    opts = [f"--gpu-architecture={arch}".encode(), b"-std=c++17", b"-default-device", b"--fmad=false"]
    opts += [f"-D{key}={value}".encode() for key, value in defines.items()]
    err, = nvrtc.nvrtcCompileProgram(prog, len(opts), opts)
    if int(err) != 0:
        size = _check(nvrtc.nvrtcGetProgramLogSize(prog), "nvrtcGetProgramLogSize")
        log = b" " * size
        nvrtc.nvrtcGetProgramLog(prog, log)
        raise RuntimeError(f"NVRTC could not compile {defines}:\n{log.decode(errors='replace')}")
    size = _check(nvrtc.nvrtcGetCUBINSize(prog), "nvrtcGetCUBINSize")
    cubin = b" " * size
    _check(nvrtc.nvrtcGetCUBIN(prog, cubin), "nvrtcGetCUBIN")
    return cubin


def source(file: str) -> str:
    """kernels/cuda/`file` with its `#include "local.cuh"` lines replaced by those files' text."""
    lines = []
    for line in resources.files(__package__).joinpath("cuda", file).read_text().splitlines():
        if line.startswith('#include "'):
            lines.append(source(line.split('"')[1]))
        elif line.strip() != "#pragma once":
            lines.append(line)
    return "\n".join(lines)


def extra_defines() -> dict:
    """EXL3MOE_NVRTC_DEFINES parsed: "A=1,B=2" -> {"A": "1", "B": "2"}."""
    text = os.environ.get("EXL3MOE_NVRTC_DEFINES", "")
    return dict(item.split("=", 1) for item in text.split(",") if item)


@functools.lru_cache(maxsize=None)
def kernel(file: str, name: str, defines: tuple, device_index: int, prelude: str = ""):
    """The CUfunction `name` of kernels/cuda/`file` compiled with `defines` ((key, value), ...) and `prelude`
    (source text placed first), cached."""
    driver, _ = _bindings()
    torch.cuda.synchronize(device_index)
    major, minor = torch.cuda.get_device_capability(device_index)
    cubin = compile_cubin(prelude + source(file), {**dict(defines), **extra_defines()}, f"sm_{major}{minor}")
    module = _check(driver.cuModuleLoadData(cubin), "cuModuleLoadData")
    return _check(driver.cuModuleGetFunction(module, name.encode()), "cuModuleGetFunction")


def launch(func, grid: tuple, block: int, args: list) -> None:
    """Launch on torch's current stream; args are tensors or None (pointers), ints or floats."""
    driver, _ = _bindings()
    values, types = [], []
    for a in args:
        if a is None:
            values.append(0)
            types.append(ctypes.c_void_p)
        elif isinstance(a, torch.Tensor):
            values.append(a.data_ptr())
            types.append(ctypes.c_void_p)
        elif isinstance(a, float):
            values.append(a)
            types.append(ctypes.c_float)
        else:
            values.append(int(a))
            types.append(ctypes.c_int)
    stream = driver.CUstream(torch.cuda.current_stream().cuda_stream)
    _check(driver.cuLaunchKernel(func, *grid, block, 1, 1, 0, stream, (tuple(values), tuple(types)), 0),
           "cuLaunchKernel")
