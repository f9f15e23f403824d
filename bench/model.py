"""Model benchmark on the GPU: exl3moe's transformers model vs the same model with bf16 weights, one run.

    python bench/model.py --synthetic qwen3-30b-a3b [--layers 12] --out bench/results/model_h200.json --plot PNG
    python bench/model.py PATH --out ...          (a real EXL3 checkpoint)

Prefill tokens/s at each --prefill length, decode tokens/s at each --batches size (generate() with a static
cache, CUDA-graph decode steps), peak memory, the exl3moe kernels' share of a decode step. With --layers the
synthetic model has fewer decoder layers than the real one; the JSON says how many ("model": layers, full_layers).
"""

import argparse
import json
import sys

from exl3moe.hf_commands import add_bench_model_arguments, bench_model_main


def plot(report: dict, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for ax, part, label, key in ((axes[0], "prefill", "prefill tokens", "tokens"), (axes[1], "decode", "batch", "batch")):
        names = [str(r[key]) for r in report["exl3moe"][part]]
        positions = range(len(names))
        ax.bar([p - 0.2 for p in positions], [r["tokens_per_s"] for r in report["exl3moe"][part]], 0.4, label="exl3moe")
        if "bf16" in report:
            ax.bar([p + 0.2 for p in positions], [r["tokens_per_s"] for r in report["bf16"][part]], 0.4, label="bf16")
        ax.set_xticks(list(positions), names)
        ax.set_xlabel(label)
        ax.set_ylabel("tokens/s")
        ax.set_title(part)
        ax.legend()
    model = report["model"]
    fig.suptitle(f"{model.get('synthetic', model.get('path'))}: {model.get('layers', '')} layers, {report['gpu']}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv=None) -> int:
    parser = add_bench_model_arguments(argparse.ArgumentParser(description=__doc__.splitlines()[0]))
    parser.add_argument("--plot", default=None, help="write a bar chart of the results here (needs --out)")
    args = parser.parse_args(argv)
    code = bench_model_main(args)
    if code == 0 and args.plot and args.out:
        with open(args.out) as f:
            plot(json.load(f), args.plot)
    return code


if __name__ == "__main__":
    sys.exit(main())
