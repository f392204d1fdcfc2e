"""The hand-written Hopper MLA kernels (``sm90_mma``, ``sm90_wgmma``: every ``cuda`` variant)
against their twin ``mla_decode_ref``.

On the GPU: DeepSeek dims (Dv 512, Dpe 64, bf16 cache), irregular lengths (0, 1, a page - 1, a
page, a page + 1, 1000, 3001), q_len 1 / 2 / 4, H 16 / 32 / 128 (row blocks past one CTA),
shuffled pages of 64 and 128, split counts 1 / 3 / 32, int32 and int64 index tensors, inside a
CUDA graph replayed over new data. On the CPU: the parameter struct's layout, the tile list
against the source, the support messages, and an nvcc compile when nvcc is present.
"""

from __future__ import annotations

import ctypes
import re

import pytest
import torch

from mla_spec.kernels.launch.cuda_driver import CSRC, compile_cubin, nvcc_path
from mla_spec.kernels.mla import PAGED_VARIANTS, mla_decode_paged, mla_decode_ref, paged_supported
from mla_spec.kernels.mla import sm90_mma as mc
from mla_spec.kernels.mla.sm90_mma import MlaParams

SM = 0.1352338
DV, DPE = 512, 64


def test_params_layout_matches_source():
    src = (CSRC / "mla_params.cuh").read_text()
    size, off = re.search(r"sizeof\(MlaParams\) == (\d+) && offsetof\(MlaParams, "
                          r"qk_scale_log2\) == (\d+)", src).groups()
    assert ctypes.sizeof(MlaParams) == int(size)
    assert MlaParams.qk_scale_log2.offset == int(off)


def test_tiles_match_source():
    src = (CSRC / "mla_splitkv_sm90.cu").read_text()
    built = {tuple(int(v) for v in m) for m in
             re.findall(r"^MLA_SPLITKV\((\d+), (\d+), (\d+), (\d+)\)", src, re.M)}
    assert built == {(t.block_m, t.block_n, t.stages, t.warps) for t in mc.CUDA_TILES}
    for name, cfg in PAGED_VARIANTS.items():
        if cfg.cuda and not cfg.wgmma:
            assert mc.CudaTile(cfg.block_m, cfg.block_n, cfg.num_stages, cfg.num_warps) in \
                mc.CUDA_TILES, name
    for t in mc.CUDA_TILES:
        assert t.smem <= 227 * 1024, t


def test_cpu_is_refused_with_a_reason():
    q = torch.zeros(1, 2, DV, dtype=torch.bfloat16)
    qp = torch.zeros(1, 2, DPE, dtype=torch.bfloat16)
    kv = torch.zeros(64, DV + DPE, dtype=torch.bfloat16)
    why = mc.cuda_mla_supported(q, qp, kv, 64, mc.CUDA_TILES[0], 1)
    assert why and "CUDA" in why
    assert "CUDA" in paged_supported(torch.device("cpu"), DV, DPE, 64, torch.bfloat16,
                                     PAGED_VARIANTS["K"])


@pytest.mark.skipif(nvcc_path() is None, reason="nvcc not installed")
def test_source_compiles_for_sm90(tmp_path, monkeypatch):
    monkeypatch.setenv("MLA_SPEC_CACHE", str(tmp_path))
    cubin = compile_cubin(CSRC / "mla_splitkv_sm90.cu")
    assert cubin[:4] == b"\x7fELF"
    for t in mc.CUDA_TILES:
        assert t.name.encode() in cubin
    assert compile_cubin(CSRC / "mla_splitkv_sm90.cu") == cubin  # from the cache


