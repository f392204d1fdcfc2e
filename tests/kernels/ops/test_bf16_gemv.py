"""BF16 GEMV (``mla_spec.kernels.ops.bf16_gemv``) against its torch reference, and its model
wiring."""

from __future__ import annotations

import pytest
import torch

import mla_spec.kernels.ops.bf16_gemv as bg
import mla_spec.models.mla as mla
from mla_spec.kernels import options
from mla_spec.kernels.ops.bf16_gemv import BgemvConfig, bgemv, bgemv_ref, gemv_linear


def _tol(dtype):
    return dict(rtol=1e-4, atol=1e-4) if dtype == torch.float32 else dict(rtol=1.6e-2, atol=2e-3)


@pytest.mark.triton
@pytest.mark.parametrize("b,m,n,k", [(1, 1, 1, 1), (1, 2, 37, 100), (3, 1, 5, 17),
                                     (2, 2, 64, 512), (1, 1, 300, 1000)])
@pytest.mark.parametrize("n_contiguous", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_matches_twin(b, m, n, k, n_contiguous, dtype, device):
    g = torch.Generator().manual_seed(b * 1000 + m * 100 + n + k)
    x = torch.randn(m, b, k + 3, generator=g).to(dtype).to(device)[..., 2:k + 2].transpose(0, 1)
    w = torch.randn(b, k, n, generator=g) if n_contiguous else torch.randn(b, n, k, generator=g)
    w = w.to(dtype).to(device)
    w = w.transpose(1, 2) if n_contiguous else w  # [b, n, k] either way
    ref = bgemv_ref(x, w)
    out = torch.full((m, b, n), float("nan"), dtype=dtype, device=device).transpose(0, 1)
    y = bgemv(x, w, out)
    assert y.data_ptr() == out.data_ptr() and y.shape == (b, m, n)
    torch.testing.assert_close(y, ref, **_tol(dtype))
    if n * k <= 4096:  # a small tile: several K steps, masked N and K edges
        small = bgemv(x, w, cfg=BgemvConfig(4, 16, 1))
        torch.testing.assert_close(small, ref, **_tol(dtype))
    assert ref.float().abs().max() > 0.5


@pytest.mark.triton
def test_empty_and_zero_k(device):
    x = torch.randn(1, 0, 8, device=device)
    assert bgemv(x, torch.randn(1, 4, 8, device=device)).shape == (1, 0, 4)
    y = bgemv(torch.randn(2, 1, 0, device=device), torch.randn(2, 3, 0, device=device))
    assert y.shape == (2, 1, 3) and (y == 0).all()


def test_bad_input_is_refused():
    with pytest.raises(ValueError, match=r"x \[B, M, K\] and w \[B, N, K\]"):
        bgemv(torch.randn(1, 2, 8), torch.randn(1, 3, 9))
    with pytest.raises(ValueError, match="out must be"):
        bgemv(torch.randn(1, 2, 8), torch.randn(1, 3, 8), torch.empty(1, 2, 4))


def test_supported_only_on_cuda_at_decode_sizes(monkeypatch):
    x, w = torch.randn(1, 1, 8), torch.randn(1, 4, 8)
    assert "CUDA" in bg.bgemv_supported(x, w)
    assert torch.equal(gemv_linear(x[0], w[0]), x[0] @ w[0].T)  # CPU: F.linear
    monkeypatch.setattr(options, "BF16_GEMV", False)
    assert "off" in bg.bgemv_supported(x, w)


@pytest.mark.triton
@pytest.mark.parametrize("n", [1, 2])
def test_absorbed_products_match_einsum(n, monkeypatch, device):
    """``models.mla``'s two absorbed products through the GEMV equal the einsums (views of a
    kv_b weight, q_nope a view of q_b's output, as in the model)."""
    monkeypatch.setattr(mla, "bgemv_supported", lambda x, w: None)
    g = torch.Generator().manual_seed(n)
    h, dn, c = 3, 8, 16
    kv_b = torch.randn(h, 2 * dn, c, generator=g).to(device)
    w_uk, w_uv = kv_b[:, :dn], kv_b[:, dn:]
    q = torch.randn(n, h, dn + 4, generator=g).to(device)[..., :dn]
    ref = torch.einsum("nhd,hdc->nhc", q, w_uk)
    torch.testing.assert_close(mla._absorb_uk(q, w_uk), ref, rtol=1e-5, atol=1e-5)
    o = torch.randn(n, h, c, generator=g).to(device)
    got = mla._absorb_uv(o, w_uv)
    assert got.is_contiguous()
    torch.testing.assert_close(got, torch.einsum("nhc,hvc->nhv", o, w_uv), rtol=1e-5,
                               atol=1e-5)


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 2])
def test_gpu_kernel_in_a_graph(m):
    """The kernel (default and pinned tiles) on the GPU, captured in a CUDA graph and replayed
    on new inputs; ``gemv_linear`` equals ``F.linear`` whichever path it takes."""
    x = torch.randn(m, 7168, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(2112, 7168, device="cuda", dtype=torch.bfloat16) * 0.02
    tol = dict(rtol=1.6e-2, atol=2e-3)
    torch.testing.assert_close(bgemv(x[None], w[None])[0], torch.nn.functional.linear(x, w),
                               **tol)
    torch.testing.assert_close(gemv_linear(x, w), torch.nn.functional.linear(x, w), **tol)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        y = bgemv(x[None], w[None])
    x.normal_()
    g.replay()
    torch.testing.assert_close(y[0], torch.nn.functional.linear(x, w), **tol)
