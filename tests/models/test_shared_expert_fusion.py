"""Shared-experts fusion: the shared expert as row E of the fused NVFP4 MoE launch.

Fusion on (shared expert = top-k column E, weight 1.0) must equal fusion off (routed experts
fused, shared MLP separately) on the fused path, which on CPU runs ``fused_moe_nvfp4`` in the
Triton interpreter (gemv path up to 4 tokens, moe_align path above); the loader must still fill
the shared expert's stacked row.
"""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch

from mla_spec.checkpoint_writer import random_state_dict, save_checkpoint, tiny_config
from mla_spec.models import moe as moe_mod
from mla_spec.models.linear import quantize_weight
from mla_spec.models.moe import DeepseekV3MoE

# hidden 32, I 32, 6 experts in 2 groups, top-3 (+1 shared = 4 columns)
CFG = tiny_config(hidden_size=32, moe_intermediate_size=32, n_routed_experts=6, n_group=2,
                  topk_group=1, num_experts_per_tok=3)


def _fill_nvfp4_(lin, scale: float) -> None:
    """Random NVFP4 weights copied in place (as the loader does), ``scale`` sets scale_2."""
    w = scale * torch.randn(lin.out_features, lin.in_features) / lin.in_features**0.5
    with torch.no_grad():
        for name, t in quantize_weight(w).items():
            getattr(lin, name).copy_(t)


def _random_moe(cfg=CFG, **kw) -> DeepseekV3MoE:
    moe = DeepseekV3MoE(cfg, quantized=lambda name: True, **kw)
    with torch.no_grad():
        moe.gate.weight.normal_(0.0, cfg.hidden_size**-0.5)
        moe.gate.e_score_correction_bias.normal_(0.0, 0.3)
    for e in moe.experts:
        for lin in (e.gate_proj, e.up_proj, e.down_proj):
            _fill_nvfp4_(lin, 1.0 + torch.rand(()).item())
    se = moe.shared_experts
    for lin, scale in ((se.gate_proj, 0.5), (se.up_proj, 3.0), (se.down_proj, 1.7)):
        _fill_nvfp4_(lin, scale)
    return moe


def _calls(module) -> list:
    seen: list = []
    module.register_forward_hook(lambda *a: seen.append(1))
    return seen


def test_shared_expert_is_stacked_row_e():
    moe = _random_moe()
    se, E = moe.shared_experts, CFG.n_routed_experts
    w13, s13, w2, s2 = moe._fused
    assert moe.shared_fused and w13["weight"].shape[0] == E + 1
    assert se.gate_proj.weight_scale_2 != se.up_proj.weight_scale_2  # distinct gate / up scales
    inter = CFG.moe_intermediate_size
    assert se.gate_proj.weight.data_ptr() == w13["weight"][E].data_ptr()
    assert torch.equal(w13["weight"][E, inter:], se.up_proj.weight)
    assert torch.equal(w13["weight_scale"][E, :inter].view(torch.uint8),
                       se.gate_proj.weight_scale.view(torch.uint8))
    assert torch.equal(w2["weight"][E], se.down_proj.weight)
    assert torch.equal(s13[E], torch.stack([se.gate_proj.weight_scale_2,
                                            se.up_proj.weight_scale_2]))
    assert s2[E] == se.down_proj.weight_scale_2


@pytest.mark.parametrize("n_tokens", [1, 3, 7])
def test_fused_shared_equals_separate(n_tokens):
    moe = _random_moe()
    moe.fused_mode = "always"
    seen = _calls(moe.shared_experts)
    x = torch.randn(n_tokens, CFG.hidden_size)
    with torch.no_grad():
        moe.fuse_shared_experts = False
        ref = moe(x)
        assert len(seen) == 1
        moe.fuse_shared_experts = True
        out = moe(x)
        # fused (the shared MLP did not run) except where the per-pair GEMV would read the
        # shared weights once per token (2..MOE_GEMV_MAX_M tokens: shared_fusion_pays)
        fused = moe_mod.shared_fusion_pays(n_tokens)
        assert fused == (n_tokens != 3)
        assert len(seen) == (1 if fused else 2)
        moe.fused_mode = "never"  # the differentiable loop, shared MLP separately
        loop = moe(x)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out, loop, rtol=1e-4, atol=1e-4)
    assert len(seen) == (2 if fused else 3)


