"""Test configuration shared by every test module.

The Triton interpreter must be switched on before anything imports triton, and only when
there is no CUDA device: then the same tests run the real kernels on a GPU unchanged.
"""

import os

import pytest


def _cuda_available() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except Exception:  # pragma: no cover - torch is a hard dependency
        return False


if not _cuda_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

HAS_CUDA = _cuda_available()
DEVICE = "cuda" if HAS_CUDA else "cpu"


def pytest_collection_modifyitems(config, items):
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device")
    skip_slow = pytest.mark.skip(reason="slow test: set TILELLM_SLOW=1 to run")
    run_slow = os.environ.get("TILELLM_SLOW") == "1"
    for item in items:
        if "gpu" in item.keywords and not HAS_CUDA:
            item.add_marker(skip_gpu)
        if "slow" in item.keywords and not run_slow:
            item.add_marker(skip_slow)


@pytest.fixture
def device() -> str:
    return DEVICE
