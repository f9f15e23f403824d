"""scripts/sanitize_sass.py lists, without a GPU, the kernel variants a sanitizer case compiles on an sm_90 GPU: every
launch the case expects (scripts/sanitize.py) is among them with its defines, and the RACECHECK_ORDER build adds its
define to each. Planning only (no NVRTC), in a subprocess: the script pretends to be an sm_90 GPU process-wide."""

import os
import subprocess
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "scripts"))
import sanitize  # noqa: E402

ROOT = os.path.join(os.path.dirname(__file__), "..")


def listed(case: str, build: str) -> list:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([os.path.join(ROOT, "src"), os.path.join(ROOT, "tests")]),
           "EXL3MOE_CACHE_DIR": ""}
    out = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "sanitize_sass.py"), case, "--build", build,
                          "--list"], capture_output=True, text=True, env=env, check=True, timeout=120).stdout
    rows = []
    for line in out.splitlines():
        name, arch, *defines = line.split()
        rows.append((name, arch, dict(d.split("=", 1) for d in defines)))
    return rows


@pytest.mark.parametrize("case,build", [("moe_ws_ring3", "racecheck_order"), ("linear_ws12", "default")])
def test_listed_variants_hold_every_expected_launch(case, build):
    rows = listed(case, build)
    for name, expected in sanitize.CASES[case].expect:
        assert any(n == name and all(d.get(k) == v for k, v in expected.items()) for n, _, d in rows), (name, rows)
    ordered = [d.get("RACECHECK_ORDER") == "1" for _, _, d in rows]
    assert all(ordered) if build == "racecheck_order" else not any(ordered)
    ws = [(name, arch) for name, arch, d in rows if name in ("moe_gate_up_mma", "moe_down_ws", "trellis_ws")]
    assert ws and all(arch == "sm_90a" for _, arch in ws)
