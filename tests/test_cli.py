"""exl3moe command line: inspect on the real fixture and on mixed-width checkpoints, verify and demo rows, one-line
refusals with exit code 2, help and version."""

import json
import os
import re
import subprocess
import sys

import pytest
import torch

from checkpoint_mutations import EXPERT_DOWN, K_PROJ, Q_PROJ, mutated, plain_bf16
from exl3moe import EXL3Weight, __version__
from exl3moe.checkpoint_report import k_histogram, split_layer, summarise
from exl3moe.cli import build_parser, main
from exl3moe.format import write_checkpoint

FIXTURE = "tiny_qwen3_moe_exl3"
EXL3_CONFIG = {"quantization_config": {"quant_method": "exl3"}}


@pytest.fixture
def fixture_path(fixtures_dir):
    return os.path.join(fixtures_dir, FIXTURE)


def one_line_refusal(argv, capsys, *words):
    """The command exits 2 with one line on stderr (holding `words`) and nothing on stdout."""
    assert main(argv) == 2
    out, err = capsys.readouterr()
    assert err.count("\n") == 1 and "Traceback" not in err, err
    assert out == "", out
    assert all(w in err for w in words), err
    return err


def test_inspect_fixture_describes_layers_experts_and_widths(fixture_path, capsys):
    assert main(["inspect", fixture_path, "--width", "220"]) == 0
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
    assert "problem" not in out


def test_inspect_fits_100_columns(fixture_path, capsys):
    assert main(["inspect", fixture_path]) == 0   # not a terminal: 100 columns
    lines = capsys.readouterr().out.splitlines()
    assert max(len(line) for line in lines) <= 100 and any("lm_head" in line for line in lines)


