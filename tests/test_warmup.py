"""exl3moe warmup on the CPU: the layers a checkpoint asks kernels for, the default set, the compile loop, and the
one-line refusal where NVRTC cannot run (the compiling itself: tests/test_warmup_gpu.py)."""

import importlib.util
import os

import pytest
import torch

from exl3moe import EXL3Weight, open_checkpoint
from exl3moe.cli import main
from exl3moe.format import write_checkpoint
from exl3moe.kernels import nvrtc
from exl3moe.rows import report_console
from exl3moe.warmup import MoESpec, WeightSpec, checkpoint_specs, compile_all, default_specs, nvrtc_problem

FIXTURE = "tiny_qwen3_moe_exl3"


def test_fixture_specs_are_its_linear_and_moe_formats(fixtures_dir):
    specs = checkpoint_specs(open_checkpoint(os.path.join(fixtures_dir, FIXTURE)))
    assert specs.linears == {WeightSpec(256, 256, 4, "mul1"), WeightSpec(256, 128, 4, "mul1"),
                             WeightSpec(256, 1024, 6, "mul1")}
    up, down = WeightSpec(256, 128, 2.5, "mul1"), WeightSpec(128, 256, 2.5, "mul1")
    assert specs.moes == {MoESpec((up,) * 16, (up,) * 16, (down,) * 16, "silu", 4)}   # both layers: one entry


def weight(k, n, K, codebook, bias=False):
    trellis = torch.zeros(k // 16, n // 16, int(16 * K), dtype=torch.int16)
    return EXL3Weight(trellis, torch.ones(k).half(), torch.ones(n).half(), codebook,
                      torch.ones(n).half() if bias else None)


def test_mixed_experts_shared_expert_and_bias_are_kept(tmp_path):
    formats = [(2, "mcg"), (3, "3inst"), (2.5, "mul1")]
    linears = {}
    for e, (K, cb) in enumerate(formats):
        for proj, (k, n) in (("w1", (128, 256)), ("w3", (128, 256)), ("w2", (256, 128))):
            linears[f"model.layers.0.block_sparse_moe.experts.{e}.{proj}"] = weight(k, n, K, cb)
    for proj, (k, n) in (("gate_proj", (128, 128)), ("up_proj", (128, 128)), ("down_proj", (128, 128))):
        linears[f"model.layers.0.block_sparse_moe.shared_experts.{proj}"] = weight(k, n, 4, "mcg")
    linears["model.layers.0.self_attn.o_proj"] = weight(128, 128, 5, "3inst", bias=True)
    write_checkpoint(tmp_path, linears, {}, {"quantization_config": {"quant_method": "exl3"},
                                             "num_experts_per_tok": 2, "hidden_act": "gelu_pytorch_tanh"})
    specs = checkpoint_specs(open_checkpoint(tmp_path))
    (moe,) = specs.moes
    assert [(s.K, s.codebook) for s in moe.gate] == formats and moe.down[2] == WeightSpec(256, 128, 2.5, "mul1")
    assert moe.top_k == 2 and moe.activation == "gelu" and not moe.shared_gated
    assert moe.shared == (WeightSpec(128, 128, 4, "mcg"),) * 3
    assert WeightSpec(128, 128, 5, "3inst", bias=True) in specs.linears


def test_default_set():
    specs = default_specs()
    assert len(specs.moes) == 5 and all(len(m.up) == 128 and m.top_k == 8 for m in specs.moes)
    assert {m.up[0].K for m in specs.moes} == {2, 3, 4, 5, 6}
    assert WeightSpec(4096, 14336, 4, "mul1") in specs.linears and len(specs.linears) == 36


def test_compile_loop_compiles_each_entry_once(capsys):
    done = []
    entries = [{"file": f"f{i}", "defines": {}, "prelude": "", "arch": "sm_90"} for i in range(5)]
    compile_all(entries, 1, report_console(), done.append)
    assert done == entries


def test_nvrtc_problem_names_what_is_missing(monkeypatch):
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name.startswith("cuda") else
                        find_spec(name, *a))
    assert "pip install 'exl3moe[cuda]'" in nvrtc_problem()
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: object() if name.startswith("cuda") else
                        find_spec(name, *a))

    def no_library():
        raise OSError("libnvrtc.so.12: cannot open shared object file")
    monkeypatch.setattr(nvrtc, "nvrtc_version", no_library)
    assert "libnvrtc.so.12" in nvrtc_problem() and "\n" not in nvrtc_problem()


def test_warmup_without_nvrtc_is_one_line(monkeypatch, fixtures_dir, capsys):
    monkeypatch.setattr("exl3moe.warmup.nvrtc_problem", lambda: "NVRTC cannot compile here: reason")
    for argv in (["warmup"], ["warmup", os.path.join(fixtures_dir, FIXTURE)]):
        assert main(argv) == 2
        out, err = capsys.readouterr()
        assert out == "" and err.count("\n") == 1 and "NVRTC cannot compile here" in err


@pytest.mark.skipif(torch.cuda.is_available(), reason="the message of a machine without a GPU")
def test_warmup_without_a_gpu_is_one_line(monkeypatch, capsys):
    monkeypatch.setattr("exl3moe.warmup.nvrtc_problem", lambda: None)
    assert main(["warmup"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1 and "no CUDA GPU" in err
