"""Time the pieces of the linear above 128 rows on a GPU: the CUDA and Triton dense decodes of W_inner (for
several k-tiles per warp), cuBLAS with fp32 output, and the whole call."""

import argparse

import torch

from exl3moe import EXL3Weight
from exl3moe.kernels import trellis_dense
from exl3moe.kernels.trellis_decode import trellis_decode
from exl3moe.ops.linear import LinearPlan
from exl3moe.timing import copies_for, time_graph


def main(args):
    g = torch.Generator(device="cuda").manual_seed(0)
    for shape in args.shapes:
        k, n = map(int, shape.split("x"))
        ones = torch.ones(max(k, n), device="cuda").half()
        ws = [EXL3Weight(torch.randint(-32768, 32767, (k // 16, n // 16, 16 * args.K), dtype=torch.int16,
                                       device="cuda", generator=g), ones[:k], ones[:n], args.codebook)
              for _ in range(copies_for(k * n * args.K // 8))]
        dense = torch.empty(k, n, device="cuda", dtype=torch.float16)
        line = f"{k}x{n} K{args.K} {args.codebook}:"
        for kt in args.ktiles:
            trellis_dense.DENSE_KTILES = kt
            us = time_graph([lambda w=w: trellis_dense.decode_dense(w, dense) for w in ws])
            line += f" cuda decode/{kt} {us:6.1f}"
        trellis_dense.DENSE_KTILES = args.ktiles[0]
        triton = time_graph([lambda w=w: trellis_decode(w.trellis, w.K, w.codebook, dense) for w in ws])
        line += f" | triton decode {triton:6.1f}"
        x = (torch.randn(args.rows, k, device="cuda", generator=g) * 0.1).half()
        part = torch.empty(args.rows, n, device="cuda")
        line += f" | mm fp32 {time_graph([lambda: torch.mm(x, dense, out_dtype=torch.float32, out=part)]):6.1f}"
        out = torch.empty(args.rows, n, device="cuda", dtype=torch.float16)
        plan = LinearPlan(ws[0], args.rows)
        wsp = plan.allocate()
        line += f" | whole {time_graph([lambda r=LinearPlan(w, args.rows).bind(wsp): r.run(x, out) for w in ws]):6.1f}"
        print(line, flush=True)


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", nargs="+", default=["4096x14336", "768x2048", "4096x1408"])
    ap.add_argument("--K", type=int, default=4)
    ap.add_argument("--codebook", default="mcg")
    ap.add_argument("--rows", type=int, default=512)
    ap.add_argument("--ktiles", nargs="+", type=int, default=[4, 2, 8, 16])
    main(ap.parse_args())
