"""One GEMM for q_a_proj and kv_a_proj_with_mqa (``MLAAttention._qkv_a_weight``)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from mla_spec.model_api import load_model
from mla_spec.models.mla import MLAAttention


@pytest.fixture(scope="module")
def loaded(fp32_ckpt):
    return load_model(fp32_ckpt, device="cpu", attention_backend="torch")


def _attns(model):
    return [m for m in model.modules() if isinstance(m, MLAAttention)]


def test_loaded_weights_share_one_buffer(loaded, tiny_cfg):
    attns = _attns(loaded.model)
    assert len(attns) == tiny_cfg.num_hidden_layers
    with torch.no_grad():
        for a in attns:
            w = a._qkv_a_weight()
            assert w is not None, "the loader's in-place copies must keep the joint buffer"
            ref = torch.cat([a.q_a_proj.weight, a.kv_a_proj_with_mqa.weight])
            assert torch.equal(w, ref) and ref.abs().sum() > 0


def test_fused_logits_equal_two_gemms(fp32_ckpt, tiny_cfg):
    ids = torch.randint(0, tiny_cfg.vocab_size, (2, 9), generator=torch.Generator().manual_seed(3))
    loaded = load_model(fp32_ckpt, device="cpu", attention_backend="torch")
    fused = loaded.logits(ids)
    with torch.no_grad():
        for a in _attns(loaded.model):  # separate allocations: the two-GEMM path
            kv = a.kv_a_proj_with_mqa
            kv.weight = nn.Parameter(kv.weight.detach().clone())
        assert all(a._qkv_a_weight() is None for a in _attns(loaded.model))
    split = loaded.logits(ids)
    torch.testing.assert_close(fused, split, rtol=1e-5, atol=1e-5)
    assert split.std() > 0.5


def test_falls_back_when_not_adjacent(tiny_cfg):
    torch.manual_seed(0)
    a = MLAAttention(tiny_cfg, 0)
    for p in a.parameters():
        nn.init.normal_(p, std=0.1)
    with torch.no_grad():
        assert a._qkv_a_weight() is not None
        kv = a.kv_a_proj_with_mqa
        kv.weight = nn.Parameter(kv.weight.detach().clone())  # a separate allocation
        assert a._qkv_a_weight() is None


def test_training_and_quantized_use_two_gemms(tiny_cfg):
    a = MLAAttention(tiny_cfg, 0)
    assert a.q_a_proj.weight.requires_grad
    assert a._qkv_a_weight() is None  # autograd on: the joint view would not route gradients
    with torch.no_grad():
        assert a._qkv_a_weight() is not None
    q = MLAAttention(tiny_cfg, 0, quantized=lambda name: name.endswith("q_a_proj"))
    with torch.no_grad():
        assert q._qkv_a_weight() is None
