"""GPU timing for benchmarks: CUDA-graph replays over rotating copies, and run metadata."""

import datetime
import statistics

import torch
import triton

L2_ROTATION_BYTES = 240 << 20  # four times the H200's 60 MB L2, so every call reads from HBM


def copies_for(bytes_per_copy: int, at_least: int = 2, at_most: int = 1024) -> int:
    return max(at_least, min(at_most, -(-L2_ROTATION_BYTES // max(1, bytes_per_copy))))


def capture_graph(calls, capture_error_mode: str = "global") -> torch.cuda.CUDAGraph:
    """All `calls` run once on a side stream, then captured in one CUDA graph (replayed once); capture_error_mode as
    torch.cuda.graph's ("thread_local" lets other threads, e.g. NCCL's watchdog, call CUDA meanwhile)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for fn in calls:
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, capture_error_mode=capture_error_mode):
        for fn in calls:
            fn()
    graph.replay()
    torch.cuda.synchronize()
    return graph


def replay_times(graph: torch.cuda.CUDAGraph, calls: int, replays: int) -> list:
    """Microseconds per call of each of `replays` replays of a graph of `calls` calls."""
    times = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1000.0 / calls)
    return times


def time_graph(calls, replays: int = 20) -> float:
    """Median microseconds per call: all `calls` captured in one CUDA graph, replayed `replays` times."""
    return statistics.median(replay_times(capture_graph(calls), len(calls), replays))


def run_info() -> dict:
    return {"gpu": torch.cuda.get_device_name(), "date": datetime.date.today().isoformat(),
            "torch": torch.__version__, "triton": triton.__version__}


def quick_linear_bench(console) -> None:
    """Time a 4096x14336 K=4 MCG linear at 1, 8 and 128 rows against fp16 torch.matmul, on this GPU."""
    from rich.table import Table

    from .format.weight import EXL3Weight
    from .ops.linear import LinearPlan

    k, n = 4096, 14336
    gen = torch.Generator(device="cuda").manual_seed(0)
    weights = [EXL3Weight(torch.randint(-32768, 32767, (k // 16, n // 16, 64), dtype=torch.int16, device="cuda",
                                        generator=gen), torch.ones(k, device="cuda").half(),
                          torch.ones(n, device="cuda").half(), "mcg") for _ in range(copies_for(k * n // 2))]
    dense = [torch.randn(k, n, device="cuda", dtype=torch.float16, generator=gen) for _ in range(copies_for(k * n * 2))]
    table = Table(title=f"linear 4096x14336 K=4 mcg on {torch.cuda.get_device_name()}")
    for col in ("rows", "exl3moe us", "fp16 matmul us", "ratio"):
        table.add_column(col)
    for rows in (1, 8, 128):
        x = torch.randn(rows, k, device="cuda", dtype=torch.float16, generator=gen)
        out = torch.empty(rows, n, device="cuda", dtype=torch.float16)
        plan = LinearPlan(weights[0], rows)
        workspace = plan.allocate()
        runners = [LinearPlan(w, rows).bind(workspace) for w in weights]
        us = time_graph([lambda r=r: r.run(x, out) for r in runners])
        fp16 = time_graph([lambda w=w: torch.matmul(x, w, out=out) for w in dense])
        table.add_row(str(rows), f"{us:.1f}", f"{fp16:.1f}", f"{us / fp16:.2f}")
    console.print(table)
