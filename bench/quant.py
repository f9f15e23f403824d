"""Proxy error and time of quantize_weight on the cases of issue #48, with exllamav3 1.6.5's figures beside.

Run from the repository root on a GPU: PYTHONPATH=src:bench python bench/quant.py [--out PATH]
  default: the error table (2 cases x codebooks x K2..K5, 20 encodings of 1024x768), then the time of one
  1024x768 K4 encoding per backend, the time against the tile count and K (--no-scaling skips it) and a
  Qwen3-30B-A3B MoE layer (--experts N; 0 skips it).
"""

import argparse
import json
import os
import time

import torch

from exl3moe.quant import quantize_weight, quantize_weights, trellis
from results_io import save_results

IN, OUT, ROWS = 1024, 768, 8192
# exllamav3 1.6.5 quantize_exl3 proxy error on the H200 (issue #48): case -> codebook -> {K: error}
EXLLAMAV3 = {
    "gaussian": {"mcg": {2: 0.0644, 3: 0.0163, 4: 0.00425, 5: 0.00112},
                 "mul1": {2: 0.0643, 3: 0.0163, 4: 0.00418, 5: 0.00108},
                 "3inst": {2: 0.0648, 3: 0.0167, 4: 0.00433, 5: 0.00113}},
    "heavy": {"mcg": {2: 0.0252, 3: 0.00599, 4: 0.00152, 5: 0.00039},
              "mul1": {2: 0.0249, 3: 0.00591, 4: 0.00146, 5: 0.00039}},
}
RESULT_KEY = ("case", "codebook", "K", "variant")
CASE_TEXT = {
    "gaussian": "W iid N(0,1) [1024, 768]; X iid N(0,1) [8192, 1024]; H = X^T X / 8192",
    "heavy": "W iid N(0,1) x exp(N(0,1)) per row, 8 random columns x6; X = Z (I + 0.5 G / 32) x exp(N(0, 0.5^2)) per "
             "column, Z and G iid N(0,1); H = X^T X / 8192 (our reading of the issue's description)",
}


def make_case(case: str, seed: int = 0):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    randn = lambda *shape: torch.randn(*shape, device="cuda", generator=gen, dtype=torch.float32)  # noqa: E731
    W = randn(IN, OUT)
    Z = randn(ROWS, IN)
    if case == "gaussian":
        X = Z
    else:
        W = W * randn(IN).exp()[:, None]
        cols = torch.randperm(OUT, device="cuda", generator=gen)[:8]
        W[:, cols] *= 6
        X = (Z @ (torch.eye(IN, device="cuda") + 0.5 * randn(IN, IN) / IN ** 0.5)) * (0.5 * randn(IN)).exp()[None, :]
    H = (X.double().T @ X.double()) / ROWS
    return W, H


def run_case(case, codebook, K, W, H, variant, options):
    torch.cuda.synchronize()
    _, stats = quantize_weight(W, H, K=K, codebook=codebook, seed=0, **options)
    reference = EXLLAMAV3.get(case, {}).get(codebook, {}).get(K)
    return {"case": case, "codebook": codebook, "K": K, "variant": variant, "proxy_error": stats.proxy_error,
            "seconds": round(stats.seconds, 3), "gaussian_bound": 2.0 ** (-2 * K), "exllamav3": reference,
            "ratio_to_exllamav3": None if reference is None else stats.proxy_error / reference,
            "global_scale": stats.global_scale, **stats.counters}


VARIANTS = {"default": {}, "no_out_scales": {"out_scales": False}, "damp_0.01": {"damp": 0.01},
            "inexact": {"exact": False}, "sweep": {"sweeps": 1}, "rms_scales": {"channel_power": 1.0}}


def timed(fn):
    torch.cuda.synchronize()
    start = time.perf_counter()
    out = fn()
    torch.cuda.synchronize()
    return out, time.perf_counter() - start


def backend_times(W, H):
    """One 1024x768 K4 mcg encoding per trellis backend (the torch passes are the CPU path)."""
    rows = []
    for backend in ("triton", "torch"):
        trellis.BACKEND = backend
        (_, stats), seconds = timed(lambda: quantize_weight(W, H, K=4, codebook="mcg"))
        rows.append({"case": "backend", "backend": backend, "K": 4, "codebook": "mcg", "variant": backend,
                     "seconds": round(seconds, 3), "proxy_error": stats.proxy_error})
    trellis.BACKEND = "auto"
    return rows


