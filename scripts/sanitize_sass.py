"""Without a GPU: the CUDA kernel variants a scripts/sanitize.py case compiles on an sm_90 GPU (planning pretends to
be one), compiled here with NVRTC and disassembled with Triton's nvdisasm, so that a sanitizer report's
`kernel+0xOFFSET` can be read as SASS and source. The cubin is the GPU's where NVRTC's version is the same.

  python3 scripts/sanitize_sass.py CASE [--build racecheck_order] --list
  python3 scripts/sanitize_sass.py CASE [--build B] --kernel moe_gate_up_mma --at 0x8f30 0x8fa0 [--lineinfo]
--lineinfo adds -lineinfo (EXL3MOE_NVRTC_LINEINFO) and prints the compiled text's line of each instruction; check
that the offsets match the build without it.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
NVDISASM_DIR = os.path.join("backends", "nvidia", "bin")


def variants(case_name: str, build: str) -> list:
    """[{file, name, defines, prelude, arch}] of every distinct kernel the case compiles (nvrtc.kernel's arguments,
    with EXL3MOE_NVRTC_DEFINES as sanitizer_check.sh sets it for `build`)."""
    sys.path[:0] = [HERE, os.path.join(HERE, "..", "tests")]
    import sanitize
    case = sanitize.CASES[case_name]
    os.environ.update(case.env)
    os.environ["EXL3MOE_NVRTC_DEFINES"] = "RACECHECK_ORDER=1" if build == "racecheck_order" else ""
    import torch
    from note_variants import pretend_sm90
    from exl3moe.kernels import nvrtc
    pretend_sm90()
    seen = []

    def kernel(file, name, defines, device_index, prelude="", arch_suffix=""):
        entry = {"file": file, "name": name, "defines": {**dict(defines), **nvrtc.extra_defines()},
                 "prelude": prelude, "arch": f"sm_90{arch_suffix}"}
        if entry not in seen:
            seen.append(entry)
        return file, name
    nvrtc.kernel = kernel
    if case.run == "moe":
        from exl3moe.ops.moe import moe_plan
        experts, _, x, ids, _ = sanitize.moe_data(case)
        moe_plan(experts, x.shape[0], ids.shape[1], out_dtype=torch.float16, stage_capacity=int(case.stages),
                 max_stage_bits=2 if case.stages else 0)
    elif case.run == "linear":
        from exl3moe.ops.linear import LinearPlan
        from helpers import random_weight
        s = case.shape
        LinearPlan(random_weight(s["k"], s["n"], 4, "mul1", bias=True, generator=torch.Generator().manual_seed(1)),
                   s["rows"])
    return seen


def disassemble(entry: dict, lineinfo: bool) -> tuple:
    """(nvdisasm text of the variant's cubin, the compiled source text)."""
    import triton
    from exl3moe.kernels import nvrtc
    if lineinfo:
        os.environ["EXL3MOE_NVRTC_LINEINFO"] = "1"
    text = entry["prelude"] + nvrtc.source(entry["file"])
    with tempfile.NamedTemporaryFile(suffix=".cubin") as fh:
        fh.write(nvrtc.compile_cubin(text, entry["defines"], entry["arch"]))
        fh.flush()
        tool = os.path.join(os.path.dirname(triton.__file__), NVDISASM_DIR, "nvdisasm")
        sass = subprocess.run([tool, "-c", *(["-g"] if lineinfo else []), fh.name], capture_output=True, text=True,
                              check=True).stdout
    return sass, text


def around(sass: str, text: str, kernel: str, offset: int, context: int) -> str:
    """The instructions of `kernel` within `context` of `offset`, each after its source line where known."""
    body = sass.split(f".text.{kernel}:", 1)[-1].split(".section", 1)[0]
    lines, out, source_line = text.splitlines(), [], None
    for raw in body.splitlines():
        found = re.search(r'line (\d+)', raw) if "//## File" in raw else None
        if found:
            source_line = int(found.group(1))
            continue
        at = re.match(r"\s*/\*([0-9a-f]{4,})\*/\s*(.*?)\s*;", raw)
        if at and abs(int(at.group(1), 16) - offset) <= 16 * context:
            mark = ">>" if int(at.group(1), 16) == offset else "  "
            where = f"   // {source_line}: {lines[source_line - 1].strip()}" if source_line else ""
            out.append(f"{mark} {at.group(1)} {at.group(2)}{where}")
    return "\n".join(out)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("case")
    parser.add_argument("--build", choices=("default", "racecheck_order"), default="default")
    parser.add_argument("--list", action="store_true", help="print the case's variants")
    parser.add_argument("--kernel", help="the kernel a report names")
    parser.add_argument("--at", nargs="*", default=[], help="offsets of the report (hex)")
    parser.add_argument("--context", type=int, default=6, help="instructions either side")
    parser.add_argument("--lineinfo", action="store_true")
    args = parser.parse_args(argv)
    found = variants(args.case, args.build)
    if args.list or not args.kernel:
        for entry in found:
            print(entry["name"], entry["arch"], " ".join(f"{k}={v}" for k, v in entry["defines"].items()))
        return 0
    for entry in (e for e in found if e["name"] == args.kernel):
        print(f"== {entry['name']} {entry['arch']} {entry['defines']}")
        sass, text = disassemble(entry, args.lineinfo)
        for offset in args.at:
            print(f"-- +{offset}\n" + around(sass, text, args.kernel, int(offset, 16), args.context))
    return 0


if __name__ == "__main__":
    sys.exit(main())
