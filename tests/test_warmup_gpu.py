"""exl3moe warmup on the GPU: after it, the plans a checkpoint's layers make compile nothing new; verify and demo
say which kernels ran."""

import os

import pytest
import torch

from exl3moe import EXL3Linear, EXL3MoE, open_checkpoint
from exl3moe.cli import main
from exl3moe.kernels import nvrtc
from exl3moe.rows import report_console
from exl3moe.warmup import MOE_TOKENS, cached, checkpoint_specs, nvrtc_problem, variants, warm

pytestmark = pytest.mark.gpu
FIXTURE = "tiny_qwen3_moe_exl3"


@pytest.fixture
def fresh_cache(tmp_path, monkeypatch):
    if nvrtc_problem() or not nvrtc.available(torch.device("cuda")):
        pytest.fail(f"the GPU tests need the CUDA C++ kernels: {nvrtc_problem()}")
    monkeypatch.setenv("EXL3MOE_CACHE_DIR", str(tmp_path / "cubins"))
    return tmp_path / "cubins"


def cubins(directory):
    return {f for f in os.listdir(directory) if f.endswith(".cubin")} if os.path.isdir(directory) else set()


def test_warmup_compiles_what_the_checkpoints_plans_load(fixtures_dir, fresh_cache):
    reader = open_checkpoint(os.path.join(fixtures_dir, FIXTURE))
    device = torch.device("cuda")
    specs = checkpoint_specs(reader)
    first = warm(specs, device, report_console(), workers=4)
    assert first["compiled"] == first["variants"] > 0 and first["cached"] == 0
    assert all(cached(entry) for entry in variants(specs, device))
    assert len(cubins(fresh_cache)) == first["variants"]
    again = warm(specs, device, report_console(), workers=4)
    assert again["compiled"] == 0 and again["cached"] == first["variants"]
    nvrtc.kernel.cache_clear()   # plans below must go to the disk cache, not to this process's loaded modules
    for info in reader.linears():
        if ".experts." not in info.key:
            EXL3Linear.from_checkpoint(reader, info.key, device, max_rows=256)
    for prefix in reader.moe_layers():
        for tokens in MOE_TOKENS:
            EXL3MoE.from_checkpoint(reader, prefix, device, max_tokens=tokens)
    assert len(cubins(fresh_cache)) == first["variants"], "a plan compiled a variant warmup did not"


def test_warmup_command_says_where_the_cache_is(fixtures_dir, fresh_cache, capsys):
    assert main(["warmup", os.path.join(fixtures_dir, FIXTURE), "--workers", "4"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert str(fresh_cache) in out and "compiled" in out and "CUDA C++ kernels compiled by NVRTC" in out


def test_verify_says_it_ran_the_cuda_kernels(fixtures_dir, fresh_cache, capsys):
    assert main(["verify", os.path.join(fixtures_dir, FIXTURE)]) == 0
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if line.startswith(("lm_head", "model.layers."))]
    assert len(rows) == 11 and all("CUDA C++" in row and " ok " in row for row in rows)
    assert torch.cuda.get_device_name() in " ".join(out.split()) and "PASS" in out


def test_labels_follow_the_kernel_switch(fixtures_dir, monkeypatch, capsys):
    monkeypatch.setenv("EXL3MOE_CUDA_KERNELS", "0")
    assert main(["demo", "--tokens", "4"]) == 0
    out = capsys.readouterr().out
    text = " ".join(out.split())
    assert "Triton kernels on" in text and "EXL3MOE_CUDA_KERNELS=0" in text and "CUDA C++" not in text
    rows = [line for line in out.splitlines() if line.startswith(("routed MoE", "linear"))]
    assert len(rows) == 2 and all("Triton" in row for row in rows)
