"""Plots and README tables from bench/results/*.json (needs matplotlib: pip install exl3moe[plot])."""

import json
import os
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

HERE = os.path.join(os.path.dirname(__file__), "results")
HBM_TBPS = 4.22  # device-to-device copy measured on the H200 (anchors-h200.md)
# exllamav3 1.6.5 on the H200, from docs/anchors-h200.md: (k, n, codebook, K) -> {rows: us}
EXL3_LINEAR = {(4096, 14336, "mcg", 4): {1: 32.6, 8: 32.7, 64: 73.1, 128: 143.0},
               (4096, 14336, "mul1", 4): {1: 28.1, 8: 32.0, 64: 72.7},
               (4096, 14336, "mcg", 2): {1: 33.8, 8: 34.7, 64: 72.4},
               (4096, 14336, "mcg", 6): {1: 41.5, 8: 44.5, 64: 83.2}}
EXL3_MOE = {"qwen3-30b-a3b": {1: 34.3, 4: 90.6, 16: 321, 64: 509, 256: 785, 1024: 2111},
            "glm-4.5-air": {1: 254, 4: 491, 16: 1433, 64: 1927, 256: 3085, 1024: 8682}}


def load(name):
    with open(os.path.join(HERE, name)) as fh:
        return json.load(fh)


def plot_linear(doc):
    fig, ax = plt.subplots(figsize=(8, 5))
    for (k, n, cb, K) in [(4096, 14336, "mcg", 2), (4096, 14336, "mcg", 4), (4096, 14336, "mul1", 4),
                          (4096, 14336, "mcg", 6)]:
        rows = sorted((r for r in doc["results"] if (r["k"], r["n"], r["codebook"], r["K"]) == (k, n, cb, K)),
                      key=lambda r: r["rows"])
        line, = ax.plot([r["rows"] for r in rows], [r["trellis_GBps"] for r in rows], "o-", label=f"exl3moe {cb} K{K}")
        anchor = EXL3_LINEAR.get((k, n, cb, K), {})
        ax.plot(list(anchor), [k * n * K / 8 / us / 1e3 for us in anchor.values()], "x--", color=line.get_color(),
                alpha=0.6, label=f"exllamav3 {cb} K{K}")
    ax.axhline(HBM_TBPS * 1000, color="k", ls=":", label="HBM copy ceiling")
    ax.set(xscale="log", yscale="log", xlabel="rows", ylabel="trellis GB/s (effective)",
           title=f"EXL3 linear 4096x14336 on {doc['gpu']}")
    ax.legend(fontsize=7)
    fig.savefig(os.path.join(HERE, "linear_h200.png"), dpi=110, bbox_inches="tight")


def plot_moe(doc):
    fig, axes = plt.subplots(1, 2, figsize=(12, 5))
    for ax, shape in zip(axes, ("qwen3-30b-a3b", "glm-4.5-air")):
        res = sorted((r for r in doc["results"] if r["shape"] == shape and "stages" not in r and "shared" not in r),
                     key=lambda r: r["tokens"])   # results are stored in the order they were measured
        for K in dict.fromkeys(r["K"] for r in res):
            sel = [r for r in res if r["K"] == K]
            kernels = sel[0].get("experts", "triton")
            ax.plot([r["tokens"] for r in sel], [r["us"] for r in sel], "o-", label=f"exl3moe K={K} ({kernels})")
        bf = {r["tokens"]: r["bf16_us"] for r in res}
        ax.plot(list(bf), list(bf.values()), "k-", label="bf16 whole layer (grouped_mm)")
        gemms = {r["tokens"]: r["bf16_gemm_us"] for r in res if "bf16_gemm_us" in r}
        ax.plot(list(gemms), list(gemms.values()), "k:", label="bf16 grouped GEMMs only")
        ax.plot(list(EXL3_MOE[shape]), list(EXL3_MOE[shape].values()), "x--", label="exllamav3 (best path) K4")
        ax.set(xscale="log", yscale="log", xlabel="tokens", ylabel="us", title=f"{shape} on {doc['gpu']}")
        ax.legend(fontsize=7)
    fig.savefig(os.path.join(HERE, "moe_h200.png"), dpi=110, bbox_inches="tight")


SHOWN_SHAPES = ((4096, 14336), (2048, 768), (4096, 1408), (1408, 4096))


def stage_table(doc):
    res = [r for r in doc["results"] if "stages" in r]
    base = {r["tokens"]: r["us"] for r in res if r["stages"] == "base"}
    out = ["| tokens | base us | zero-stage us | K2 stage on all experts us | on a quarter us |",
           "|---|---|---|---|---|"]
    for T in sorted(base):
        row = {r["stages"]: r["us"] for r in res if r["tokens"] == T}
        out.append(f"| {T} | {row['base']} | {row['zero-stage']} ({row['zero-stage'] / row['base']:.2f}x) | "
                   f"{row['k2-all']} ({row['k2-all'] / row['base']:.2f}x) | "
                   f"{row['k2-quarter']} ({row['k2-quarter'] / row['base']:.2f}x) |")
    return "\n".join(out)


def linear_table(doc):
    out = ["| shape | codebook | K | rows | exl3moe us | fp16 us | ratio | exllamav3 us |",
           "|---|---|---|---|---|---|---|---|"]
    shown = [r for r in doc["results"] if r["K"] == 4 and r["codebook"] in ("mcg", "mul1")
             and (r["k"], r["n"]) in SHOWN_SHAPES]
    for r in sorted(shown, key=lambda r: (SHOWN_SHAPES.index((r["k"], r["n"])), r["codebook"], r["rows"])):
        ex = EXL3_LINEAR.get((r["k"], r["n"], r["codebook"], 4), {}).get(r["rows"], "")
        out.append(f"| {r['k']}x{r['n']} | {r['codebook']} | 4 | {r['rows']} | {r['us']} | {r['fp16_us']} | "
                   f"{r['us'] / r['fp16_us']:.2f} | {ex} |")
    return "\n".join(out)


def moe_table(doc):
    """K4 rows; the bf16 GEMMs-only column (bench/moe.py's bf16_gemm_us) where the run measured it."""
    out = ["| shape | K | tokens | exl3moe us | bf16 whole layer us | bf16 GEMMs only us | exllamav3 K4 us |",
           "|---|---|---|---|---|---|---|"]
    shapes = list(EXL3_MOE)
    for r in sorted(doc["results"], key=lambda r: (shapes.index(r["shape"]), r["tokens"])):
        if r["K"] == 4 and "stages" not in r and "shared" not in r:
            out.append(f"| {r['shape']} | 4 | {r['tokens']} | {r['us']} | {r['bf16_us']} | {r.get('bf16_gemm_us', '')} "
                       f"| {EXL3_MOE[r['shape']].get(r['tokens'], 'n/a')} |")
    return "\n".join(out)


if __name__ == "__main__":
    lin, moe = load("linear_h200.json"), load("moe_h200.json")
    plot_linear(lin)
    plot_moe(moe)
    if "--tables" in sys.argv:
        print(linear_table(lin))
        print()
        print(moe_table(moe))
        print()
        print(stage_table(moe))