def test_switch_and_unfusable_shapes():
    moe = _random_moe()
    moe.fused_mode = "always"
    seen = _calls(moe.shared_experts)
    x = torch.randn(1, CFG.hidden_size)
    with torch.no_grad():
        assert moe.fuse_shared_experts is True  # the default
        moe.fuse_shared_experts = False
        ref = moe(x)
        assert len(seen) == 1
        moe.fuse_shared_experts = True
        torch.testing.assert_close(moe(x), ref, rtol=1e-5, atol=1e-5)
        assert len(seen) == 1
    # two shared experts ([2I, K]) are not fused: still one separate MLP, same sum as the loop
    moe2 = _random_moe(replace(CFG, n_shared_experts=2))
    assert not moe2.shared_fused and moe2._fused[0]["weight"].shape[0] == CFG.n_routed_experts
    with torch.no_grad():
        moe2.fused_mode = "always"
        a = moe2(x)
        moe2.fused_mode = "never"
        torch.testing.assert_close(a, moe2(x), rtol=1e-4, atol=1e-4)
    # BF16 shared expert next to NVFP4 routed experts: not fused
    bf16_shared = DeepseekV3MoE(CFG, quantized=lambda name: "shared" not in name)
    assert bf16_shared._fused is not None and not bf16_shared.shared_fused


@pytest.fixture(scope="module")
def fp4_ckpt(tmp_path_factory):
    return save_checkpoint(random_state_dict(CFG, seed=3), CFG,
                           tmp_path_factory.mktemp("sef") / "fp4", quantize=True,
                           dtype=torch.float32, shards=2)


def _logits(path, fuse: bool, ids, rank: int = 0, world: int = 1):
    from mla_spec.loader import load_checkpoint
    from mla_spec.model_api import prefill_forward

    model = load_checkpoint(path, load_mtp=False, tp_rank=rank, tp_size=world).model
    moes = [m for m in model.modules() if isinstance(m, DeepseekV3MoE)]
    assert moes and all(m.shared_fused for m in moes)
    for m in moes:
        m.fused_mode, m.fuse_shared_experts = "always", fuse
    with torch.no_grad():
        return model.compute_logits(prefill_forward(model, ids, attention_backend="torch"))


def _rank_logits(rank, world, path, ids):
    return _logits(path, True, ids, rank, world)


def test_loader_fills_fused_shared_expert(fp4_ckpt):
    from safetensors import safe_open

    from mla_spec.loader import load_checkpoint

    moe = load_checkpoint(fp4_ckpt, load_mtp=False).model.layers[1].mlp
    E, name = CFG.n_routed_experts, "model.layers.1.mlp.shared_experts"
    w13, s13, w2, s2 = moe._fused
    idx = json.loads((fp4_ckpt / "model.safetensors.index.json").read_text())
    f = {n: safe_open(str(fp4_ckpt / idx["weight_map"][f"{name}.{n}"]), "pt").get_tensor(
        f"{name}.{n}") for n in ("gate_proj.weight", "up_proj.weight_scale_2",
                                  "down_proj.weight", "gate_proj.weight_scale_2")}
    assert torch.equal(w13["weight"][E, :CFG.moe_intermediate_size], f["gate_proj.weight"])
    assert torch.equal(w2["weight"][E], f["down_proj.weight"])
    assert s13[E, 1] == f["up_proj.weight_scale_2"].reshape(())
    assert s13[E, 0] == f["gate_proj.weight_scale_2"].reshape(()) != s13[E, 1]
    assert s2[E] == moe.shared_experts.down_proj.weight_scale_2 > 0


def test_model_logits_fusion_on_off(fp4_ckpt):
    ids = torch.randint(0, CFG.vocab_size, (1, 5))
    on, off = _logits(fp4_ckpt, True, ids), _logits(fp4_ckpt, False, ids)
    torch.testing.assert_close(on, off, rtol=1e-5, atol=1e-5)


def test_tp2_fused_matches_tp1(fp4_ckpt):
    from mla_spec.runtime.launch import launch

    ids = torch.randint(0, CFG.vocab_size, (1, 3))
    ref = _logits(fp4_ckpt, False, ids)
    outs = launch(_rank_logits, 2, backend="gloo", args=(fp4_ckpt, ids))
    for out in outs:
        torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)


@pytest.mark.gpu
@pytest.mark.parametrize("n_tokens", [1, 4, 16, 77])
def test_fused_shared_cuda_bf16(n_tokens):
    """The compiled kernels (gemv and sorted paths) on the GPU, bf16 activations."""
    moe = _random_moe(dtype=torch.bfloat16, device="cuda")
    x = torch.randn(n_tokens, CFG.hidden_size, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        moe.fuse_shared_experts = False
        ref = moe(x).float()
        moe.fuse_shared_experts = True
        out = moe(x).float()
        assert moe._use_fused(x)  # the fused path runs at inference (no grad) on CUDA
    torch.testing.assert_close(out, ref, rtol=2e-2, atol=2e-2 * ref.abs().max().item())
