"""NVFP4 kernel configs: the table pinned by the H200 sweep parses, the defaults pick its
entries for measured shapes and a heuristic elsewhere, and the PTX decoders (the defaults) are
never used by the interpreter or on CPU."""

from __future__ import annotations

import inspect

import pytest
import torch

import mla_spec.kernels.nvfp4_gemm as gemm_mod
from mla_spec.kernels import nvfp4_configs, nvfp4_gemv
from mla_spec.kernels.nvfp4_configs import (
    M_BUCKETS,
    PINNED_CONFIGS,
    PINNED_CUDA,
    GemvConfig,
    NVFP4GemmConfig,
    NVFP4MmaConfig,
    m_bucket,
    parse_variant,
    pinned_config,
    variant_name,
)
from mla_spec.kernels.nvfp4_gemm import (
    _CONFIGS,
    auto_config,
    default_gemm_config,
    default_mma_config,
    nvfp4_gemm,
    nvfp4_gemm_ref,
    ptx_decoder_ok,
    set_gemm_config,
)
from mla_spec.kernels.nvfp4_gemv import GEMV_MAX_M, default_gemv_config, packed_gemv_config
from mla_spec.kernels.nvfp4_moe import fused_moe_nvfp4
from mla_spec.quant.nvfp4 import quantize_nvfp4


def test_pinned_table_parses_and_round_trips():
    assert len(PINNED_CONFIGS) >= 16
    kinds = {"gemv": GemvConfig, "mma": NVFP4GemmConfig, "mmab": NVFP4MmaConfig}
    for (n, k, bucket), name in PINNED_CONFIGS.items():
        assert bucket in M_BUCKETS and n > 0 and k % 16 == 0
        cfg = parse_variant(name)
        assert isinstance(cfg, kinds[name.split()[0]])
        assert variant_name(cfg) == name
    assert parse_variant("gemv bn256 s16 w2 st1") == GemvConfig(256, 2, 16, 2, 1)
    assert parse_variant("mma bn128 s4 w8 st3 bk128") == NVFP4GemmConfig(128, 128, 4, 8, 3)
    assert parse_variant("mma bn16 s8 w4 st4 bk256 pure").fast_dequant is False
    assert parse_variant("gemv st2 g4 bn64") == GemvConfig(block_n=64, groups=4, num_stages=2)


def test_mmab_variants_round_trip():
    cfg = parse_variant("mmab bm64 bn128 bk128 w4 st3 s1")
    assert cfg == NVFP4MmaConfig(block_m=64, block_n=128, block_k=128, split_k=1, num_warps=4,
                                 num_stages=3)
    assert parse_variant("mmab s2 bn64 bk256 w8 st4 pure") == NVFP4MmaConfig(
        0, 64, 256, 2, 8, 4, False)
    for name in ("mmab bm64 bn128 bk128 w4 st3 s1", "mmab bn256 bk64 w8 st2 s4 pure",
                 "mmab bm16 bn64 bk128 w4 st4 s8", "mmab bm128 bn128 bk128 w8 st3 s1"):
        assert variant_name(parse_variant(name)) == name
    for cfg in (NVFP4MmaConfig(), default_mma_config(100, 9216, 7168)):
        assert parse_variant(variant_name(cfg)) == cfg


@pytest.mark.parametrize("bad", ["", "wgmma bn64", "gemv bk128", "mma g2", "gemv bn100",
                                 "gemv s0", "mma bn64 x3", "gemv bn64s4", "mma bm64",
                                 "mmab g2", "mmab bm48", "mmab bm256", "mmab bn96", "gemv bm16"])
def test_parse_variant_rejects(bad):
    with pytest.raises(ValueError):
        parse_variant(bad)


def test_m_buckets():
    assert [m_bucket(m) for m in (1, 2, 4, 5, 8, 9, 16, 17, 64, 65, 128, 129, 512, 513)] == \
        [1, 2, 4, 8, 8, 16, 16, 64, 64, 128, 128, 512, 512, None]


def test_defaults_pick_the_table_for_listed_shapes():
    gate_up, down, w13, w2 = (9216, 7168), (7168, 4608), (1024, 7168), (7168, 512)
    # M = 1: the packed-math GEMV with wide steps (fourth session); above: the MMA kernel
    assert auto_config(1, *gate_up) == parse_variant("gemv bn8 s1 w2 st1 g64 h2 pf")
    assert auto_config(1, *w2).packed and auto_config(1, *w2).groups == 32
    assert auto_config(3, *down) == parse_variant("mmab bm16 bn64 bk128 w4 st4 s4")  # bucket 4
    assert auto_config(40, *down) == parse_variant("mmab bm64 bn64 bk128 w4 st4 s4")
    assert auto_config(12, *w13) == parse_variant("mmab bm16 bn64 bk128 w4 st4 s8")
    assert auto_config(64, *w2) == parse_variant("mmab bm64 bn64 bk128 w4 st4 s1")
    assert auto_config(300, *gate_up) == parse_variant("mmab bm128 bn64 bk128 w4 st4 s1")
    assert isinstance(default_gemv_config(1, *down), GemvConfig)
    assert isinstance(default_gemv_config(4, *down), GemvConfig)  # mmab pin: the heuristic
    # an "mmab" entry is not a swap-AB config: that kernel's default falls back to its heuristic
    assert isinstance(default_gemm_config(1, *gate_up), NVFP4GemmConfig)


