"""Proxy error and time of quantize_weight on the cases of issue #48, with exllamav3 1.6.5's figures beside.

Run from the repository root on a GPU: PYTHONPATH=src:bench python bench/quant.py [--out PATH]
  default: the error table (2 cases x codebooks x K2..K5, 20 encodings of 1024x768), then the time of one
  1024x768 K4 encoding per backend and Triton search (--searches), the time against the tile count and K
  (--no-scaling skips it) and a Qwen3-30B-A3B MoE layer (--experts N; 0 skips it). Timing rows carry
  phase_seconds and part_seconds, the encoder's time per phase and in the passes and tracebacks, measured with the
  device synchronised at phase boundaries (docs/quant.md, Speed), and a table of them is printed at the end.
  --profile: only torch.profiler on one 1024x768 K4 encoding per search; the top kernels and ops by device and by
  host time go to --profile-out.
"""

import argparse
import json
import os
import time

import torch

from exl3moe.quant import quantize_weight, quantize_weights, trellis
from exl3moe.quant.phases import PHASES
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


def use(backend: str, search: str = "global") -> None:
    trellis.BACKEND, trellis.SEARCH = backend, search


_WARM: set = set()


def warm(K) -> None:
    """One small encoding at K under the current backend and search, so that no timing includes a compile."""
    key = (trellis.BACKEND, trellis.SEARCH, K)
    if key not in _WARM:
        quantize_weight(torch.randn(128, 128, device="cuda"), K=K, scale_tiles=4)
        _WARM.add(key)


def breakdown(stats) -> dict:
    """phase_seconds (exclusive, summing to the call) and part_seconds (the passes, the tracebacks: inclusive)."""
    return {"phase_seconds": {name: round(stats.phase_seconds.get(name, 0.0), 4) for name in PHASES},
            "part_seconds": {name: round(value, 4) for name, value in stats.part_seconds.items()}}


def backend_times(W, H, searches):
    """One 1024x768 K4 mcg encoding per Triton search and with the torch passes (the CPU path): timed plainly, then
    again with the device synchronised at phase boundaries for the breakdown; trellis compared with the first."""
    rows, first = [], None
    for backend, search in [("triton", s) for s in searches] + [("torch", "global")]:
        use(backend, search)
        warm(4)
        (weight, stats), seconds = timed(lambda: quantize_weight(W, H, K=4, codebook="mcg"))
        (_, synced), synced_seconds = timed(lambda: quantize_weight(W, H, K=4, codebook="mcg", sync_phases=True))
        first = weight.trellis if first is None else first
        rows.append({"case": "backend", "backend": backend, "search": search, "K": 4, "codebook": "mcg",
                     "variant": backend if backend == "torch" else f"triton-{search}", "seconds": round(seconds, 3),
                     "seconds_synced": round(synced_seconds, 3), "proxy_error": stats.proxy_error,
                     "same_trellis": bool(torch.equal(weight.trellis, first)), **breakdown(synced),
                     **synced.counters})
    use("auto")
    return rows


def scaling_times(searches):
    """Seconds against the tile count (K4) and against K (1024x768), iid Gaussian W and H, per Triton search."""
    rows = []
    for search in searches:
        use("auto", search)
        for (k, n), K in [((256, 256), 4), ((512, 512), 4), ((1024, 768), 4), ((2048, 2048), 4)] + \
                [((1024, 768), K) for K in (1, 2, 3, 5, 6, 8)]:
            warm(K)
            gen = torch.Generator(device="cuda").manual_seed(1)
            W = torch.randn(k, n, device="cuda", generator=gen)
            X = torch.randn(4 * k, k, device="cuda", generator=gen)
            (_, stats), seconds = timed(lambda: quantize_weight(W, X.T @ X / X.shape[0], K=K, codebook="mcg",
                                                                sync_phases=True))
            rows.append({"case": "scaling", "k": k, "n": n, "tiles": k * n // 256, "K": K, "codebook": "mcg",
                         "search": search, "variant": f"{k}x{n}-{search}", "seconds": round(seconds, 3),
                         "proxy_error": stats.proxy_error, **breakdown(stats), **stats.counters})
    use("auto")
    return rows


def profile_encoding(W, H, searches, top: int = 25) -> list:
    """torch.profiler over one K4 mcg encoding per search (after a warm-up one): the top ops by device and by host
    self time."""
    from torch.profiler import ProfilerActivity, profile
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if W.is_cuda else [])
    rows = []
    for search in searches:
        use("auto", search)
        quantize_weight(W, H, K=4, codebook="mcg")
        with profile(activities=activities) as prof:
            _, stats = quantize_weight(W, H, K=4, codebook="mcg")
            if W.is_cuda:
                torch.cuda.synchronize()
        events = prof.key_averages()
        rows.append({"search": search, "seconds": round(stats.seconds, 3), **breakdown(stats),
                     "device_ms_total": round(sum(device_us(e) for e in events) / 1e3, 3),
                     "host_ms_total": round(sum(e.self_cpu_time_total for e in events) / 1e3, 3),
                     "top_device": [entry(e) for e in sorted(events, key=device_us, reverse=True)[:top]],
                     "top_host": [entry(e) for e in sorted(events, key=lambda e: e.self_cpu_time_total,
                                                          reverse=True)[:top]]})
        print(f"search={search}: {stats.seconds:.3f} s")
        for e in rows[-1]["top_device" if W.is_cuda else "top_host"]:
            print(f"  {e['self_device_ms']:10.3f} ms device {e['self_host_ms']:10.3f} ms host {e['calls']:7d}  "
                  f"{e['name']}")
    use("auto")
    return rows


