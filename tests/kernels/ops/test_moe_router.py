"""The fused router kernel (interpreter on CPU) against route_tokens, on random logits."""

from __future__ import annotations

import pytest
import torch

from mla_spec.device import use_triton
from mla_spec.kernels.ops import fused_route, fused_route_ref, route_tokens

CASES = [  # E, n_group, topk_group, top_k, bias, norm, scoring
    (256, 8, 4, 8, True, True, "sigmoid"),  # DeepSeek-V3
    (16, 4, 2, 3, True, False, "sigmoid"),  # top_k not a power of two
    (32, 1, 1, 6, False, True, "softmax"),  # no groups, softmax scores
    (8, 8, 3, 2, True, True, "sigmoid"),    # one expert per group
]


def _by_id(w, ids):
    order = ids.argsort(dim=1)
    return w.gather(1, order), ids.gather(1, order)


@pytest.mark.parametrize("n", [0, 1, 7, 33])
@pytest.mark.parametrize("e,g,tg,k,has_bias,norm,scoring", CASES)
def test_kernel_matches_route_tokens(n, e, g, tg, k, has_bias, norm, scoring, device):
    gen = torch.Generator().manual_seed(n * 131 + e)
    logits = (torch.randn(n, e, generator=gen) * 2).to(device)
    bias = (torch.randn(e, generator=gen) * 0.3).to(device) if has_bias else None
    kw = dict(top_k=k, n_group=g, topk_group=tg, norm_topk_prob=norm,
              routed_scaling_factor=2.5, scoring_func=scoring)
    w, ids = fused_route(logits, bias, **kw)
    assert w.shape == ids.shape == (n, k) and w.dtype == torch.float32 and ids.dtype == torch.int64
    rw, rids = route_tokens(logits, bias, **kw)
    w_s, ids_s = _by_id(w, ids)
    rw_s, rids_s = _by_id(rw, rids)
    assert torch.equal(ids_s, rids_s)
    torch.testing.assert_close(w_s, rw_s, rtol=1e-5, atol=1e-6)
    tw, tids = fused_route_ref(logits, bias, **kw)  # the reference: same order as the kernel
    assert torch.equal(ids, tids)
    torch.testing.assert_close(w, tw, rtol=1e-5, atol=1e-6)


def test_bias_changes_the_choice_not_the_weights(device):
    logits = torch.randn(4, 16, generator=torch.Generator().manual_seed(1)).to(device)
    bias = torch.zeros(16, device=device)
    bias[3] = 100.0  # expert 3 always chosen, its weight is still its unbiased score
    kw = dict(top_k=2, n_group=1, topk_group=1, norm_topk_prob=False, routed_scaling_factor=1.0)
    w, ids = fused_route(logits, bias, **kw)
    assert (ids[:, 0] == 3).all()
    torch.testing.assert_close(w[:, 0], logits[:, 3].sigmoid())


@pytest.mark.parametrize("bad, match", [
    (dict(logits=torch.randn(2, 24)), "power of two"),
    (dict(n_group=3), "power of two"),
    (dict(topk_group=5), "do not fit"),
    (dict(top_k=17), "do not fit"),
    (dict(logits=torch.randn(2, 16, dtype=torch.float64)), "float32"),
    (dict(bias=torch.zeros(8)), "e_score_correction_bias"),
    (dict(scoring_func="relu"), "scoring_func"),
])
def test_bad_inputs(bad, match):
    kw = dict(logits=torch.randn(2, 16), bias=None, top_k=2, n_group=4, topk_group=2,
              scoring_func="sigmoid")
    kw.update(bad)
    logits, bias = kw.pop("logits"), kw.pop("bias")
    with pytest.raises(ValueError, match=match):
        fused_route(logits, bias, norm_topk_prob=True, routed_scaling_factor=1.0, **kw)


def _tiny_gate(seed: int, bias: bool = False):
    """A 16-expert ``MoEGate`` (4 groups, top-2 groups, top-3) with random weights."""
    from types import SimpleNamespace

    import mla_spec.models.moe as moe

    cfg = SimpleNamespace(n_routed_experts=16, hidden_size=24, topk_method="noaux_tc",
                          num_experts_per_tok=3, n_group=4, topk_group=2, norm_topk_prob=True,
                          routed_scaling_factor=2.5, scoring_func="sigmoid")
    gate = moe.MoEGate(cfg)
    with torch.no_grad():
        gate.weight.normal_(generator=torch.Generator().manual_seed(seed))
        if bias:
            gate.e_score_correction_bias.uniform_(-0.1, 0.1)
    return gate


