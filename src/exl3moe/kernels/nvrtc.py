"""CUDA C++ kernels compiled at run time with NVRTC (cuda-python's `cuda.bindings`), launched on torch's stream.

Optional: without `cuda.bindings`, or with EXL3MOE_CUDA_KERNELS=0, callers use the Triton kernels instead.
EXL3MOE_NVRTC_DEFINES="NAME=1,OTHER=2" adds -D options to every compile (for kernel experiments; RACECHECK_ORDER=1
for sanitizer runs), EXL3MOE_NVRTC_LINEINFO=1 adds -lineinfo.
Compiled cubins are kept on disk (cache_dir) keyed by source, options, architecture and NVRTC version; each
variant a process loads is also noted there (variants/), so that a machine with the same NVRTC and no GPU can
rebuild the cache for newer sources (rebuild_variants, scripts/warm_cache.py).
"""

from __future__ import annotations

import concurrent.futures
import ctypes
import functools
import hashlib
import json
import os
import pathlib
import tempfile
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


OPTIONS = ("-std=c++17", "-default-device", "--fmad=false")


def options() -> tuple:
    """OPTIONS, and -lineinfo where EXL3MOE_NVRTC_LINEINFO=1 (sanitizer and profiler reports then name lines of the
    compiled text, nvrtc.source's concatenation)."""
    return OPTIONS + (("-lineinfo",) if os.environ.get("EXL3MOE_NVRTC_LINEINFO") == "1" else ())


def compile_cubin(source: str, defines: dict, arch: str) -> bytes:
    """Compile CUDA C++ source to a cubin for `arch` (e.g. "sm_90")."""
    _, nvrtc = _bindings()
    prog = _check(nvrtc.nvrtcCreateProgram(source.encode(), b"kernel.cu", 0, [], []), "nvrtcCreateProgram")
    opts = [f"--gpu-architecture={arch}".encode()] + [o.encode() for o in options()]
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


def nvrtc_version() -> str:
    _, nvrtc = _bindings()
    major, minor = _check(nvrtc.nvrtcVersion(), "nvrtcVersion")
    return f"{major}.{minor}"


def cache_dir() -> str | None:
    """Directory of compiled cubins: EXL3MOE_CACHE_DIR (empty: no disk cache), else
    $XDG_CACHE_HOME/exl3moe/cubins or ~/.cache/exl3moe/cubins."""
    path = os.environ.get("EXL3MOE_CACHE_DIR")
    if path is None:
        home = os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache")
        path = os.path.join(tempfile.gettempdir() if home.startswith("~") else home, "exl3moe", "cubins")
    return path or None


def cubin_path(text: str, defines: dict, arch: str) -> str | None:
    """Where the cubin of (text, defines, arch) is cached, or None without a cache directory."""
    directory = cache_dir()
    if directory is None:
        return None
    key = "|".join([nvrtc_version(), arch, *options(), *(f"{k}={v}" for k, v in sorted(defines.items())), text])
    return os.path.join(directory, hashlib.sha256(key.encode()).hexdigest() + ".cubin")


def _cached(path: str | None) -> bytes | None:
    """The cubin stored at `path`, or None when there is none (or only an empty file)."""
    if path is None or not os.path.isfile(path):
        return None
    with open(path, "rb") as fh:
        return fh.read() or None


def cached_cubin(text: str, defines: dict, arch: str) -> bytes:
    """compile_cubin, through the disk cache: written atomically, so a reader never sees half a file."""
    path = cubin_path(text, defines, arch)
    cubin = _cached(path)
    if cubin is not None:
        return cubin
    cubin = compile_cubin(text, defines, arch)
    if path is not None:
        _write_atomically(path, cubin)
    return cubin


def _write_atomically(path: str, data: bytes) -> None:
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=os.path.dirname(path), delete=False) as fh:
            fh.write(data)
        os.replace(fh.name, path)
    except OSError:
        pass  # a read-only or full cache only costs the next process a compile


def record_variant(file: str, defines: dict, prelude: str, arch: str) -> None:
    """Note (file, defines, prelude, arch) under cache_dir()/variants, once."""
    directory = cache_dir()
    if directory is None:
        return
    entry = json.dumps({"file": file, "defines": defines, "prelude": prelude, "arch": arch}, sort_keys=True)
    path = os.path.join(directory, "variants", hashlib.sha256(entry.encode()).hexdigest()[:32] + ".json")
    if not os.path.exists(path):
        _write_atomically(path, entry.encode())


