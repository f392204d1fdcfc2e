"""mla_decode_paged (page-granular fast path; interpreter on CPU) vs the twin and the oracle.

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
from mla_spec.kernels.mla_decode import mla_decode_ref
from mla_spec.kernels.mla_decode_paged import (
    PagedConfig,
    mla_decode_paged,
    paged_supported,
    pick_num_splits_paged,
)
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


def test_split_cost_model():
    # batch 1: about two KV tiles per split at 4k, one at 1k, 8 at 32k (the H200 sweep's
    # winners, docs/bench_mla.md sixth session); big batches: no split
    assert pick_num_splits_paged(1, 2, 4096, 64, 32, 1152) == 32
    assert pick_num_splits_paged(1, 2, 1024, 64, 32, 1152) == 16
    assert pick_num_splits_paged(1, 2, 32768, 64, 32, 1152) == 64
    # G4 (4 siblings per row block) keeps two programs per SM: 64 splits are still one wave
    from mla_spec.kernels.mla_decode_tiles import PAGED_VARIANTS, splits_for
    assert splits_for(PAGED_VARIANTS["G4"], 1, 1, 32768, 32, 576) == 64
    assert pick_num_splits_paged(1, 1, 32768, 64, 32, 576, vsplit=4) == 32
    assert pick_num_splits_paged(128, 1, 8192, 64, 32, 1152) == 1
    assert pick_num_splits_paged(32, 1, 4096, 64, 32, 1152) == 4
    assert pick_num_splits_paged(1, 1, 0, 64, 32, 1152) == 1


# --- options with their own kernels: V-split / fused combine (mla_decode_vsplit) and swap AB
# (mla_decode_swapab: the KV tile on the MMA's M side) --------------------------------------

SWAP_CASES = [
    (PagedConfig(16, 8, 4, 1, swap=True), 1),
    (PagedConfig(16, 8, 4, 1, tma=True, swap=True), 3),
    (PagedConfig(16, 8, 4, 1, part_bf16=True, swap=True), 2),
]

VSPLIT_CASES = [
    (PagedConfig(16, 8, 4, 1, vsplit=2), 1),
    (PagedConfig(16, 8, 4, 1, vsplit=4), 3),
    (PagedConfig(16, 8, 4, 1, vsplit=2, fused=True), 3),
    (PagedConfig(16, 8, 4, 1, part_bf16=True, fused=True), 2),
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
    (PagedConfig(16, 8, 4, 1, vsplit=4, fused=True), 4, FP8_DTYPE),
    (PagedConfig(16, 8, 4, 1, tma=True, vsplit=2), 2, FP8_DTYPE),  # 16-byte TMA boxes
    (PagedConfig(16, 8, 4, 1, tma=True, vsplit=4, fused=True), 3, torch.bfloat16),
], ids=lambda c: getattr(c, "tag", str(c)))
def test_vsplit_ragged_with_empty_requests(cfg, splits, kvd, device):
    # 0-row request, a split with no visible KV (4 splits of a 3-token request)
    sc = _scene(ForwardMode.EXTEND, [5, 0, 20, 3], [2, 0, 5, 1], kvd, device)
    o, lse, ref, lse_ref, _ = _run(sc, cfg, splits, ragged=True)
    torch.testing.assert_close(o.float(), ref.float(), rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(lse, lse_ref, rtol=1e-2, atol=1e-2)


def test_fused_combine_resets_its_counters(device):
    # the counters are left zeroed, so a second launch (a graph replay) reuses them
    sc = _scene(ForwardMode.DECODE, [9, 30, 17], [1, 1, 1], torch.bfloat16, device)
    b, pool = sc.batch, sc.pool
    flat = pool.get_kv(0).view(pool.num_slots, -1)
    cnt = torch.zeros(16, dtype=torch.int32, device=device)
    cfg = _tiles(PagedConfig(16, 8, 4, 1, vsplit=2, fused=True), device)
    outs = [mla_decode_paged(sc.q_nope, sc.q_pe, flat, sc.req_pool.req_to_token,
                             b.req_pool_indices, b.kv_lens, SM, page_size=pool.page_size, q_len=1,
                             num_splits=3, config=cfg, counters=cnt) for _ in range(2)]
    assert int(cnt.abs().sum()) == 0
    torch.testing.assert_close(outs[0], outs[1], rtol=0, atol=0)
    with pytest.raises(ValueError, match="counters"):
        mla_decode_paged(sc.q_nope, sc.q_pe, flat, sc.req_pool.req_to_token,
                         b.req_pool_indices, b.kv_lens, SM, page_size=pool.page_size, q_len=1,
                         num_splits=3, config=cfg, counters=cnt[:2])


def test_defaults_table_and_choice_strings():
    from mla_spec.kernels.mla_decode_paged import (
        PAGED_DEFAULTS,
        PAGED_VARIANTS,
        paged_choice,
        parse_choice,
        shape_class,
    )

    assert all(parse_choice(a)[0] is PAGED_VARIANTS[a.split("/")[0]]
               for v in PAGED_DEFAULTS.values() for a in v.split("|"))
    # a class entry ends with a Triton variant (it must run everywhere)
    assert not any(parse_choice(v.split("|")[-1])[0].cuda for v in PAGED_DEFAULTS.values())
    assert parse_choice("G4x/sp16") == (PAGED_VARIANTS["G4x"], 16)
    with pytest.raises(ValueError, match="unknown paged variant"):
        parse_choice("nope")
    assert shape_class(32, torch.bfloat16, 1) == ("bf16", "r32", "b1")
    assert shape_class(512, FP8_DTYPE, 64) == ("fp8", "big", "big")
    cpu_cfg, sp = paged_choice(32, torch.bfloat16, torch.device("cpu"), 8, 1)
    assert sp is None and not cpu_cfg.sibling_kernel
    # V-split multiplies the programs: fewer splits for the same batch-1 shape
    assert pick_num_splits_paged(1, 1, 4096, 64, 32, 1152, vsplit=4) < 64


def test_context_axis_overrides_the_class():
    """TARGET_VERIFY at batch 1 (128 rows): the winner changes with the context (v6 sweep);
    without ``max_kv`` (or outside the table) the class default holds."""
    from mla_spec.kernels.mla_decode_paged import (
        PAGED_CONTEXT_DEFAULTS,
        PAGED_DEFAULTS,
        PAGED_VARIANTS,
        paged_choice,
        parse_choice,
    )
    from mla_spec.kernels.mla_decode_tiles import context_class

    cuda = torch.device("cuda")  # only the device type is read
    assert [context_class(n) for n in (0, 2048, 2049, 8192, 8193)] == \
        ["c2k", "c2k", "c8k", "c8k", "long"]
    assert all(parse_choice(a)[0] is PAGED_VARIANTS[a.split("/")[0]]
               for v in PAGED_CONTEXT_DEFAULTS.values() for a in v.split("|"))
    pick = lambda kv, ctx: paged_choice(128, kv, cuda, 64, 1, ctx)[0]  # noqa: E731
    assert pick(FP8_DTYPE, 1000) is PAGED_VARIANTS["G4"]
    assert pick(FP8_DTYPE, 4096) is PAGED_VARIANTS["G4"]
    assert pick(FP8_DTYPE, 32768) is pick(FP8_DTYPE, None) is \
        parse_choice(PAGED_DEFAULTS[("fp8", "r128", "b1")])[0]
    assert pick(torch.bfloat16, 32768) in (PAGED_VARIANTS["W64"], PAGED_VARIANTS["CF"])
    assert pick(torch.bfloat16, 4096) is PAGED_VARIANTS["S16"]
    # other classes ignore the context (W where the wgmma kernel runs)
    assert paged_choice(32, torch.bfloat16, cuda, 64, 32, 32768)[0] in \
        (PAGED_VARIANTS["W"], PAGED_VARIANTS["S16"])
    # the 32-row batch-1 class: 64 one-tile splits up to 8k, the model's count at 1k
    assert paged_choice(32, torch.bfloat16, cuda, 64, 1, 4096) == (PAGED_VARIANTS["S16"], 64)
    assert paged_choice(32, torch.bfloat16, cuda, 64, 1, 1024) == (PAGED_VARIANTS["S16"], None)


@pytest.mark.parametrize("kvd,splits", [(torch.bfloat16, 4), (FP8_DTYPE, 1)])
def test_swapab_ragged_with_empty_requests(kvd, splits, device):
    # 0-row request, splits with no visible KV, a 5-row request over 2 row blocks of 3 heads
    sc = _scene(ForwardMode.EXTEND, [5, 0, 20, 3], [2, 0, 5, 1], kvd, device)
    o, lse, ref, lse_ref, _ = _run(sc, PagedConfig(16, 8, 4, 1, swap=True), splits, ragged=True)
    torch.testing.assert_close(o.float(), ref.float(), rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(lse, lse_ref, rtol=1e-2, atol=1e-2)


def test_swap_excludes_vsplit():
    with pytest.raises(ValueError, match="swap excludes"):
        PagedConfig(32, 64, 8, 2, vsplit=2, swap=True)
    assert PagedConfig(32, 64, 8, 2, swap=True).tag.endswith("S")


def test_cuda_kernel_entries_fall_back_where_it_cannot_run(monkeypatch):
    """A CUDA-kernel alternative (``K*`` / ``W*``) applies only with fixed rows, a cache it
    takes (bf16; fp8 for ``W*``), the kernels available and (``W*``) sm_90; else the next
    alternative, and for a context entry none of whose alternatives runs, the class entry."""
    from mla_spec.kernels import mla_decode_tiles as mt
    from mla_spec.quant.fp8 import FP8_DTYPE

    cuda = torch.device("cuda")  # only the device type is read (availability is patched)
    cap = {"v": (9, 0)}
    monkeypatch.setattr(mt, "cuda_capability", lambda dev: cap["v"])
    monkeypatch.setattr(mt, "cuda_kernels_available", lambda dev: None)
    V = mt.PAGED_VARIANTS
    # the 32-row large-batch class: W on sm_90, its Triton alternative elsewhere
    assert mt.paged_choice(32, torch.bfloat16, cuda, 64, 128, 8192) == (V["W"], None)
    assert mt.paged_choice(32, torch.bfloat16, cuda, 64, 128, 8192, fixed=False) == \
        (V["S32w4"], None)
    assert mt.paged_choice(32, torch.float16, cuda, 64, 128, 8192) == (V["S32w4"], None)
    # the 32-row batch-1 long-context entry: W, then K (sm_100 has no wgmma), then the class
    assert mt.paged_choice(32, torch.bfloat16, cuda, 64, 1, 32768) == (V["W"], 128)
    cap["v"] = (10, 0)
    assert mt.paged_choice(32, torch.bfloat16, cuda, 64, 1, 32768) == (V["K"], 128)
    assert mt.paged_choice(32, torch.bfloat16, cuda, 64, 128, 8192) == (V["S32w4"], None)
    assert mt.paged_choice(128, torch.bfloat16, cuda, 64, 1, 32768) == (V["CF"], None)
    cap["v"] = (9, 0)
    assert mt.paged_choice(128, torch.bfloat16, cuda, 64, 1, 32768) == (V["WR"], 64)
    assert mt.paged_choice(128, torch.bfloat16, cuda, 64, 32, 4096) == (V["WR"], None)
    # more than 128 rows (H 128 q 4): WR for bf16 and e4m3
    assert mt.paged_choice(512, torch.bfloat16, cuda, 64, 32, 4096) == (V["WR"], None)
    assert mt.paged_choice(512, torch.bfloat16, cuda, 64, 1, 32768) == (V["WR"], 16)
    assert mt.paged_choice(512, torch.bfloat16, cuda, 64, 1, 4096) == (V["WR"], 16)
    assert mt.paged_choice(512, FP8_DTYPE, cuda, 64, 1, 4096) == (V["WR"], 16)
    assert mt.paged_choice(512, torch.bfloat16, cuda, 64, 1, 1024) == (V["WR"], None)
    assert mt.paged_choice(512, FP8_DTYPE, cuda, 64, 1, 32768) == (V["WR"], 16)
    assert mt.paged_choice(512, FP8_DTYPE, cuda, 64, 1, 2048) == (V["WR"], None)
    assert mt.paged_choice(32, FP8_DTYPE, cuda, 64, 1, 1024) == (V["WE8"], None)
    cap["v"] = (10, 0)  # no wgmma: the Triton fallbacks
    assert mt.paged_choice(512, torch.bfloat16, cuda, 64, 1, 1024) == (V["C"], None)
    assert mt.paged_choice(512, FP8_DTYPE, cuda, 64, 1, 32768) == (V["CF"], None)
    assert mt.paged_choice(32, FP8_DTYPE, cuda, 64, 1, 1024) == (V["G4"], None)
    cap["v"] = (9, 0)
    assert mt.paged_choice(512, FP8_DTYPE, cuda, 64, 32, 4096) == (V["WR"], None)
    assert mt.paged_choice(128, FP8_DTYPE, cuda, 64, 32, 4096) == (V["WR"], None)
    # an e4m3 cache: the wgmma kernels on sm_90 (not the mma.sync K*), Triton elsewhere
    assert mt.paged_choice(32, FP8_DTYPE, cuda, 64, 128, 8192) == (V["WE8"], None)
    # the softmax weights kept in fp16 on request: WE2; the queries too: the e4m3-MMA kernels
    # are passed over
    assert mt.paged_choice(32, FP8_DTYPE, cuda, 64, 128, 8192, e4m3_probs=False) == \
        (V["WE2"], None)
    assert mt.paged_choice(32, FP8_DTYPE, cuda, 64, 128, 8192, e4m3_queries=False) == \
        (V["W"], None)
    assert mt.paged_choice(32, torch.bfloat16, cuda, 64, 128, 8192, e4m3_queries=False) == \
        (V["W"], None)
    assert mt.paged_choice(32, FP8_DTYPE, cuda, 64, 1, 32768) == (V["WE8"], 128)
    assert mt.paged_choice(32, FP8_DTYPE, cuda, 64, 1, 32768, e4m3_probs=False) == \
        (V["WE2"], 128)
    assert mt.paged_choice(32, FP8_DTYPE, cuda, 64, 1, 32768, e4m3_queries=False) == \
        (V["W"], 128)
    assert mt.paged_choice(32, FP8_DTYPE, cuda, 64, 1, 4096) == (V["WE8"], 32)
    assert mt.paged_choice(32, FP8_DTYPE, cuda, 64, 1, 4096, e4m3_queries=False) == \
        (V["G4"], None)  # the class entry: no context alternative runs
    assert mt.paged_choice(32, FP8_DTYPE, cuda, 64, 1, 1024, e4m3_queries=False) == \
        (V["G4"], None)
    assert mt.paged_choice(128, FP8_DTYPE, cuda, 64, 1, 4096) == (V["WR"], 64)
    assert not mt.cuda_cache_ok(V["K"], FP8_DTYPE) and not mt.cuda_cache_ok(V["Wp"], FP8_DTYPE)
    cap["v"] = (10, 0)
    assert mt.paged_choice(32, FP8_DTYPE, cuda, 64, 128, 8192) == (V["CF"], None)
    assert mt.paged_choice(32, FP8_DTYPE, cuda, 64, 1, 32768) == (V["G4"], None)
    base = mt.parse_choice(mt.PAGED_DEFAULTS[("bf16", "r32", "b1")])
    assert mt.paged_choice(32, torch.bfloat16, cuda, 64, 1, 32768, fixed=False) == base
    monkeypatch.setattr(mt, "cuda_kernels_available", lambda dev: "nvcc not found")
    assert mt.paged_choice(32, torch.bfloat16, cuda, 64, 1, 32768) == base
