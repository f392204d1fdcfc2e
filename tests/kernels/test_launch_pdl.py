"""Programmatic dependent launch and L2 prefetches (``mla_spec.kernels.launch.pdl``): off the GPU
nothing changes; on it, a chain of our kernels gives bit-identical results with both on and
off, eagerly and in a replayed CUDA graph."""

from __future__ import annotations

import pytest
import torch

import mla_spec.kernels.launch.pdl as pdl
from mla_spec.kernels import options


def _switch(monkeypatch, on: bool) -> None:
    """PDL and the attention kernels' KV prefetch together (neither may change a bit)."""
    monkeypatch.setattr(options, "PDL", on)
    monkeypatch.setattr(options, "L2_PREFETCH", on)


def test_off_on_cpu():
    t = torch.zeros(1)
    assert not pdl.pdl_on(t)
    assert pdl.pdl_kwargs(t) == {"USE_GDC": False, "launch_pdl": False}
    assert not pdl.l2pf_on(t)


def _chain(x, w_norm, w_gate, bias, w_lin, pos, q_pe, k_pe, inv_freq, fp4a, fp4b, w13, w2,
           fp4c):
    """Each kernel consumes its predecessor's output; the GEMVs that read weights before the
    wait (pdl rule 3) follow the kernel that writes their activations."""
    from mla_spec.kernels.nvfp4 import NVFP4MmaConfig, fused_moe_nvfp4, nvfp4_gemm
    from mla_spec.kernels.nvfp4.gemv import packed_gemv_config
    from mla_spec.kernels.ops import bgemv, fused_route, gate_logits, rms_norm, rope_qk

    h = rms_norm(x, w_norm)
    y = bgemv(h[None], w_lin[None], static_w=True)[0]  # consumes the norm right after it
    z = nvfp4_gemm(y, *fp4a, config=packed_gemv_config(1, fp4a[0].shape[0], y.shape[1]))
    z2 = nvfp4_gemm(z.expand(3, -1), *fp4b,  # mmab with split K, then sum_rows
                    config=NVFP4MmaConfig(16, 64, 128, 4, 4, 3))
    logits = gate_logits(h, w_gate)
    w, ids = fused_route(logits, bias, top_k=8, n_group=8, topk_group=4, norm_topk_prob=True,
                         routed_scaling_factor=2.5, ids_dtype=torch.int32)
    moe = fused_moe_nvfp4(h, ids, w, w13, w2, path="gemv")
    # the hand-written mma.sync kernel (weights before the wait, split-K counters) when it can
    # be built here; else the Triton choice for the same call
    from mla_spec.kernels.nvfp4 import CudaMmaConfig
    from mla_spec.kernels.nvfp4.gemm_cuda import cuda_kernels_available
    z3 = nvfp4_gemm(moe.expand(5, -1).contiguous(), *fp4c,
                    config=None if cuda_kernels_available(moe.device)
                    else CudaMmaConfig(4, 4, 2, True, 2))
    q, k = rope_qk(pos, q_pe, k_pe, inv_freq)
    return y, z, z2, w, ids, moe, z3, q, k


@pytest.mark.gpu
def test_chain_identical_with_and_without_pdl(monkeypatch):
    from mla_spec.quant.nvfp4 import quantize_nvfp4

    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("PDL needs sm_90 or newer")
    g = torch.Generator(device="cuda").manual_seed(0)
    dev, bf = "cuda", torch.bfloat16

    def fp4(*shape):
        q = quantize_nvfp4(torch.randn(*shape, device=dev, generator=g) * 0.05)
        return q.weight, q.weight_scale, q.weight_scale_2

    x = torch.randn(1, 7168, device=dev, dtype=bf, generator=g)
    w13, w2 = (quantize_nvfp4(torch.randn(256, 2 * 64, 7168, device=dev, generator=g) * 0.05),
               quantize_nvfp4(torch.randn(256, 7168, 64, device=dev, generator=g) * 0.05))
    args = (x, torch.rand(7168, device=dev, dtype=bf, generator=g) + 0.5,
            torch.randn(256, 7168, device=dev, generator=g) * 0.02,
            torch.randn(256, device=dev, generator=g) * 0.01,
            torch.randn(2112, 7168, device=dev, dtype=bf, generator=g) * 0.02,
            torch.tensor([1234], device=dev),
            torch.randn(1, 32, 192, device=dev, dtype=bf, generator=g)[..., 128:],
            torch.randn(1, 576, device=dev, dtype=bf, generator=g)[:, 512:],
            torch.rand(32, device=dev, generator=g) * 0.1,
            fp4(1040, 2112), fp4(528, 1040), w13, w2, fp4(300, 7168))
    _switch(monkeypatch, False)
    ref = _chain(*args)
    _switch(monkeypatch, True)
    eager = _chain(*args)
    for a, b in zip(ref, eager):
        assert torch.equal(a, b)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = _chain(*args)
    for _ in range(3):  # new inputs each replay: a stale read would show
        x.copy_(torch.randn(1, 7168, device=dev, dtype=bf, generator=g))
        graph.replay()
        torch.cuda.synchronize()
        _switch(monkeypatch, False)
        ref2 = _chain(*args)
        _switch(monkeypatch, True)
        for a, b in zip(ref2, out):
            assert torch.equal(a, b)


@pytest.mark.gpu
@pytest.mark.parametrize("fp8", [False, True])
@pytest.mark.parametrize("verify", [False, True])
def test_attention_after_kv_store_identical_with_and_without_pdl(monkeypatch, fp8, verify):
    """The attention kernels prefetch their first KV tiles into L2 before the PDL wait (pdl
    rule 4) while the KV store right before them writes this step's rows: results must not
    change, eagerly or in a graph replayed with new rows each time."""
    from mla_spec.attention import create_backend
    from mla_spec.attention.synthetic import make_scene
    from mla_spec.forward_mode import ForwardMode
    from mla_spec.quant.fp8 import FP8_DTYPE

    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("PDL needs sm_90 or newer")
    bf = torch.bfloat16
    mode, prefix, q = ((ForwardMode.TARGET_VERIFY, [4000, 1301], [4, 4]) if verify
                       else (ForwardMode.DECODE, [4000], [1]))  # bs 1: the many-split variants
    sc = make_scene(mode, prefix, q, num_heads=32, num_draft_tokens=4,
                    kv_dtype=FP8_DTYPE if fp8 else bf, q_dtype=bf, page_size=64, device="cuda",
                    seed=3)
    be = create_backend("triton", num_heads=32, softmax_scale=0.1352, kv_pool=sc.pool,
                        req_to_token=sc.req_pool)
    loc = sc.batch.out_cache_loc
    g = torch.Generator(device="cuda").manual_seed(1)
    ckv = torch.randn(loc.numel(), 512, device="cuda", dtype=bf, generator=g)
    kpe = torch.randn(loc.numel(), 64, device="cuda", dtype=bf, generator=g)

    def step():
        sc.pool.store(0, loc, ckv, kpe)
        return be.forward(sc.q_nope, sc.q_pe, 0, sc.batch)

    be.plan(sc.batch)
    _switch(monkeypatch, False)
    ref = step()
    _switch(monkeypatch, True)
    assert torch.equal(step(), ref)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    for _ in range(3):
        ckv.copy_(torch.randn(ckv.shape, device="cuda", dtype=bf, generator=g))
        kpe.copy_(torch.randn(kpe.shape, device="cuda", dtype=bf, generator=g))
        graph.replay()
        torch.cuda.synchronize()
        _switch(monkeypatch, False)
        ref = step()
        _switch(monkeypatch, True)
        assert torch.equal(out, ref)
