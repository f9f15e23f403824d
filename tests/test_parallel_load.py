"""Per-rank loading of tensor-parallel slices: reader.linear(columns= / rows=) and experts(tensor_shard=) read only the
rank's byte ranges (every read recorded) and give the same weights as slicing the whole linear."""

import os

import pytest
import torch

from exl3moe.errors import ContractError
from exl3moe.format import safetensors_io
from exl3moe.format.checkpoint import open_checkpoint
from exl3moe.parallel.experts import expert_shard, tensor_shard
from exl3moe.parallel.split import column_shard, row_shard


@pytest.fixture(scope="module")
def reader(fixtures_dir):
    return open_checkpoint(os.path.join(fixtures_dir, "tiny_qwen3_moe_exl3"))


@pytest.fixture
def reads(monkeypatch):
    """[(tensor key, offset in the tensor, bytes)] of every range read_tensor_slice reads."""
    seen, read_range = [], safetensors_io.read_range

    def recording(handle, entry, offset, into):
        seen.append((entry.key, offset, len(into)))
        return read_range(handle, entry, offset, into)

    monkeypatch.setattr(safetensors_io, "read_range", recording)
    return seen


def same_weight(a, b) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a.stored_tensors().values(), b.stored_tensors().values())) and \
        a.stored_tensors().keys() == b.stored_tensors().keys()


def test_column_slice_reads_one_strided_range_per_tile_row(reader, reads):
    key = "model.layers.0.self_attn.q_proj"                       # 256 x 256: two column blocks
    entry = reader.entry(f"{key}.trellis")
    k_tiles, n_tiles, words = entry.shape
    got = reader.linear(key, columns=(128, 256))
    assert same_weight(got, column_shard(reader.linear(key), 1, 2))
    trellis = [(offset, size) for name, offset, size in reads if name == entry.key]
    row_bytes, half = n_tiles * words * 2, 8 * words * 2
    assert trellis == [(i * row_bytes + half, half) for i in range(k_tiles)]
    assert sum(size for _, _, size in reads) == got.trellis.numel() * 2 + 128 * 2     # trellis half + svh half


def test_row_slice_reads_one_contiguous_range(reader, reads):
    key = "model.layers.1.self_attn.o_proj"
    entry = reader.entry(f"{key}.trellis")
    got = reader.linear(key, rows=(128, 256))
    assert same_weight(got, row_shard(reader.linear(key), 1, 2))
    assert [(o, s) for name, o, s in reads if name == entry.key] == [(entry.nbytes // 2, entry.nbytes // 2)]


def test_expert_tensor_shard_reads_only_its_slice_of_every_expert(reader, reads):
    prefix = "model.layers.1.mlp"
    whole = reader.experts(prefix)
    reads.clear()
    # the fixture's experts are 128 wide: one block, so a tensor shard over 2 ranks is refused
    with pytest.raises(ContractError, match=r"model\.layers\.1\.mlp\.experts intermediate.*leaves a rank with none"):
        reader.experts(prefix, tensor_shard=(0, 2))
    got = reader.experts(prefix, shard=(1, 2), tensor_shard=(0, 1))
    expected = tensor_shard(expert_shard(whole, 1, 2), 0, 1)
    for a, b in zip(got.gate + got.up + got.down, expected.gate + expected.up + expected.down):
        assert same_weight(a, b)
    assert {name.split(".experts.")[1].split(".")[0] for name, _, _ in reads} == {str(e) for e in range(8, 16)}


@pytest.mark.parametrize("span", [(0, 100), (128, 128), (0, 384), (-128, 128), (0.0, 128)])
def test_slices_off_the_block_grid_are_refused(reader, span):
    with pytest.raises(ContractError, match=r"q_proj \(columns\).*whole 128-wide blocks"):
        reader.linear("model.layers.0.self_attn.q_proj", columns=span)


def test_columns_and_rows_together_are_refused(reader):
    with pytest.raises(ContractError, match="columns or rows, not both"):
        reader.linear("model.layers.0.self_attn.q_proj", columns=(0, 128), rows=(0, 128))
