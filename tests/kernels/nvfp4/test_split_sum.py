"""The split-K reduction kernel (``kernels/nvfp4/gemm.py``) against ``src.sum(1)``."""

from __future__ import annotations

import pytest
import torch

from mla_spec.kernels.nvfp4.gemm import sum_rows


@pytest.mark.triton
@pytest.mark.parametrize("r,s,n", [(1, 1, 1), (3, 5, 17), (2, 8, 1500), (4, 2, 1024)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_sum_rows_matches_twin(r, s, n, dtype, device):
    src = torch.randn(r, s, n + 3, device=device)[..., :n]  # rows with a padded stride
    dst = torch.full((r, n), float("nan"), device=device, dtype=dtype)
    sum_rows(src, dst)
    # one bf16 ulp: the CPU interpreter truncates on the cast where the GPU rounds to nearest
    tol = 8e-3 if dtype == torch.bfloat16 else 1e-5
    assert torch.allclose(dst.float(), src.sum(1).float(), rtol=tol, atol=tol)
