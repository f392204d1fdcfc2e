"""Seeds, device fixtures and the GPU skip markers."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from mla_spec.device import triton_interpreting

HAS_CUDA = torch.cuda.is_available()
GPU_COUNT = torch.cuda.device_count() if HAS_CUDA else 0


def cuda_capability() -> tuple[int, int] | None:
    return torch.cuda.get_device_capability() if HAS_CUDA else None


def pytest_collection_modifyitems(config, items):
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU; this machine has none")
    skip_multi = pytest.mark.skip(reason=f"needs >= 2 CUDA GPUs; this machine has {GPU_COUNT}")
    skip_triton = pytest.mark.skip(reason="needs TRITON_INTERPRET=1 on CPU or a GPU")
    for item in items:
        if "triton" in item.keywords and not (HAS_CUDA or triton_interpreting()):
            item.add_marker(skip_triton)
        if "gpu" in item.keywords and not HAS_CUDA:
            item.add_marker(skip_gpu)
        if "multigpu" in item.keywords and GPU_COUNT < 2:
            item.add_marker(skip_multi)


@pytest.fixture(autouse=True)
def _seed():
    random.seed(0)
    np.random.seed(0)
    torch.manual_seed(0)
    yield


@pytest.fixture
def device() -> torch.device:
    return torch.device("cuda" if HAS_CUDA else "cpu")
