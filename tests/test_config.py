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


# ---- required keys, logged defaults, quantization configs ------------------------------------
@pytest.mark.parametrize("keys", [("num_experts_per_tok",), ("n_group",),
                                  ("n_group", "num_experts_per_tok"), ("rope_theta",)])
def test_missing_architecture_key_is_an_error_naming_key_and_file(tmp_path, keys):
    raw = json.loads(REAL.read_text())
    for k in keys:
        raw.pop(k)
    (tmp_path / "config.json").write_text(json.dumps(raw))
    want = rf"{tmp_path / 'config.json'}: missing or null key\(s\) " + ", ".join(
        f"'{k}'" for k in keys)
    with pytest.raises(ValueError, match=want):
        ModelConfig.from_hf(tmp_path)
    with pytest.raises(ValueError, match=f"some/config.json: .*'{keys[-1]}'"):
        ModelConfig.from_hf(raw, source="some/config.json")


def test_null_architecture_key_is_an_error_but_q_lora_rank_may_be_null():
    raw = json.loads(REAL.read_text())
    with pytest.raises(ValueError, match="'num_experts_per_tok'"):
        ModelConfig.from_hf({**raw, "num_experts_per_tok": None})
    assert ModelConfig.from_hf({**raw, "q_lora_rank": None}).q_lora_rank is None


def test_harmless_default_is_logged_once_with_its_value(tmp_path, caplog):
    raw = json.loads(REAL.read_text())
    raw.pop("topk_method")
    raw.pop("num_nextn_predict_layers")
    (tmp_path / "config.json").write_text(json.dumps(raw))
    with caplog.at_level("WARNING", logger="mla_spec.config"):
        cfg = ModelConfig.from_hf(tmp_path)
        ModelConfig.from_hf(tmp_path)
    assert cfg.topk_method == "noaux_tc" and cfg.num_nextn_predict_layers == 1
    msgs = [r.getMessage() for r in caplog.records]
    assert sum("'topk_method'" in m and "'noaux_tc'" in m for m in msgs) == 1
    assert sum("'num_nextn_predict_layers'" in m and " 1" in m for m in msgs) == 1
    assert all(str(tmp_path) in m for m in msgs) and len(msgs) == 2


def test_shipped_configs_take_no_default(caplog):
    from mla_spec import EMBEDDED_MODEL

    with caplog.at_level("WARNING", logger="mla_spec.config"):
        ModelConfig.from_hf(REAL)
        tiny = ModelConfig.from_hf(EMBEDDED_MODEL)
    assert not caplog.records
    assert (tiny.num_experts_per_tok, tiny.n_group, tiny.topk_group) == (2, 4, 2)


@pytest.mark.parametrize("kv,ok", [("FP8", True), ("fp8", True), (None, True), ("INT8", False),
                                   ("NVFP4", False), ("FP8_E5M2", False)])
def test_kv_cache_quant_algo_supported_or_rejected(kv, ok):
    from mla_spec.models.quant_config import QuantConfig

    d = {"quantization": {"quant_algo": "NVFP4", "group_size": 16, "kv_cache_quant_algo": kv}}
    if ok:
        assert QuantConfig.from_hf_quant_config(d).kv_cache_fp8 == (kv is not None)
    else:
        with pytest.raises(ValueError, match=f"kv_cache_quant_algo '{kv}': supported 'FP8'"):
            QuantConfig.from_hf_quant_config(d)


@pytest.mark.parametrize("algo", ["FP8", "W4A8_AWQ", "INT4_AWQ", None])
def test_unsupported_quant_algo_rejected(algo):
    from mla_spec.models.quant_config import QuantConfig

    with pytest.raises(ValueError, match=f"quant_algo {algo!r}: supported 'NVFP4'"):
        QuantConfig.from_hf_quant_config({"quantization": {"quant_algo": algo}})


def test_flat_kv_cache_scheme_other_than_fp8_rejected_naming_the_file(tmp_path):
    from mla_spec.models.quant_config import QuantConfig

    raw = json.loads(REAL.read_text())
    raw["quantization_config"] = {"quant_method": "modelopt", "quant_algo": "NVFP4",
                                  "kv_cache_scheme": {"type": "int", "num_bits": 8}}
    (tmp_path / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ValueError, match=r"config.json: quantization_config: kv_cache_scheme .*"
                                         r"supported \{'type': 'float', 'num_bits': 8\}"):
        QuantConfig.from_folder(tmp_path)
    (tmp_path / "hf_quant_config.json").write_text(json.dumps(
        {"quantization": {"quant_algo": "NVFP4", "kv_cache_quant_algo": "INT8"}}))
    with pytest.raises(ValueError, match="hf_quant_config.json: kv_cache_quant_algo 'INT8'"):
        QuantConfig.from_folder(tmp_path)
