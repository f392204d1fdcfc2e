"""mla_decode (the Triton gather kernel, interpreter on CPU) and the split combine vs their
torch twins and the oracle.

Tiny generic dims (Dv 32, Dpe 16) keep the interpreter fast; H = 3 is not a power of two.
"""

from __future__ import annotations

import pytest
import torch

from mla_spec.attention.synthetic import make_scene
from mla_spec.attention.torch_ref import mla_attention_ref
from mla_spec.forward_mode import ForwardMode
from mla_spec.kernels.mla import (
    combine_splits,
    combine_splits_ref,
    mla_decode,
    mla_decode_paged,
    mla_decode_ref,
    pick_num_splits,
)
from mla_spec.kernels.pad import pad_draft_extend_query, unpad_draft_extend_output
from mla_spec.quant.fp8 import FP8_DTYPE

SM = 0.3
DIMS = dict(kv_lora_rank=32, qk_rope_head_dim=16)


def _scene(mode, prefix, q, kvd, device, **kw):
    return make_scene(mode, prefix, q, num_heads=3, kv_dtype=kvd, device=device,
                      k_scale=0.75, v_scale=0.5, **DIMS, **kw)


def _args(sc):
    b, pool = sc.batch, sc.pool
    flat = pool.get_kv(0).view(pool.num_slots, -1)
    ks, vs = pool.read_scales(0)
    return b, flat, ks, vs


def _oracle(sc, flat, ks, vs):
    b = sc.batch
    return mla_attention_ref(sc.q_nope, sc.q_pe, flat, sc.req_pool.req_to_token,
                             b.req_pool_indices.tolist(), b.seq_lens_q_cpu, b.kv_lens_cpu, SM,
                             ks, vs, return_lse=True)


