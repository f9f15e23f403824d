"""bench/moe.py --merge: a rerun replaces its own entries and keeps the others."""

import importlib.util
import pathlib

spec = importlib.util.spec_from_file_location("bench_moe", pathlib.Path(__file__).parents[1] / "bench" / "moe.py")
bench_moe = importlib.util.module_from_spec(spec)
spec.loader.exec_module(bench_moe)


def entry(shape, K, tokens, us, **extra):
    return dict(shape=shape, K=K, codebook="mcg", tokens=tokens, us=us, **extra)


def test_merge_replaces_matching_entries_and_keeps_the_rest():
    old = [entry("qwen3-30b-a3b", 4, 1, 47.7), entry("qwen3-30b-a3b", 4, 4, 86.6),
           entry("qwen3-30b-a3b", 4, 1, 49.0, stages="base"), entry("glm-4.5-air", 4, 1, 92.7)]
    new = [entry("qwen3-30b-a3b", 4, 1, 35.0), entry("glm-4.5-air", 4, 1, 80.0, shared=True)]
    merged = bench_moe.merge_results(old, new)
    assert [e["us"] for e in merged] == [86.6, 49.0, 92.7, 35.0, 80.0]
