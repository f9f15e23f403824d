"""Time the linear with trellis_ws at any row count it may take (EXL3MOE_WS_MIN_ROWS=1; splits per block swept)
against trellis_mma (EXL3MOE_WS=0) on a GPU, over rotating weight copies, and check that both give the same bytes."""

import argparse
import os

import torch

from exl3moe import EXL3Weight
from exl3moe.ops.linear import LinearPlan
from exl3moe.timing import copies_for, time_graph


def timed(ws, x, out, env: dict) -> float:
    os.environ.update(env)
    plan = LinearPlan(ws[0], x.shape[0])
    space = plan.allocate()
    return time_graph([lambda r=LinearPlan(w, x.shape[0]).bind(space): r.run(x, out) for w in ws])


def main(args):
    g = torch.Generator(device="cuda").manual_seed(0)
    for shape in args.shapes:
        k, n = map(int, shape.split("x"))
        ws = [EXL3Weight(torch.randint(-32768, 32767, (k // 16, n // 16, int(16 * args.K)), dtype=torch.int16,
                                       device="cuda", generator=g), torch.ones(k, device="cuda").half(),
                         torch.ones(n, device="cuda").half(), args.codebook)
              for _ in range(copies_for(k * n * args.K // 8))]
        for rows in args.rows:
            x = (torch.randn(rows, k, device="cuda", generator=g) * 0.1).half()
            out = torch.empty(rows, n, device="cuda", dtype=torch.float16)
            mma = timed(ws, x, out, {'EXL3MOE_WS': '0'}) if not args.skip_mma else float("nan")
            line = f"{shape} K{args.K} {args.codebook} rows {rows:3d}: mma {mma:6.1f}"
            ref = out.clone()
            for spb in args.spb:
                us = timed(ws, x, out, {"EXL3MOE_WS": "1", "EXL3MOE_WS_SPB": str(spb), "EXL3MOE_WS_MIN_ROWS": "1"})
                same = torch.equal(out.view(torch.int16), ref.view(torch.int16))
                line += f" | ws spb{spb or 'auto'} {us:6.1f}{'' if same else ' BYTES DIFFER'}"
            print(line.replace(" BYTES DIFFER", "") if args.skip_mma else line, flush=True)


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", nargs="+", default=["4096x14336", "14336x4096", "2048x768", "4096x1408"])
    ap.add_argument("--K", type=float, default=4)
    ap.add_argument("--codebook", default="mcg")
    ap.add_argument("--rows", nargs="+", type=int, default=[65, 128])
    ap.add_argument("--spb", nargs="+", type=int, default=[0, 1, 2])
    ap.add_argument("--skip-mma", action="store_true")
    main(ap.parse_args())