def device_us(event) -> float:
    """An op's self time on the device in microseconds (the attribute's name depends on the torch version)."""
    return getattr(event, "self_device_time_total", None) or getattr(event, "self_cuda_time_total", 0) or 0


def entry(event) -> dict:
    return {"name": event.key[:120], "calls": event.count, "self_device_ms": round(device_us(event) / 1e3, 3),
            "self_host_ms": round(event.self_cpu_time_total / 1e3, 3)}


def print_phase_table(rows) -> None:
    timed_rows = [r for r in rows if "phase_seconds" in r]
    if not timed_rows:
        return
    parts = ("passes", "tracebacks")
    print(f"{'row':28s} {'total':>8s} " + " ".join(f"{name[:12]:>12s}" for name in PHASES + parts))
    for r in timed_rows:
        total = r.get("seconds_synced", r["seconds"])
        print(f"{r['case'] + ':' + str(r['variant']) + ':K' + str(r['K']):28s} {total:8.3f} "
              + " ".join(f"{r['phase_seconds'][name]:12.4f}" for name in PHASES) + " "
              + " ".join(f"{r.get('part_seconds', {}).get(name, 0.0):12.4f}" for name in parts))


def layer_times(experts: int, K: float = 4, codebook: str = "mcg", search: str = "global"):
    """A Qwen3-30B-A3B MoE layer: gate and up [2048, 768] and down [768, 2048] per expert, each projection's
    experts in one quantize_weights call; each expert's H from shared inputs with its own column scales."""
    gen = torch.Generator(device="cuda").manual_seed(2)
    use("auto", search)
    warm(K)
    rows, total = [], 0.0
    for proj, (k, n) in (("gate", (2048, 768)), ("up", (2048, 768)), ("down", (768, 2048))):
        X = torch.randn(2 * k, k, device="cuda", generator=gen, dtype=torch.float64)
        base = X.T @ X / X.shape[0]
        Ws, Hs = [], []
        for _ in range(experts):
            c = (0.3 * torch.randn(k, device="cuda", generator=gen, dtype=torch.float64)).exp()
            Ws.append(torch.randn(k, n, device="cuda", generator=gen))
            Hs.append(c[:, None] * base * c[None, :])
        results, seconds = timed(lambda: quantize_weights(Ws, Hs, K=K, codebook=codebook, sync_phases=True))
        total += seconds
        errors = [s.proxy_error for _, s in results]
        rows.append({"case": "layer", "projection": proj, "experts": experts, "k": k, "n": n, "K": K,
                     "codebook": codebook, "search": search, "variant": f"{proj}x{experts}-{search}",
                     "seconds": round(seconds, 3), "proxy_error_mean": sum(errors) / len(errors),
                     "proxy_error_max": max(errors), **breakdown(results[0][1]),
                     **results[0][1].counters})
        del Ws, Hs, results
    rows.append({"case": "layer", "projection": "all", "experts": experts, "K": K, "codebook": codebook,
                 "search": search, "variant": f"allx{experts}-{search}", "seconds": round(total, 3)})
    use("auto")
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
    ap.add_argument("--searches", nargs="+", default=["global", "onchip"], choices=["global", "onchip"],
                    help="Triton pass kernels to time (trellis.SEARCH); the error table uses the default")
    ap.add_argument("--layer-searches", nargs="+", default=["onchip"], choices=["global", "onchip"],
                    help="Triton pass kernels for the MoE layer timing")
    ap.add_argument("--profile", action="store_true", help="only profile one 1024x768 K4 encoding per search")
    ap.add_argument("--profile-out", default=os.path.join(os.path.dirname(__file__), "results",
                                                          "quant_profile_h200.json"))
    args = ap.parse_args()
    for search in args.searches:  # warm-up: CUDA, codebook tables, each search's kernels at K2 and K4
        use("auto", search)
        warm(2)
        warm(4)
    use("auto")
    if args.profile:
        rows = profile_encoding(*make_case("gaussian"), args.searches)
        save_results(args.profile_out, rows, ("search",), merge=args.merge)
        return
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
        extra += backend_times(*make_case("gaussian"), args.searches) + scaling_times(args.searches)
    if args.experts:
        extra += [row for search in args.layer_searches for row in layer_times(args.experts, search=search)]
    for row in extra:
        print(json.dumps(row), flush=True)
        results.append(row)
        save_results(args.out, results, RESULT_KEY, merge=args.merge)
    print_phase_table(results)
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
