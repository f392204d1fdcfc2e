"""Memory plan: DeepSeek-V3's published parameter count, per-GPU bytes, KV per token."""

from __future__ import annotations

from pathlib import Path

import pytest

from mla_spec.config import ModelConfig
from mla_spec.memory_plan import memory_plan, param_counts

V3 = ModelConfig.from_hf(Path(__file__).resolve().parent / "data" / "deepseek_v3_config.json")


def test_published_parameter_count():
    c = param_counts(V3)
    assert round(c["target_total"] / 1e9) == 671  # "671B total parameters"
    assert round(c["mtp_layer"] / 1e9, 1) == pytest.approx(13.5, abs=0.1)  # published as 14B
    assert round((c["target_total"] + c["mtp_layer"]) / 1e9, 0) in (684, 685)  # "685B on HF"
    assert c["routed_experts"] == 58 * 256 * 3 * 7168 * 2048
    assert c["embed_tokens"] == c["lm_head"] == 129280 * 7168


def test_kv_bytes_and_tp_split():
    p1 = memory_plan(V3, tp=1, gpu="H200", kv_dtype="bfloat16")
    p8 = memory_plan(V3, tp=8, gpu="H200", kv_dtype="fp8_e4m3")
    assert p1.kv_bytes_per_token == 62 * 576 * 2  # 61 target layers + the MTP draft layer
    assert p8.kv_bytes_per_token == 62 * 576
    assert p8.weight_bytes["routed experts (nvfp4)"] == pytest.approx(
        p1.weight_bytes["routed experts (nvfp4)"] / 8)
    # vocab-parallel: 129280 rows split 8 ways (mla_spec.models.vocab_parallel)
    assert p8.weight_bytes["lm_head (bf16)"] == pytest.approx(p1.weight_bytes["lm_head (bf16)"] / 8)
    assert p8.weight_bytes["embed_tokens (bf16)"] == pytest.approx(
        p1.weight_bytes["embed_tokens (bf16)"] / 8)
    assert p1.max_tokens == 0  # 671B in FP4 does not fit one H200
    assert 300_000 < memory_plan(V3, tp=4, gpu="H200").max_tokens < 2_000_000
    assert memory_plan(V3, tp=4, gpu="B200").max_tokens > memory_plan(V3, tp=4).max_tokens


def test_table_and_errors():
    t = memory_plan(V3, tp=4, gpu="B200", kv_dtype="fp8_e4m3").table()
    assert "B200 x TP4" in t and "tokens that fit per GPU" in t and "routed experts" in t
    with pytest.raises(ValueError, match="supported H200, B200"):
        memory_plan(V3, gpu="A100")
    with pytest.raises(ValueError, match="must divide"):
        memory_plan(V3, tp=3)
    with pytest.raises(ValueError, match="kv_dtype"):
        memory_plan(V3, kv_dtype="int4")
