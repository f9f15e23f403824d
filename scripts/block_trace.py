"""Per-block timelines of the mma.sync kernels (BLOCK_TRACE builds: thread 0 of every block prints globaltimer at its
start and end and SM cycles at its phase marks) for one uncaptured call on weights not yet in L2. Prints per kernel:
blocks, the spread of block starts, the span, and median / max cycles at each mark (0 tables read, 1 first chunk
staged, 2 partials stored, 3 arrival counted, 4 epilogue done, 5 combine done), the last blocks' apart.
Usage: python3 scripts/block_trace.py [--warm]   (--warm, without a GPU: notes the traced variants, then compiles
every variant noted in the cache directory, as scripts/warm_cache.py does)"""

import ctypes
import os
import statistics
import sys
import tempfile

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "bench"))
os.environ["EXL3MOE_NVRTC_DEFINES"] = "BLOCK_TRACE=1"

LINEAR_CASES = [((768, 2048), "mcg", 1), ((768, 2048), "mcg", 8), ((1408, 4096), "mul1", 8), ((4096, 14336), "mcg", 1)]
MOE_CASES = [("qwen3-30b-a3b", 1), ("qwen3-30b-a3b", 4), ("glm-4.5-air", 1)]
KERNELS = {0: "linear", 1: "moe gate_up", 2: "moe down"}
MARKS = ("tables", "staged", "stored", "arrived", "epilogue", "combine")


def captured(call) -> str:
    """What the device printed (C stdout) during call() and a synchronize."""
    libc = ctypes.CDLL(None)
    sys.stdout.flush()
    libc.fflush(None)
    saved = os.dup(1)
    with tempfile.TemporaryFile() as tmp:
        os.dup2(tmp.fileno(), 1)
        try:
            call()
            torch.cuda.synchronize()
            libc.fflush(None)
        finally:
            os.dup2(saved, 1)
            os.close(saved)
        tmp.seek(0)
        return tmp.read().decode(errors="replace")


def report(name: str, text: str) -> None:
    rows = [list(map(int, line.split()[1:])) for line in text.splitlines() if line.startswith("TR ")]
    t_first = min(r[5] for r in rows)
    for kernel in sorted({r[0] for r in rows}):
        ks = [r for r in rows if r[0] == kernel]
        starts = sorted(r[5] - t_first for r in ks)
        ends = [r[6] - t_first for r in ks]
        print(f"{name} | {KERNELS[kernel]}: {len(ks)} blocks on {len({r[4] for r in ks})} SMs, starts {starts[0]}.."
              f"{starts[len(starts) // 2]}..{starts[-1]} ns, last end {max(ends)} ns")
        last = [r for r in ks if r[11] > 0]
        for label, group in (("all", ks), ("last", last)):
            marks = [f"{m} {statistics.median(r[7 + i] for r in group):.0f}/{max(r[7 + i] for r in group)}"
                     for i, m in enumerate(MARKS) if any(r[7 + i] for r in group)]
            print(f"    {label} {len(group)}: cycles median/max: " + ", ".join(marks))


def linear_case(k, n, codebook, rows, gen):
    from linear import random_weight

    from exl3moe.ops.linear import LinearPlan
    weights = [random_weight(k, n, 4, codebook, gen) for _ in range(2)]
    x = torch.randn(rows, k, device="cuda", dtype=torch.float16, generator=gen)
    out = torch.empty(rows, n, device="cuda", dtype=torch.float16)
    plan = LinearPlan(weights[0], rows)
    workspace = plan.allocate()
    runners = [LinearPlan(w, rows).bind(workspace) for w in weights]
    return [lambda r=r: r.run(x, out) for r in runners]


def moe_case(shape, tokens, gen):
    from moe import SHAPES, random_layer, routings

    from exl3moe.ops.moe import moe_plan
    hidden, inter, E, top_k = SHAPES[shape]
    layer = random_layer(hidden, inter, E, [4], "mcg", gen)
    plan = moe_plan(layer, tokens, top_k)
    runner = plan.bind(plan.allocate())
    x = (torch.randn(tokens, hidden, device="cuda", generator=gen) * 0.3).half()
    out = torch.empty(tokens, hidden, device="cuda", dtype=torch.float16)
    return [lambda r=r: runner.run(x, r[0], r[1], out) for r in routings(tokens, E, top_k, gen)[:2]]


def main() -> None:
    if "--warm" in sys.argv:
        import note_variants
        note_variants.pretend_sm90()
        from note_variants import layer, weight

        from exl3moe.ops.linear import LinearPlan
        from exl3moe.ops.moe import moe_plan
        for (k, n), codebook, rows in LINEAR_CASES:
            LinearPlan(weight(k, n, 4, codebook), rows)
        for shape, tokens in MOE_CASES:
            from moe import SHAPES
            hidden, inter, E, top_k = SHAPES[shape]
            moe_plan(layer(hidden, inter, E, [4]), tokens, top_k)
        from exl3moe.kernels import nvrtc
        print("compiled %d, cached %d" % nvrtc.rebuild_variants())
        return
    gen = torch.Generator(device="cuda").manual_seed(0)
    cases = [(f"linear {k}x{n} {cb} rows {rows}", linear_case(k, n, cb, rows, gen))
             for (k, n), cb, rows in LINEAR_CASES]
    cases += [(f"moe {shape} T={tokens}", moe_case(shape, tokens, gen)) for shape, tokens in MOE_CASES]
    for name, (warm, traced) in cases:
        captured(warm)
        report(name, captured(traced))


if __name__ == "__main__":
    main()
