"""compute-sanitizer logs read back: the reports of one run (parse_report), the per-run rows of a sweep and their
table (summarize). Pure Python, so the parsing is tested without a GPU (tests/test_sanitize_report.py)."""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass, field

PREFIX = "========="
# Reports that come from the CUDA Python bindings probing driver symbols at import, not from a kernel: dropped by
# the API name they mention, never by their count.
FILTERED_NAMES = ("cuGetProcAddress",)
# Unindented lines of a log that are the tool's bookkeeping, not reports.
BOOKKEEPING = re.compile(r"(COMPUTE-SANITIZER|(ERROR|RACECHECK|LEAK) SUMMARY:|Target application returned an error"
                         r"|Error: process didn't terminate successfully|No .*results found)")
SUMMARY = re.compile(r"(ERROR|RACECHECK) SUMMARY:")
# Lines under a report header, for logs whose indentation was lost.
DETAIL = re.compile(r"((Read|Write) Thread|Current Value|at \S+\+0x|at 0x|by thread|Address 0x|and is |"
                    r"Saved host backtrace|Host Frame|and (Read|Write) access)")
FIRST_REPORT_CHARS = 600


@dataclass
class Report:
    """The reports of one log: kept (kernel or API faults) and filtered (FILTERED_NAMES), each its lines joined."""

    kept: list = field(default_factory=list)
    filtered: list = field(default_factory=list)
    complete: bool = False   # the tool printed its summary: the run was not cut short

    @property
    def first(self) -> str | None:
        return self.kept[0][:FIRST_REPORT_CHARS] if self.kept else None


def _blocks(text: str):
    """The log's report blocks: a header line after the prefix and the indented (or detail) lines under it."""
    block = None
    for line in text.splitlines():
        if not line.startswith(PREFIX):
            continue
        rest = line[len(PREFIX):]
        body = rest.strip()
        if not body:
            if block:
                yield block
            block = None
        elif block is not None and (rest.startswith("  ") or DETAIL.match(body)):
            block.append(body)
        elif not rest.startswith("  "):
            if block:
                yield block
            block = None if BOOKKEEPING.match(body) else [body]
    if block:
        yield block


def parse_report(text: str) -> Report:
    """Every report of a compute-sanitizer log (memcheck, racecheck in hazard or analysis mode, synccheck,
    initcheck), split into kept and filtered ones."""
    report = Report(complete=bool(SUMMARY.search(text)))
    for block in _blocks(text):
        joined = " | ".join(block)
        filtered = any(name in joined for name in FILTERED_NAMES)
        (report.filtered if filtered else report.kept).append(joined)
    return report


def run_status(report: Report, result: dict | None, timed_out: bool, sanitized: bool = True,
               skipped: bool = False) -> str:
    """clean, reports (kept reports), mismatch (the case's output missed the oracle), timeout, skipped (not started
    within the sweep's budget), or error (the case wrote no result, or a sanitized run's tool printed no summary)."""
    if skipped:
        return "skipped"
    if timed_out:
        return "timeout"
    if result is not None and not result.get("ok", False):
        return "mismatch"
    if report.kept:
        return "reports"
    if result is None or (sanitized and not report.complete):
        return "error"
    return "clean"


def run_row(run: dict, log_text: str, result: dict | None) -> dict:
    """The JSON row of one run: `run` holds case, family, tool ("plain": no sanitizer), build, exit_code, seconds,
    timed_out; log_text is the tool's log, result the case's own verdict (sanitize.py --result)."""
    report = parse_report(log_text)
    status = run_status(report, result, run["timed_out"], run["tool"] != "plain", run.get("skipped", False))
    return {"family": run["family"], "case": run["case"], "tool": run["tool"], "build": run["build"],
            "reports": len(report.kept), "filtered": len(report.filtered), "seconds": round(run["seconds"], 1),
            "status": status, "first_report": report.first, "exit_code": run["exit_code"],
            "rel_l2": None if result is None else result.get("rel_l2")}


def decides(row: dict) -> bool:
    """Whether a run decides the stage: every run but racecheck of a warp-specialized case's default build, which is
    recorded beside its RACECHECK_ORDER build's run (the tool does not model the ring's mbarrier order)."""
    return not (row["tool"] == "racecheck" and row["build"] == "default" and row.get("ordered_build"))


TOOL_ORDER = ("plain", "memcheck", "racecheck", "synccheck", "initcheck")


def table(rows: list) -> str:
    """Kept reports per (family, tool), the racecheck count of the default builds of warp-specialized cases in
    brackets and "!" where a run was not clean for another reason; then every deciding run that is not clean."""
    present = {r["tool"] for r in rows}
    tools = [t for t in TOOL_ORDER if t in present] + sorted(present - set(TOOL_ORDER))
    families = list(dict.fromkeys(r["family"] for r in rows))
    cells = {}
    for r in rows:
        cell = cells.setdefault((r["family"], r["tool"]), {"kept": 0, "default": None, "failed": False})
        if decides(r):
            cell["kept"] += r["reports"]
            cell["failed"] |= r["status"] not in ("clean", "reports")
        else:
            cell["default"] = (cell["default"] or 0) + r["reports"]
    width = max([len("family")] + [len(f) for f in families])
    lines = [f"{'family':<{width}}" + "".join(f"{t:>13}" for t in tools)]
    for f in families:
        texts = []
        for t in tools:
            cell = cells.get((f, t))
            text = "-" if cell is None else (f"{cell['kept']}" + ("!" if cell["failed"] else "")
                                             + ("" if cell["default"] is None else f" [{cell['default']}]"))
            texts.append(f"{text:>13}")
        lines.append(f"{f:<{width}}" + "".join(texts))
    bad = [r for r in rows if decides(r) and r["status"] != "clean"]
    lines.append(f"{len(rows)} runs, {len(bad)} not clean" + (":" if bad else ""))
    lines += [f"  {r['case']} {r['tool']} {r['build']}: {r['status']}, {r['reports']} reports "
              f"{(r['first_report'] or '')[:160]}" for r in bad]
    return "\n".join(lines)


def summarize(log_dir: str, out_path: str) -> tuple:
    """Rows of every run described in log_dir/*.run.json (written by sanitizer_check.sh: case, family, tool, build,
    exit_code, seconds, timed_out, log, result), written to out_path as JSON; returns (rows, table text)."""
    runs = []
    for name in sorted(os.listdir(log_dir)):
        if name.endswith(".run.json"):
            with open(os.path.join(log_dir, name)) as fh:
                runs.append(json.load(fh))
    ordered = {r["case"] for r in runs if r["build"] == "racecheck_order"}
    rows = []
    for run in runs:
        row = run_row(run, _read(run.get("log")), _result(run.get("result")))
        row["ordered_build"] = run["case"] in ordered
        rows.append(row)
    with open(out_path, "w") as fh:
        json.dump(rows, fh, indent=1)
    return rows, table(rows)


def _result(path: str | None) -> dict | None:
    """A case's verdict (sanitize.py --result), None where it wrote none."""
    text = _read(path)
    try:
        return json.loads(text) if text else None
    except json.JSONDecodeError:
        return None


def _read(path: str | None) -> str:
    if not path or not os.path.isfile(path):
        return ""
    with open(path, errors="replace") as fh:
        return fh.read()
