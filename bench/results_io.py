"""Benchmark result files: {"gpu", "date", "torch", "triton", "results": [...]}, optionally merged with an older run."""

import json
import os

from exl3moe.timing import run_info


def merge_results(old: list, new: list, fields: tuple) -> list:
    """old entries whose values of `fields` no new entry has, then the new ones."""
    def key(r):
        return tuple(str(r.get(f)) for f in fields)
    fresh = {key(r) for r in new}
    return [r for r in old if key(r) not in fresh] + new


def save_results(path: str, results: list, fields: tuple, merge: bool = False) -> None:
    """Write `results` with this run's GPU and versions; with merge, keep the file's entries this run does not
    replace."""
    if merge and os.path.exists(path):
        with open(path) as fh:
            results = merge_results(json.load(fh)["results"], results, fields)
    with open(path, "w") as fh:
        json.dump({**run_info(), "results": results}, fh, indent=1)
