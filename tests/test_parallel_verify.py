"""`exl3moe verify PATH --tp N --ep M` on the tiny fixture: every layer sharded over spawned gloo processes, compared
with one process and float64 in one table; exit 0 when all pass, 2 when a layer cannot be split, 2 on bad usage."""

import os
import re

import pytest

from exl3moe.cli import main

CHECKPOINT = "tiny_qwen3_moe_exl3"
LINEARS = 9      # lm_head and two layers' q, k, v, o
MOE_LAYERS = 2


@pytest.fixture(autouse=True)
def torch_path(monkeypatch):
    """The ops' torch path in the spawned ranks (the interpreter is checked elsewhere)."""
    monkeypatch.setenv("TRITON_INTERPRET", "0")


def table_rows(text: str) -> dict:
    """{layer: (split, vs one process, vs float64, check)} of the table's one-line rows."""
    rows = {}
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip("│┃ ").split("│")]
        if len(cells) == 5 and re.fullmatch(r"(lm_head|model\.[\w.]+)", cells[0]):
            rows[cells[0]] = tuple(cells[1:])
    return rows


def run(argv: list, capsys) -> tuple:
    code = main(argv + ["--width", "160"])
    return code, capsys.readouterr().out


def test_expert_parallel_over_two_ranks_passes(fixtures_dir, capsys):
    code, out = run(["verify", os.path.join(fixtures_dir, CHECKPOINT), "--ep", "2"], capsys)
    rows = table_rows(out)
    assert code == 0, out
    assert len(rows) == LINEARS + MOE_LAYERS
    for name in ("model.layers.0.mlp", "model.layers.1.mlp"):
        split, single, float64, check = rows[name]
        assert split == "experts / 2 x tensor / 1" and check == "ok"
        assert float(single) < 1e-5 and float(float64) < 2e-3


def test_tensor_parallel_refuses_experts_of_one_block_and_exits_2(fixtures_dir, capsys):
    code, out = run(["verify", os.path.join(fixtures_dir, CHECKPOINT), "--tp", "2"], capsys)
    rows = table_rows(out)
    assert code == 2, out
    assert rows["model.layers.0.self_attn.q_proj"][0] == "columns / 2"
    assert rows["model.layers.0.self_attn.k_proj"][0] == "rows / 2"        # 128 columns: one block, so by rows
    assert all(check == "ok" and float(single) < 1e-5 for name, (_, single, _, check) in rows.items()
               if not name.endswith(".mlp"))
    assert rows["model.layers.1.mlp"][-1] == "ERROR"
    assert "experts intermediate: has 1 blocks of 128: a world of 2" in out.replace("\n", " ").replace("│", "")


@pytest.mark.parametrize("argv", [["--tp", "0"], ["--ep", "x"], ["--tp", "65"]])
def test_bad_degrees_are_usage_errors(fixtures_dir, argv, capsys):
    assert main(["verify", os.path.join(fixtures_dir, CHECKPOINT)] + argv) == 2
    assert f"argument {argv[0]}" in capsys.readouterr().err