def test_gate_uses_the_kernel_on_cuda_or_when_asked(monkeypatch):
    gate = _tiny_gate(5, bias=True)
    x = torch.randn(5, 24, generator=torch.Generator().manual_seed(6))
    calls = []
    real = fused_route
    import mla_spec.kernels.ops as ops
    monkeypatch.setattr(ops, "fused_route", lambda *a, **k: calls.append(1) or real(*a, **k))
    with torch.no_grad():
        w0, i0 = gate(x)
        assert not calls  # CPU tensors keep route_tokens by default (CUDA ones take the kernel)
        gate.fused_router = True
        w1, i1 = gate(x)
    assert bool(calls) == use_triton(x)  # asked: wherever Triton runs (here: the interpreter)
    w0, i0 = _by_id(w0, i0)
    w1, i1 = _by_id(w1, i1)
    assert torch.equal(i0, i1)
    torch.testing.assert_close(w0, w1, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("n", [0, 1, 5])
@pytest.mark.parametrize("ids_dtype", [torch.int64, torch.int32])
def test_shared_column_and_int32_ids(n, ids_dtype, device):
    """``shared_id`` appends ``(shared_id, 1.0)`` after the routed columns (which keep their
    scaled weights); ``ids_dtype`` int32 changes the type, not the values."""
    gen = torch.Generator().manual_seed(17 + n)
    logits = (torch.randn(n, 256, generator=gen) * 2).to(device)
    bias = (torch.randn(256, generator=gen) * 0.3).to(device)
    kw = dict(top_k=8, n_group=8, topk_group=4, norm_topk_prob=True,
              routed_scaling_factor=2.5)
    w0, ids0 = fused_route(logits, bias, **kw)
    w, ids = fused_route(logits, bias, shared_id=256, ids_dtype=ids_dtype, **kw)
    assert w.shape == ids.shape == (n, 9) and ids.dtype == ids_dtype
    assert torch.equal(ids[:, :8].long(), ids0) and torch.equal(w[:, :8], w0)
    assert (ids[:, 8] == 256).all() and (w[:, 8] == 1.0).all()
    tw, tids = fused_route_ref(logits, bias, shared_id=256, ids_dtype=ids_dtype, **kw)
    assert torch.equal(ids, tids) and tids.dtype == ids_dtype
    torch.testing.assert_close(w, tw, rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="ids_dtype"):
        fused_route(logits, bias, ids_dtype=torch.float32, **kw)


# ---- router logits ---------------------------------------------------------------------------
@pytest.mark.triton
@pytest.mark.parametrize("n", [1, 2, 3, 4])
@pytest.mark.parametrize("e,hidden", [(16, 72), (8, 200), (256, 7168)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_gate_logits_kernel_matches_twin(n, e, hidden, dtype, device):
    if device.type == "cpu" and hidden > 1024:
        pytest.skip("DeepSeek's size runs on the GPU (the interpreter is slow)")
    from mla_spec.kernels.ops import gate_logits, gate_logits_ref
    from mla_spec.kernels.ops.router import GateConfig

    gen = torch.Generator().manual_seed(n * 7 + e)
    x = torch.randn(n, hidden + 8, generator=gen).to(dtype).to(device)[:, 3:hidden + 3]
    w = (torch.randn(e, hidden, generator=gen) * 0.05).to(device)
    ref = gate_logits_ref(x, w)
    out = gate_logits(x, w)
    assert out.shape == (n, e) and out.dtype == torch.float32
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    assert ref.abs().max() > 0.1
    # a tile that loops over K in several masked steps, two experts per program
    small = gate_logits(x, w, GateConfig(2, 32, 1))
    torch.testing.assert_close(small, ref, rtol=1e-5, atol=1e-5)


def test_gate_logits_falls_back_and_refuses_bad_input():
    from mla_spec.kernels.ops.router import GATE_GEMV_MAX_N, GateConfig, gate_logits

    w = torch.randn(16, 40)
    x = torch.randn(GATE_GEMV_MAX_N + 3, 40)  # above the kernel's token range: cuBLAS / torch
    torch.testing.assert_close(gate_logits(x, w), x @ w.T)
    with pytest.raises(ValueError, match=r"x \[N, hidden\] and weight \[E, hidden\]"):
        gate_logits(torch.randn(2, 41), w)
    if use_triton(x):
        with pytest.raises(ValueError, match="must divide E"):
            gate_logits(x[:2], w, GateConfig(3, 64, 1))


def test_moe_router_writes_the_shared_column_for_the_fused_path():
    """``DeepseekV3MoE`` on its fused NVFP4 path asks the router for the shared column and
    int32 ids; the torch route gives the same columns."""
    gate = _tiny_gate(8)
    with torch.no_grad():
        x = torch.randn(3, 24, generator=torch.Generator().manual_seed(9))
        w_t, ids_t = gate(x, shared_id=16, ids_dtype=torch.int32)  # torch route on CPU
        gate.fused_router = True
        w_k, ids_k = gate(x, shared_id=16, ids_dtype=torch.int32)
    for w, ids in ((w_t, ids_t), (w_k, ids_k)):
        assert ids.dtype == torch.int32 and ids.shape == (3, 4)
        assert (ids[:, 3] == 16).all() and (w[:, 3] == 1.0).all()
    a, b = _by_id(w_t[:, :3], ids_t[:, :3].long()), _by_id(w_k[:, :3], ids_k[:, :3].long())
    assert torch.equal(a[1], b[1])
    torch.testing.assert_close(a[0], b[0], rtol=1e-5, atol=1e-6)
