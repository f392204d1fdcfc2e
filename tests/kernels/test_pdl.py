"""Programmatic dependent launch (``mla_spec.kernels.pdl``): off the GPU nothing changes; on
it, a chain of our kernels gives bit-identical results with PDL on and off, eagerly and in a
replayed CUDA graph."""

from __future__ import annotations

import pytest
import torch

import mla_spec.kernels.pdl as pdl


def test_off_on_cpu():
    t = torch.zeros(1)
    assert not pdl.pdl_on(t)
    assert pdl.pdl_kwargs(t) == {"USE_GDC": False, "launch_pdl": False}


def _chain(x, w_norm, w_gate, bias, w_lin, pos, q_pe, k_pe, inv_freq):
    from mla_spec.kernels.bf16_gemv import bgemv
    from mla_spec.kernels.moe_router import fused_route, gate_logits
    from mla_spec.kernels.rmsnorm import rms_norm
    from mla_spec.kernels.rope import rope_qk

    h = rms_norm(x, w_norm)
    y = bgemv(h[None], w_lin[None])[0]  # consumes the norm right after it
    logits = gate_logits(h, w_gate)
    w, ids = fused_route(logits, bias, top_k=8, n_group=8, topk_group=4, norm_topk_prob=True,
                         routed_scaling_factor=2.5, shared_id=256, ids_dtype=torch.int32)
    q, k = rope_qk(pos, q_pe, k_pe, inv_freq)
    return y, w, ids, q, k


@pytest.mark.gpu
def test_chain_identical_with_and_without_pdl(monkeypatch):
    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("PDL needs sm_90 or newer")
    g = torch.Generator(device="cuda").manual_seed(0)
    dev, bf = "cuda", torch.bfloat16
    x = torch.randn(1, 7168, device=dev, dtype=bf, generator=g)
    args = (x, torch.rand(7168, device=dev, dtype=bf, generator=g) + 0.5,
            torch.randn(256, 7168, device=dev, generator=g) * 0.02,
            torch.randn(256, device=dev, generator=g) * 0.01,
            torch.randn(2112, 7168, device=dev, dtype=bf, generator=g) * 0.02,
            torch.tensor([1234], device=dev),
            torch.randn(1, 32, 192, device=dev, dtype=bf, generator=g)[..., 128:],
            torch.randn(1, 576, device=dev, dtype=bf, generator=g)[:, 512:],
            torch.rand(32, device=dev, generator=g) * 0.1)
    monkeypatch.setattr(pdl, "PDL", False)
    ref = _chain(*args)
    monkeypatch.setattr(pdl, "PDL", True)
    eager = _chain(*args)
    for a, b in zip(ref, eager):
        assert torch.equal(a, b)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = _chain(*args)
    x.copy_(torch.randn(1, 7168, device=dev, dtype=bf, generator=g))
    graph.replay()
    torch.cuda.synchronize()
    monkeypatch.setattr(pdl, "PDL", False)
    ref2 = _chain(*args)
    for a, b in zip(ref2, out):
        assert torch.equal(a, b)
