"""The bf16 baseline two ways on a GPU: the whole routed layer as bench/moe.py times it (sort, gather, grouped GEMMs,
SiLU, weighted scatter-add) and its grouped GEMMs and SiLU alone (rows sorted and gathered outside the timing, as
in the anchors' bf16 grouped_mm column)."""

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "bench"))
from moe import SHAPES, TOKENS, bf16_layer, time_bf16  # noqa: E402

from exl3moe.timing import run_info  # noqa: E402


def main(args):
    gen = torch.Generator(device="cuda").manual_seed(0)
    results = []
    for shape in args.shapes:
        hidden, inter, E, top_k = SHAPES[shape]
        gate_up, down = bf16_layer(hidden, inter, E, gen)
        for T in args.tokens:
            whole, gemm = time_bf16((gate_up, down), hidden, E, T, top_k, gen)
            print(f"bf16 {shape:14s} T={T:5d} whole layer {whole:8.1f} us  grouped GEMMs + SiLU {gemm:8.1f} us",
                  flush=True)
            results.append({"shape": shape, "tokens": T, "whole_layer_us": round(whole, 1),
                            "gemms_silu_us": round(gemm, 1)})
    with open(args.out, "w") as fh:
        json.dump({**run_info(), "source": "scripts/bf16_probe.py", "results": results}, fh, indent=1)


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", nargs="+", default=list(SHAPES))
    ap.add_argument("--tokens", nargs="+", type=int, default=TOKENS)
    ap.add_argument("--out", default="bench/results/bf16_baselines_h200.json")
    main(ap.parse_args())