def scaling_times():
    """Seconds against the tile count (K4) and against K (1024x768), iid Gaussian W and H."""
    rows = []
    for (k, n), K in [((256, 256), 4), ((512, 512), 4), ((1024, 768), 4), ((2048, 2048), 4)] + \
            [((1024, 768), K) for K in (1, 2, 3, 5, 6, 8)]:
        gen = torch.Generator(device="cuda").manual_seed(1)
        W = torch.randn(k, n, device="cuda", generator=gen)
        X = torch.randn(4 * k, k, device="cuda", generator=gen)
        (_, stats), seconds = timed(lambda: quantize_weight(W, X.T @ X / X.shape[0], K=K, codebook="mcg"))
        rows.append({"case": "scaling", "k": k, "n": n, "tiles": k * n // 256, "K": K, "codebook": "mcg",
                     "variant": f"{k}x{n}", "seconds": round(seconds, 3), "proxy_error": stats.proxy_error,
                     **stats.counters})
    return rows


def layer_times(experts: int, K: float = 4, codebook: str = "mcg"):
    """A Qwen3-30B-A3B MoE layer: gate and up [2048, 768] and down [768, 2048] per expert, each projection's
    experts in one quantize_weights call; each expert's H from shared inputs with its own column scales."""
    gen = torch.Generator(device="cuda").manual_seed(2)
    rows, total = [], 0.0
    for proj, (k, n) in (("gate", (2048, 768)), ("up", (2048, 768)), ("down", (768, 2048))):
        X = torch.randn(2 * k, k, device="cuda", generator=gen, dtype=torch.float64)
        base = X.T @ X / X.shape[0]
        Ws, Hs = [], []
        for _ in range(experts):
            c = (0.3 * torch.randn(k, device="cuda", generator=gen, dtype=torch.float64)).exp()
            Ws.append(torch.randn(k, n, device="cuda", generator=gen))
            Hs.append(c[:, None] * base * c[None, :])
        results, seconds = timed(lambda: quantize_weights(Ws, Hs, K=K, codebook=codebook))
        total += seconds
        errors = [s.proxy_error for _, s in results]
        rows.append({"case": "layer", "projection": proj, "experts": experts, "k": k, "n": n, "K": K,
                     "codebook": codebook, "variant": f"{proj}x{experts}", "seconds": round(seconds, 3),
                     "proxy_error_mean": sum(errors) / len(errors), "proxy_error_max": max(errors)})
        del Ws, Hs, results
    rows.append({"case": "layer", "projection": "all", "experts": experts, "K": K, "codebook": codebook,
                 "variant": f"allx{experts}", "seconds": round(total, 3)})
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results", "quant_h200.json"))
    ap.add_argument("--cases", nargs="+", default=["gaussian", "heavy"])
    ap.add_argument("--K", nargs="+", type=float, default=[2, 3, 4, 5])
    ap.add_argument("--codebooks", nargs="+", default=["mcg", "mul1", "3inst"])
    ap.add_argument("--variants", nargs="+", default=["default", "rms_scales"], choices=sorted(VARIANTS),
                    help="rms_scales: channel scales by RMS (exllamav3's choice) instead of (RMS^2 / diag H)^(1/4)")
    ap.add_argument("--merge", action="store_true", help="keep the file's entries this run does not replace")
    ap.add_argument("--no-scaling", action="store_true", help="skip the backend and scaling timings")
    ap.add_argument("--experts", type=int, default=128, help="experts of the MoE layer timing (0: skip it)")
    args = ap.parse_args()
    quantize_weight(torch.randn(128, 128, device="cuda"), K=2, scale_tiles=4)  # warm-up: CUDA, codebook tables
    results = []
    for case in args.cases:
        W, H = make_case(case)
        for codebook in args.codebooks:
            if codebook not in EXLLAMAV3[case]:
                continue
            for K in args.K:
                K = int(K) if K == int(K) else K
                for variant in args.variants:
                    t = time.perf_counter()
                    results.append(run_case(case, codebook, K, W, H, variant, VARIANTS[variant]))
                    print(json.dumps(results[-1]), f"wall {time.perf_counter() - t:.1f}s", flush=True)
                    save_results(args.out, results, RESULT_KEY, merge=args.merge)
    extra = []
    if not args.no_scaling:
        extra += backend_times(*make_case("gaussian")) + scaling_times()
    if args.experts:
        extra += layer_times(args.experts)
    for row in extra:
        print(json.dumps(row), flush=True)
        results.append(row)
        save_results(args.out, results, RESULT_KEY, merge=args.merge)
    ratios = [r["ratio_to_exllamav3"] for r in results if r.get("ratio_to_exllamav3") and r["variant"] == "default"]
    if ratios:
        print(f"mean ratio to exllamav3 over {len(ratios)} entries: {sum(ratios) / len(ratios):.4f}; "
              f"max {max(ratios):.4f}")
    with open(args.out) as fh:
        doc = json.load(fh)
    doc["cases"] = CASE_TEXT
    with open(args.out, "w") as fh:
        json.dump(doc, fh, indent=1)


if __name__ == "__main__":
    main()
