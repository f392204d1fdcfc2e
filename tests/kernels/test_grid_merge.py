"""The split-KV merge inside the wgmma split kernel (``csrc/sm90_grid_merge.cuh``): its torch
twin (``mla_spec.kernels.grid_merge``) against the combine's reference on the CPU, and on an
H200 the kernel with the merge against the reference and against the combine kernel."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from mla_spec.kernels import mla_decode_wgmma as mw
from mla_spec.kernels.launch.arrival import arrival_counters
from mla_spec.kernels.grid_merge import grid_merge_ref, merge_chunk_ranges
from mla_spec.kernels.mla_decode import mla_decode_ref
from mla_spec.kernels.mla_decode_combine import combine_splits_ref
from mla_spec.kernels.mla_decode_paged import PAGED_VARIANTS, mla_decode_paged
from mla_spec.quant.fp8 import FP8_DTYPE

DV, DPE, SM, PAGE = 512, 64, 0.1352338, 64


@given(rows=st.integers(0, 70), splits=st.integers(1, 300))
@settings(max_examples=200, deadline=None)
def test_every_chunk_is_merged_once(rows, splits):
    seen = []
    for lo, hi in merge_chunk_ranges(rows, splits):
        seen += range(lo, hi)
    assert seen == list(range(rows * 64))


def test_ranges_reject_nonsense():
    with pytest.raises(ValueError, match="splits >= 1"):
        merge_chunk_ranges(4, 0)


def _partials(splits, rows, seed, empty=()):
    g = torch.Generator().manual_seed(seed)
    part = torch.randn(splits, rows, DV, generator=g)
    lse = torch.randn(splits, rows, generator=g) * 6
    for s, r in empty:  # a split that saw no KV: -inf and a partial it never finished
        lse[s, r] = -math.inf
        part[s, r] = float("nan")
    return part, lse


@pytest.mark.parametrize("splits,rows", [(1, 1), (2, 3), (7, 32), (16, 5), (17, 2), (128, 32),
                                         (300, 3)])
def test_twin_matches_the_combine_reference(splits, rows):
    empty = [(s, s % rows) for s in range(0, splits, 3)]
    part, lse = _partials(splits, rows, seed=splits * 7 + rows, empty=empty)
    lse[:, rows - 1] = -math.inf  # a row no split saw: zeros and -inf
    out, lse_out = grid_merge_ref(part, lse)
    ref = torch.empty(rows, 1, DV)
    ref_lse = torch.empty(rows, 1)
    combine_splits_ref(part, lse, ref, ref_lse)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, ref[:, 0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lse_out, ref_lse[:, 0], rtol=1e-5, atol=1e-5)
    assert not out[rows - 1].any() and lse_out[rows - 1] == -math.inf


def test_twin_rejects_mismatched_lse():
    with pytest.raises(ValueError, match="part_lse must be"):
        grid_merge_ref(torch.zeros(2, 3, DV), torch.zeros(3, 2))


def test_merge_is_taken_only_where_every_cta_fits(monkeypatch):
    key = mw.WgmmaKind().key(torch.bfloat16)
    assert key in mw._MERGE_KEYS and mw.WgmmaKind().key(FP8_DTYPE) in mw._MERGE_KEYS
    assert mw.WgmmaKind(rows_m=True, block_m=64).key(torch.bfloat16) not in mw._MERGE_KEYS
    assert mw.WgmmaKind.of(PAGED_VARIANTS["WE8"]).key(FP8_DTYPE) not in mw._MERGE_KEYS
    monkeypatch.setattr(mw, "sm_count", lambda device: 132)
    monkeypatch.setattr(mw, "GRID_MERGE", True)
    dev = torch.device("cpu")
    assert mw.grid_merges(key, 128, 128, 32, dev) and mw.grid_merges(key, 64, 128, 32, dev)
    assert mw.grid_merges(key, 2, 132, 1, dev)  # one row: 32 chunks a CTA, 2 passes
    assert not mw.grid_merges(key, 1, 4, 32, dev)  # one split: nothing to merge
    assert not mw.grid_merges(key, 128, 133, 32, dev)  # a CTA would wait for one not resident
    assert not mw.grid_merges(key, 32, 128, 32, dev)  # 64 chunks a CTA: 4 passes
    monkeypatch.setattr(mw, "GRID_MERGE", False)
    assert not mw.grid_merges(key, 128, 128, 32, dev)


gpu = pytest.mark.skipif(not torch.cuda.is_available() or
                         torch.cuda.get_device_capability() != (9, 0),
                         reason="the wgmma kernels need an sm_90 GPU")


def _case(lens, h, q_len, seed, kv_dtype=torch.bfloat16):
    g = torch.Generator().manual_seed(seed)
    bs = len(lens)
    pages_per = [-(-max(n, 1) // PAGE) for n in lens]
    perm = torch.randperm(sum(pages_per) + 1, generator=g)
    kv = torch.randn(len(perm) * PAGE, DV + DPE, generator=g)
    r2t = torch.zeros(bs, max(lens) + PAGE, dtype=torch.int32)
    used = 0
    for i, n in enumerate(lens):
        pos = torch.arange(n)
        r2t[i, :n] = (perm[used + pos // PAGE] * PAGE + pos % PAGE).int()
        used += pages_per[i]
    qn = torch.randn(bs * q_len, h, DV, generator=g).to(torch.bfloat16)
    qp = torch.randn(bs * q_len, h, DPE, generator=g).to(torch.bfloat16)
    kvq = kv.to(kv_dtype) if kv_dtype == FP8_DTYPE else kv.to(torch.bfloat16)
    return [t.cuda() for t in (qn, qp, kvq, r2t, torch.arange(bs, dtype=torch.int32),
                               torch.tensor(lens, dtype=torch.int32))]


def _run(args, q_len, splits, name="W", out=None):
    qn, qp, kv, r2t, rpi, kl = args
    return mla_decode_paged(qn, qp, kv, r2t, rpi, kl, SM, page_size=PAGE, q_len=q_len,
                            num_splits=splits, config=PAGED_VARIANTS[name],
                            max_kv=r2t.shape[1], return_lse=True, out=out)


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("lens,h,q_len,splits,name", [
    ([32768], 32, 1, 128, "W"),
    ([5000, 0, 1], 20, 2, 7, "W"),        # 40 rows: two row blocks; empty and one-token requests
    ([4099, 65], 32, 1, 33, "W"),         # 33 splits: 64 chunks a CTA's share is uneven
    ([777], 16, 3, 32, "W16"),
    ([3000, 129], 32, 1, 16, "W"),
])
@pytest.mark.parametrize("kv_dtype", [torch.bfloat16, FP8_DTYPE])
def test_merge_in_the_grid_matches_the_reference_and_the_combine(lens, h, q_len, splits, name,
                                                                  kv_dtype, monkeypatch):
    """Irregular shapes take the merge whatever its passes (it is faster only at few, but the
    code is the same for any number)."""
    monkeypatch.setattr(mw, "MERGE_MAX_PASSES", 1 << 20)
    monkeypatch.setattr(mw, "GRID_MERGE", True)
    args = _case(lens, h, q_len, seed=splits + h, kv_dtype=kv_dtype)
    bm = PAGED_VARIANTS[name].block_m
    ctas = splits * len(lens) * -(-(h * q_len) // bm)
    assert mw.grid_merges(mw.WgmmaKind.of(PAGED_VARIANTS[name]).key(kv_dtype), splits, ctas,
                          min(bm, h * q_len), args[0].device)
    out, lse = _run(args, q_len, splits, name)
    monkeypatch.setattr(mw, "GRID_MERGE", False)
    out_c, lse_c = _run(args, q_len, splits, name)
    qn, qp, kv, r2t, rpi, kl = args
    ref, ref_lse = mla_decode_ref(qn, qp, kv, r2t, rpi, kl, SM, q_len=q_len, return_lse=True)
    torch.cuda.synchronize()
    assert torch.isfinite(out).all()
    scale = ref.float().abs().max()
    assert ((out.float() - ref.float()).abs().max() / scale).item() < 2e-2
    assert ((out.float() - out_c.float()).abs().max() / scale).item() < 1e-2
    torch.testing.assert_close(lse, lse_c, rtol=1e-4, atol=1e-4)
    empty = kl.repeat_interleave(q_len) == 0
    assert not out[empty].any() and (lse[empty] == -math.inf).all()
    torch.testing.assert_close(lse[~empty], ref_lse[~empty].float(), rtol=2e-3, atol=2e-3)


@gpu
@pytest.mark.gpu
def test_merge_survives_graph_replays(monkeypatch):
    """The split barriers' counters are back at zero after every call: many eager calls and a
    graph replayed many times on a side stream give the same result (a broken barrier hangs,
    traps or reads a split's stale partial)."""
    monkeypatch.setattr(mw, "GRID_MERGE", True)
    args = _case([9000, 300], 32, 1, seed=5)
    assert mw.grid_merges(mw.WgmmaKind().key(torch.bfloat16), 64, 128, 32, args[0].device)
    first, _ = _run(args, 1, 64)
    for _ in range(50):
        again, _ = _run(args, 1, 64)
    torch.testing.assert_close(again, first, rtol=0, atol=0)
    out = torch.empty_like(first)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        _run(args, 1, 64, out=out)  # warm-up
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            _run(args, 1, 64, out=out)
        for _ in range(100):
            graph.replay()
    stream.synchronize()
    torch.testing.assert_close(out, first, rtol=0, atol=0)
    assert not arrival_counters(2, args[0].device)[:2].any()