def _rebuild_entry(entry: dict) -> bool:
    """Compile one noted variant into the cache unless it is there: True when it compiled."""
    text = entry["prelude"] + source(entry["file"])
    if _cached(cubin_path(text, entry["defines"], entry["arch"])) is not None:
        return False
    cached_cubin(text, entry["defines"], entry["arch"])
    return True


def rebuild_variants(workers: int = 1) -> tuple:
    """Compile every noted variant against the current sources into the cache, over `workers` processes:
    (compiled, already cached)."""
    directory = cache_dir()
    variants = os.path.join(directory, "variants") if directory else ""
    entries = []
    for name in sorted(os.listdir(variants)) if os.path.isdir(variants) else []:
        with open(os.path.join(variants, name)) as fh:
            entries.append(json.load(fh))
    if workers > 1:
        with concurrent.futures.ProcessPoolExecutor(workers) as pool:
            done = list(pool.map(_rebuild_entry, entries))
    else:
        done = [_rebuild_entry(entry) for entry in entries]
    return sum(done), len(done) - sum(done)


def source(file: str, included: set | None = None, directory: str | None = None) -> str:
    """kernels/cuda/`file` (or `directory`/`file`) with its `#include "local.cuh"` lines replaced by those files'
    text, each file once."""
    included = set() if included is None else included
    lines = []
    folder = pathlib.Path(directory) if directory else resources.files(__package__).joinpath("cuda")
    for line in folder.joinpath(file).read_text().splitlines():
        if line.startswith('#include "'):
            name = line.split('"')[1]
            if name not in included:
                included.add(name)
                lines.append(source(name, included, directory))
        elif line.strip() != "#pragma once":
            lines.append(line)
    return "\n".join(lines)


def extra_defines() -> dict:
    """EXL3MOE_NVRTC_DEFINES parsed: "A=1,B=2" -> {"A": "1", "B": "2"}."""
    text = os.environ.get("EXL3MOE_NVRTC_DEFINES", "")
    return dict(item.split("=", 1) for item in text.split(",") if item)


def variant_entry(file: str, defines: tuple, device_index: int, prelude: str = "", arch_suffix: str = "") -> dict:
    """What kernel() with these arguments compiles, as record_variant notes it: {file, defines (with
    EXL3MOE_NVRTC_DEFINES), prelude, arch}; its cubin is cubin_path(prelude + source(file), defines, arch)."""
    major, minor = torch.cuda.get_device_capability(device_index)
    return {"file": file, "defines": {**dict(defines), **extra_defines()}, "prelude": prelude,
            "arch": f"sm_{major}{minor}{arch_suffix}"}


@functools.lru_cache(maxsize=None)
def kernel(file: str, name: str, defines: tuple, device_index: int, prelude: str = "", arch_suffix: str = ""):
    """The CUfunction `name` of kernels/cuda/`file` compiled with `defines` ((key, value), ...) and `prelude`
    (source text placed first), cached; arch_suffix "a" targets the architecture-specific features (sm_90a)."""
    driver, _ = _bindings()
    torch.cuda.synchronize(device_index)
    major, minor = torch.cuda.get_device_capability(device_index)
    text, options = prelude + source(file), {**dict(defines), **extra_defines()}
    arch = f"sm_{major}{minor}{arch_suffix}"
    err, module = driver.cuModuleLoadData(cached_cubin(text, options, arch))
    if int(err) != 0:
        # A damaged cache entry: drop it and compile afresh.
        path = cubin_path(text, options, arch)
        if path is not None and os.path.exists(path):
            os.remove(path)
        module = _check(driver.cuModuleLoadData(cached_cubin(text, options, arch)), "cuModuleLoadData")
    record_variant(file, options, prelude, arch)
    return _check(driver.cuModuleGetFunction(module, name.encode()), "cuModuleGetFunction")


def local_bytes(func) -> int:
    """Local memory per thread (stack and spills) of a compiled function."""
    driver, _ = _bindings()
    attribute = driver.CUfunction_attribute.CU_FUNC_ATTRIBUTE_LOCAL_SIZE_BYTES
    return int(_check(driver.cuFuncGetAttribute(attribute, func), "cuFuncGetAttribute"))


def sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device (0 for any other device)."""
    return _sm_count(device.index if device.index is not None else torch.cuda.current_device()) \
        if device.type == "cuda" else 0


@functools.lru_cache(maxsize=None)
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


_DEFAULT_SHARED_LIMIT = 48 * 1024
_shared_limits: dict = {}
_non_portable: set = set()


def allow_non_portable_clusters(func) -> None:
    """Let `func` launch with thread-block clusters above the portable 8 blocks (sm_90: up to 16); once per
    function."""
    if int(func) not in _non_portable:
        driver, _ = _bindings()
        attribute = driver.CUfunction_attribute.CU_FUNC_ATTRIBUTE_NON_PORTABLE_CLUSTER_SIZE_ALLOWED
        _check(driver.cuFuncSetAttribute(func, attribute, 1), "cuFuncSetAttribute")
        _non_portable.add(int(func))


def x_tensor_map(x: torch.Tensor, rows: int, cols: int, stride: int | None = None, box_rows: int = 128):
    """A tensor map (TMA) of x's first `rows` rows of `cols` 16-bit values, `stride` (default cols) apart (16-byte
    aligned rows), in boxes of `box_rows` rows x 64 values in the 128-byte swizzle; rows past the end read as 0.
    Cached by address and shape: a map holds nothing else."""
    return _x_tensor_map(x.data_ptr(), rows, cols, cols if stride is None else stride, box_rows)


@functools.lru_cache(maxsize=256)
def _x_tensor_map(address: int, rows: int, cols: int, stride: int, box_rows: int):
    driver, _ = _bindings()
    u64, u32 = driver.cuuint64_t, driver.cuuint32_t
    return _check(driver.cuTensorMapEncodeTiled(
        driver.CUtensorMapDataType.CU_TENSOR_MAP_DATA_TYPE_UINT16, 2, address, [u64(cols), u64(rows)],
        [u64(stride * 2)], [u32(64), u32(box_rows)], [u32(1), u32(1)],
        driver.CUtensorMapInterleave.CU_TENSOR_MAP_INTERLEAVE_NONE,
        driver.CUtensorMapSwizzle.CU_TENSOR_MAP_SWIZZLE_128B,
        driver.CUtensorMapL2promotion.CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
        driver.CUtensorMapFloatOOBfill.CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE), "cuTensorMapEncodeTiled")


def launch(func, grid: tuple, block: int, args: list, shared: int = 0, early: bool = False) -> None:
    """Launch on torch's current stream; args are tensors or None (pointers), ints, floats or tensor maps
    (x_tensor_map); `shared` bytes of
    dynamic shared memory (the function's limit is raised once where it exceeds the default 48 KB). `early`: a
    programmatic dependent launch of the stream's previous kernel (sm_90+), for kernels that wait for it
    (griddepcontrol.wait) before reading what it wrote."""
    driver, _ = _bindings()
    if shared > _shared_limits.get(int(func), _DEFAULT_SHARED_LIMIT):
        attribute = driver.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
        _check(driver.cuFuncSetAttribute(func, attribute, shared), "cuFuncSetAttribute")
        _shared_limits[int(func)] = shared
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
        elif isinstance(a, driver.CUtensorMap):
            values.append(a)
            types.append(None)   # passed by value from the object's memory
        else:
            values.append(int(a))
            types.append(ctypes.c_int)
    stream = driver.CUstream(torch.cuda.current_stream().cuda_stream)
    if early:
        _check(driver.cuLaunchKernelEx(_early_config(driver, grid, block, shared, stream), func,
                                       (tuple(values), tuple(types)), 0), "cuLaunchKernelEx")
        return
    _check(driver.cuLaunchKernel(func, *grid, block, 1, 1, shared, stream, (tuple(values), tuple(types)), 0),
           "cuLaunchKernel")


def _early_config(driver, grid: tuple, block: int, shared: int, stream):
    """A launch configuration with programmatic stream serialization allowed."""
    attribute = driver.CUlaunchAttribute()
    attribute.id = driver.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION
    attribute.value.programmaticStreamSerializationAllowed = 1
    config = driver.CUlaunchConfig()
    config.gridDimX, config.gridDimY, config.gridDimZ = grid
    config.blockDimX, config.blockDimY, config.blockDimZ = block, 1, 1
    config.sharedMemBytes, config.hStream = shared, stream
    config.attrs, config.numAttrs = [attribute], 1
    return config
