"""Batch invariance on a GPU: rows of a large call against the same rows computed in calls of fewer rows, byte by
byte, for the linear and the fused MoE layer (skewed routings, mixed widths, a shared expert). Records, per case and
row count: rows compared, rows byte-equal, max abs difference."""

import argparse

import torch

from exl3moe import ExpertSet
from exl3moe.ops.linear import linear
from exl3moe.ops.moe import fused_experts
from linear import random_weight as random_linear
from moe import random_layer
from results_io import save_results

LINEAR_SHAPES = [(4096, 14336, 4, "mcg"), (14336, 4096, 4, "mcg"), (2048, 768, 4, "mcg"), (4096, 1408, 3, "mul1")]
LINEAR_ROWS, LINEAR_FULL = [1, 2, 7, 16, 17, 33, 64, 128, 129, 300, 512], 2048
MOE_TOKENS, MOE_FULL = [1, 2, 3, 8, 16, 17, 64, 300, 1024], 4096
RESULT_KEY = ("case", "rows")


def compare(case: str, rows: int, part: torch.Tensor, full: torch.Tensor) -> dict:
    equal = (part.view(torch.int16) == full.view(torch.int16)).all(dim=-1) if part.dtype != torch.float32 else \
        (part.view(torch.int32) == full.view(torch.int32)).all(dim=-1)
    diff = (part.float() - full.float()).abs().max().item()
    return dict(case=case, rows=rows, compared=rows, equal=int(equal.sum().item()), max_diff=diff)


def linear_cases(gen) -> list:
    out = []
    for k, n, K, cb in LINEAR_SHAPES:
        w = random_linear(k, n, K, cb, gen)
        x = torch.randn(LINEAR_FULL, k, device="cuda", generator=gen).half()
        for dtype in (torch.float16, torch.bfloat16, torch.float32):
            full = linear(x, w, out_dtype=dtype)
            for rows in LINEAR_ROWS:
                out.append(compare(f"linear {k}x{n} K{K} {cb} {str(dtype)[6:]}", rows,
                                   linear(x[:rows], w, out_dtype=dtype), full[:rows]))
    return out


def routing(T, E, top_k, gen, skew: str):
    logits = torch.randn(T, E, device="cuda", generator=gen)
    if skew == "one expert":
        logits[:, 0] += 100.0
    elif skew == "half empty":
        logits[:, E // 2:] -= 100.0
    w, ids = torch.softmax(logits, -1).topk(top_k, -1)
    return ids.to(torch.int32).contiguous(), (w / w.sum(-1, keepdim=True)).contiguous()


def moe_cases(gen) -> list:
    hidden, inter, E, top_k = 2048, 768, 128, 8
    layers = {"K4 mcg": random_layer(hidden, inter, E, [4], "mcg", gen),
              "mixed K3/K4": random_layer(hidden, inter, E, [3, 4], "mcg", gen)}
    shared = random_layer(hidden, inter, 1, [4], "mcg", gen)
    out = []
    for name, experts in layers.items():
        for skew in ("random", "one expert", "half empty"):
            for with_shared in (False, True) if name == "K4 mcg" and skew == "random" else (False,):
                x = (torch.randn(MOE_FULL, hidden, device="cuda", generator=gen) * 0.3).half()
                ids, wts = routing(MOE_FULL, E, top_k, gen, skew)
                sh = shared if with_shared else None
                full = fused_experts(x, experts, ids, wts, shared=sh)
                for T in MOE_TOKENS:
                    part = fused_experts(x[:T], experts, ids[:T], wts[:T], shared=sh)
                    case = f"moe qwen3 {name} {skew}" + (" shared" if with_shared else "")
                    out.append(compare(case, T, part, full[:T]))
    return out


def main(args):
    gen = torch.Generator(device="cuda").manual_seed(0)
    results = []
    for make in (linear_cases, moe_cases) if args.part == "all" else \
            ((linear_cases,) if args.part == "linear" else (moe_cases,)):
        for r in make(gen):
            results.append(r)
            print(f"{r['case']:45s} rows {r['rows']:5d} equal {r['equal']:5d}/{r['compared']:<5d} "
                  f"max diff {r['max_diff']:.3g}", flush=True)
        save_results(args.out, results, RESULT_KEY, args.merge)


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="bench/results/invariance_h200.json")
    ap.add_argument("--part", choices=("all", "linear", "moe"), default="all")
    ap.add_argument("--merge", action="store_true")
    main(ap.parse_args())
