"""Time the CUDA C++ linear kernel's variants (k split target, prefetch, n16 tiles per warp, m16 tiles per block)
against the planned call and fp16 torch.matmul on a GPU; `--triton` adds the Triton path. Each variant's output is
compared with the planned call's (0 where the split is the same: same bytes)."""

import argparse
import os

import torch

from exl3moe import EXL3Weight
from exl3moe.kernels.trellis_mma import counter_count
from exl3moe.ops.linear_cuda import trellis_mma
from exl3moe.ops.linear_planning import plan_mma
from exl3moe.ops.linear import LinearPlan
from exl3moe.timing import copies_for, time_graph


def planned_time(ws, rows, x, out, backend="1"):
    os.environ["EXL3MOE_CUDA_KERNELS"] = backend
    plan = LinearPlan(ws[0], rows)
    workspace = plan.allocate()
    us = time_graph([lambda r=LinearPlan(w, rows).bind(workspace): r.run(x, out) for w in ws])
    os.environ["EXL3MOE_CUDA_KERNELS"] = "1"
    return us


def main(args):
    g = torch.Generator(device="cuda").manual_seed(0)
    for shape in args.shapes:
        k, n = map(int, shape.split("x"))
        K = args.K
        ws = [EXL3Weight(torch.randint(-32768, 32767, (k // 16, n // 16, int(16 * K)), dtype=torch.int16,
                                       device="cuda", generator=g), torch.ones(k, device="cuda").half(),
                         torch.ones(n, device="cuda").half(), args.codebook) for _ in range(copies_for(k * n * K // 8))]
        dense = [torch.randn(k, n, device="cuda", dtype=torch.float16, generator=g)
                 for _ in range(copies_for(k * n * 2))]
        for rows in args.rows:
            x = (torch.randn(rows, k, device="cuda", generator=g) * 0.1).half()
            out = torch.empty(rows, n, device="cuda", dtype=torch.float16)
            fp16 = time_graph([lambda d=d: torch.matmul(x, d, out=out) for d in dense])
            line = f"{k}x{n} K{K} {args.codebook} rows {rows:3d}: fp16 {fp16:6.1f}"
            if args.triton:
                line += f" | triton {planned_time(ws, rows, x, out, '0'):6.1f}"
            line += f" | planned {planned_time(ws, rows, x, out):6.1f} |"
            ref = out.clone()
            counters = torch.zeros(counter_count(n, rows), dtype=torch.int32, device="cuda")
            for target in args.targets:
                m = plan_mma(k, n, target)
                part = torch.empty(m.splits, rows, n, device="cuda")
                for pf in args.prefetch:
                    for nt in args.nt:
                        for mt in args.mt:
                            us = time_graph([lambda w=w: trellis_mma(x, w, part, counters, out, m, pf, nt or None,
                                                                          mt or None) for w in ws])
                            trellis_mma(x, ws[-1], part, counters, out, m, pf, nt or None, mt or None)
                            err = ((out.float() - ref.float()).norm() / ref.float().norm()).item()
                            line += f" w{target}/s{m.splits}/pf{pf}/nt{nt}/mt{mt} {us:6.1f} ({err:.0e})"
            print(line, flush=True)
        del dense


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", nargs="+", default=["4096x14336"])
    ap.add_argument("--K", type=float, default=4)
    ap.add_argument("--codebook", default="mcg")
    ap.add_argument("--rows", nargs="+", type=int, default=[1, 8, 16])
    ap.add_argument("--targets", nargs="+", type=int, default=[2048, 4096, 8192])
    ap.add_argument("--prefetch", nargs="+", type=int, default=[4])
    ap.add_argument("--mt", nargs="+", type=int, default=[0], help="m16 tiles per block; 0 = the default for the rows")
    ap.add_argument("--nt", nargs="+", type=int, default=[0], help="n16 tiles per warp; 0 = the default for the rows")
    ap.add_argument("--triton", action="store_true", help="time the Triton path as well")
    main(ap.parse_args())
