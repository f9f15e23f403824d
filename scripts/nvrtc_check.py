"""Compile the CUDA C++ kernels for sm_90 without a GPU (NVRTC from cuda-bindings); print registers and spills."""

import itertools
import os
import subprocess
import sys
import tempfile

import triton

from exl3moe.kernels import moe_mma_config, moe_mma_source, nvrtc
from exl3moe.ops import moe_planning

CUOBJDUMP = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")


def res_usage(text: str, defines: dict, arch: str = "sm_90") -> str:
    """cuobjdump -res-usage of `text` compiled with `defines` for `arch`."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as fh:
        fh.write(nvrtc.compile_cubin(text, defines, arch))
        fh.flush()
        return subprocess.run([CUOBJDUMP, "-res-usage", fh.name], capture_output=True, text=True).stdout


def usage(name: str, defines: dict, text: str, arch: str = "sm_90") -> None:
    res = res_usage(text, defines, arch)
    lines = [line.split("Function ")[-1] for line in res.splitlines() if "Function" in line or "REG" in line]
    wanted = [f"{a.strip(':')} {b.strip()[:48]}" for a, b in zip(lines[::2], lines[1::2]) if a.startswith(name)]
    print(name, {k: v for k, v in defines.items() if k != "PF"}, *wanted, flush=True)


def moe_variants(quick: bool):
    for bm, stages, direct in itertools.product((16, 32, 64, 128), (0, 4), (False, True)):
        if (direct and bm != 16) or (quick and stages):
            continue
        plan = moe_mma_config.MoeMmaPlan(bm, moe_mma_config.warps_for(bm), ((8, 1), (6, 2)), ((8, 1),),
                                         moe_planning.formats_up_to(stages), 1, 8, 1, 8, moe_planning.pre_rotates(bm),
                                         direct)
        names = ["moe_gate_up_mma", "moe_down_mma"] + (["moe_rotate_input"] if plan.pre_rotate else [])
        for name in names:
            defines, prelude = moe_mma_source.kernel_source(plan, name)
            usage(name, dict(defines), prelude + nvrtc.source("moe_mma.cu"))


def linear_variants():
    for mt, nt, fuse in [(1, 2, 1), (1, 2, 0), (2, 2, 0), (4, 1, 0), (8, 1, 0)]:
        defines = {"K2": 8, "CB": 1, "MT": mt, "NT": nt, "PF": 4, "WARPS": 4, "FUSE_IN": fuse}
        usage("trellis_mma", defines, nvrtc.source("trellis_mma.cu"))


if __name__ == "__main__":
    quick = "--quick" in sys.argv
    linear_variants()
    moe_variants(quick)
