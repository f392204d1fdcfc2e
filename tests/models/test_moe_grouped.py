"""Unquantized experts as two grouped GEMMs (``models/moe_grouped.py``, the MoE's CUDA path).

The grouped path must equal the per-expert loop and the masked all-experts path on random
routing (tokens 0, 1, 3, 7, 33; experts never chosen, experts chosen by every token), keep the
experts' parameters as views of the stacked weights (loader copies and optimizer steps land in
both), and fall back when a ``.to()`` or an unsupported dtype breaks the stacking.
"""

from __future__ import annotations

import pytest
import torch

from mla_spec.checkpoint_writer import tiny_config
from mla_spec.models.moe import DeepseekV3MoE
from mla_spec.models.moe_grouped import (
    grouped_experts_forward,
    grouped_supported,
    stack_dense_experts,
    still_stacked,
)

pytestmark = pytest.mark.skipif(not hasattr(torch, "_grouped_mm"),
                                reason=f"torch {torch.__version__} has no _grouped_mm")

# hidden 40, I 24, 6 experts in 2 groups, top-3, one shared expert
CFG = tiny_config(hidden_size=40, moe_intermediate_size=24, n_routed_experts=6, n_group=2,
                  topk_group=1, num_experts_per_tok=3)


def _moe(dtype=torch.float32) -> DeepseekV3MoE:
    moe = DeepseekV3MoE(CFG, dtype=dtype)
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for p in moe.parameters():
            p.copy_(torch.randn(p.shape, generator=g, device="cpu") * p.shape[-1] ** -0.5)
    return moe


@pytest.mark.parametrize("n_tokens", [0, 1, 3, 7, 33])
def test_grouped_equals_loop_and_masked(n_tokens):
    moe = _moe()
    assert moe._dense is not None and still_stacked(moe.experts, *moe._dense)
    x = torch.randn(n_tokens, CFG.hidden_size, generator=torch.Generator().manual_seed(n_tokens))
    with torch.no_grad():
        outs = {}
        for mode in ("grouped", "never", "masked"):
            moe.fused_mode = mode
            outs[mode] = moe(x)
    torch.testing.assert_close(outs["grouped"], outs["never"], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(outs["grouped"], outs["masked"], rtol=1e-5, atol=1e-5)


def test_every_token_on_one_expert_and_unused_experts():
    e, k_in, inter = 5, 16, 8
    w13 = torch.randn(e, 2 * inter, k_in)
    w2 = torch.randn(e, k_in, inter)
    x = torch.randn(4, k_in)
    ids = torch.tensor([[2, 4], [2, 0], [2, 4], [2, 1]])  # expert 3 unused, 2 chosen by all
    w = torch.rand(4, 2)
    out = grouped_experts_forward(x, w, ids, w13, w2)
    ref = torch.zeros_like(x)
    for n in range(4):
        for j in range(2):
            g, u = (x[n] @ w13[ids[n, j]].T).chunk(2)
            ref[n] += w[n, j] * (torch.nn.functional.silu(g) * u) @ w2[ids[n, j]].T
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


def test_parameters_are_views_of_the_stack():
    moe = _moe()
    w13, w2 = moe._dense
    e = moe.experts[4]
    with torch.no_grad():
        e.up_proj.weight.fill_(0.25)  # an in-place write (loader copy, optimizer step)
        e.down_proj.weight[0, 0] = 7.0
    inter = CFG.moe_intermediate_size
    assert torch.all(w13[4, inter:] == 0.25) and w2[4, 0, 0] == 7.0
    assert {n for n, _ in moe.named_parameters()} == {
        n for n, _ in DeepseekV3MoE(CFG).named_parameters()}  # same names, nothing extra


def test_stale_stack_falls_back():
    moe = _moe()
    x = torch.randn(3, CFG.hidden_size)
    moe.fused_mode = "grouped"
    assert not moe._use_grouped(x)  # grad mode: the differentiable loop
    moe.experts[0].gate_proj.weight = torch.nn.Parameter(moe.experts[0].gate_proj.weight.clone())
    with torch.no_grad():
        assert not moe._use_grouped(x)  # a new storage (as after .to()): not the stack any more
        moe.fused_mode = "never"
        ref = moe(x)
        moe.fused_mode = "grouped"
        torch.testing.assert_close(moe(x), ref)  # the loop ran: still right


def test_stacked_by_default_and_refusals():
    assert DeepseekV3MoE(CFG)._dense is not None  # unquantized experts are stacked at build time
    w13 = torch.zeros(2, 16, 8)
    assert grouped_supported(torch.zeros(1, 8), w13) is None
    assert "bfloat16" in grouped_supported(torch.zeros(1, 8, dtype=torch.bfloat16), w13)
    assert stack_dense_experts(torch.nn.ModuleList()) is None


@pytest.mark.gpu
@pytest.mark.parametrize("n_tokens", [1, 4, 32])
def test_grouped_cuda_bf16_matches_loop(n_tokens):
    """On an SM90 GPU in BF16 (what the MTP layer runs), also inside a CUDA graph."""
    if torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("torch._grouped_mm needs SM90")
    moe = _moe(dtype=torch.bfloat16).cuda()  # .cuda() breaks the stack ...
    assert moe._dense is None or not still_stacked(moe.experts, *moe._dense)
    with torch.device("cuda"):
        moe = _moe(dtype=torch.bfloat16)  # ... built on the GPU it holds
    x = torch.randn(n_tokens, CFG.hidden_size, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        assert moe._use_grouped(x)
        out = moe(x)
        moe.fused_mode = "never"
        ref = moe(x)
        moe.fused_mode = "auto"
        graph = torch.cuda.CUDAGraph()
        moe(x)
        with torch.cuda.graph(graph):
            static = moe(x)
        graph.replay()
    torch.testing.assert_close(out.float(), ref.float(), rtol=3e-2, atol=3e-2)
    # the replay may sum a token's experts in another order than the eager call: bf16 ulps
    torch.testing.assert_close(static.float(), out.float(), rtol=2e-2, atol=1e-2)
