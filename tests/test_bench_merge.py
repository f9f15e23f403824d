"""bench --merge: a rerun replaces its own entries and keeps the others."""

import importlib.util
import json
import pathlib
import sys

BENCH = pathlib.Path(__file__).parents[1] / "bench"
sys.path.insert(0, str(BENCH))
spec = importlib.util.spec_from_file_location("bench_moe", BENCH / "moe.py")
bench_moe = importlib.util.module_from_spec(spec)
spec.loader.exec_module(bench_moe)
import results_io  # noqa: E402


def entry(shape, K, tokens, us, **extra):
    return dict(shape=shape, K=K, codebook="mcg", tokens=tokens, us=us, **extra)


def test_merge_replaces_matching_entries_and_keeps_the_rest():
    old = [entry("qwen3-30b-a3b", 4, 1, 47.7), entry("qwen3-30b-a3b", 4, 4, 86.6),
           entry("qwen3-30b-a3b", 4, 1, 49.0, stages="base"), entry("glm-4.5-air", 4, 1, 92.7)]
    new = [entry("qwen3-30b-a3b", 4, 1, 35.0), entry("glm-4.5-air", 4, 1, 80.0, shared=True)]
    merged = results_io.merge_results(old, new, bench_moe.RESULT_KEY)
    assert [e["us"] for e in merged] == [86.6, 49.0, 92.7, 35.0, 80.0]


def test_save_results_merges_only_when_asked(tmp_path, monkeypatch):
    monkeypatch.setattr(results_io, "run_info", lambda: {"gpu": "test"})
    path = str(tmp_path / "linear.json")
    key = ("k", "n", "K", "codebook", "rows")
    first = [dict(k=64, n=64, K=4, codebook="mcg", rows=r, us=float(r)) for r in (1, 8)]
    results_io.save_results(path, first, key)
    results_io.save_results(path, [dict(k=64, n=64, K=4, codebook="mcg", rows=8, us=3.0)], key, merge=True)
    doc = json.load(open(path))
    assert [(e["rows"], e["us"]) for e in doc["results"]] == [(1, 1.0), (8, 3.0)] and "gpu" in doc
    results_io.save_results(path, first[:1], key)
    assert len(json.load(open(path))["results"]) == 1
