"""store_kv kernel vs its torch twin (interpreter on CPU, compiled on GPU)."""

from __future__ import annotations

import pytest
import torch

from mla_spec.kernels.ops.kv_store import store_kv, store_kv_ref
from mla_spec.quant.fp8 import FP8_DTYPE


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, FP8_DTYPE])
@pytest.mark.parametrize("n", [0, 1, 5])
def test_kernel_matches_twin(dtype, n, device):
    slots, dc, dp = 13, 24, 8  # non-power-of-two widths
    loc = torch.randperm(slots)[:n].to(device)
    if n > 2:
        loc[1] = -1  # padding row: skipped
    ckv = torch.randn(n, 1, dc, device=device) * 200  # [N, 1, D] accepted; fp8 saturates
    kpe = torch.randn(n, dp, device=device).to(torch.bfloat16)
    a = torch.randn(slots, dc + dp, device=device).to(dtype)
    b = a.clone()
    store_kv(a, loc, ckv, kpe, scale=0.5)
    store_kv_ref(b, loc, ckv, kpe, scale=0.5)
    if dtype == FP8_DTYPE:
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))
        assert torch.isfinite(a.float()).all()
    elif dtype == torch.bfloat16:
        torch.testing.assert_close(a.float(), b.float(), rtol=1e-2, atol=1e-2)
    else:
        assert torch.equal(a, b)


def test_width_mismatch():
    with pytest.raises(ValueError, match="cache row width"):
        store_kv(torch.zeros(4, 10), torch.tensor([0]), torch.ones(1, 4), torch.ones(1, 4))


def test_bad_rows_slots_and_devices():
    # regression: a slot past the cache was written out of bounds under the interpreter, a
    # row-count mismatch was reported as a width mismatch, and a layer past the pool was an
    # IndexError
    from mla_spec.kv_cache import MLATokenToKVPool

    buf = torch.zeros(8, 24 + 8)
    ckv, kpe = torch.randn(2, 24), torch.randn(2, 8)
    with pytest.raises(ValueError, match="slots 0..7"):
        store_kv(buf, torch.tensor([0, 8]), ckv, kpe)
    with pytest.raises(ValueError, match="has 2 rows; loc has 3"):
        store_kv(buf, torch.tensor([0, 1, 2]), ckv, kpe)
    with pytest.raises(ValueError, match="one device"):
        store_kv(buf, torch.tensor([0, 1]), ckv.to("meta"), kpe)
    pool = MLATokenToKVPool(1, 2, 4, torch.bfloat16, kv_lora_rank=24, qk_rope_head_dim=8)
    with pytest.raises(ValueError, match="layers 0..0"):
        pool.store(1, torch.tensor([0, 1]), ckv, kpe)
