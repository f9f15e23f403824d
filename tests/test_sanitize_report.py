"""Reading compute-sanitizer logs (scripts/sanitize_report.py) and the case list of scripts/sanitize.py, on sample
reports in the tools' formats: the CUDA bindings' cuGetProcAddress probing is dropped by name, kernel faults and
shared-memory hazards are counted."""

import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "scripts"))
import sanitize  # noqa: E402
from sanitize_report import decides, parse_report, run_row, run_status, summarize, table  # noqa: E402

PROBE = """========= Program hit CUDA_ERROR_NOT_FOUND (error 500) due to "named symbol not found" on CUDA API call to \
cuGetProcAddress_v2.
=========     Saved host backtrace up to driver entry point at error
=========         Host Frame: [0x2b1c4d] in libcuda.so.1
=========         Host Frame: [0x3a10f] in cydriver.cpython-312-x86_64-linux-gnu.so
=========
"""
HAZARD = """========= Error: Potential WAW hazard detected at __shared__ 0xa04 in block (20,3,0) :
=========     Write Thread (97,0,0) at trellis_ws+0x47d0
=========     Write Thread (353,0,0) at trellis_ws+0x47d0
=========     Current Value : 26, Incoming Value : 37
=========
"""
OUT_OF_BOUNDS = """========= Invalid __global__ read of size 4 bytes
=========     at moe_down_ws+0x1a70
=========     by thread (12,0,0) in block (3,0,0)
=========     Address 0x7f3a40001000 is out of bounds
=========     and is 4 bytes after the nearest allocation at 0x7f3a40000000 of size 4096 bytes
=========     Saved host backtrace up to driver entry point at kernel launch time
=========         Host Frame: [0x2f3e1a] in libcuda.so.1
=========
"""


def memcheck_log(*reports: str) -> str:
    return ("========= COMPUTE-SANITIZER\n" + "".join(reports)
            + f"========= ERROR SUMMARY: {len(reports)} error{'s' if len(reports) != 1 else ''}\n")


def racecheck_log(*reports: str) -> str:
    n = len(reports)
    return ("========= COMPUTE-SANITIZER\n" + "".join(reports)
            + f"========= RACECHECK SUMMARY: {n} hazards displayed ({n} errors, 0 warnings)\n")


def test_symbol_probing_reports_are_filtered_by_name():
    report = parse_report(memcheck_log(PROBE, PROBE))
    assert report.kept == [] and len(report.filtered) == 2 and report.complete
    assert "cuGetProcAddress" in report.filtered[0]
    assert run_status(report, {"ok": True}, timed_out=False) == "clean"


def test_a_shared_memory_hazard_is_counted_with_its_threads():
    report = parse_report(racecheck_log(HAZARD, HAZARD.replace("0xa04", "0xa05")))
    assert len(report.kept) == 2 and report.filtered == []
    assert report.first.startswith("Error: Potential WAW hazard detected at __shared__ 0xa04")
    assert "Write Thread (353,0,0) at trellis_ws+0x47d0" in report.first
    assert run_status(report, {"ok": True}, timed_out=False) == "reports"


def test_a_kernel_fault_beside_probing_reports_is_kept():
    report = parse_report(memcheck_log(PROBE, OUT_OF_BOUNDS, PROBE))
    assert len(report.kept) == 1 and len(report.filtered) == 2
    assert "Invalid __global__ read of size 4 bytes | at moe_down_ws+0x1a70" in report.first


def test_hazard_lines_without_indentation_stay_one_report():
    flat = "\n".join("========= " + line[len("========="):].strip() if line.strip("=") else line
                     for line in HAZARD.splitlines())
    assert len(parse_report(racecheck_log(flat + "\n")).kept) == 1


