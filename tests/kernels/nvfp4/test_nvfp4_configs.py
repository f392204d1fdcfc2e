"""NVFP4 kernel configs: the table pinned by the H200 sweep parses, the defaults pick its
entries for measured shapes and a heuristic elsewhere, and the PTX decoders (the GPU default)
are never used by the interpreter or on CPU."""

from __future__ import annotations

import pytest
import torch

import mla_spec.kernels.nvfp4.gemm as gemm_mod
from mla_spec.kernels.nvfp4 import configs
from mla_spec.kernels.nvfp4.configs import (
    M_BUCKETS,
    PINNED_CONFIGS,
    PINNED_CUDA,
    GemvConfig,
    NVFP4MmaConfig,
    m_bucket,
    parse_variant,
    pinned_config,
    variant_name,
)
from mla_spec.kernels.nvfp4.gemm import auto_config, default_mma_config, nvfp4_gemm, ptx_decoder_ok
from mla_spec.kernels.nvfp4.gemv import packed_gemv_config
from mla_spec.kernels.nvfp4.reference import nvfp4_gemm_ref
from mla_spec.quant.nvfp4 import quantize_nvfp4


def test_pinned_table_parses_and_round_trips():
    assert len(PINNED_CONFIGS) >= 16
    kinds = {"gemv": GemvConfig, "mmab": NVFP4MmaConfig}
    for (n, k, bucket), name in PINNED_CONFIGS.items():
        assert bucket in M_BUCKETS and n > 0 and k % 16 == 0
        cfg = parse_variant(name)
        assert isinstance(cfg, kinds[name.split()[0]])
        assert variant_name(cfg) == name
    assert parse_variant("gemv bn256 s16 w2 st1") == GemvConfig(256, 2, 16, 2, 1)
    assert parse_variant("gemv st2 g4 bn64") == GemvConfig(block_n=64, groups=4, num_stages=2)


def test_mmab_variants_round_trip():
    cfg = parse_variant("mmab bm64 bn128 bk128 w4 st3 s1")
    assert cfg == NVFP4MmaConfig(block_m=64, block_n=128, block_k=128, split_k=1, num_warps=4,
                                 num_stages=3)
    assert parse_variant("mmab s2 bn64 bk256 w8 st4") == NVFP4MmaConfig(0, 64, 256, 2, 8, 4)
    for name in ("mmab bm64 bn128 bk128 w4 st3 s1", "mmab bn256 bk64 w8 st2 s4",
                 "mmab bm16 bn64 bk128 w4 st4 s8", "mmab bm128 bn128 bk128 w8 st3 s1"):
        assert variant_name(parse_variant(name)) == name
    for cfg in (NVFP4MmaConfig(), default_mma_config(100, 9216, 7168)):
        assert parse_variant(variant_name(cfg)) == cfg


@pytest.mark.parametrize("bad", ["", "wgmma bn64", "gemv bk128", "mma bn64 bk128", "gemv bn100",
                                 "gemv s0", "mmab bn64 x3", "gemv bn64s4", "gemv bn8 pure",
                                 "mmab g2", "mmab bm48", "mmab bm256", "mmab bn96", "gemv bm16",
                                 "mmab bn64 h2", "cuda w4 pf"])
def test_parse_variant_rejects(bad):
    with pytest.raises(ValueError):
        parse_variant(bad)


def test_m_buckets():
    assert [m_bucket(m) for m in (1, 2, 4, 5, 8, 9, 16, 17, 64, 65, 128, 129, 512, 513)] == \
        [1, 2, 4, 8, 8, 16, 16, 64, 64, 128, 128, 512, 512, None]


def test_defaults_pick_the_table_for_listed_shapes():
    gate_up, down, w13, w2 = (9216, 7168), (7168, 4608), (1024, 7168), (7168, 512)
    # M = 1: the packed-math GEMV with wide steps; above: the MMA kernel
    assert auto_config(1, *gate_up) == parse_variant("gemv bn8 s1 w2 st1 g64 h2 pf")
    assert auto_config(1, *w2).packed and auto_config(1, *w2).groups == 32
    assert auto_config(3, *down) == parse_variant("mmab bm16 bn64 bk128 w4 st4 s4")  # bucket 4
    assert auto_config(40, *down) == parse_variant("mmab bm64 bn64 bk128 w4 st4 s4")
    assert auto_config(12, *w13) == parse_variant("mmab bm16 bn64 bk128 w4 st4 s8")
    assert auto_config(64, *w2) == parse_variant("mmab bm64 bn64 bk128 w4 st4 s1")
    assert auto_config(300, *gate_up) == parse_variant("mmab bm128 bn64 bk128 w4 st4 s1")


