"""Configs: the real DeepSeek-V3 config.json, the YaRN softmax scale, validation."""

import json
from pathlib import Path

import pytest

from mla_spec import CacheConfig, ModelConfig, ParallelConfig, SpecConfig

REAL = Path(__file__).parent / "data" / "deepseek_v3_config.json"


def test_real_config_softmax_scale():
    cfg = ModelConfig.from_hf(REAL)
    assert cfg.softmax_scale == pytest.approx(0.1352338, abs=1e-6)
    assert cfg.kv_cache_dim == 576 and cfg.qk_head_dim == 192
    assert cfg.num_hidden_layers == 61 and cfg.n_routed_experts == 256
    assert not cfg.is_moe_layer(2) and cfg.is_moe_layer(3)


def test_from_dict_folder_and_roundtrip(tmp_path):
    raw = json.loads(REAL.read_text())
    (tmp_path / "config.json").write_text(json.dumps(raw))
    a, b = ModelConfig.from_hf(raw), ModelConfig.from_hf(tmp_path)
    assert a == b
    assert ModelConfig.from_hf(a.to_dict()) == a


def test_no_yarn_scale():
    cfg = ModelConfig(rope_scaling=None)
    assert cfg.softmax_scale == pytest.approx(192**-0.5)


def test_missing_config(tmp_path):
    with pytest.raises(FileNotFoundError, match="config.json"):
        ModelConfig.from_hf(tmp_path)


def test_cache_config():
    import torch

    assert CacheConfig().torch_dtype(torch.bfloat16) is torch.bfloat16
    assert CacheConfig(kv_dtype="fp8_e4m3").torch_dtype(torch.bfloat16) is torch.float8_e4m3fn
    assert CacheConfig(kv_dtype="fp8_e4m3").is_fp8
    with pytest.raises(ValueError, match="supported 'auto'"):
        CacheConfig(kv_dtype="int4")
    with pytest.raises(ValueError, match="k_scale"):
        CacheConfig(k_scale=0.0)
    with pytest.raises(ValueError, match="page_size"):
        CacheConfig(page_size=0)


def test_spec_config():
    s = SpecConfig()
    assert (s.num_steps, s.topk, s.num_draft_tokens, s.version) == (3, 1, 4, "v2") and s.enabled
    assert SpecConfig(algorithm="nextn").algorithm == "EAGLE"
    assert not SpecConfig.off().enabled
    with pytest.raises(ValueError, match="num_steps \\+ 1"):
        SpecConfig(num_steps=3, num_draft_tokens=3)
    with pytest.raises(ValueError, match="topk"):
        SpecConfig(topk=2)
    with pytest.raises(ValueError, match="version"):
        SpecConfig(version="v3")
    with pytest.raises(ValueError, match="algorithm"):
        SpecConfig(algorithm="MEDUSA")


def test_parallel_config():
    assert ParallelConfig(tp_size=4).tp_size == 4
    with pytest.raises(ValueError, match="tp_size"):
        ParallelConfig(tp_size=0)
    with pytest.raises(ValueError, match="backend"):
        ParallelConfig(backend="mpi")


def test_frozen():
    import dataclasses

    with pytest.raises(dataclasses.FrozenInstanceError):
        CacheConfig().page_size = 32


def test_transformers5_rope_parameters():
    raw = json.loads(REAL.read_text())
    rs = raw.pop("rope_scaling")
    raw.pop("rope_theta")
    raw["rope_parameters"] = {"rope_type": "yarn", "rope_theta": 10000.0,
                              **{k: v for k, v in rs.items() if k != "type"}}
    cfg = ModelConfig.from_hf(raw)
    assert cfg.softmax_scale == pytest.approx(0.1352338, abs=1e-6)
    assert cfg.rope_theta == 10000.0 and cfg.rope_scaling["type"] == "yarn"
