"""exl3moe quantize / stages refuse bad input before writing anything (each names the tensor or option)."""

import json
import os

import pytest
import torch
from safetensors.torch import load_file, save_file

from convert_models import save_tiny_model, tiny_config
from exl3moe.cli import main
from exl3moe.convert import quantize_model
from exl3moe.convert.stages import make_stages
from exl3moe.errors import ContractError, FormatError
from exl3moe.hf.synthetic import write_synthetic_checkpoint


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("src") / "in")
    save_tiny_model(path, tiny_config())
    return path


def _copy_without(src: str, dst: str, drop: str) -> None:
    os.makedirs(dst)
    tensors = load_file(os.path.join(src, "model.safetensors"))
    del tensors[drop]
    save_file(tensors, os.path.join(dst, "model.safetensors"))
    with open(os.path.join(src, "config.json")) as f, open(os.path.join(dst, "config.json"), "w") as g:
        g.write(f.read())


def test_unsupported_architecture_is_refused(tmp_path, source):
    bad = tmp_path / "gpt2"
    bad.mkdir()
    (bad / "config.json").write_text(json.dumps({"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]}))
    out = tmp_path / "out"
    with pytest.raises(FormatError, match="model_type.*not supported|not supported"):
        quantize_model(str(bad), str(out), bits=4, device="cpu")
    assert not out.exists()


def test_missing_tensor_is_refused(tmp_path, source):
    missing = "model.layers.0.mlp.experts.1.down_proj.weight"
    _copy_without(source, str(tmp_path / "in"), missing)
    out = tmp_path / "out"
    with pytest.raises(FormatError) as err:
        quantize_model(str(tmp_path / "in"), str(out), bits=4, device="cpu")
    assert err.value.name == missing
    assert not out.exists()


@pytest.mark.parametrize("budget,codebook", [(1.5, "mcg"), (8.5, "mcg"), (1.5, "mul1"), (float("nan"), "mul1")])
def test_expert_budget_outside_the_widths_is_refused(tmp_path, source, budget, codebook):
    out = tmp_path / "out"
    with pytest.raises(ContractError, match="expert_bits"):
        quantize_model(source, str(out), bits=4, codebook=codebook, expert_bits=budget, device="cpu")
    assert not out.exists()


def test_half_integer_bits_need_mul1(tmp_path, source):
    with pytest.raises(ContractError, match="mul1"):
        quantize_model(source, str(tmp_path / "out"), bits=2.5, codebook="mcg", device="cpu")
    assert not (tmp_path / "out").exists()


def test_dims_not_multiple_of_128_are_refused(tmp_path):
    src = str(tmp_path / "in")
    save_tiny_model(src, tiny_config(head_dim=64))
    with pytest.raises(FormatError, match="multiples of 128"):
        quantize_model(src, str(tmp_path / "out"), bits=4, device="cpu")
    assert not (tmp_path / "out").exists()


def test_existing_out_dir_is_kept_without_force(tmp_path, source):
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    with pytest.raises(ContractError, match="--force"):
        quantize_model(source, str(out), bits=4, device="cpu")
    assert os.listdir(out) == ["keep.txt"] and (out / "keep.txt").read_text() == "mine"
    assert main(["quantize", source, str(out), "--bits", "4", "--device", "cpu"]) == 2
    assert os.listdir(out) == ["keep.txt"]


def test_stages_refuse_mismatched_shapes_and_architectures(tmp_path):
    base = str(tmp_path / "base")
    write_synthetic_checkpoint(base, tiny_config())
    target = str(tmp_path / "target")
    save_tiny_model(target, tiny_config())
    tensors = load_file(os.path.join(target, "model.safetensors"))
    tensors["model.layers.0.mlp.experts.0.up_proj.weight"] = torch.zeros(256, 128, dtype=torch.bfloat16)
    save_file(tensors, os.path.join(target, "model.safetensors"))
    out = tmp_path / "stages.safetensors"
    with pytest.raises(FormatError) as err:
        make_stages(base, target, str(out), device="cpu")
    assert err.value.name == "model.layers.0.mlp.experts.0.up_proj.weight" and "differs" in err.value.rule
    other = str(tmp_path / "mixtral")
    save_tiny_model(other, tiny_config("mixtral"))
    with pytest.raises(FormatError, match="model_type"):
        make_stages(base, other, str(out), device="cpu")
    with pytest.raises(ContractError, match="K"):
        make_stages(base, target, str(out), stage_bits=2.5, device="cpu")
    assert not out.exists()
