"""Fused RoPE kernel (q_pe and k_pe in one launch) against its torch twin: the interpreter on
CPU, the compiled kernel on a GPU; strided views, odd head counts, empty batches, bad input."""

from __future__ import annotations

import pytest
import torch

import mla_spec.models.rope as rope_mod
from mla_spec.kernels.ops import rope_qk, rope_qk_ref
from mla_spec.models.rope import DeepseekRotaryEmbedding, yarn_inv_freq

YARN = {"type": "yarn", "factor": 40.0, "original_max_position_embeddings": 4096,
        "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0}


def _inputs(n, h, d, dtype, device, seed=0):
    """q_pe / k_pe as views into wider projection outputs (as the model slices them)."""
    g = torch.Generator().manual_seed(seed)
    q_full = torch.randn(n, h, 128 + d, generator=g).to(dtype).to(device)
    latent = torch.randn(n, 512 + d, generator=g).to(dtype).to(device)
    pos = torch.randint(0, 163840, (n,), generator=g).to(device)
    return pos, q_full[..., 128:], latent[:, 512:]


@pytest.mark.triton
@pytest.mark.parametrize("n,h,d", [(1, 1, 64), (3, 32, 64), (5, 7, 64), (2, 128, 64),
                                   (4, 3, 10), (0, 16, 64)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_matches_twin(n, h, d, dtype, device):
    inv_freq, attn = yarn_inv_freq(d, 10000.0, YARN, 163840)
    inv_freq = inv_freq.to(device)
    pos, q, k = _inputs(n, h, d, dtype, device)
    qo, ko = rope_qk(pos, q, k, inv_freq, attn * 1.25)
    qr, kr = rope_qk_ref(pos, q, k, inv_freq, attn * 1.25)
    assert qo.shape == q.shape and ko.shape == k.shape and qo.dtype == dtype
    assert qo.is_contiguous() and ko.is_contiguous()
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(qo, qr, **tol)
    torch.testing.assert_close(ko, kr, **tol)
    if n and dtype == torch.bfloat16 and qo.is_cuda:  # a rare one-ulp difference after the cast
        assert (qo != qr).float().mean().item() < 0.01  # (the interpreter's casts truncate)


@pytest.mark.triton
def test_inputs_untouched_and_positions_int32(device):
    inv_freq, _ = yarn_inv_freq(64, 10000.0, None, 4096)
    pos, q, k = _inputs(6, 4, 64, torch.float32, device, seed=3)
    q0, k0 = q.clone(), k.clone()
    qo, ko = rope_qk(pos.to(torch.int32), q, k, inv_freq.to(device))
    qr, kr = rope_qk_ref(pos, q, k, inv_freq.to(device))
    torch.testing.assert_close(qo, qr, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ko, kr, rtol=1e-5, atol=1e-5)
    assert torch.equal(q, q0) and torch.equal(k, k0)


def test_bad_input_is_refused():
    inv = torch.ones(32)
    pos, q, k = torch.arange(3), torch.randn(3, 2, 64), torch.randn(3, 64)
    with pytest.raises(ValueError, match="positions \\[N\\], q_pe \\[N, H, D\\]"):
        rope_qk(pos, q[0], k, inv)
    with pytest.raises(ValueError, match="must agree"):
        rope_qk(pos, q, k[:2], inv)
    with pytest.raises(ValueError, match="inv_freq must be fp32"):
        rope_qk(pos, q, k, inv.double())
    with pytest.raises(ValueError, match="integer"):
        rope_qk(pos.float(), q, k, inv)
    with pytest.raises(ValueError, match="supported"):
        rope_qk(pos, q.to(torch.int8), k, inv)


def test_module_uses_the_twin_on_cpu(monkeypatch):
    """Off CUDA (and in training) the module runs the torch twin; on CUDA the kernel."""
    from mla_spec.config import ModelConfig
    cfg = ModelConfig(rope_scaling=YARN, max_position_embeddings=163840)
    rope = DeepseekRotaryEmbedding(cfg)
    pos, q, k = _inputs(4, 3, cfg.qk_rope_head_dim, torch.float32, "cpu")
    assert not rope._fused(pos, q, k)
    calls = []
    monkeypatch.setattr(rope_mod, "rope_qk", lambda *a: calls.append(a))
    rope(pos, q, k)
    assert not calls


@pytest.mark.gpu
def test_gpu_module_fused_and_graph_capturable():
    from mla_spec.config import ModelConfig
    cfg = ModelConfig(rope_scaling=YARN, max_position_embeddings=163840)
    rope = DeepseekRotaryEmbedding(cfg, device="cuda")
    pos, q, k = _inputs(8, 32, cfg.qk_rope_head_dim, torch.bfloat16, "cuda")
    assert rope._fused(pos, q, k)
    with torch.no_grad():
        out = rope(pos, q, k)
        ref = rope_qk_ref(pos, q, k, rope.inv_freq, rope.attention_factor)
        torch.testing.assert_close(out[0], ref[0], rtol=1e-2, atol=1e-2)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            static = rope(pos, q, k)
        pos.copy_(pos + 17)
        g.replay()
        ref = rope_qk_ref(pos, q, k, rope.inv_freq, rope.attention_factor)
    torch.testing.assert_close(static[0], ref[0], rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(static[1], ref[1], rtol=1e-2, atol=1e-2)
