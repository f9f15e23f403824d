"""Model benchmark on a GPU: prefill and decode tokens/s of a transformers causal LM, peak memory, and the
share of a decode step spent in exl3moe's kernels (torch.profiler).

Prefill: one forward of [1, L] tokens (a fresh dynamic cache, only the last position's logits), median of a
few runs after a warm-up. Decode: generate() with a static cache from a [B, context] prompt, greedy, a fixed
number of new tokens; the time of N + steps tokens minus that of N tokens, over steps, is one decode step as
generate() runs it (CUDA-graph replays where the model has DecodeGraphs installed, see graphs.py).
"""

from __future__ import annotations

import os
import re
import statistics
import time
from functools import lru_cache

import torch

KERNEL_DIR = os.path.join(os.path.dirname(os.path.dirname(__file__)), "kernels")
WARMUP_TOKENS = 4


@lru_cache(maxsize=1)
def exl3moe_kernel_names() -> tuple:
    """Names of every Triton and CUDA kernel exl3moe defines (the profiler reports kernels by these names)."""
    names = set()
    for root, _, files in os.walk(KERNEL_DIR):
        for name in files:
            with open(os.path.join(root, name), encoding="utf-8") as f:
                text = f.read()
            if name.endswith(".py"):
                names.update(re.findall(r"@triton\.jit[^\n]*\n(?:@[^\n]*\n)*def (\w+)", text))
            elif name.endswith((".cu", ".cuh")):
                names.update(re.findall(r"__global__[^\n]*\n(\w+)\(", text))
    return tuple(sorted(names))


def is_exl3moe_kernel(name: str) -> bool:
    """Triton and NVRTC kernels are reported under their function names exactly."""
    return name in exl3moe_kernel_names()


def _seconds(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _tokens(vocab: int, batch: int, length: int, seed: int) -> torch.Tensor:
    g = torch.Generator(device="cuda").manual_seed(seed)
    return torch.randint(0, vocab, (batch, length), device="cuda", generator=g)


@torch.no_grad()
def prefill_rate(model, length: int, vocab: int, repeats: int = 3) -> dict:
    ids = _tokens(vocab, 1, length, seed=length)

    def run():
        model(input_ids=ids, use_cache=True, logits_to_keep=1)
    run()
    seconds = _seconds(run, repeats)
    return {"tokens": length, "seconds": seconds, "tokens_per_s": length / seconds}


def _generate(model, prompt: torch.Tensor, new_tokens: int):
    return model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=new_tokens,
                          min_new_tokens=new_tokens, do_sample=False, cache_implementation="static",
                          pad_token_id=0)


@torch.no_grad()
def decode_rate(model, batch: int, context: int, steps: int, vocab: int, repeats: int = 3) -> dict:
    prompt = _tokens(vocab, batch, context, seed=batch)
    graphs = getattr(model, "decode_graphs", None)
    _generate(model, prompt, WARMUP_TOKENS + steps)     # compiles, sizes the static cache's length
    replays = graphs.replays if graphs is not None else 0
    short = _seconds(lambda: _generate(model, prompt, WARMUP_TOKENS), repeats)
    long = _seconds(lambda: _generate(model, prompt, WARMUP_TOKENS + steps), repeats)
    step = (long - short) / steps
    result = {"batch": batch, "context": context, "step_ms": step * 1e3, "tokens_per_s": batch / step,
              "cuda_graphs": bool(graphs is not None and graphs.replays > replays)}
    if graphs is not None and graphs.failed:
        result["graph_failures"] = sorted(set(graphs.failed.values()))[:2]
    return result


def _kernel_ms(fn) -> dict:
    """{kernel name: (device milliseconds, launches)} of one call of fn, from the profiler."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    kernels: dict = {}
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            us = getattr(event, "device_time", None)
            ms, calls = kernels.get(event.name, (0.0, 0))
            kernels[event.name] = (ms + (event.cuda_time if us is None else us) / 1e3, calls + 1)
    return kernels


TOP_KERNELS = 12


@torch.no_grad()
def decode_kernel_share(model, batch: int, context: int, steps: int, vocab: int, step_ms: float) -> dict:
    """Kernel time of one decode step: generate() of N + steps tokens minus N tokens, eager steps (a graph's
    kernels are the captured ones), under the profiler; the kernels that take most of it, by name."""
    prompt = _tokens(vocab, batch, context, seed=batch)
    graphs = getattr(model, "decode_graphs", None)
    if graphs is not None:
        graphs.enabled = False
    try:
        short = _kernel_ms(lambda: _generate(model, prompt, WARMUP_TOKENS))
        long = _kernel_ms(lambda: _generate(model, prompt, WARMUP_TOKENS + steps))
    finally:
        if graphs is not None:
            graphs.enabled = True
    per_step = {name: ((ms - short.get(name, (0.0, 0))[0]) / steps, (calls - short.get(name, (0.0, 0))[1]) / steps)
                for name, (ms, calls) in long.items()}
    ours = sum(ms for name, (ms, _) in per_step.items() if is_exl3moe_kernel(name))
    other = sum(ms for name, (ms, _) in per_step.items() if not is_exl3moe_kernel(name))
    top = sorted(per_step.items(), key=lambda item: -item[1][0])[:TOP_KERNELS]
    return {"exl3moe_kernels_ms": ours, "other_kernels_ms": other, "step_ms": step_ms,
            "exl3moe_share_of_step": ours / step_ms, "step_over_kernel_sum": step_ms / max(ours + other, 1e-9),
            "top_kernels": [{"name": name[:80], "ms": ms, "launches": calls, "exl3moe": is_exl3moe_kernel(name)}
                            for name, (ms, calls) in top]}


def measure(model, vocab: int, prefill=(512, 2048), batches=(1, 8, 32), context: int = 128,
            steps: int = 32) -> dict:
    """All measurements of one model; peak memory from the allocator's high-water mark since the call began."""
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    out = {"prefill": [prefill_rate(model, n, vocab) for n in prefill], "decode": []}
    for batch in batches:
        result = decode_rate(model, batch, context, steps, vocab)
        result["profile"] = decode_kernel_share(model, batch, context, min(steps, 8), vocab, result["step_ms"])
        out["decode"].append(result)
    out["peak_memory_gib"] = torch.cuda.max_memory_allocated() / 2**30
    return out
