"""Paged MLA pool, request table, page allocator, page tables."""

from __future__ import annotations

import pytest
import torch

from mla_spec.kv_cache import (
    KVCacheFullError,
    MLATokenToKVPool,
    PageAllocator,
    ReqToTokenPool,
    assign_request_slots,
    build_block_tables,
    build_kv_indices,
)
from mla_spec.quant.fp8 import FP8_DTYPE


def test_page_allocator_full_and_free():
    a = PageAllocator(5)
    pages = a.alloc(3)
    assert pages == [0, 1, 2] and a.num_free == 2
    with pytest.raises(KVCacheFullError, match="asked for 4 pages, 2 of 5 free"):
        a.alloc(4)
    a.free(pages[:2])
    assert a.num_free == 4
    with pytest.raises(ValueError, match="not allocated"):
        a.free([0])


def test_req_to_token_pool():
    p = ReqToTokenPool(2, 16)
    assert p.req_to_token.shape == (2, 16) and p.req_to_token.dtype == torch.int32
    i, j = p.alloc(), p.alloc()
    with pytest.raises(KVCacheFullError, match="request table full"):
        p.alloc()
    p.free(i)
    assert p.alloc() == i and j != i


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, FP8_DTYPE])
def test_store_and_read(dtype):
    pool = MLATokenToKVPool(2, 4, 3, dtype, k_scale=0.5, v_scale=0.25,
                            kv_lora_rank=8, qk_rope_head_dim=4)
    loc = torch.tensor([0, 7, -1, 11])
    ckv, kpe = torch.randn(4, 8) * 100, torch.randn(4, 4)
    ckv[1, 0] = 1e6  # saturates in fp8, never NaN
    pool.store(1, loc, ckv, kpe)
    flat = pool.get_kv(1).view(-1, 12)
    assert pool.get_kv(0).float().abs().sum() == 0  # other layer untouched
    assert flat[[1, 2, 3]].float().abs().sum() == 0  # row with loc -1 skipped
    k, v = pool.read_rows(1, torch.tensor([0, 7, 11]))
    want = torch.cat([ckv, kpe], -1)[[0, 1, 3]]
    if dtype == FP8_DTYPE:
        assert torch.isfinite(k).all() and k[1, 0] == 448 * 0.5
        # stored x / k_scale; K reads * k_scale, V reads * v_scale
        stored = (want / 0.5).clamp(-448, 448)
        assert torch.allclose(k, (stored.to(FP8_DTYPE).float() * 0.5))
        assert torch.allclose(v, stored.to(FP8_DTYPE).float()[:, :8] * 0.25)
        assert pool.read_scales(1) == (0.5, 0.25)
    else:
        tol = 0 if dtype == torch.float32 else 1e-2
        assert torch.allclose(k, want.to(dtype).float(), rtol=tol)
        assert pool.read_scales(1) == (1.0, 1.0)
    assert pool.bytes_per_token() == 2 * 12 * torch.empty(0, dtype=dtype).element_size()


def test_scales_from_checkpoint_and_validation():
    pool = MLATokenToKVPool(3, 2, 4, FP8_DTYPE)
    n = pool.load_scales({
        "model.layers.1.self_attn.k_scale": torch.tensor(0.5),
        "model.layers.1.self_attn.v_scale": torch.tensor([0.25]),
        "model.layers.62.self_attn.k_scale": torch.tensor(9.0),  # out of range: ignored
        "model.layers.0.mlp.weight": torch.ones(1),
    })
    assert n == 2 and pool.k_scales == [1.0, 0.5, 1.0] and pool.v_scales[1] == 0.25
    assert pool.k_scale == [1.0, 0.5, 1.0] and pool.v_scale == [1.0, 0.25, 1.0]
    with pytest.raises(ValueError, match="positive"):
        MLATokenToKVPool(1, 1, 1, FP8_DTYPE, k_scale=0.0)
    with pytest.raises(ValueError, match="kv dtype"):
        MLATokenToKVPool(1, 1, 1, torch.int8)
    with pytest.raises(ValueError, match="last dims"):
        pool.store(0, torch.tensor([0]), torch.ones(1, 5), torch.ones(1, 64))


def test_page_tables():
    r2t = torch.zeros(4, 300, dtype=torch.int32)
    assign_request_slots(r2t, 1, [5, 2, 9], 64, 0, 130)
    assign_request_slots(r2t, 3, [7], 64, 0, 1)
    rpi = torch.tensor([1, 3, 0])
    bt = build_block_tables(r2t, rpi, [130, 1, 0], 64, pad_multiple=2)
    assert bt.dtype == torch.int32 and bt.shape == (3, 4)
    assert bt.tolist() == [[5, 2, 9, -1], [7, -1, -1, -1], [-1, -1, -1, -1]]
    assert r2t[1, 129] == 9 * 64 + 1
    indptr, indices, last = build_kv_indices(r2t, rpi, [130, 1, 0], 64)
    assert indptr.tolist() == [0, 3, 4, 4] and indices.tolist() == [5, 2, 9, 7]
    assert last.tolist() == [2, 1, 0]
    with pytest.raises(ValueError, match="more than"):
        assign_request_slots(r2t, 0, [1], 64, 0, 65)
