"""Time the CUDA C++ linear kernel (splits, prefetch, n tiles per warp) against the Triton path on a GPU."""

import argparse

import torch

from exl3moe import EXL3Weight
from exl3moe.kernels import trellis_mma as tmma
from exl3moe.ops.linear import LinearPlan
from exl3moe.timing import copies_for, time_graph


def main(args):
    g = torch.Generator(device="cuda").manual_seed(0)
    for shape in args.shapes:
        k, n = map(int, shape.split("x"))
        K = args.K
        ws = [EXL3Weight(torch.randint(-32768, 32767, (k // 16, n // 16, int(16 * K)), dtype=torch.int16,
                                       device="cuda", generator=g), torch.ones(k, device="cuda").half(),
                         torch.ones(n, device="cuda").half(), args.codebook) for _ in range(copies_for(k * n * K // 8))]
        dense = [torch.randn(k, n, device="cuda", dtype=torch.float16, generator=g) for _ in range(copies_for(k * n * 2))]
        for rows in args.rows:
            x = (torch.randn(rows, k, device="cuda", generator=g) * 0.1).half()
            out = torch.empty(rows, n, device="cuda", dtype=torch.float16)
            fp16 = time_graph([lambda d=d: torch.matmul(x, d, out=out) for d in dense])
            times = {}
            for backend in ("0", "1"):
                import os
                os.environ["EXL3MOE_CUDA_KERNELS"] = backend
                plan = LinearPlan(ws[0], rows)
                wsp = plan.allocate()
                times[backend] = time_graph([lambda r=LinearPlan(w, rows).bind(wsp): r.run(x, out) for w in ws])
                if backend == "0":
                    ref = out.clone()
            err = ((out.float() - ref.float()).norm() / ref.float().norm()).item()
            line = (f"{k}x{n} K{K} rows {rows:3d}: fp16 {fp16:6.1f} | triton {times['0']:6.1f} | cuda {times['1']:6.1f}"
                    f" (vs triton {err:.0e}) |")
            counters = torch.zeros(tmma.counter_count(n, rows), dtype=torch.int32, device="cuda")
            for target in args.targets:
                m = tmma.plan_mma(k, n, target)
                part = torch.empty(m.splits, rows, n, device="cuda")
                for pf in args.prefetch:
                    for nt in args.nt:
                        for mt in args.mt:
                            us = time_graph([lambda w=w: tmma.trellis_mma(x, w, part, counters, out, m, pf, nt or None,
                                                                          mt or None) for w in ws])
                            line += f" w{target}/s{m.splits}/pf{pf}/nt{nt}/mt{mt} {us:6.1f}"
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
    main(ap.parse_args())
