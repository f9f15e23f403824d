"""The `generate` and `bench-model` commands (exl3moe.hf_commands) on the CPU: parsing, streamed text equal to
generate()'s greedy tokens, the rate lines, refusals."""

import argparse
import os

import pytest
import torch

import transformers  # noqa: E402  (the hf extra; make test installs it)

import exl3moe.hf as hf  # noqa: E402
from exl3moe.hf_commands import add_bench_model_parser, add_generate_parser  # noqa: E402

CHECKPOINT = "tiny_qwen3_moe_exl3"
PROMPT = "The quick brown fox"


@pytest.fixture
def parser():
    p = argparse.ArgumentParser(prog="exl3moe")
    sub = p.add_subparsers(dest="command")
    add_generate_parser(sub)
    add_bench_model_parser(sub)
    return p


@pytest.fixture
def torch_path(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def test_generate_streams_greedy_text_and_rates(parser, fixtures_dir, capsys, torch_path):
    path = os.path.join(fixtures_dir, CHECKPOINT)
    args = parser.parse_args(["generate", path, "--prompt", PROMPT, "--max-new-tokens", "6", "--device", "cpu"])
    assert args.func(args) == 0
    out = capsys.readouterr().out
    tokenizer = transformers.AutoTokenizer.from_pretrained(path, local_files_only=True)
    ids = tokenizer(PROMPT, return_tensors="pt").input_ids
    with torch.no_grad():
        tokens = hf.from_pretrained(path, device="cpu").generate(ids, max_new_tokens=6, do_sample=False)
    text = tokenizer.decode(tokens[0, ids.shape[1]:], skip_special_tokens=True)
    assert text and out.startswith(text)
    new = tokens.shape[1] - ids.shape[1]
    assert f"prefill: {ids.shape[1]} tokens in " in out and f"decode: {new - 1} tokens in " in out
    assert out.count("tokens/s") == 2


def test_generate_reports_a_bad_checkpoint(parser, tmp_path, capsys):
    args = parser.parse_args(["generate", str(tmp_path), "--prompt", "x", "--device", "cpu"])
    assert args.func(args) == 1
    assert "error:" in capsys.readouterr().err


def test_generate_refuses_bad_arguments(parser, fixtures_dir, capsys):
    path = os.path.join(fixtures_dir, CHECKPOINT)
    args = parser.parse_args(["generate", path, "--prompt", "x", "--max-new-tokens", "0"])
    assert args.func(args) == 2


def test_bench_model_parsing_and_gpu_requirement(parser, capsys):
    args = parser.parse_args(["bench-model", "--synthetic", "qwen3-30b-a3b", "--layers", "4", "--out", "r.json"])
    assert (args.synthetic, args.layers, args.prefill, args.batches, args.K) == ("qwen3-30b-a3b", 4, [512, 2048],
                                                                                [1, 8, 32], 4)
    if not torch.cuda.is_available():
        assert args.func(args) == 2 and "needs a CUDA GPU" in capsys.readouterr().err
