"""exl3moe command line: inspect on the real fixture and on mixed-width checkpoints; subcommand wiring."""

import json
import os
import subprocess
import sys

import pytest
import torch

from exl3moe import EXL3Weight
from exl3moe.cli import build_parser, k_histogram, main, split_layer, summarise
from exl3moe.format import write_checkpoint

FIXTURE = "tiny_qwen3_moe_exl3"


def test_inspect_fixture_describes_layers_experts_and_widths(fixtures_dir, capsys):
    assert main(["inspect", os.path.join(fixtures_dir, FIXTURE), "--width", "220"]) == 0
    out = capsys.readouterr().out
    assert "Qwen3MoeForCausalLM" in out and "bits=2.67" in out
    rows = [line for line in out.splitlines() if "│" in line]
    expert_rows = [r for r in rows if "mlp.experts.*.gate_proj" in r]
    assert len(expert_rows) == 2 and all("256x128" in r and "2.5" in r and "mul1" in r and " 16 " in r
                                         for r in expert_rows)
    q_rows = [r for r in rows if "self_attn.q_proj" in r]
    assert len(q_rows) == 2 and all("256x256" in r and "│ 4 " in r for r in q_rows)
    head = [r for r in rows if "lm_head" in r]
    assert len(head) == 1 and "256x1024" in head[0] and "│ 6 " in head[0]
    moe_rows = [r for r in rows if r.startswith("│ model.layers.") and ".mlp " in r]
    assert len(moe_rows) == 2 and all("│ 16 " in r and "256" in r and "128" in r and "K=2.5" in r and " 48 " in r
                                      for r in moe_rows)
    assert "105 (3801088 weights)" in out
    assert "2.897 (trellis)" in out
    assert "2003876" in out


def test_inspect_summarises_mixed_expert_widths(tmp_path, capsys):
    g = torch.Generator().manual_seed(0)
    linears = {}
    for e, K in enumerate([2, 2, 3, 4]):
        for proj, (k, n) in (("gate_proj", (128, 256)), ("up_proj", (128, 256)), ("down_proj", (256, 128))):
            trellis = torch.randint(-32768, 32768, (k // 16, n // 16, 16 * K), generator=g, dtype=torch.int32)
            linears[f"model.layers.0.mlp.experts.{e}.{proj}"] = EXL3Weight(
                trellis.to(torch.int16), torch.ones(k).half(), torch.ones(n).half(), "mcg")
    write_checkpoint(tmp_path, linears, {}, {"quantization_config": {"quant_method": "exl3"}})
    assert main(["inspect", str(tmp_path), "--width", "220"]) == 0
    out = capsys.readouterr().out
    assert "2 x2, 3 x1, 4 x1" in out
    assert "K=2" in out and "K=3" in out and "K=4" in out
    histogram_lines = [line for line in out.splitlines() if "K=2 " in line or "K=3 " in line]
    assert any(" 6 " in line for line in histogram_lines) and any(" 3 " in line for line in histogram_lines)


def test_inspect_reports_a_bad_checkpoint(tmp_path, capsys):
    (tmp_path / "config.json").write_text(json.dumps({"quantization_config": {"quant_method": "awq"}}))
    assert main(["inspect", str(tmp_path)]) == 1
    assert "config.json" in capsys.readouterr().err


def test_helpers():
    assert summarise(["4", "4"]) == "4"
    assert summarise(["2.5", "3", "2.5"]) == "2.5 x2, 3 x1"
    assert split_layer("model.layers.12.mlp.experts.7.w1") == ("model.layers.12", "mlp.experts.*.w1")
    assert split_layer("lm_head") == ("-", "lm_head")
    lines = k_histogram([2.5] * 4 + [3] * 2).splitlines()
    assert lines[0].startswith("K=2.5") and lines[0].endswith(" 4") and lines[0].count("#") == 20
    assert lines[1].startswith("K=3") and lines[1].count("#") == 10


def test_all_subcommands_are_registered(capsys):
    parser = build_parser()
    commands = parser._subparsers._group_actions[0].choices
    assert set(commands) == {"inspect", "demo", "verify", "bench", "quantize"}
    assert main([]) == 2
    assert "inspect" in capsys.readouterr().out


def test_module_entry_point_runs(fixtures_dir):
    result = subprocess.run([sys.executable, "-m", "exl3moe.cli", "inspect", os.path.join(fixtures_dir, FIXTURE)],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "lm_head" in result.stdout and "mlp.experts.*.down_proj" in result.stdout


def test_verify_runs_every_layer_of_the_fixture(fixtures_dir, capsys):
    assert main(["verify", os.path.join(fixtures_dir, FIXTURE), "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    assert "PASS" in out and "lm_head" in out and "model.layers.1.mlp (experts)" in out
    assert "2.5/mul1" in out


def test_verify_reports_a_bad_checkpoint(tmp_path, capsys):
    (tmp_path / "config.json").write_text("{}")
    assert main(["verify", str(tmp_path)]) == 1
    assert "quant_method" in capsys.readouterr().err


def test_demo_passes_and_reports_both_ops(capsys):
    assert main(["demo", "--device", "cpu", "--tokens", "3"]) == 0
    out = capsys.readouterr().out
    assert "routed MoE" in out and "linear" in out and "PASS" in out


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on machines without a GPU")
def test_bench_needs_a_gpu(capsys):
    assert main(["bench"]) == 2
    assert "needs a CUDA GPU" in capsys.readouterr().err