def test_a_log_cut_short_or_a_wrong_output_is_not_clean():
    cut = parse_report("========= COMPUTE-SANITIZER\n" + PROBE)
    assert not cut.complete and run_status(cut, {"ok": True}, timed_out=False) == "error"
    assert run_status(cut, None, timed_out=True) == "timeout"
    clean = parse_report(memcheck_log())
    assert run_status(clean, {"ok": False}, timed_out=False) == "mismatch"
    assert run_status(clean, None, timed_out=False) == "error"
    assert run_status(parse_report(""), {"ok": True}, timed_out=False, sanitized=False) == "clean"
    assert run_status(parse_report(""), None, timed_out=False, skipped=True) == "skipped"


def run(case, tool, build, log, result):
    return {"case": case, "family": "fam_" + case, "tool": tool, "build": build, "exit_code": 0, "seconds": 1.5,
            "timed_out": False, "log": str(log), "result": str(result)}


def test_summary_rows_and_table(tmp_path):
    ok = tmp_path / "ok.json"
    ok.write_text(json.dumps({"ok": True, "rel_l2": 4e-4}))
    logs = {"probe.log": memcheck_log(PROBE), "hazard.log": racecheck_log(HAZARD), "clean.log": racecheck_log()}
    for name, text in logs.items():
        (tmp_path / name).write_text(text)
    runs = [run("ws", "racecheck", "default", tmp_path / "hazard.log", ok),
            run("ws", "racecheck", "racecheck_order", tmp_path / "clean.log", ok),
            run("ws", "memcheck", "default", tmp_path / "probe.log", ok),
            run("mma", "racecheck", "default", tmp_path / "hazard.log", ok)]
    for i, r in enumerate(runs):
        (tmp_path / f"{i}.run.json").write_text(json.dumps(r))
    rows, text = summarize(str(tmp_path), str(tmp_path / "out.json"))
    assert json.loads((tmp_path / "out.json").read_text()) == rows
    by = {(r["case"], r["tool"], r["build"]): r for r in rows}
    assert by[("ws", "memcheck", "default")]["filtered"] == 1 and by[("ws", "memcheck", "default")]["reports"] == 0
    assert by[("ws", "racecheck", "default")]["reports"] == 1 and not decides(by[("ws", "racecheck", "default")])
    assert by[("ws", "racecheck", "racecheck_order")]["status"] == "clean"
    assert decides(by[("mma", "racecheck", "default")]) and by[("mma", "racecheck", "default")]["status"] == "reports"
    lines = text.splitlines()
    assert lines[0].split() == ["family", "memcheck", "racecheck"]
    assert lines[1].split() == ["fam_ws", "0", "0", "[1]"]
    assert lines[2].split() == ["fam_mma", "-", "1"]
    assert lines[3] == "4 runs, 1 not clean:" and "mma racecheck default: reports" in lines[4]


def test_a_row_without_result_is_an_error():
    row = run_row(run("x", "initcheck", "default", "", ""), memcheck_log(), None)
    assert row["status"] == "error" and row["rel_l2"] is None
    assert "x initcheck default: error" in table([{**row, "ordered_build": False}])


def test_case_list_names_families_and_ws_cases(capsys):
    assert sanitize.main(["--list"]) == 0
    lines = [line.split(" ", 3) for line in capsys.readouterr().out.splitlines()]
    assert [name for name, *_ in lines] == list(sanitize.CASES)
    assert all(len(line) == 4 and line[2] in ("ws", "-") for line in lines)
    ws = {name for name, _, flag, _ in lines if flag == "ws"}
    assert {"linear_ws16", "linear_ws12", "moe_ws", "moe_ws+stages", "moe_split"} <= ws
    families = {family for _, family, _, _ in lines}
    assert {"trellis_mma", "trellis_ws16", "trellis_ws12", "trellis_dense", "reduce_splits", "triton_linear",
            "moe_direct", "moe_packed", "moe_ws", "moe_split_192_128", "route_pack", "triton_moe"} <= families
    staged = {name[:-len("+stages")] for name in sanitize.CASES if name.endswith("+stages")}
    assert {c.name for c in sanitize.MOE_CASES if not c.stages} == staged
