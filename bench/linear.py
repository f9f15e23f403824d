"""Benchmark the EXL3 linear on a GPU against fp16 torch.matmul of the same shape, measured in the same run."""

import argparse

import torch

from exl3moe import EXL3Weight
from exl3moe.ops.linear import LinearPlan, LinearTiles
from exl3moe.timing import copies_for, time_graph
from results_io import save_results

SHAPES = [(4096, 14336), (14336, 4096), (2048, 768), (768, 2048), (4096, 1408), (1408, 4096)]
BITS = [2, 3, 4, 6, 8]
CODEBOOKS = ["mcg", "mul1", "3inst"]
ROWS = [1, 8, 32, 128, 512]
RESULT_KEY = ("k", "n", "K", "codebook", "rows")  # what a --merge rerun replaces


def random_weight(k, n, K, codebook, gen):
    trellis = torch.randint(-32768, 32767, (k // 16, n // 16, int(16 * K)), dtype=torch.int16, device="cuda",
                            generator=gen)
    sign = lambda m: torch.where(torch.rand(m, device="cuda", generator=gen) < 0.5, -1.0, 1.0)  # noqa: E731
    suh = (sign(k) * (0.5 + torch.rand(k, device="cuda", generator=gen))).half() / 64
    svh = (sign(n) * (0.5 + torch.rand(n, device="cuda", generator=gen))).half()
    return EXL3Weight(trellis, suh, svh, codebook)


def exl3_calls(k, n, K, codebook, rows, gen, tiles=None):
    """(builder, trellis bytes of one copy): the builder plans and binds one call per rotating weight copy."""
    probe = random_weight(k, n, K, codebook, gen)
    weights = [probe] + [random_weight(k, n, K, codebook, gen) for _ in range(copies_for(probe.trellis_bytes) - 1)]
    x = torch.randn(rows, k, device="cuda", dtype=torch.float16, generator=gen)
    out = torch.empty(rows, n, device="cuda", dtype=torch.float16)

    def calls():
        workspace = LinearPlan(weights[0], rows, tiles).allocate()
        return [lambda r=LinearPlan(w, rows, tiles).bind(workspace): r.run(x, out) for w in weights]
    return calls, probe.trellis_bytes


def time_exl3(k, n, K, codebook, rows, gen, tiles=None):
    calls, trellis_bytes = exl3_calls(k, n, K, codebook, rows, gen, tiles)
    return time_graph(calls(), replays=10), trellis_bytes


def time_fp16(k, n, rows, gen):
    copies = copies_for(k * n * 2)
    ws = [torch.randn(k, n, device="cuda", dtype=torch.float16, generator=gen) for _ in range(copies)]
    x = torch.randn(rows, k, device="cuda", dtype=torch.float16, generator=gen)
    out = torch.empty(rows, n, device="cuda", dtype=torch.float16)
    return time_graph([lambda w=w: torch.matmul(x, w, out=out) for w in ws], replays=10)


def tune(args):
    gen = torch.Generator(device="cuda").manual_seed(0)
    k, n = 4096, 14336
    fp16 = {rows: time_fp16(k, n, rows, gen) for rows in (1, 8, 128)}
    rows_out = []
    for bn, bk, warps, stages in [(64, 32, 4, 2), (64, 64, 4, 2), (128, 32, 4, 2), (128, 32, 8, 2), (64, 32, 4, 3),
                                  (32, 64, 4, 2), (128, 64, 8, 2), (64, 16, 4, 2)]:
        chunks = k // bk
        splits = max(1, min(chunks, -(-512 // (n // bn))))
        tiles = LinearTiles(bn, bk, -(-chunks // -(-chunks // splits)), warps, stages)
        for cb in ("mcg", "mul1"):
            for rows in (1, 8, 128):
                us, tb = time_exl3(k, n, 4, cb, rows, gen, tiles)
                rows_out.append(dict(tiles=str(tiles), codebook=cb, rows=rows, us=us, fp16_us=fp16[rows]))
                print(f"{str(tiles):70s} {cb:5s} rows {rows:4d} {us:8.1f} us  fp16 {fp16[rows]:6.1f}", flush=True)
    return rows_out


def full(args):
    gen = torch.Generator(device="cuda").manual_seed(0)
    results = []
    for k, n in (tuple(map(int, shape.split("x"))) for shape in args.shapes):
        fp16 = {rows: time_fp16(k, n, rows, gen) for rows in args.rows}
        for K in args.bits:
            for cb in args.codebooks:
                for rows in args.rows:
                    us, tb = time_exl3(k, n, K, cb, rows, gen)
                    results.append(dict(k=k, n=n, K=K, codebook=cb, rows=rows, us=round(us, 2),
                                        fp16_us=round(fp16[rows], 2), trellis_GBps=round(tb / us / 1e3, 1)))
                    save_results(args.out, results, RESULT_KEY, args.merge)
                    print(f"{k}x{n} K{K} {cb:5s} rows {rows:4d} {us:8.1f} us fp16 {fp16[rows]:7.1f} "
                          f"ratio {us / fp16[rows]:5.2f}", flush=True)
    return results


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--tune", action="store_true")
    ap.add_argument("--out", default="bench/results/linear_h200.json")
    ap.add_argument("--shapes", nargs="+", default=[f"{k}x{n}" for k, n in SHAPES])
    ap.add_argument("--bits", nargs="+", type=int, default=BITS)
    ap.add_argument("--codebooks", nargs="+", default=CODEBOOKS)
    ap.add_argument("--rows", nargs="+", type=int, default=ROWS)
    ap.add_argument("--merge", action="store_true", help="keep the entries of --out that this run does not replace")
    a = ap.parse_args()
    if a.tune:
        save_results(a.out, tune(a), ())
    else:
        full(a)
