"""quantize_weight refuses bad input with a ContractError naming the tensor and the rule, before any work."""

import pytest
import torch

import exl3moe.quant.encoder as encoder
from exl3moe.errors import ContractError
from exl3moe.quant.checks import symmetric_psd_hessian
from helpers import random_weight


@pytest.fixture(autouse=True)
def no_work(monkeypatch):
    """Any refusal must come before the codebook ring is built, i.e. before any search."""
    def fail(*args, **kwargs):
        raise AssertionError("quantize_weight started work before refusing")
    monkeypatch.setattr(encoder, "tile_ring", fail)


def _w(k=128, n=128, seed=0):
    return torch.randn(k, n, generator=torch.Generator().manual_seed(seed))


def _refused(name, match, *args, call=encoder.quantize_weight, **kwargs):
    with pytest.raises(ContractError, match=match) as err:
        call(*args, **kwargs)
    assert err.value.name == name


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_non_finite_weights(bad):
    W = _w()
    W[3, 7] = bad
    _refused("W", "finite", W)


@pytest.mark.parametrize("shape", [(100, 128), (128, 200), (0, 128), (128, 64)])
def test_shapes_not_multiples_of_128(shape):
    _refused("W", "multiples of 128.*pad", torch.randn(*shape))


def test_weight_type_dtype_rank():
    _refused("W", "tensor", [[1.0]])
    _refused("W", "dtype", torch.ones(128, 128, dtype=torch.int32))
    _refused("W", "2-D", torch.ones(128 * 128))


@pytest.mark.parametrize("K, codebook, match", [(9, "mcg", "integer 1..8"), (0, "mcg", "integer 1..8"),
                                                (2.25, "mul1", "integer 1..8"), (4.5, "mul1", "integer 1..8"),
                                                (2.5, "mcg", "only with the mul1"), (True, "mcg", "integer")])
def test_bad_rates(K, codebook, match):
    _refused("K", match, _w(), K=K, codebook=codebook)


def test_bad_codebook():
    _refused("codebook", "one of", _w(), codebook="e8p")


def test_hessian_shape_and_values():
    W = _w()
    _refused("H", "\\[128, 128\\]", W, torch.eye(64))
    H = torch.eye(128)
    H[1, 2] = float("nan")
    _refused("H", "finite", W, H)
    _refused("H", "all zeros", W, torch.zeros(128, 128))


def test_non_symmetric_hessian_is_refused():
    X = torch.randn(512, 128, generator=torch.Generator().manual_seed(1))
    H = X.T @ X / 512
    H[0, 5] += 0.5
    _refused("H", "not symmetric", _w(), H)


def test_hopeless_hessian_is_refused():
    _refused("H", "mean diagonal", _w(), -torch.eye(128))
    H = torch.eye(128)
    H[0, 0] = -20.0
    _refused("H", "not positive semidefinite", _w(), H)


def test_slightly_indefinite_or_asymmetric_hessian_is_regularised():
    X = torch.randn(64, 128, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    H = X.T @ X / 64                        # rank 64: eigenvalues down to 0
    H = H - 0.01 * torch.eye(128, dtype=torch.float64)
    H[3, 4] += 1e-6                          # rounding-level asymmetry
    fixed, shift = symmetric_psd_hessian(H)
    assert shift == pytest.approx(0.01, rel=1e-4)
    assert torch.equal(fixed, fixed.T)
    assert float(torch.linalg.eigvalsh(fixed)[0]) >= -1e-9


def test_batches_of_mixed_shapes_or_lengths():
    batch = encoder.quantize_weights
    _refused("Ws", "non-empty list", [], call=batch)
    _refused("W[1]", "differs from the first", [_w(), _w(256, 128)], call=batch)
    _refused("Hs", "list of 2", [_w(), _w(seed=1)], [torch.eye(128)], call=batch)
    asymmetric = torch.eye(128)
    asymmetric[0, 9] = 1.0
    _refused("H[1]", "not symmetric", [_w(), _w(seed=1)], [torch.eye(128), asymmetric], call=batch)


def test_bad_options():
    W = _w()
    _refused("damp", "number >= 0", W, damp=-1)
    _refused("scale", "positive finite", W, scale=0.0)
    _refused("scale_tiles", "integer >= 1", W, scale_tiles=0)
    _refused("sweeps", "integer >= 0", W, sweeps=1.5)
    _refused("channel_power", "in \\[0, 2\\]", W, channel_power=-1)
    _refused("device", "not a torch device", W, device="gpu7")
    _refused("init", "EXL3Weight", W, init=torch.zeros(3))
    _refused("init", "K=4", W, K=3, init=random_weight(128, 128, K=4, codebook="mcg"))
    _refused("init", "3inst", W, K=4, init=random_weight(128, 128, K=4, codebook="3inst"))
