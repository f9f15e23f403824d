"""Ratios, the issue's targets, a table and a plot of bench/parallel.py's rows."""

LARGE_TOKENS, LARGE_TARGET = 1024, 0.6   # at >= 1024 tokens a split should take at most 0.6x one GPU's time
SMALL_TOKENS = 16                        # at 1-16 tokens: which split wins, and is the all-reduce most of it


def with_ratios(results: list) -> list:
    """The rows with `ratio` (to one GPU's time at the same shape and tokens) and, for splits, `collective_share`
    (the all-reduce alone over the split's time)."""
    one = {(r["shape"], r["tokens"]): r["us"] for r in results if r["mode"] == "one"}
    out = []
    for r in results:
        base = one[(r["shape"], r["tokens"])]
        extra = {"ratio": round(r["us"] / base, 4) if base > 0 else float("inf")}
        if "collective_us" in r:
            extra["collective_share"] = round(r["collective_us"] / r["us"], 4) if r["us"] > 0 else float("inf")
        out.append({**r, **extra})
    return out


def _points(results: list) -> dict:
    """{(shape, tokens): {mode: row}} in measured order."""
    points = {}
    for r in results:
        points.setdefault((r["shape"], r["tokens"]), {})[r["mode"]] = r
    return points


def summarize(results: list, world: int) -> dict:
    """The issue's two targets, judged on rows that carry ratios (with_ratios)."""
    splits = (f"tp{world}", f"ep{world}")
    large, small = [], []
    for (shape, T), modes in _points(results).items():
        best = min(splits, key=lambda m: modes[m]["us"])
        if T >= LARGE_TOKENS:
            ratio = modes[best]["ratio"]
            large.append(dict(shape=shape, tokens=T, best=best, ratio=ratio, met=ratio <= LARGE_TARGET))
        if T <= SMALL_TOKENS:
            shares = {m: modes[m]["collective_share"] for m in splits}
            small.append(dict(shape=shape, tokens=T, winner=best, winner_ratio=modes[best]["ratio"],
                              beats_one_gpu=modes[best]["ratio"] < 1.0, collective_us=modes[best]["collective_us"],
                              collective_share={m: shares[m] for m in splits},
                              collective_dominates=shares[best] >= 0.5))
    return {"large_tokens": {"target": f"at >= {LARGE_TOKENS} tokens, {' or '.join(splits)} at most "
                                       f"{LARGE_TARGET}x one GPU's time",
                             "met": all(p["met"] for p in large) if large else None, "points": large},
            "small_tokens": {"question": f"at 1-{SMALL_TOKENS} tokens, which split wins and whether the all-reduce "
                                         "is at least half of its time",
                             "points": small}}


def print_table(doc: dict) -> None:
    world = doc["world_size"]
    splits = (f"tp{world}", f"ep{world}")
    print(f"{doc['gpu']} x{world}, torch {doc['torch']}, nccl {doc.get('nccl')}, graphs {doc['graphs']}")
    heads = "".join(f"{m + ' us':>11s}{'ratio':>7s}{'coll':>6s}" for m in splits)
    print(f"{'shape':16s}{'tokens':>7s}{'one us':>10s}{heads}{'allreduce us':>14s}  experts")
    for (shape, T), modes in _points(doc["results"]).items():
        cells = "".join(f"{modes[m]['us']:11.1f}{modes[m]['ratio']:7.2f}{modes[m]['collective_share']:6.2f}"
                        for m in splits)
        kernels = "/".join(sorted({k for r in modes.values() for k in r.get("experts", [])}))
        print(f"{shape:16s}{T:7d}{modes['one']['us']:10.1f}{cells}{modes[splits[0]]['collective_us']:14.1f}  {kernels}")
    large = doc["summary"]["large_tokens"]
    print(f"target: {large['target']}: {'met' if large['met'] else 'NOT met' if large['met'] is False else 'n/a'}")
    for p in doc["summary"]["small_tokens"]["points"]:
        print(f"  {p['shape']} T={p['tokens']}: {p['winner']} wins ({p['winner_ratio']:.2f}x one GPU), all-reduce "
              f"{p['collective_share'][p['winner']]:.0%} of it{' (dominates)' if p['collective_dominates'] else ''}")
    for c in doc.get("determinism", []):
        print(f"  determinism {c['shape']} T={c['tokens']} {c['mode']}: "
              f"{'identical' if c['identical'] else 'DIFFERENT'} bytes run to run, {c['vs_one_gpu_rel_l2']:.1e} "
              "rel L2 to one GPU")


def plot(doc: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    world = doc["world_size"]
    shapes = list(dict.fromkeys(r["shape"] for r in doc["results"]))
    fig, axes = plt.subplots(2, len(shapes), figsize=(6 * len(shapes), 8), squeeze=False)
    for col, shape in enumerate(shapes):
        rows = [r for r in doc["results"] if r["shape"] == shape]
        top, bottom = axes[0][col], axes[1][col]
        for mode, style in (("one", "k-"), (f"tp{world}", "o-"), (f"ep{world}", "s-")):
            sel = sorted((r for r in rows if r["mode"] == mode), key=lambda r: r["tokens"])
            label = "one GPU, whole layer" if mode == "one" else f"{mode.upper()} with its all-reduce"
            top.plot([r["tokens"] for r in sel], [r["us"] for r in sel], style, label=label)
            if mode != "one":
                bottom.plot([r["tokens"] for r in sel], [r["ratio"] for r in sel], style, label=mode.upper())
        coll = sorted({(r["tokens"], r["collective_us"]) for r in rows if "collective_us" in r})
        top.plot([t for t, _ in coll], [u for _, u in coll], "k:", label="fp32 all-reduce alone")
        bottom.axhline(1.0, color="k", lw=0.8)
        bottom.axhline(LARGE_TARGET, color="r", ls=":", label=f"target {LARGE_TARGET}x (>= {LARGE_TOKENS} tokens)")
        top.set(xscale="log", yscale="log", xlabel="tokens", ylabel="us", title=f"{shape} on {doc['gpu']} x{world}")
        bottom.set(xscale="log", xlabel="tokens", ylabel="time / one GPU's")
        top.legend(fontsize=7)
        bottom.legend(fontsize=7)
    fig.savefig(path, dpi=110, bbox_inches="tight")