def test_heuristics_for_unseen_shapes(monkeypatch):
    n, k = 6144, 1536  # q_b_proj, not in the table
    assert pinned_config(4, n, k) is None
    # 1-2 tokens: the packed, wide, double-buffered GEMV, fitted to the M = 1 winners
    for m in (1, 2):
        cfg = auto_config(m, n, k)
        assert cfg == packed_gemv_config(m, n, k) and cfg.packed and cfg.prefetch
    assert packed_gemv_config(1, 9216, 7168) == parse_variant("gemv bn8 s1 w2 st1 g64 h2 pf")
    assert packed_gemv_config(1, 1024, 7168) == parse_variant("gemv bn4 s4 w1 st1 g64 h2 pf")
    assert packed_gemv_config(1, 96, 48).groups == 4  # K / 16 = 3 blocks
    assert isinstance(auto_config(3, n, k), NVFP4MmaConfig)  # above: the MMA kernel
    monkeypatch.setattr(gemm_mod, "MMA_FOR_SMALL_M", False)  # the GEMV regime, when asked
    assert isinstance(auto_config(GEMV_MAX_M, n, k), GemvConfig)
    assert isinstance(auto_config(6, n, k), GemvConfig)
    cfg = auto_config(GEMV_MAX_M + 1, n, k)  # above the GEMV: the standard-orientation MMA
    assert isinstance(cfg, NVFP4MmaConfig)
    assert (cfg.block_m, cfg.block_n, cfg.block_k, cfg.num_warps) == (16, 128, 128, 4)
    assert cfg.split_k == 2  # 48 tiles x 4 warps x 2 splits; K = 12 steps of 128 caps it
    old = default_gemm_config(GEMV_MAX_M + 1, n, k)  # the swap-AB kernel's heuristic
    assert (old.block_n, old.block_k, old.num_warps, old.num_stages, old.split_k) == \
        (128, 128, 8, 3, 4)
    for m, bm, warps in ((100, 128, 8), (512, 128, 8), (40, 64, 4), (30, 32, 4)):
        cfg = default_mma_config(m, 9216 if m > 64 else n, 7168 if m > 64 else k)
        assert isinstance(cfg, NVFP4MmaConfig) and (cfg.block_m, cfg.num_warps) == (bm, warps)
    assert default_mma_config(512, 9216, 7168).split_k == 1  # 288 tiles fill the SMs
    assert default_mma_config(128, 9216, 7168).split_k == 2  # 72 tiles x 8 warps
    g = default_gemv_config(1, 4096, 7168)
    assert g.num_warps == 1 and g.block_n == 128 and 32 * g.split_k >= 4 * 132
    assert default_gemv_config(1, 16384, 7168).num_warps == 2


def test_set_gemm_config_overrides_the_table_where_mma_runs(monkeypatch):
    monkeypatch.setattr(gemm_mod, "MMA_FOR_SMALL_M", False)
    mine = NVFP4GemmConfig(block_n=32, split_k=2)
    set_gemm_config(16, 9216, 7168, mine)
    try:
        assert auto_config(16, 9216, 7168) == mine
        assert isinstance(auto_config(1, 6144, 1536), GemvConfig)  # GEMV regime untouched
    finally:
        _CONFIGS.clear()


def test_fast_decoders_are_default_but_never_on_cpu():
    assert nvfp4_gemv.GEMV_FAST is True
    assert NVFP4GemmConfig().fast_dequant is True
    assert inspect.signature(fused_moe_nvfp4).parameters["fast_dequant"].default is True
    assert not ptx_decoder_ok(torch.device("cpu"), False)
    assert not ptx_decoder_ok(torch.device("cuda", 0), True)  # interpreter: never


@pytest.mark.triton
def test_pinned_entry_drives_the_launch(monkeypatch, device):
    """A pinned MMA entry at M = 3 (where the heuristic runs the GEMV) runs the MMA kernel."""
    m, n, k = 3, 33, 160
    monkeypatch.setitem(nvfp4_configs.PINNED_CONFIGS, (n, k, 4), "mma bn16 s2 w4 st1 bk64")

    def no_gemv(*args, **kwargs):
        raise AssertionError("the GEMV ran instead of the pinned MMA config")

    monkeypatch.setattr(gemm_mod, "nvfp4_gemv", no_gemv)
    q = quantize_nvfp4(torch.randn(n, k, device=device) * 0.05)
    x = torch.randn(m, k, device=device).to(torch.bfloat16)
    args = (q.weight, q.weight_scale, q.weight_scale_2)
    y = nvfp4_gemm(x, *args, torch.float32)
    ref = nvfp4_gemm_ref(x, *args, torch.float32)
    torch.testing.assert_close(y, ref, rtol=1e-4, atol=1e-4 * ref.abs().max().item())
    # an "mmab" pin runs the standard-orientation kernel (and not the swap-AB one)
    monkeypatch.setitem(nvfp4_configs.PINNED_CONFIGS, (n, k, 4), "mmab bm16 bn16 bk64 w4 st1 s2")
    monkeypatch.setattr(gemm_mod, "_nvfp4_gemm_kernel", None)
    y = nvfp4_gemm(x, *args, torch.float32)
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
