"""mla_decode_paged's Triton kernels (paged, swap AB, V-split; interpreter on CPU) vs the twin
and the oracle.

Tiny dims (Dv 32, Dpe 16, page 8, BLOCK_N 8, BLOCK_M 16); H = 3 is not a power of two. Pages are
shuffled, lengths irregular (0-prefix, 1-row, partial last pages). The TMA variant (device-side
tensor descriptors) runs in the interpreter too; fp8 runs the fp16-MMA path. On a GPU the same
cases run with page 16, BLOCK_N 16 (``_tiles``) and Dv 64: an MMA's K must be >= 16 there.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from mla_spec.attention.synthetic import make_scene
from mla_spec.attention.torch_ref import mla_attention_ref
from mla_spec.forward_mode import ForwardMode
from mla_spec.kernels.mla import PagedConfig, mla_decode_paged, mla_decode_ref, paged_supported
from mla_spec.quant.fp8 import FP8_DTYPE

SM = 0.3
PAGE = 8
DIMS = dict(kv_lora_rank=32, qk_rope_head_dim=16)


def _page(device) -> int:
    return 2 * PAGE if torch.device(device).type == "cuda" else PAGE


def _tiles(cfg: PagedConfig, device) -> PagedConfig:
    """The interpreter's tiles on CPU; on a GPU the smallest a compiled MMA takes (K >= 16)."""
    if torch.device(device).type != "cuda":
        return cfg
    return dataclasses.replace(cfg, block_n=max(cfg.block_n, 16))


def _scene(mode, prefix, q, kvd, device, **kw):
    # on a GPU Dv 64: a V-split of 4 siblings multiplies Dv / 4 = 16 columns (an MMA's K >= 16)
    dims = dict(DIMS, kv_lora_rank=64) if torch.device(device).type == "cuda" else DIMS
    return make_scene(mode, prefix, q, num_heads=3, kv_dtype=kvd, device=device,
                      page_size=_page(device), k_scale=0.75, v_scale=0.5, q_dtype=torch.bfloat16,
                      **dims, **kw)


def _run(sc, cfg, splits, ragged=False, part_lse=True):
    b, pool = sc.batch, sc.pool
    cfg = _tiles(cfg, sc.q_nope.device)
    flat = pool.get_kv(0).view(pool.num_slots, -1)
    ks, vs = pool.read_scales(0)
    r2t = sc.req_pool.req_to_token
    shape = (dict(qo_indptr=b.qo_indptr.to(torch.int32), max_q=b.max_seq_len_q) if ragged
             else dict(q_len=b.seq_lens_q_cpu[0]))
    o, lse = mla_decode_paged(sc.q_nope, sc.q_pe, flat, r2t, b.req_pool_indices, b.kv_lens, SM,
                              page_size=pool.page_size, k_scale=ks, v_scale=vs,
                              num_splits=splits,
                              return_lse=True, config=cfg, max_kv=b.max_kv_len, **shape)
    ref, lse_ref = mla_attention_ref(sc.q_nope, sc.q_pe, flat, r2t, b.req_pool_indices.tolist(),
                                     b.seq_lens_q_cpu, b.kv_lens_cpu, SM, ks, vs,
                                     return_lse=True)
    twin = mla_decode_ref(sc.q_nope, sc.q_pe, flat, r2t, b.req_pool_indices, b.kv_lens, SM,
                          k_scale=ks, v_scale=vs,
                          **{k: v for k, v in shape.items() if k != "max_q"})
    return o, lse, ref, lse_ref, twin