@pytest.mark.parametrize("kvd", [torch.float32, torch.bfloat16, FP8_DTYPE])
@pytest.mark.parametrize("splits", [1, 3])
def test_fixed_q_len(kvd, splits, device):
    sc = _scene(ForwardMode.TARGET_VERIFY, [0, 1, 37], [3, 3, 3], kvd, device,
                num_draft_tokens=3)
    b, flat, ks, vs = _args(sc)
    r2t = sc.req_pool.req_to_token
    o, lse = mla_decode(sc.q_nope, sc.q_pe, flat, r2t, b.req_pool_indices, b.kv_lens, SM,
                        k_scale=ks, v_scale=vs, q_len=3, num_splits=splits, return_lse=True)
    o2, lse2 = mla_decode_ref(sc.q_nope, sc.q_pe, flat, r2t, b.req_pool_indices, b.kv_lens, SM,
                              k_scale=ks, v_scale=vs, q_len=3, return_lse=True)
    ref, lse_ref = _oracle(sc, flat, ks, vs)
    torch.testing.assert_close(o, o2, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(o, ref, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(lse, lse_ref, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(lse2, lse_ref, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("splits", [1, 4])
def test_ragged_with_empty_requests(splits, device):
    # EXTEND with a 0-row request and a 1-row one: no padding at all
    sc = _scene(ForwardMode.EXTEND, [5, 0, 20, 3], [2, 0, 5, 1], torch.bfloat16, device)
    b, flat, ks, vs = _args(sc)
    o = mla_decode(sc.q_nope, sc.q_pe, flat, sc.req_pool.req_to_token, b.req_pool_indices,
                   b.kv_lens, SM, k_scale=ks, v_scale=vs, qo_indptr=b.qo_indptr,
                   max_q=b.max_seq_len_q, num_splits=splits)
    ref, _ = _oracle(sc, flat, ks, vs)
    torch.testing.assert_close(o, ref, rtol=1e-4, atol=1e-5)


def test_padded_v1_end_aligned_is_exact_and_empty_rows_are_zero(device):
    # v1 draft extend, padded to max_q rows at the end of each block, run through the
    # fixed-q_len path; padding rows whose window is empty must be zeros (never NaN).
    sc = _scene(ForwardMode.DRAFT_EXTEND, [0, 6, 2], [1, 3, 2], torch.bfloat16, device,
                num_draft_tokens=4)
    b, flat, ks, vs = _args(sc)
    max_q = 4
    qn = pad_draft_extend_query(sc.q_nope, b.seq_lens_q, b.qo_indptr, max_q, align="end")
    qp = pad_draft_extend_query(sc.q_pe, b.seq_lens_q, b.qo_indptr, max_q, align="end")
    raw = mla_decode(qn, qp, flat, sc.req_pool.req_to_token, b.req_pool_indices, b.kv_lens, SM,
                     k_scale=ks, v_scale=vs, num_splits=2)  # [bs*max_q, H, Dv]
    assert torch.isfinite(raw).all()
    assert raw.view(3, max_q, 3, -1)[0, :2].abs().max() == 0  # kv_len 1: rows 0..1 see nothing
    o = unpad_draft_extend_output(raw.view(3, max_q, 3, -1), b.seq_lens_q, b.qo_indptr,
                                  b.total_q, align="end")
    ref, _ = _oracle(sc, flat, ks, vs)
    torch.testing.assert_close(o, ref, rtol=1e-4, atol=1e-5)


def test_out_path_and_validation(device):
    sc = _scene(ForwardMode.DECODE, [4, 9], [1, 1], torch.float32, device)
    b, flat, ks, vs = _args(sc)
    r2t = sc.req_pool.req_to_token
    out = torch.full_like(sc.q_nope, float("nan"))
    res = mla_decode(sc.q_nope, sc.q_pe, flat, r2t, b.req_pool_indices, b.kv_lens, SM, q_len=1,
                     out=out)
    assert res is out and torch.isfinite(out).all()
    with pytest.raises(ValueError, match="exactly one"):
        mla_decode(sc.q_nope, sc.q_pe, flat, r2t, b.req_pool_indices, b.kv_lens, SM)
    with pytest.raises(ValueError, match="powers of two"):
        mla_decode(sc.q_nope[..., :24], sc.q_pe, flat[:, :40], r2t, b.req_pool_indices,
                   b.kv_lens, SM, q_len=1)


@pytest.mark.parametrize("splits,rows", [(1, 10), (2, 10), (3, 10), (16, 10), (17, 10),
                                         (40, 10), (64, 10), (65, 10), (128, 10), (130, 10),
                                         (2, 300), (5, 300), (33, 300)])  # one block <= 128
def test_combine_kernel_matches_twin(splits, rows, device):
    """Every split block (2 ... 128, and the walk past 128), few rows and many (whole-row
    programs on the GPU)."""
    part = torch.randn(splits, rows, 32, device=device)
    lse = torch.randn(splits, rows, device=device) * 3
    lse[:, 4] = float("-inf")  # a row no split saw
    lse[splits // 2, 5] = float("-inf")
    part[splits // 2, 5] = float("nan")  # an empty split's partial is never read
    lse[: min(16, splits - 1), 7] = float("-inf")  # the first block empty, a later one not
    a, b = torch.empty(rows // 2, 2, 32, device=device), torch.empty(rows // 2, 2, 32,
                                                                     device=device)
    la, lb = torch.empty(rows // 2, 2, device=device), torch.empty(rows // 2, 2, device=device)
    combine_splits(part, lse, a, la)
    combine_splits_ref(part, lse, b, lb)
    assert torch.isfinite(a).all()
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(la, lb)
    assert a.view(rows, 32)[4].abs().max() == 0


def test_split_heuristic():
    assert pick_num_splits(1, 1, 4096, 64) == 32  # min 2 tiles per split
    assert pick_num_splits(1, 1, 65536, 64) == 64  # capped
    assert pick_num_splits(512, 2, 8192, 64) == 1
    assert pick_num_splits(1, 1, 0, 64) == 1


def test_bad_inputs_are_value_errors():
    # regression: int / mixed query dtypes, an int8 cache, kv_lens / qo_indptr of the wrong
    # length, q_pe with other rows or heads, a kv_len past req_to_token and inputs on two
    # devices ran (reading out of bounds) or failed with TypeError / RuntimeError
    sc = _scene(ForwardMode.DECODE, [4, 9], [1, 1], torch.bfloat16, "cpu")
    b, flat, _, _ = _args(sc)
    r2t, rpi, kvl = sc.req_pool.req_to_token, b.req_pool_indices, b.kv_lens
    qn, qp = sc.q_nope.to(torch.bfloat16), sc.q_pe.to(torch.bfloat16)
    i32 = lambda v: torch.tensor(v, dtype=torch.int32)
    cases = [
        ("share one dtype", (qn.int(), qp.int(), flat, r2t, rpi, kvl), {}),
        ("share one dtype", (qn.float(), qp, flat, r2t, rpi, kvl), {}),
        ("float8_e4m3fn", (qn, qp, flat.view(torch.int16), r2t, rpi, kvl), {}),
        ("kv_lens has 3", (qn, qp, flat, r2t, rpi, i32([4, 9, 1])), {}),
        ("qo_indptr has 2", (qn, qp, flat, r2t, rpi, kvl), {"qo_indptr": i32([0, 2])}),
        ("same N and H", (qn, qp[:1], flat, r2t, rpi, kvl), {}),
        ("same N and H", (qn, qp[:, :1], flat, r2t, rpi, kvl), {}),
        ("max_context_len", (qn, qp, flat, r2t, rpi, i32([4, r2t.shape[1] + 1])), {}),
        ("one device", (qn, qp, flat.to("meta"), r2t, rpi, kvl), {}),
    ]
    for fn, extra in ((mla_decode, {}), (mla_decode_paged, {"page_size": 32})):
        for match, args, kw in cases:
            kw = {"q_len": 1, **kw} if "qo_indptr" not in kw else kw
            with pytest.raises(ValueError, match=match):
                fn(*args, SM, **kw, **extra)
