"""exl3moe quantize on the CPU: a tiny qwen3_moe (2 layers, 2 experts, random init) converted once, interrupted after
layer 0 and resumed; the checkpoint opens strictly, verify passes, its logits stay close to the original's."""

import hashlib
import json
import os

import pytest
import torch

from convert_models import FAST_ENCODE, save_tiny_model, tiny_config
from exl3moe.cli import main
from exl3moe.convert import quantize_model
from exl3moe.format.checkpoint import open_checkpoint
from exl3moe.hf.dense import dense_model

pytestmark = pytest.mark.usefixtures("one_torch_thread")

KL_BOUND_K4 = 2e-3   # mean per-token KL(original || quantized) at K4 (measured 4.6e-4)


class Interrupted(Exception):
    pass


def _digest(path: str) -> str:
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


@pytest.fixture(scope="module")
def converted(tmp_path_factory, one_torch_thread):
    root = tmp_path_factory.mktemp("convert")
    src, out = str(root / "in"), str(root / "out")
    model = save_tiny_model(src, tiny_config(layers=2, tied=False))

    def stop(unit, row):
        if unit == 0:
            raise Interrupted

    with pytest.raises(Interrupted):
        quantize_model(src, out, bits=4, head_bits=6, rows=256, device="cpu", on_unit=stop, **FAST_ENCODE)
    first = os.path.join(out, "model-00001-of-00003.safetensors")
    interrupted = {"files": sorted(os.listdir(out)), "digest": _digest(first), "mtime": os.stat(first).st_mtime_ns}
    report = quantize_model(src, out, bits=4, head_bits=6, rows=256, device="cpu", **FAST_ENCODE)
    return {"src": src, "out": out, "model": model, "report": report, "interrupted": interrupted, "first": first}


def test_interrupted_run_is_resumed_without_redoing_layer_0(converted):
    assert "exl3moe_progress.json" in converted["interrupted"]["files"]
    assert "config.json" not in converted["interrupted"]["files"]    # unfinished: no checkpoint yet
    report = converted["report"]
    assert report.resumed == [0]
    assert [row["unit"] for row in report.rows] == ["layer 0", "layer 1", "head"]
    assert _digest(converted["first"]) == converted["interrupted"]["digest"]
    assert os.stat(converted["first"]).st_mtime_ns == converted["interrupted"]["mtime"]
    assert not os.path.exists(os.path.join(converted["out"], "exl3moe_progress.json"))


def test_every_tensor_is_written_and_reads_back_strictly(converted):
    from safetensors import safe_open

    reader = open_checkpoint(converted["out"])          # strict: manifest, markers, architecture's linears
    with safe_open(os.path.join(converted["src"], "model.safetensors"), "pt") as f:
        source_keys = list(f.keys())
    written = set(reader.keys())
    for key in source_keys:
        module = key.rsplit(".", 1)[0]
        assert key in written or f"{module}.trellis" in written, key
    linears = {info.key: info for info in reader.linears()}
    assert len(linears) == 2 * (4 + 2 * 3) + 1
    assert linears["lm_head"].K == 6 and all(i.K == 4 for k, i in linears.items() if k != "lm_head")
    qc = reader.config["quantization_config"]
    assert qc == {"quant_method": "exl3", "bits": 4.0, "head_bits": 6, "codebook": "mcg"}
    with open(os.path.join(converted["out"], "quantization_config.json")) as f:
        assert set(json.load(f)["tensor_storage"]) >= set(linears)
    assert os.path.isfile(os.path.join(converted["out"], "generation_config.json"))   # copied from the input
    rows = converted["report"].rows
    assert all(0 < row["proxy_error"] < 0.01 for row in rows)


def test_verify_passes_on_the_converted_checkpoint(converted):
    assert main(["verify", converted["out"], "--device", "cpu"]) == 0


def test_logits_stay_within_the_kl_bound(converted):
    quantized = dense_model(converted["out"])
    ids = torch.randint(0, 128, (2, 64), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        p = converted["model"](ids).logits.log_softmax(-1)
        q = quantized(ids).logits.log_softmax(-1)
    kl = float((p.exp() * (p - q)).sum(-1).mean())
    print(f"mean KL at K4: {kl:.3g}")
    assert 0 < kl < KL_BOUND_K4


def test_the_command_converts_a_model_end_to_end(tmp_path, capsys):
    src, out = str(tmp_path / "in"), str(tmp_path / "out")
    save_tiny_model(src, tiny_config(layers=1, tied=False))
    assert main(["quantize", src, out, "--bits", "3", "--rows", "32", "--device", "cpu", "--fast"]) == 0
    table = capsys.readouterr().out
    assert "layer 0" in table and "head" in table
    reader = open_checkpoint(out)
    assert {info.K for info in reader.linears()} == {3, 6}          # every linear at --bits, the head at its default
    assert main(["quantize", src, out, "--bits", "3", "--device", "cpu"]) == 2, "an existing OUT_DIR needs --force"
