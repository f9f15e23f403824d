"""Registers, stack and shared memory of the mma.sync MoE kernels for typical plans, without a GPU (NVRTC for sm_90),
for each define set given and optionally for the sources of another git revision, so a change's cost in registers
(and so in blocks per SM) is known before the H200 sees it. Every column takes today's plan defines; `_kernel`'s
run-time drop of a spilling MIN_BLOCKS bound is not applied.
Usage: python3 scripts/moe_registers.py [--rev REV] [--plans NAME ...] [SET ...]   (SET: "A=1,B=2"; "0" for none)"""

import argparse
import os
import re
import subprocess
import sys
import tempfile

from nvrtc_check import res_usage

from exl3moe.kernels import moe_mma_config, moe_mma_source, nvrtc

P = moe_mma_config.MoeMmaPlan
SEVEN = tuple((k2, 1) for k2 in (4, 6, 8, 10, 12, 14, 16))
PLANS = {   # (2K, codebook id) formats; direct plans are one token's, packed ones a 4-64-token call's
    "direct-k4": P(16, 4, ((8, 1),), ((8, 1),), (), 8, 16, 6, 8, False, True, small_call=True, one_wave=True),
    "direct-k5": P(16, 4, ((10, 1),), ((10, 1),), (), 8, 16, 6, 8, False, True, small_call=True, one_wave=True),
    "direct-mixed": P(16, 4, ((6, 1), (8, 1)), ((6, 1), (8, 1)), (), 8, 16, 6, 8, False, True, small_call=True,
                      one_wave=True),
    "direct-stages": P(16, 4, ((8, 1),), ((8, 1),), ((2, 1), (4, 1)), 8, 16, 6, 8, False, True, one_wave=True),
    "p16-k4": P(16, 4, ((8, 1),), ((8, 1),), (), 2, 64, 1, 48, False),
    "p16-k5": P(16, 4, ((10, 1),), ((10, 1),), (), 2, 64, 1, 48, False),
    "p16-stages": P(16, 4, ((8, 1),), ((8, 1),), ((2, 1), (4, 1)), 2, 64, 1, 48, False),
    "p16-mixed7": P(16, 4, SEVEN, SEVEN, (), 2, 64, 1, 48, False),
    "p32-k4": P(32, 4, ((8, 1),), ((8, 1),), (), 2, 64, 1, 48, False),
    "p32-stages": P(32, 4, ((8, 1),), ((8, 1),), ((4, 1),), 2, 64, 1, 48, False),
    "p64-k4": P(64, 8, ((8, 1),), ((8, 1),), (), 2, 64, 1, 48, True),
}
KERNELS = ("moe_gate_up_mma", "moe_down_mma")


def source_at(rev: str) -> str:
    """moe_mma.cu with its includes as of git revision `rev` (a worktree-free read of its files)."""
    root = subprocess.run(["git", "rev-parse", "--show-toplevel"], capture_output=True, text=True).stdout.strip()
    with tempfile.TemporaryDirectory() as tmp:
        cuda = os.path.join("src", "exl3moe", "kernels", "cuda")
        names = subprocess.run(["git", "ls-tree", "--name-only", f"{rev}:{cuda}"], capture_output=True, text=True,
                               cwd=root, check=True).stdout.split()
        for name in names:
            text = subprocess.run(["git", "show", f"{rev}:{cuda}/{name}"], capture_output=True, text=True, cwd=root,
                                  check=True).stdout
            with open(os.path.join(tmp, name), "w") as fh:
                fh.write(text)
        return nvrtc.source("moe_mma.cu", directory=tmp)


def usage(plan, name: str, extra: dict, text: str) -> str:
    defines, prelude = moe_mma_source.kernel_source(plan, name)
    res = res_usage(prelude + text, {**dict(defines), **extra})
    m = re.search(r"Function %s:\s*\n\s*REG:(\d+) STACK:(\d+) SHARED:(\d+)" % name, res)
    return f"{m[1]}r {m[2]}s {int(m[3]) // 1024}K" if m else "?"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("sets", nargs="*", default=["0"])
    ap.add_argument("--rev", help="also compile the sources of this git revision (no extra defines)")
    ap.add_argument("--plans", nargs="+", default=list(PLANS), choices=list(PLANS))
    args = ap.parse_args()
    sets = [{} if s == "0" else dict(kv.split("=") for kv in s.split(",")) for s in args.sets]
    columns = [(s, nvrtc.source("moe_mma.cu"), extra) for s, extra in zip(args.sets, sets)]
    if args.rev:
        columns.append((args.rev, source_at(args.rev), {}))
    print("plan kernel | " + " | ".join(c[0] for c in columns))
    for key in args.plans:
        for name in KERNELS:
            print(f"{key} {name} | " + " | ".join(usage(PLANS[key], name, extra, text) for _, text, extra in columns),
                  flush=True)


if __name__ == "__main__":
    sys.exit(main())