def _case(h, q_len, lens, page, idx_dtype, seed):
    g = torch.Generator().manual_seed(seed)
    dev = torch.device("cuda")
    bs = len(lens)
    pages_per = [-(-max(n, 1) // page) for n in lens]
    num_pages = sum(pages_per) + 3
    perm = torch.randperm(num_pages, generator=g)
    kv = torch.randn(num_pages * page, DV + DPE, generator=g).to(torch.bfloat16)
    max_ctx = max(max(lens), 1) + page
    r2t = torch.zeros(bs + 2, max_ctx, dtype=torch.int32)
    rpi = torch.tensor([bs + 1 - i for i in range(bs)], dtype=idx_dtype)  # not 0..bs-1
    used = 0
    for i, n in enumerate(lens):
        pos = torch.arange(n)
        pg = perm[used + pos // page]
        r2t[int(rpi[i]), :n] = (pg * page + pos % page).int()
        used += pages_per[i]
    kv_lens = torch.tensor(lens, dtype=idx_dtype)
    qn = torch.randn(bs * q_len, h, DV, generator=g).to(torch.bfloat16)
    qp = torch.randn(bs * q_len, h, DPE, generator=g).to(torch.bfloat16)
    return [t.to(dev) for t in (qn, qp, kv, r2t, rpi, kv_lens)]


@pytest.mark.gpu
# (the e4m3-MMA kernels take an FP8 cache only: test_mla_decode_wgmma.py checks them)
@pytest.mark.parametrize("name", [n for n, c in PAGED_VARIANTS.items()
                                  if c.cuda and not c.e4m3_mma])
@pytest.mark.parametrize("h,q_len,lens,page,splits,idx", [
    (32, 1, [4096], 64, 32, torch.int64),
    (32, 1, [0, 1, 63, 64, 65, 1000], 64, 1, torch.int32),
    (16, 2, [3001, 5, 128, 0], 128, 3, torch.int64),
    (128, 1, [700, 2049], 64, 7, torch.int32),
    (32, 4, [1, 4, 1500], 64, 5, torch.int64),
])
def test_matches_twin_on_gpu(name, h, q_len, lens, page, splits, idx):
    cfg = PAGED_VARIANTS[name]
    qn, qp, kv, r2t, rpi, kv_lens = _case(h, q_len, lens, page, idx, seed=h + q_len + splits)
    kl = kv_lens.int()
    # a row whose window is empty (kv_len < q_len rows ahead) yields zeros in both
    ref, lse_ref = mla_decode_ref(qn, qp, kv, r2t, rpi, kl, SM, k_scale=0.8, v_scale=0.7,
                                  q_len=q_len, return_lse=True)
    out, lse = mla_decode_paged(qn, qp, kv, r2t, rpi, kv_lens, SM, page_size=page, k_scale=0.8,
                                v_scale=0.7, q_len=q_len, num_splits=splits, config=cfg,
                                max_kv=max(lens), return_lse=True)
    torch.cuda.synchronize()
    assert torch.isfinite(out).all()
    scale = ref.float().abs().max().clamp_min(1e-3)
    assert ((out.float() - ref.float()).abs().max() / scale).item() < 1e-2
    fin = torch.isfinite(lse_ref)
    assert torch.equal(fin, torch.isfinite(lse))
    assert torch.allclose(lse[fin], lse_ref[fin].float(), atol=2e-2, rtol=1e-3)


@pytest.mark.gpu
@pytest.mark.parametrize("name,fp8", [("K", False), ("W", False), ("W", True), ("WR", False),
                                      ("WR", True), ("WE2", True), ("WE8", True)])
def test_cuda_graph_replay_reads_new_data(name, fp8):
    from mla_spec.quant.fp8 import e4m3_rows_round_trip, quantize_fp8

    cfg = PAGED_VARIANTS[name]
    qn, qp, kv, r2t, rpi, kv_lens = _case(32, 1, [2000, 300], 64, torch.int64, seed=5)
    if fp8:  # the wgmma kernels widen an e4m3 cache to fp16 in shared memory
        kv = quantize_fp8(kv.float() * 8)
    out = torch.empty_like(qn)

    def run():
        mla_decode_paged(qn, qp, kv, r2t, rpi, kv_lens, SM, page_size=64, q_len=1,
                         num_splits=16, config=cfg, max_kv=2000, out=out)

    run()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        run()
    for seed in range(3):
        gen = torch.Generator(device="cuda").manual_seed(seed)
        qn.copy_(torch.randn(qn.shape, device="cuda", generator=gen).to(qn.dtype))
        fresh = torch.randn(kv.shape, device="cuda", generator=gen)
        kv.copy_(quantize_fp8(fresh * 8) if fp8 else fresh.to(kv.dtype))
        g.replay()
        torch.cuda.synchronize()
        q_ref = (qn, qp)
        if cfg.e4m3_mma:  # the queries as WE2 / WE8 multiply them (e4m3 per row, fp32)
            q = e4m3_rows_round_trip(torch.cat([qn, qp], -1))
            q_ref = (q[..., :512], q[..., 512:])
        ref = mla_decode_ref(*q_ref, kv, r2t, rpi, kv_lens.int(), SM, q_len=1)
        err = (out.float() - ref.float()).abs().max() / ref.float().abs().max()
        # e4m3 MMAs round inside each instruction (test_e4m3_mma_kernel_matches_its_twin); WE8
        # rounds P to e4m3 too
        assert err.item() < (0.12 if cfg.e4m3_pv else 0.06 if cfg.e4m3_mma else 1e-2)
