import os
import shutil

import pytest

if "TRITON_INTERPRET" not in os.environ and shutil.which("nvidia-smi") is None:
    os.environ["TRITON_INTERPRET"] = "1"

import torch  # noqa: E402

FIXTURES = os.path.join(os.path.dirname(__file__), "..", "..", "shared", "fixtures")


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (pytest -m gpu on the H200)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def fixtures_dir():
    path = os.path.abspath(os.environ.get("EXL3MOE_FIXTURES", FIXTURES))
    if not os.path.isdir(path):
        pytest.fail(f"fixtures not found at {path}; set EXL3MOE_FIXTURES")
    return path
