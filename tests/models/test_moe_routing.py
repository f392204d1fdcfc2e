"""noaux_tc routing equals transformers' router; the bias only steers selection; MoE sums."""

from __future__ import annotations

import torch

from mla_spec.checkpoint_writer import tiny_config
from mla_spec.kernels.ops import route_tokens
from mla_spec.models.moe import DeepseekV3MoE


def _hf_router(cfg, weight, bias):
    from transformers import DeepseekV3Config
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

    d = {k: v for k, v in cfg.to_dict().items()
         if k not in ("architectures", "model_type", "torch_dtype")}
    r = DeepseekV3TopkRouter(DeepseekV3Config(**d))
    r.weight.data.copy_(weight)
    r.e_score_correction_bias.copy_(bias)
    return r


def test_routing_matches_transformers():
    cfg = tiny_config(n_routed_experts=16, n_group=4, topk_group=2, num_experts_per_tok=3)
    w = torch.randn(16, cfg.hidden_size) / cfg.hidden_size**0.5
    bias = 0.5 * torch.randn(16)
    x = torch.randn(37, cfg.hidden_size)
    kw = dict(top_k=3, n_group=4, topk_group=2, norm_topk_prob=True,
              routed_scaling_factor=cfg.routed_scaling_factor)
    weights, ids = route_tokens(x @ w.T, bias, **kw)
    _, hw, hids = _hf_router(cfg, w, bias)(x)
    # same set of experts with the same weights (order of top-k is unspecified)
    o1, o2 = ids.sort(-1), hids.sort(-1)
    assert torch.equal(o1.values, o2.values)
    torch.testing.assert_close(weights.gather(1, o1.indices), hw.gather(1, o2.indices))
    torch.testing.assert_close(weights.sum(-1), torch.full((37,), 2.5))
    # chosen experts lie in at most topk_group groups
    assert ((ids // 4).unsqueeze(-1) == (ids // 4).unsqueeze(-2)).any(-1).all()
    assert max(len(set((r // 4).tolist())) for r in ids) <= 2
    # the bias changes the choice but never the weights' source (unbiased scores)
    _, ids0 = route_tokens(x @ w.T, None, **kw)
    assert not torch.equal(ids0.sort(-1).values, o1.values)
    scores = (x @ w.T).sigmoid()
    sel = scores.gather(1, ids)
    torch.testing.assert_close(weights, sel / sel.sum(-1, keepdim=True) * 2.5)


def test_moe_equals_dense_sum():
    cfg = tiny_config()
    moe = DeepseekV3MoE(cfg)
    for p in moe.parameters():
        torch.nn.init.normal_(p, std=0.2)
    moe.gate.e_score_correction_bias.normal_()
    x = torch.randn(9, cfg.hidden_size)
    w, ids = moe.gate(x)
    ref = moe.shared_experts(x)
    for n in range(9):
        for k in range(cfg.num_experts_per_tok):
            ref[n] += w[n, k] * moe.experts[int(ids[n, k])](x[n])
    torch.testing.assert_close(moe(x), ref, rtol=1e-5, atol=1e-5)
    assert moe(x[:0]).shape == (0, cfg.hidden_size)


def test_fused_nvfp4_experts_equal_loop(fp4_ckpt, tiny_cfg):
    """The stacked w13 / w2 views the fused kernel reads hold what the loader wrote."""
    from mla_spec.kernels.nvfp4 import fused_moe_ref
    from mla_spec.loader import load_checkpoint

    moe = load_checkpoint(fp4_ckpt, load_mtp=False).model.layers[1].mlp
    assert moe._fused is not None
    w13 = moe._fused[0]["weight"]
    assert torch.equal(w13[3, tiny_cfg.moe_intermediate_size:], moe.experts[3].up_proj.weight)
    assert w13.data_ptr() == moe.experts[0].gate_proj.weight.data_ptr()
    x = torch.randn(6, tiny_cfg.hidden_size)
    w, ids = moe.gate(x)
    with torch.no_grad():
        loop = moe.experts_forward(x, w, ids)
        fused = moe.fused_experts_forward(x, w, ids, kernel=fused_moe_ref)
    torch.testing.assert_close(fused, loop, rtol=1e-4, atol=1e-4)


def test_masked_experts_path_equals_loop():
    cfg = tiny_config()
    moe = DeepseekV3MoE(cfg)
    for p in moe.parameters():
        torch.nn.init.normal_(p, std=0.2)
    x = torch.randn(5, cfg.hidden_size)
    ref = moe(x)
    moe.fused_mode = "masked"
    torch.testing.assert_close(moe(x), ref, rtol=1e-5, atol=1e-5)
