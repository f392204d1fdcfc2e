"""Every backend x every forward mode x {bf16, fp8} KV against the oracle; the oracle against
float64; the FP8 error bound; the registry.

The triton backend runs under the interpreter on CPU; trtllm runs its plumbing with the torch
stand-in kernel (no Blackwell here); flashinfer needs a GPU (skipped on CPU).
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

from mla_spec.attention import backends_for_device, create_backend, resolve_auto
from mla_spec.attention.base import UnsupportedError
from mla_spec.attention.synthetic import ALL_MODES, make_scene
from mla_spec.attention.torch_ref import mla_attention_ref
from mla_spec.attention.trtllm_mla import reference_trtllm_kernel
from mla_spec.forward_mode import ForwardMode
from mla_spec.quant.fp8 import FP8_DTYPE, fp8_kv_attention_error_bound

SM = 0.25
DIMS = dict(kv_lora_rank=32, qk_rope_head_dim=16)
PREFIX, QLENS = [0, 37, 5, 70], [1, 3, 2, 1]  # irregular; request 0 has an empty prefix


def _make(name, sc, **kw):
    extra = {"kernel": reference_trtllm_kernel} if name == "trtllm" else {}
    return create_backend(name, num_heads=sc.q_nope.shape[1], softmax_scale=SM, kv_pool=sc.pool,
                          req_to_token=sc.req_pool, **extra, **kw)


BACKENDS = ["torch", "triton", "trtllm",
            pytest.param("flashinfer", marks=[
                pytest.mark.gpu,
                pytest.mark.skipif(importlib.util.find_spec("flashinfer") is None,
                                   reason="flashinfer-python is not installed (extra 'gpu')")])]


@pytest.mark.parametrize("kvd", [torch.bfloat16, FP8_DTYPE])
@pytest.mark.parametrize("mode", ALL_MODES, ids=lambda m: m.name)
@pytest.mark.parametrize("name", BACKENDS)
def test_backend_matches_oracle(name, mode, kvd, device):
    # FlashInfer's kernels only take DeepSeek's dims (see FlashInferMLABackend.dims_reason)
    dims = dict(kv_lora_rank=512, qk_rope_head_dim=64) if name == "flashinfer" else DIMS
    sc = make_scene(mode, PREFIX, QLENS, num_heads=3, num_draft_tokens=3, kv_dtype=kvd,
                    q_dtype=torch.bfloat16, page_size=32, device=device, k_scale=0.5,
                    v_scale=0.5, **dims)
    be = _make(name, sc)
    why = be.supports(mode, kvd)
    if why is not None:
        assert name == "trtllm" and not mode.is_idle()
        with pytest.raises(UnsupportedError, match="decode/verify"):
            be.forward(sc.q_nope, sc.q_pe, 0, sc.batch)
        pytest.skip(why)
    be.plan(sc.batch)
    out = be.forward(sc.q_nope, sc.q_pe, 0, sc.batch)
    ref = _make("torch", sc).forward(sc.q_nope, sc.q_pe, 0, sc.batch)
    assert out.shape == (sc.batch.total_q, 3, dims["kv_lora_rank"]) and out.dtype == sc.q_nope.dtype
    if mode.is_idle():
        return
    assert torch.isfinite(out).all()
    err = (out.float() - ref.float()).abs().max() / ref.float().abs().max()
    # bf16 output rounding: 1e-2. trtllm with FP8 KV also casts the queries to e4m3
    # (relative error <= 2**-4 per element), which moves the scores: 0.2.
    tol = 0.2 if (name == "trtllm" and kvd == FP8_DTYPE) else 1e-2
    assert err <= tol, f"{name} {mode.name}: rel err {err:.3g}"


@pytest.mark.parametrize("mode", [ForwardMode.TARGET_VERIFY, ForwardMode.DRAFT_EXTEND,
                                  ForwardMode.EXTEND], ids=lambda m: m.name)
def test_oracle_vs_float64(mode):
    sc = make_scene(mode, PREFIX, QLENS, num_heads=3, num_draft_tokens=3, **DIMS)
    b, pool = sc.batch, sc.pool
    flat = pool.get_kv(0).view(pool.num_slots, -1)
    args = (sc.q_nope, sc.q_pe, flat, sc.req_pool.req_to_token, b.req_pool_indices.tolist(),
            b.seq_lens_q_cpu, b.kv_lens_cpu, SM)
    o32 = mla_attention_ref(*args)
    o64 = mla_attention_ref(*args, compute_dtype=torch.float64)
    torch.testing.assert_close(o32.double(), o64.double().to(torch.float32).double(),
                               rtol=1e-5, atol=1e-6)


def test_fp8_cache_error_within_stated_bound():
    """Attention over an e4m3 cache vs the same rows in fp32, per request, <= the bound."""
    kw = dict(num_heads=3, page_size=32, seed=3, **DIMS)
    ref_sc = make_scene(ForwardMode.TARGET_VERIFY, PREFIX, [3] * 4, num_draft_tokens=3, **kw)
    f8_sc = make_scene(ForwardMode.TARGET_VERIFY, PREFIX, [3] * 4, num_draft_tokens=3,
                       kv_dtype=FP8_DTYPE, k_scale=0.05, v_scale=0.05, **kw)
    qn, qp = ref_sc.q_nope * 0.2, ref_sc.q_pe * 0.2
    o_ref = _make("torch", ref_sc).forward(qn, qp, 0, ref_sc.batch)
    o_f8 = _make("triton", f8_sc).forward(qn, qp, 0, f8_sc.batch)
    b, r2t = ref_sc.batch, ref_sc.req_pool.req_to_token
    flat = ref_sc.pool.get_kv(0).view(ref_sc.pool.num_slots, -1)
    for i in range(b.batch_size):
        rows = slice(int(b.qo_indptr[i]), int(b.qo_indptr[i + 1]))
        kv = flat[r2t[int(b.req_pool_indices[i]), : b.kv_lens_cpu[i]].long()]
        q = torch.cat([qn[rows], qp[rows]], -1).reshape(-1, 48)
        bound = fp8_kv_attention_error_bound(q, kv, 32, SM, 0.05)
        err = float((o_f8[rows] - o_ref[rows]).abs().max())
        assert err <= bound, (i, err, bound)
    # and in practice far below it: a few percent of the output scale
    assert float((o_f8 - o_ref).abs().max() / o_ref.abs().max()) < 0.05


def test_registry_auto_and_errors(caplog):
    sc = make_scene(ForwardMode.DECODE, [3], [1], **DIMS)
    kw = dict(num_heads=2, softmax_scale=SM, kv_pool=sc.pool, req_to_token=sc.req_pool)
    name, why = resolve_auto("cpu")
    assert name == "torch" and "cpu" in why
    with caplog.at_level("INFO", logger="mla_spec.attention"):
        assert create_backend("auto", **kw).name == "torch"
    assert "auto -> torch" in caplog.text
    with pytest.raises(UnsupportedError, match="Backends that can: torch, triton"):
        create_backend("flashinfer", **kw)
    with pytest.raises(UnsupportedError, match="trtllm"):
        create_backend("trtllm", **kw)
    with pytest.raises(ValueError, match="unknown attention backend"):
        create_backend("sdpa", **kw)
    table = backends_for_device("cpu")
    assert table["torch"] is None and table["flashinfer"] is not None
    be = create_backend("triton", **kw)
    assert be.supports(ForwardMode.DECODE, torch.int8).startswith("kv dtype int8")
    with pytest.raises(ValueError, match="expected"):
        be.forward(sc.q_nope[:, :1], sc.q_pe, 0, sc.batch)


def test_out_path_and_trtllm_page_size():
    sc = make_scene(ForwardMode.DECODE, [3, 9], [1, 1], page_size=4, **DIMS)
    be = create_backend("triton", num_heads=2, softmax_scale=SM, kv_pool=sc.pool,
                        req_to_token=sc.req_pool.req_to_token)
    out = torch.empty_like(sc.q_nope)
    assert be.forward(sc.q_nope, sc.q_pe, 0, sc.batch, out=out) is out
    with pytest.raises(ValueError, match="page_size 32 or 64"):
        _make("trtllm", sc)


@pytest.mark.gpu
@pytest.mark.parametrize("kvd", [torch.bfloat16, FP8_DTYPE])
@pytest.mark.parametrize("early_kv", [False, True])
def test_triton_cuda_graph_replay(early_kv, kvd):
    # early_kv: the replayed calls load their first KV tile before the PDL wait (the scene's
    # cache was written long before); the same bits as the eager call without it
    sc = make_scene(ForwardMode.TARGET_VERIFY, [100, 700], [4, 4], num_heads=16,
                    num_draft_tokens=4, kv_dtype=kvd, q_dtype=torch.bfloat16,
                    page_size=64, device="cuda")
    eager = _make("triton", sc)
    eager.plan(sc.batch)
    eager = eager.forward(sc.q_nope, sc.q_pe, 0, sc.batch)
    be = _make("triton", sc, early_kv=early_kv)
    be.plan(sc.batch)
    out = torch.empty_like(eager)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        be.forward(sc.q_nope, sc.q_pe, 0, sc.batch, out=out)
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        be.forward(sc.q_nope, sc.q_pe, 0, sc.batch, out=out)
    out.zero_()
    g.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, eager)


def test_flashinfer_dims_reason():
    from mla_spec.attention.flashinfer_mla import FlashInferMLABackend as FI

    assert FI.dims_reason(512, 64, FP8_DTYPE) is None
    assert FI.dims_reason(512, 64, torch.bfloat16) is None
    assert "512" in FI.dims_reason(256, 64, FP8_DTYPE)
    assert "multiple of 128" in FI.dims_reason(32, 16, torch.bfloat16)


@pytest.mark.parametrize("name", ["torch", "triton", "trtllm"])
def test_forward_rejects_bad_query_dtype_device_and_layer(name):
    # regression: int / mixed-dtype queries, queries on another device than the cache and an
    # out-of-range layer used to run (or fail deep inside) instead of a ValueError
    sc = make_scene(ForwardMode.DECODE, [5, 9], [1, 1], num_heads=2, page_size=32,
                    q_dtype=torch.bfloat16, kv_dtype=torch.bfloat16, **DIMS)
    be = _make(name, sc)
    qn, qp = sc.q_nope, sc.q_pe
    with pytest.raises(ValueError, match="queries must share one dtype"):
        be.forward(qn.to(torch.int32), qp.to(torch.int32), 0, sc.batch)
    with pytest.raises(ValueError, match="queries must share one dtype"):
        be.forward(qn.half(), qp, 0, sc.batch)
    with pytest.raises(ValueError, match="cache's device"):
        be.forward(qn.to("meta"), qp.to("meta"), 0, sc.batch)
    with pytest.raises(ValueError, match="layers 0..0"):
        be.forward(qn, qp, 1, sc.batch)


def test_trtllm_query_in_kv_dtype():
    # regression: with a bf16 cache, fp16 / fp32 queries reached the kernel uncast, but
    # trtllm-gen needs the query in the KV dtype
    sc = make_scene(ForwardMode.DECODE, [5, 9], [1, 1], num_heads=2, page_size=32,
                    q_dtype=torch.float32, kv_dtype=torch.bfloat16, **DIMS)
    seen = []

    def kernel(**kw):
        seen.append((kw["query"].dtype, kw["kv_cache"].dtype))
        return reference_trtllm_kernel(**kw)

    be = create_backend("trtllm", num_heads=2, softmax_scale=SM, kv_pool=sc.pool,
                        req_to_token=sc.req_pool, kernel=kernel)
    out = be.forward(sc.q_nope, sc.q_pe, 0, sc.batch)
    assert seen == [(torch.bfloat16, torch.bfloat16)] and out.dtype == torch.float32


def test_ragged_draft_extend_tile_choice_is_stable(monkeypatch):
    # v1 draft extend runs eagerly with 1..num_draft_tokens rows per request: the tile (a
    # compiled binary) is chosen from the bound, not from this step's longest accept
    import mla_spec.attention.triton_mla as tm
    from mla_spec.kernels.mla import PagedConfig

    seen, splits = [], []

    def record(rows, *a, **k):
        seen.append(rows)
        return PagedConfig(16, 8, 4, 1), None

    monkeypatch.setattr(tm, "paged_choice", record)
    shapes = []
    real = tm.mla_decode_paged

    def spy(*a, **k):
        shapes.append("qo_indptr" in k and "q_len" not in k)
        return real(*a, **k)

    monkeypatch.setattr(tm, "mla_decode_paged", spy)
    for qlens in ([1, 1], [2, 1], [3, 3]):
        sc = make_scene(ForwardMode.DRAFT_EXTEND, [5, 9], qlens, num_heads=3, num_draft_tokens=3,
                        page_size=8, kv_dtype=torch.bfloat16, q_dtype=torch.bfloat16, **DIMS)
        be = _make("triton", sc)
        plan = be.plan(sc.batch)
        splits.append(plan.extra["paged_splits"])
        out = be.forward(sc.q_nope, sc.q_pe, 0, sc.batch)
        ref = _make("torch", sc).forward(sc.q_nope, sc.q_pe, 0, sc.batch)
        torch.testing.assert_close(out.float(), ref.float(), rtol=1e-2, atol=1e-2)
    assert seen == [9, 9, 9]  # num_draft_tokens 3 x 3 heads
    assert min(splits) >= 2  # the split binary even for short contexts
    assert shapes == [True, True, True]  # ragged (RAGGED binary) even when all lengths agree


def test_triton_backend_passes_the_e4m3_queries_choice_on(monkeypatch):
    # on an FP8 cache the defaults may round the queries to e4m3 (WE2); the backend option
    # e4m3_queries=False reaches paged_choice, which then passes those kernels over
    import mla_spec.attention.triton_mla as tm
    from mla_spec.kernels.mla import PagedConfig

    seen = []

    def record(*a, **k):
        seen.append((k.get("e4m3_queries"), k.get("e4m3_probs")))
        return PagedConfig(16, 8, 4, 1), None

    monkeypatch.setattr(tm, "paged_choice", record)
    sc = make_scene(ForwardMode.DECODE, [5, 9], [1, 1], num_heads=3, page_size=8,
                    kv_dtype=FP8_DTYPE, q_dtype=torch.bfloat16, **DIMS)
    for flag in (True, False):
        be = create_backend("triton", num_heads=3, softmax_scale=SM, kv_pool=sc.pool,
                            req_to_token=sc.req_pool, e4m3_queries=flag)
        be.plan(sc.batch)
    be = create_backend("triton", num_heads=3, softmax_scale=SM, kv_pool=sc.pool,
                        req_to_token=sc.req_pool, e4m3_probs=False)  # WE8 -> WE2
    be.plan(sc.batch)
    assert seen == [(True, True), (False, True), (True, False)]


def test_triton_backend_asks_for_early_kv_loads_only_when_told_and_rows_are_fixed(monkeypatch):
    # early_kv (default off) reaches mla_decode_paged in the fixed-row modes; the ragged ones
    # (v1 draft extend, extend) never ask, whatever the option
    import mla_spec.attention.triton_mla as tm

    seen = []
    real = tm.mla_decode_paged

    def spy(*a, **k):
        seen.append(k["early_kv"])
        return real(*a, **k)

    monkeypatch.setattr(tm, "mla_decode_paged", spy)
    for mode in (ForwardMode.DECODE, ForwardMode.TARGET_VERIFY, ForwardMode.DRAFT_EXTEND):
        sc = make_scene(mode, [5, 9], [1, 2], num_heads=3, num_draft_tokens=2, page_size=8,
                        kv_dtype=torch.bfloat16, q_dtype=torch.bfloat16, **DIMS)
        for flag in (False, True):
            be = _make("triton", sc, early_kv=flag)
            be.plan(sc.batch)
            be.forward(sc.q_nope, sc.q_pe, 0, sc.batch)
    assert seen == [False, True, False, True, False, False]