def test_heuristics_for_unseen_shapes():
    n, k = 6144, 1536  # q_b_proj, not in the table
    assert pinned_config(4, n, k) is None
    # 1-2 tokens: the packed, wide, double-buffered GEMV, fitted to the M = 1 winners
    for m in (1, 2):
        cfg = auto_config(m, n, k)
        assert cfg == packed_gemv_config(m, n, k) and cfg.packed and cfg.prefetch
    assert packed_gemv_config(1, 9216, 7168) == parse_variant("gemv bn8 s1 w2 st1 g64 h2 pf")
    assert packed_gemv_config(1, 1024, 7168) == parse_variant("gemv bn4 s4 w1 st1 g64 h2 pf")
    assert packed_gemv_config(1, 96, 48).groups == 4  # K / 16 = 3 blocks
    cfg = auto_config(3, n, k)  # above: the MMA kernel
    assert isinstance(cfg, NVFP4MmaConfig)
    assert (cfg.block_m, cfg.block_n, cfg.block_k, cfg.num_warps) == (16, 128, 128, 4)
    assert cfg.split_k == 2  # 48 tiles x 4 warps x 2 splits; K = 12 steps of 128 caps it
    for m, bm, warps in ((100, 128, 8), (512, 128, 8), (40, 64, 4), (30, 32, 4)):
        cfg = default_mma_config(m, 9216 if m > 64 else n, 7168 if m > 64 else k)
        assert isinstance(cfg, NVFP4MmaConfig) and (cfg.block_m, cfg.num_warps) == (bm, warps)
    assert default_mma_config(512, 9216, 7168).split_k == 1  # 288 tiles fill the SMs
    assert default_mma_config(128, 9216, 7168).split_k == 2  # 72 tiles x 8 warps


def test_ptx_decoders_never_on_cpu_or_in_the_interpreter():
    assert not ptx_decoder_ok(torch.device("cpu"), False)
    assert not ptx_decoder_ok(torch.device("cuda", 0), True)  # interpreter: never


def test_config_type_is_checked():
    q = quantize_nvfp4(torch.randn(8, 32))
    with pytest.raises(ValueError, match="config must be"):
        nvfp4_gemm(torch.randn(2, 32), q.weight, q.weight_scale, q.weight_scale_2, config=(64,))


@pytest.mark.triton
def test_pinned_entry_drives_the_launch(monkeypatch, device):
    """A pinned MMA entry at M = 2 (where the heuristic runs the GEMV) runs the MMA kernel."""
    m, n, k = 2, 33, 160
    monkeypatch.setitem(configs.PINNED_CONFIGS, (n, k, 2), "mmab bm16 bn16 bk64 w4 st1 s2")

    def no_gemv(*args, **kwargs):
        raise AssertionError("the GEMV ran instead of the pinned MMA config")

    monkeypatch.setattr(gemm_mod, "nvfp4_gemv", no_gemv)
    q = quantize_nvfp4(torch.randn(n, k, device=device) * 0.05)
    x = torch.randn(m, k, device=device).to(torch.bfloat16)
    args = (q.weight, q.weight_scale, q.weight_scale_2)
    y = nvfp4_gemm(x, *args, torch.float32)
    ref = nvfp4_gemm_ref(x, *args, torch.float32)
    torch.testing.assert_close(y, ref, rtol=1e-4, atol=1e-4 * ref.abs().max().item())


def test_recorded_numbers_match_the_table():
    """The notebook's recorded H200 rows name the configs that are pinned now."""
    pytest.importorskip("plotly")  # mla_spec.viz needs the notebook extras
    from mla_spec.viz.nvfp4 import RECORDED_H200
    shapes = {"dense_gate_up_tp4": (9216, 7168), "dense_down_tp4": (7168, 4608),
              "expert_w13_tp4": (1024, 7168), "expert_w2_tp4": (7168, 512)}
    for r in RECORDED_H200:
        key = (*shapes[r["shape"]], r["m"])
        assert PINNED_CUDA.get(key, PINNED_CONFIGS[key]) == r["pinned"]
        assert r["ours_us"] <= r["default_us"] * 1.01  # the pin is never the slower one
