"""Benchmark helpers: CUDA-graph timing over rotating copies, run metadata."""

import datetime
import statistics

import torch
import triton

L2_ROTATION_BYTES = 240 << 20  # four times the H200's 60 MB L2, so every call reads from HBM


def copies_for(bytes_per_copy: int, at_least: int = 2, at_most: int = 64) -> int:
    return max(at_least, min(at_most, -(-L2_ROTATION_BYTES // max(1, bytes_per_copy))))


def time_graph(calls, replays: int = 20) -> float:
    """Median microseconds per call: all `calls` captured in one CUDA graph, replayed `replays` times."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for fn in calls:
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for fn in calls:
            fn()
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1000.0 / len(calls))
    return statistics.median(times)


def run_info() -> dict:
    return {"gpu": torch.cuda.get_device_name(), "date": datetime.date.today().isoformat(),
            "torch": torch.__version__, "triton": triton.__version__}
