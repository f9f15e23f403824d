"""Time moe_combine's Triton kernel at several (tokens per program, columns per program, warps) on a GPU: CUDA-graph
replays over a y of T * top_k fp32 rows (larger than L2); checks each variant's bytes against the library's."""

import argparse

import torch
import triton

from exl3moe.kernels.moe_combine import moe_combine, moe_combine_kernel

VARIANTS = [(8, 128, 4), (8, 256, 4), (8, 512, 4), (8, 512, 8), (16, 128, 4), (4, 512, 4), (2, 1024, 4),
            (1, 2048, 8), (8, 1024, 8)]


def launch(ids, weights, y, out, E, bt, bc, warps):
    T, top_k = ids.shape
    grid = (triton.cdiv(T, bt), out.shape[1] // bc)
    moe_combine_kernel[grid](ids, weights, y, y, out, T, E, out.shape[1], out.stride(0), TOP_K=top_k,
                             HAS_SHARED=False, BT=bt, BC=bc, num_warps=warps)


def graph_us(fn, reps=20):
    fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(reps):
            fn()
    times = []
    for _ in range(7):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        g.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) * 1000 / reps)
    return sorted(times)[len(times) // 2]


def main(args):
    g = torch.Generator(device="cuda").manual_seed(0)
    T, H, E, top_k = args.tokens, args.hidden, 128, 8
    ids = torch.randint(0, E, (T, top_k), device="cuda", generator=g, dtype=torch.int32)
    weights = torch.rand(T, top_k, device="cuda", generator=g)
    y = torch.randn(T * top_k, H, device="cuda", generator=g)
    ref = torch.empty(T, H, device="cuda", dtype=torch.float16)
    moe_combine(ids, weights, y, None, ref, E)
    gb = y.numel() * 4 / 1e9
    for bt, bc, warps in VARIANTS:
        out = torch.empty_like(ref)
        us = graph_us(lambda: launch(ids, weights, y, out, E, bt, bc, warps))
        same = torch.equal(out.view(torch.int16), ref.view(torch.int16))
        print(f"combine T={T} BT={bt:2d} BC={bc:4d} warps={warps} {us:7.1f} us {gb / us * 1e6 / 1e3:5.2f} TB/s "
              f"same bytes {same}", flush=True)


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--hidden", type=int, default=2048)
    main(ap.parse_args())
