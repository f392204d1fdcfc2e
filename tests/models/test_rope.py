"""YaRN RoPE: frequencies and attention factor equal transformers'; interleaved pairs."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from mla_spec.config import ModelConfig
from mla_spec.models.rope import DeepseekRotaryEmbedding, yarn_inv_freq

V3 = ModelConfig.from_hf(Path(__file__).resolve().parents[1] / "data" / "deepseek_v3_config.json")


def _hf_yarn(cfg: ModelConfig):
    from transformers import DeepseekV3Config
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    d = {k: v for k, v in cfg.to_dict().items()
         if k not in ("architectures", "model_type", "torch_dtype")}
    hcfg = DeepseekV3Config(**d)
    kind = hcfg.rope_parameters["rope_type"]
    if kind == "default":
        base = hcfg.rope_parameters["rope_theta"]
        dim = cfg.qk_rope_head_dim
        return 1.0 / base ** (torch.arange(0, dim, 2).float() / dim), 1.0
    return ROPE_INIT_FUNCTIONS[kind](hcfg)


@pytest.mark.parametrize("rope_scaling", [
    V3.rope_scaling,
    {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128, "beta_fast": 32,
     "beta_slow": 1, "mscale": 0.8, "mscale_all_dim": 1.0},
    {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 64},
    None,
])
def test_yarn_matches_transformers(rope_scaling):
    cfg = ModelConfig.from_hf({**V3.to_dict(), "rope_scaling": rope_scaling})
    ours, attn = yarn_inv_freq(cfg.qk_rope_head_dim, cfg.rope_theta, cfg.rope_scaling,
                               cfg.max_position_embeddings)
    ref, ref_attn = _hf_yarn(cfg)
    torch.testing.assert_close(ours, ref.float(), rtol=1e-6, atol=0)
    assert attn == pytest.approx(ref_attn, rel=1e-9)


def test_v3_softmax_scale_and_factor():
    _, attn = yarn_inv_freq(64, 10000.0, V3.rope_scaling, V3.max_position_embeddings)
    assert attn == pytest.approx(1.0)  # mscale == mscale_all_dim
    assert V3.softmax_scale == pytest.approx(0.1352338, abs=1e-7)


def test_interleaved_pairs_and_dot_products():
    """Pair (x[2i], x[2i+1]) rotates by freq i; q.k equals transformers' de-interleaved form."""
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import (
        apply_rotary_pos_emb_interleave,
    )

    rope = DeepseekRotaryEmbedding(V3)
    pos = torch.tensor([0, 1, 7, 4095, 70000])
    q = torch.randn(5, 3, 64)
    k = torch.randn(5, 64)
    qr, kr = rope(pos, q, k)
    cos, sin = rope.cos_sin(pos)
    # pair 0 of row 2 rotated by angle pos * inv_freq[0]
    a = pos[2] * rope.inv_freq[0]
    exp0 = q[2, :, 0] * torch.cos(a) - q[2, :, 1] * torch.sin(a)
    torch.testing.assert_close(qr[2, :, 0], exp0, rtol=1e-4, atol=1e-4)
    c2, s2 = torch.cat([cos, cos], -1), torch.cat([sin, sin], -1)
    hq, hk = apply_rotary_pos_emb_interleave(q[None].transpose(1, 2), k[None, None], c2[None],
                                             s2[None])
    # transformers returns [even | odd]; ours stays interleaved: same values, permuted.
    perm = torch.cat([torch.arange(0, 64, 2), torch.arange(1, 64, 2)])
    torch.testing.assert_close(qr[..., perm], hq[0].transpose(0, 1), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(kr[..., perm], hk[0, 0], rtol=1e-5, atol=1e-5)
    assert qr.dtype == q.dtype