@pytest.mark.parametrize("kvd", [torch.bfloat16, FP8_DTYPE])
@pytest.mark.parametrize("cfg,splits", [
    (PagedConfig(16, 8, 4, 1), 1),
    (PagedConfig(16, 8, 4, 1, tma=True), 3),
    (PagedConfig(16, 8, 4, 1, part_bf16=True), 2),
])
def test_fixed_q_len_matches_oracle(kvd, cfg, splits, device):
    # verify: 3 rows per request, a 0-prefix request, last pages partly used
    sc = _scene(ForwardMode.TARGET_VERIFY, [0, 1, 37], [3, 3, 3], kvd, device,
                num_draft_tokens=3)
    o, lse, ref, lse_ref, twin = _run(sc, cfg, splits)
    tol = 2e-2 if cfg.part_bf16 else 1e-2  # bf16 output (and partial) rounding
    torch.testing.assert_close(o.float(), ref.float(), rtol=tol, atol=tol)
    torch.testing.assert_close(o.float(), twin.float(), rtol=tol, atol=tol)
    torch.testing.assert_close(lse, lse_ref, rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("splits", [1, 4])
def test_ragged_with_empty_requests(splits, device):
    sc = _scene(ForwardMode.EXTEND, [5, 0, 20, 3], [2, 0, 5, 1], torch.bfloat16, device)
    o, lse, ref, lse_ref, _ = _run(sc, PagedConfig(16, 8, 4, 1), splits, ragged=True)
    torch.testing.assert_close(o.float(), ref.float(), rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(lse, lse_ref, rtol=1e-2, atol=1e-2)


def test_fp8_fp16_path_handles_large_and_tiny_queries(device):
    # the power-of-two query pre-scale keeps fp16 exact-ish for |q| far outside fp16's range
    sc = _scene(ForwardMode.DECODE, [9, 30], [1, 1], FP8_DTYPE, device)
    for amp in (3e5, 1e-6):
        sc.q_nope.mul_(amp)
        sc.q_pe.mul_(amp)
        o, _, ref, _, _ = _run(sc, PagedConfig(16, 8, 4, 1), 2)
        assert torch.isfinite(o).all()
        torch.testing.assert_close(o.float(), ref.float(), rtol=2e-2, atol=2e-2)
        sc.q_nope.div_(amp)
        sc.q_pe.div_(amp)


def test_supported_and_validation(device):
    assert paged_supported(torch.device("cpu"), 512, 64, 6, torch.bfloat16,
                           PagedConfig(16, 4)) is not None  # 6 % 4
    assert paged_supported(torch.device("cpu"), 512, 64, 64, torch.float32) is not None
    sc = _scene(ForwardMode.DECODE, [4, 9], [1, 1], torch.bfloat16, device)
    with pytest.raises(ValueError, match="multiple of BLOCK_N"):
        _run(sc, PagedConfig(16, 2 * _page(device), 4, 1), 1)


# --- options with their own kernels: V-split (triton_vsplit) and swap AB (triton_paged: the
# KV tile on the MMA's M side) ---------------------------------------------------------------

SWAP_CASES = [
    (PagedConfig(16, 8, 4, 1, swap=True), 1),
    (PagedConfig(16, 8, 4, 1, tma=True, swap=True), 3),
    (PagedConfig(16, 8, 4, 1, part_bf16=True, swap=True), 2),
]

VSPLIT_CASES = [
    (PagedConfig(16, 8, 4, 1, vsplit=4), 1),
    (PagedConfig(16, 8, 4, 1, vsplit=4), 3),
    (PagedConfig(16, 8, 4, 1, part_bf16=True, vsplit=4), 2),
]


@pytest.mark.parametrize("kvd", [torch.bfloat16, FP8_DTYPE])
@pytest.mark.parametrize("cfg,splits", VSPLIT_CASES + SWAP_CASES,
                         ids=lambda c: getattr(c, "tag", c))
def test_vsplit_and_swap_fixed_match_oracle(kvd, cfg, splits, device):
    sc = _scene(ForwardMode.TARGET_VERIFY, [0, 1, 37], [3, 3, 3], kvd, device,
                num_draft_tokens=3)
    o, lse, ref, lse_ref, twin = _run(sc, cfg, splits)
    tol = 2e-2 if cfg.part_bf16 else 1e-2
    torch.testing.assert_close(o.float(), ref.float(), rtol=tol, atol=tol)
    torch.testing.assert_close(o.float(), twin.float(), rtol=tol, atol=tol)
    torch.testing.assert_close(lse, lse_ref, rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("cfg,splits,kvd", [
    (PagedConfig(16, 8, 4, 1, vsplit=4), 4, FP8_DTYPE),
    (PagedConfig(16, 8, 4, 1, tma=True, vsplit=4), 3, torch.bfloat16),  # 16-byte TMA boxes
], ids=lambda c: getattr(c, "tag", str(c)))
def test_vsplit_ragged_with_empty_requests(cfg, splits, kvd, device):
    # 0-row request, a split with no visible KV (4 splits of a 3-token request)
    sc = _scene(ForwardMode.EXTEND, [5, 0, 20, 3], [2, 0, 5, 1], kvd, device)
    o, lse, ref, lse_ref, _ = _run(sc, cfg, splits, ragged=True)
    torch.testing.assert_close(o.float(), ref.float(), rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(lse, lse_ref, rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("kvd,splits", [(torch.bfloat16, 4), (FP8_DTYPE, 1)])
def test_swapab_ragged_with_empty_requests(kvd, splits, device):
    # 0-row request, splits with no visible KV, a 5-row request over 2 row blocks of 3 heads
    sc = _scene(ForwardMode.EXTEND, [5, 0, 20, 3], [2, 0, 5, 1], kvd, device)
    o, lse, ref, lse_ref, _ = _run(sc, PagedConfig(16, 8, 4, 1, swap=True), splits, ragged=True)
    torch.testing.assert_close(o.float(), ref.float(), rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(lse, lse_ref, rtol=1e-2, atol=1e-2)


def test_swap_excludes_vsplit_and_vsplit_is_four():
    with pytest.raises(ValueError, match="swap excludes"):
        PagedConfig(32, 64, 8, 2, vsplit=4, swap=True)
    with pytest.raises(ValueError, match="vsplit is 1 or 4"):
        PagedConfig(32, 64, 8, 2, vsplit=2)
    assert PagedConfig(32, 64, 8, 2, swap=True).tag.endswith("S")


def test_vsplit_refuses_too_narrow_tma_boxes():
    # Dv 32 / 4 siblings = 8 e4m3 bytes a box: TMA needs 16
    sc = _scene(ForwardMode.DECODE, [4, 9], [1, 1], FP8_DTYPE, "cpu")
    with pytest.raises(ValueError, match="TMA boxes need >= 16 bytes"):
        _run(sc, PagedConfig(16, 8, 4, 1, tma=True, vsplit=4), 2)


def test_a_repeated_call_only_launches(monkeypatch):
    """Host work per call: the checks, the variant and the splits of a call signature are decided
    once; a second call with the same signature (new data) plans nothing and is still right."""
    from mla_spec.kernels.mla import paged

    planned = []
    real = paged._plan
    monkeypatch.setattr(paged, "_plan", lambda *a, **k: planned.append(1) or real(*a, **k))
    monkeypatch.setattr(paged, "_CALLS", {})
    sc = _scene(ForwardMode.TARGET_VERIFY, [5, 0, 19], [3, 3, 3], torch.bfloat16, "cpu",
                num_draft_tokens=3)
    cfg = PagedConfig(16, 8, 4, 1)
    o1, _, ref1, _, _ = _run(sc, cfg, 2)
    assert len(planned) == 1
    sc.q_nope.copy_(torch.randn_like(sc.q_nope))  # same signature, other queries
    o2, _, ref2, _, _ = _run(sc, cfg, 2)
    assert len(planned) == 1
    torch.testing.assert_close(o2.float(), ref2.float(), atol=2e-2, rtol=2e-2)
    assert not torch.equal(o1, o2)
    _run(sc, cfg, 3)  # another split count: another signature
    assert len(planned) == 2


def test_a_repeated_call_relaunches_its_bound_launches(monkeypatch):
    """After the first call of a signature the launcher's bound relaunch runs (on a GPU: the
    pointers and scales rewritten in prepared launches), with this call's tensors and scale; a
    changed kernel option rebinds."""
    from mla_spec.kernels import options
    from mla_spec.kernels.mla import paged

    launched, relaunched = [], []
    real = paged._launch

    def bound(call, args, qo, out, lse, scale, v_scale, q_len, early_kv):
        launched.append(scale)
        real(call, args, qo, out, lse, scale, v_scale, q_len, early_kv)

        def go(*a):  # what a GPU relaunch does, through the normal launch here
            relaunched.append(a[9])
            real(call, a[:6], a[6], a[7], a[8], a[9], a[10], q_len, early_kv)
            return True
        return go

    monkeypatch.setattr(paged, "_launch", bound)
    monkeypatch.setattr(paged, "_CALLS", {})
    sc = _scene(ForwardMode.DECODE, [5, 0, 19], [1, 1, 1], torch.bfloat16, "cpu")
    cfg = PagedConfig(16, 8, 4, 1)
    _run(sc, cfg, 2)
    sc.q_nope.copy_(torch.randn_like(sc.q_nope))
    o2, _, ref2, _, _ = _run(sc, cfg, 2)
    assert len(launched) == 1 and relaunched == launched
    torch.testing.assert_close(o2.float(), ref2.float(), atol=2e-2, rtol=2e-2)
    monkeypatch.setattr(options, "PDL", not options.PDL)
    _run(sc, cfg, 2)
    assert len(launched) == 2 and len(relaunched) == 1


def test_the_backend_plans_a_step_once(monkeypatch):
    """The triton backend's ``forward`` after ``plan``: the kernel call of a second layer with
    the same step (new queries) plans nothing."""
    from mla_spec.attention import create_backend
    from mla_spec.kernels.mla import paged

    planned = []
    real = paged._plan
    monkeypatch.setattr(paged, "_plan", lambda *a, **k: planned.append(1) or real(*a, **k))
    monkeypatch.setattr(paged, "_CALLS", {})
    sc = _scene(ForwardMode.DECODE, [7, 30, 1], [1, 1, 1], FP8_DTYPE, "cpu")
    be = create_backend("triton", num_heads=3, softmax_scale=SM, kv_pool=sc.pool,
                        req_to_token=sc.req_pool)
    be.plan(sc.batch)
    first = be.forward(sc.q_nope, sc.q_pe, 0, sc.batch)
    second = be.forward(sc.q_nope * 0.5, sc.q_pe, 0, sc.batch)
    assert len(planned) == 1
    assert not torch.equal(first, second)