def test_inspect_summarises_mixed_expert_widths(tmp_path, capsys):
    g = torch.Generator().manual_seed(0)
    linears = {}
    for e, K in enumerate([2, 2, 3, 4]):
        for proj, (k, n) in (("gate_proj", (128, 256)), ("up_proj", (128, 256)), ("down_proj", (256, 128))):
            trellis = torch.randint(-32768, 32768, (k // 16, n // 16, 16 * K), generator=g, dtype=torch.int32)
            linears[f"model.layers.0.mlp.experts.{e}.{proj}"] = EXL3Weight(
                trellis.to(torch.int16), torch.ones(k).half(), torch.ones(n).half(), "mcg")
    write_checkpoint(tmp_path, linears, {}, EXL3_CONFIG)
    assert main(["inspect", str(tmp_path), "--width", "220"]) == 0
    out = capsys.readouterr().out
    assert "2 x2, 3 x1, 4 x1" in out
    assert "K=2" in out and "K=3" in out and "K=4" in out
    histogram_lines = [line for line in out.splitlines() if "K=2 " in line or "K=3 " in line]
    assert any(" 6 " in line for line in histogram_lines) and any(" 3 " in line for line in histogram_lines)


def test_inspect_reports_what_is_missing(fixtures_dir, tmp_path, capsys):
    path = mutated(fixtures_dir, tmp_path / "c", drop=[f"{EXPERT_DOWN}.trellis"])
    assert main(["inspect", str(path), "--width", "200"]) == 2
    out, err = capsys.readouterr()
    assert "1 problem:" in out and f"{EXPERT_DOWN}.trellis" in out and "lm_head" in out
    assert err.count("\n") == 1 and f"{EXPERT_DOWN}.trellis" in err


def test_inspect_reports_a_bad_checkpoint(tmp_path, capsys):
    (tmp_path / "config.json").write_text(json.dumps({"quantization_config": {"quant_method": "awq"}}))
    one_line_refusal(["inspect", str(tmp_path)], capsys, "config.json", "not an EXL3 checkpoint",
                     "exllamav3's converter")


def test_helpers():
    assert summarise(["4", "4"]) == "4"
    assert summarise(["2.5", "3", "2.5"]) == "2.5 x2, 3 x1"
    assert split_layer("model.layers.12.mlp.experts.7.w1") == ("model.layers.12", "mlp.experts.*.w1")
    assert split_layer("lm_head") == ("-", "lm_head")
    lines = k_histogram([2.5] * 4 + [3] * 2).splitlines()
    assert lines[0].startswith("K=2.5") and lines[0].endswith(" 4") and lines[0].count("#") == 20
    assert lines[1].startswith("K=3") and lines[1].count("#") == 10


def subcommands():
    return build_parser()._subparsers._group_actions[0].choices


def test_help_lists_only_working_commands_and_exit_codes(capsys):
    assert set(subcommands()) == {"inspect", "verify", "demo", "warmup", "bench", "generate", "bench-model",
                                  "quantize", "stages"}
    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    assert re.search(r"\bquantize\b", out) and "exit codes" in out and "EXL3MOE_CACHE_DIR" in out
    assert max(len(line) for line in out.splitlines()) <= 100
    assert main([]) == 2
    assert "inspect" in capsys.readouterr().out
    assert main(["--version"]) == 0
    assert capsys.readouterr().out.strip() == f"exl3moe {__version__}"
    assert main(["warmup", "--help"]) == 0
    out = capsys.readouterr().out
    assert "~/.cache/exl3moe/cubins" in out and "EXL3MOE_CACHE_DIR" in out and "exit codes" in out


def test_every_option_has_help():
    for name, parser in [("exl3moe", build_parser())] + list(subcommands().items()):
        for action in parser._actions:
            assert action.help, f"{name} {action.dest}"


@pytest.mark.parametrize("argv,words", [
    (["demo", "--tokens", "-1"], ("--tokens", "-1", "1..4096")),
    (["demo", "--tokens", "many"], ("--tokens", "whole number")),
    (["demo", "--device", "tpu"], ("--device", "tpu")),
    (["demo", "--device", "meta"], ("--device", "cuda", "cpu")),
    (["demo", "--width", "0"], ("--width",)),
    (["quantize"], ("required", "IN_DIR")),
])
def test_usage_mistakes_are_one_line(argv, words, capsys):
    one_line_refusal(argv, capsys, *words)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the message of a machine without a GPU")
@pytest.mark.parametrize("command", ["demo", "verify"])
def test_cuda_without_a_gpu_is_one_line(command, fixture_path, capsys):
    argv = [command, "--device", "cuda"] + ([fixture_path] if command == "verify" else [])
    one_line_refusal(argv, capsys, "no CUDA GPU", "--device cpu")


def test_paths_that_are_not_checkpoints(fixture_path, tmp_path, capsys):
    one_line_refusal(["verify", str(tmp_path / "absent")], capsys, "pass the checkpoint directory")
    one_line_refusal(["verify", os.path.join(fixture_path, "model.safetensors")], capsys, "pass the checkpoint")
    one_line_refusal(["verify", str(tmp_path)], capsys, "config.json", "pass the checkpoint directory")
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    one_line_refusal(["verify", str(tmp_path)], capsys, "this is not an EXL3 checkpoint")


def test_truncated_shard_is_one_line(fixtures_dir, tmp_path, capsys):
    path = mutated(fixtures_dir, tmp_path / "c")
    blob = (path / "model.safetensors").read_bytes()
    (path / "model.safetensors").write_bytes(blob[:-1000])
    one_line_refusal(["verify", str(path)], capsys, "model.safetensors", "the file is truncated")


@pytest.mark.parametrize("case,name", [
    ("attention", f"{Q_PROJ}.trellis"), ("expert", f"{EXPERT_DOWN}.trellis"), ("marker", f"{K_PROJ}.mul1")])
def test_verify_names_a_missing_tensor_before_any_work(fixtures_dir, tmp_path, capsys, case, name):
    drop = {"attention": f"{Q_PROJ}.trellis", "expert": f"{EXPERT_DOWN}.trellis", "marker": f"{K_PROJ}.mul1"}[case]
    path = mutated(fixtures_dir, tmp_path / "c", drop=[drop])
    one_line_refusal(["verify", str(path), "--device", "cpu"], capsys, name)


def test_verify_of_plain_bf16_weights_is_not_a_pass(fixtures_dir, tmp_path, capsys):
    one_line_refusal(["verify", str(plain_bf16(fixtures_dir, tmp_path / "c", manifest=False))], capsys,
                     f"{Q_PROJ}.weight", "unquantized")


def test_verify_runs_every_layer_of_the_fixture(fixture_path, capsys):
    """One interpreter run of the whole fixture: every row printed, what is compared and the limit said."""
    assert main(["verify", fixture_path, "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    assert max(len(line) for line in lines) <= 100
    text = " ".join(out.split())
    assert "Triton interpreter" in text and "routed by its own router" in text and "float64" in text
    assert "relative L2 error < 0.002" in text
    rows = [line for line in lines if line.startswith(("lm_head", "model.layers."))]
    assert len(rows) == 11 and all(" ok " in row and "interp." in row for row in rows)
    assert sum("(experts)" in row and "2.5/mul1" in row for row in rows) == 2
    assert "PASS 105 of 105 quantized linears in 11 rows" in out


def small_checkpoint(path, bad_scale=False):
    """Two 128x128 linears of an unknown architecture; the second one's suh NaN when bad_scale."""
    g = torch.Generator().manual_seed(0)
    trellis = torch.randint(-32768, 32768, (8, 8, 32), generator=g, dtype=torch.int32).to(torch.int16)
    good = EXL3Weight(trellis, torch.ones(128).half(), torch.ones(128).half(), "3inst")
    second = {"b.trellis": trellis, "b.suh": torch.full((128,), float("nan") if bad_scale else 1.0).half(),
              "b.svh": torch.ones(128).half()}
    write_checkpoint(path, {"a": good}, second, EXL3_CONFIG)
    return path


def test_verify_with_a_layer_it_cannot_check_fails(tmp_path, capsys):
    assert main(["verify", str(small_checkpoint(tmp_path, bad_scale=True)), "--device", "cpu"]) == 2
    out = capsys.readouterr().out
    assert any(line.startswith("a ") and " ok " in line for line in out.splitlines())
    assert any(line.startswith("b ") and "ERROR" in line for line in out.splitlines())
    assert "b.suh" in out and "not checked: b" in out and "PASS" not in out


def test_verify_over_the_limit_exits_1(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr("exl3moe.rows.LIMIT", 0.0)
    assert main(["verify", str(small_checkpoint(tmp_path)), "--device", "cpu"]) == 1
    out = capsys.readouterr().out
    assert out.count("FAIL") >= 2 and "over the limit" in out


def test_module_entry_point_runs(fixture_path):
    result = subprocess.run([sys.executable, "-m", "exl3moe.cli", "inspect", fixture_path],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "lm_head" in result.stdout and "mlp.experts.*.down_proj" in result.stdout


def test_demo_passes_and_reports_both_ops(capsys):
    assert main(["demo", "--device", "cpu", "--tokens", "3"]) == 0
    out = capsys.readouterr().out
    assert max(len(line) for line in out.splitlines()) <= 100
    assert "Triton interpreter" in out and "PASS" in out
    rows = [line for line in out.splitlines() if line.startswith(("routed MoE", "linear"))]
    assert len(rows) == 2 and all(" ok " in row and "interp." in row for row in rows)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on machines without a GPU")
def test_bench_needs_a_gpu(capsys):
    one_line_refusal(["bench"], capsys, "needs a CUDA GPU")


def qwen2_moe_checkpoint(path, router=True):
    """One Qwen2-MoE layer at 128 wide: attention, 4 mixed-format experts, a shared expert behind a sigmoid gate."""
    g = torch.Generator().manual_seed(3)

    def weight(K, codebook):
        trellis = torch.randint(-32768, 32768, (8, 8, int(16 * K)), generator=g, dtype=torch.int32)
        return EXL3Weight(trellis.to(torch.int16), (torch.rand(128, generator=g) + 0.5).half(),
                          (torch.rand(128, generator=g) + 0.5).half(), codebook)
    mlp = "model.layers.0.mlp"
    linears = {f"model.layers.0.self_attn.{p}": weight(4, "mcg") for p in ("q_proj", "k_proj", "v_proj", "o_proj")}
    for e, (K, codebook) in enumerate([(2, "mcg"), (3, "mul1"), (4, "3inst"), (2.5, "mul1")]):
        linears.update({f"{mlp}.experts.{e}.{p}": weight(K, codebook) for p in ("gate_proj", "up_proj", "down_proj")})
    linears.update({f"{mlp}.shared_expert.{p}": weight(3, "mcg") for p in ("gate_proj", "up_proj", "down_proj")})
    tensors = {f"{mlp}.gate.weight": torch.randn(4, 128, generator=g).half(),
               f"{mlp}.shared_expert_gate.weight": torch.randn(1, 128, generator=g).half()}
    config = {"model_type": "qwen2_moe", "num_hidden_layers": 1, "num_experts": 4, "num_experts_per_tok": 2,
              "hidden_act": "silu", "norm_topk_prob": False, "tie_word_embeddings": True,
              "quantization_config": {"quant_method": "exl3"}}
    if not router:
        tensors, config = {}, EXL3_CONFIG
    write_checkpoint(path, linears, tensors, config)
    return path


@pytest.mark.parametrize("router", [True, False])
def test_verify_routes_by_the_router_or_says_it_did_not(tmp_path, capsys, monkeypatch, router):
    """The torch path (no interpreter) checks verify's routing, shared-expert gate and reference, not the kernels."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert main(["verify", str(qwen2_moe_checkpoint(tmp_path, router)), "--device", "cpu", "--width", "160"]) == 0
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if line.startswith("model.layers.")]
    assert len(rows) == 8 and all(" ok " in row and " torch " in row for row in rows)
    (moe,) = [row for row in rows if "(experts" in row]
    assert "E4+1 128x128" in moe and ("random routing" in moe) != router
    assert "5 formats" in moe and "formats: 2.5/mul1 x3, 2/mcg x3, 3/mcg x3, 3/mul1 x3, 4/3inst x3" in out
    assert "PASS 19 of 19 quantized linears in 8 rows" in out
