import os
import shutil

import pytest

if "TRITON_INTERPRET" not in os.environ and shutil.which("nvidia-smi") is None:
    os.environ["TRITON_INTERPRET"] = "1"

import numpy as np  # noqa: E402
import torch  # noqa: E402


def _row_invariant_interpreter_dot() -> None:
    """The interpreter's tl.dot is numpy's matmul, whose BLAS may sum a row in an order that depends on where the row
    sits in the tile (OpenBLAS 0.3.31's AVX2 kernels do); a GPU's MMA never does, and the batch-invariance tests
    check the kernels' own ordering, so floating-point dots run through einsum's loops in fp32 instead."""
    from triton.runtime import interpreter

    matmul_dot = interpreter.InterpreterBuilder.create_dot

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        if a.dtype.primitive_bitwidth == 8 or b.dtype.primitive_bitwidth == 8 or d.data.dtype != np.float32:
            return matmul_dot(self, a, b, d, input_precision, max_num_imprecise_acc)
        product = np.einsum("...mk,...kn->...mn", a.data.astype(np.float32), b.data.astype(np.float32),
                            optimize=False)
        return interpreter.TensorHandle(product + d.data, d.dtype.scalar)

    interpreter.InterpreterBuilder.create_dot = create_dot


if os.environ.get("TRITON_INTERPRET") == "1":
    _row_invariant_interpreter_dot()

FIXTURES = os.path.join(os.path.dirname(__file__), "fixtures")


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (pytest -m gpu on the H200)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="module")
def one_torch_thread():
    """One torch thread for a module of many small CPU ops: on shared cores, hand-offs cost more than they bring."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def torch_path_one_thread():
    """The ops' torch path (no interpreter) on one torch thread, for modules of whole models (spawned ranks inherit
    both)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("TRITON_INTERPRET", "0")
        yield
    torch.set_num_threads(threads)


@pytest.fixture(params=["interpreter", "torch"])
def kernel_path(request, monkeypatch):
    """Each test twice: its kernels under the Triton interpreter, then on the torch path (no interpreter)."""
    if request.param == "torch":
        monkeypatch.setenv("TRITON_INTERPRET", "0")
    elif os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("needs TRITON_INTERPRET=1")
    return request.param


@pytest.fixture(scope="session")
def fixtures_dir():
    path = os.path.abspath(os.environ.get("EXL3MOE_FIXTURES", FIXTURES))
    if not os.path.isdir(path):
        pytest.fail(f"fixtures not found at {path}; set EXL3MOE_FIXTURES")
    return path
