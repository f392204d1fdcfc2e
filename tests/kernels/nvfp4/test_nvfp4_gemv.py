"""NVFP4 GEMV (decode regime) and the pair-per-program MoE path: Triton kernels (interpreter on
CPU, compiled on GPU) against the torch twins, split-K counters, and the PTX decoder's bit
layout checked in Python."""

from __future__ import annotations

import pytest
import torch

from mla_spec.kernels.nvfp4 import (
    GemvConfig,
    MoeGemvConfig,
    fused_moe_nvfp4,
    fused_moe_ref,
    nvfp4_gemm,
    nvfp4_gemm_ref,
)
from mla_spec.kernels.nvfp4.configs import parse_variant, variant_name
from mla_spec.kernels.nvfp4.gemv import _COUNTERS, split_k_for
from mla_spec.quant.nvfp4 import E2M1_VALUES, NVFP4Tensor, quantize_nvfp4

CASES = [  # m, n, k, (block_n, groups, split_k)
    (1, 17, 48, (16, 4, 1)),      # K not a multiple of the step: masked tail
    (3, 33, 160, (16, 2, 2)),     # split-K with the last-program reduction
    (5, 9, 272, (16, 16, 3)),     # one row tile, uneven split
    (9, 20, 512, (16, 8, 4)),     # M > 8: two token tiles
]


@pytest.mark.triton
@pytest.mark.parametrize("m,n,k,tile", CASES)
def test_gemv_matches_twin(m, n, k, tile, device):
    q = quantize_nvfp4(torch.randn(n, k, device=device) * 0.05)
    x = torch.randn(m, k, device=device).to(torch.bfloat16)
    cfg = GemvConfig(*tile)
    y = nvfp4_gemm(x, q.weight, q.weight_scale, q.weight_scale_2, torch.float32, cfg)
    ref = nvfp4_gemm_ref(x, q.weight, q.weight_scale, q.weight_scale_2, torch.float32)
    torch.testing.assert_close(y, ref, rtol=1e-4, atol=1e-4 * ref.abs().max().item())
    if tile[2] > 1:  # counters are reset by the last program: a second call is right too
        y2 = nvfp4_gemm(x, q.weight, q.weight_scale, q.weight_scale_2, torch.float32, cfg)
        assert torch.equal(y, y2)
        assert int(_COUNTERS[x.device].abs().sum()) == 0


@pytest.mark.triton
@pytest.mark.parametrize("m,n,k,tile", CASES)
def test_packed_gemv_matches_twin(m, n, k, tile, device):
    """The packed-fp16 path (``h2``): its indexing (x as int64 words) on CPU through the
    portable twin; on a GPU the PTX version, within fp16 rounding of the block sums."""
    q = quantize_nvfp4(torch.randn(n, k, device=device) * 0.05)
    x = torch.randn(m, k, device=device).to(torch.bfloat16)
    ref = nvfp4_gemm_ref(x, q.weight, q.weight_scale, q.weight_scale_2, torch.float32)
    tol = 2e-3 if x.is_cuda else 1e-4
    for prefetch in (False, True):
        cfg = GemvConfig(*tile, packed=True, prefetch=prefetch)
        y = nvfp4_gemm(x, q.weight, q.weight_scale, q.weight_scale_2, torch.float32, cfg)
        torch.testing.assert_close(y, ref, rtol=tol, atol=tol * ref.abs().max().item())
    xs = torch.randn(m, k + 4, device=device).to(torch.bfloat16)[:, 1:k + 1]  # not word-aligned
    y2 = nvfp4_gemm(xs, q.weight, q.weight_scale, q.weight_scale_2, torch.float32, cfg)
    ref2 = nvfp4_gemm_ref(xs, q.weight, q.weight_scale, q.weight_scale_2, torch.float32)
    torch.testing.assert_close(y2, ref2, rtol=1e-4, atol=1e-4 * ref2.abs().max().item())


def test_packed_variant_name_round_trips():
    cfg = parse_variant("gemv bn128 s4 w1 st1 g4 h2 pf")
    assert cfg.packed and cfg.prefetch and cfg.groups == 4
    assert variant_name(cfg) == "gemv bn128 s4 w1 st1 g4 h2 pf"
    with pytest.raises(ValueError, match="unsupported token"):
        parse_variant("mmab bn64 bk128 w4 st4 s1 h2")


def _e4m3_pair_bytes(w: int) -> tuple[int, int]:
    """Python model of the packed decoder: e4m3 bytes L (even elements), H (odd elements)."""
    lo = ((w << 2) & 0x1C1C1C1C) | ((w << 4) & 0x80808080)
    hi = ((w >> 2) & 0x1C1C1C1C) | (w & 0x80808080)
    return lo & 0xFFFFFFFF, hi


def test_packed_decoder_bytes_are_e2m1_times_2_pow_minus_6():
    vals = E2M1_VALUES.tolist()
    for lo_code in range(16):
        for hi_code in range(16):
            byte = lo_code | (hi_code << 4)
            w = byte | (0x5A5A5A << 8)  # other bytes: noise
            lb, hb = _e4m3_pair_bytes(w)
            e = torch.tensor([lb & 0xFF, hb & 0xFF], dtype=torch.uint8).view(torch.float8_e4m3fn)
            assert (e.float() * 64).tolist() == [vals[lo_code], vals[hi_code]]


def test_split_k_spreads_work():
    assert split_k_for(12, 224, 8) == 32  # 12 tiles: split until 4 programs per SM
    assert split_k_for(12, 16, 8) == 4  # ... or until a split has fewer than 8 steps
    assert split_k_for(600, 224, 8) == 1


def _pair_bits(w: int, j: int) -> int:
    """Python model of one PTX pair: fp16x2 bits of nibbles j and j+4 of a 32-bit word."""
    sm, ss = 9 - 4 * j, 12 - 4 * j
    a = (w << sm if sm > 0 else w >> -sm) & 0x0E000E00
    b = (w << ss) & 0x80008000
    return (a | b) & 0xFFFFFFFF


def test_ptx_pair_layout_is_e2m1_times_2_pow_minus_14():
    """Every nibble value at every position decodes to E2M1 * 2**-14 in its fp16 lane."""
    vals = E2M1_VALUES.tolist()
    for j in range(4):
        for lo in range(16):
            for hi in range(16):
                w = (lo << (4 * j)) | (hi << (4 * (j + 4))) | (0x5A5A5A5A & ~(
                    (0xF << (4 * j)) | (0xF << (4 * (j + 4)))))  # other nibbles: noise
                bits = _pair_bits(w, j)
                h = torch.tensor([bits & 0xFFFF, bits >> 16], dtype=torch.int32)
                f = h.to(torch.int16).view(torch.float16).float() * 2.0**14
                assert f.tolist() == [vals[lo], vals[hi]]


def _experts(e, k, inter, device):
    def stack(qs):
        return NVFP4Tensor(*(torch.stack([getattr(q, f) for q in qs])
                             for f in ("weight", "weight_scale", "weight_scale_2")))
    w13 = stack([quantize_nvfp4(torch.randn(2 * inter, k) * 0.1) for _ in range(e)])
    w2 = stack([quantize_nvfp4(torch.randn(k, inter) * 0.1) for _ in range(e)])
    s2 = torch.stack([w13.weight_scale_2, w13.weight_scale_2 * 1.5], dim=1)  # [E, 2]
    return NVFP4Tensor(w13.weight, w13.weight_scale, s2).to(device), w2.to(device)


@pytest.mark.triton
@pytest.mark.parametrize("m,topk,cfg", [
    (1, 2, MoeGemvConfig(block_n=16)),
    (3, 3, MoeGemvConfig(block_n=16, split_k=2)),
    (2, 1, MoeGemvConfig(block_n=16, split_k=1)),
    (1, 3, MoeGemvConfig(block_n=16, groups=4, block_n2=32, num_warps2=2)),  # K/16 = 3: masked
    (2, 2, MoeGemvConfig(block_n=16, num_warps=2, split_k=2, block_n2=16)),
    (3, 3, MoeGemvConfig(block_n=16, groups=2, split_k=2, groups2=2)),  # uneven K steps
])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_moe_gemv_matches_twin(m, topk, cfg, dtype, device):
    """bf16: packed-fp16 math and the w2 loop launch; fp16: fp32 math for w13, bf16
    activations into the w2 loop; fp32: fp32 math and the per-slot w2 launch summed through
    split partials."""
    e, k, inter = 4, 48, 32
    w13, w2 = _experts(e, k, inter, device)
    x = torch.randn(m, k, device=device, dtype=dtype)
    ids = torch.randint(0, e, (m, topk), device=device)
    ids[0, 0] = -1  # another rank's expert: skipped
    tw = torch.rand(m, topk, device=device)
    y = fused_moe_nvfp4(x, ids, tw, w13, w2, path="gemv", gemv_config=cfg)
    ref = fused_moe_ref(x, ids, tw, w13, w2)
    torch.testing.assert_close(y.float(), ref.float(), rtol=2e-2,
                               atol=2e-2 * ref.abs().max().item())


@pytest.mark.triton
@pytest.mark.parametrize("m,topk,inter,cfg", [
    (1, 2, 32, MoeGemvConfig(block_n2=16, num_warps2=1)),
    (3, 3, 48, MoeGemvConfig(groups2=2, block_n2=32)),  # K/16 = 3 over steps of 2: masked tail
    (2, 8, 32, MoeGemvConfig(groups2=4, block_n2=16, num_warps2=2)),  # a masked step per slot
    (4, 1, 48, MoeGemvConfig(groups2=1, block_n2=8)),  # three steps, one slot
])
def test_moe_w2_loop_matches_twin(m, topk, inter, cfg, device):
    """The w2 launch summing the top-k experts in one program (``moe_w2_loop``, bf16 activations):
    against the torch reference, with a skipped expert id and uneven K steps."""
    e, k = 5, 40
    w13, w2 = _experts(e, k + 8, inter, device)  # k + 8 = 48: w13's K
    x = torch.randn(m, k + 8, device=device, dtype=torch.bfloat16)
    ids = torch.randint(0, e, (m, topk), device=device)
    ids[-1, -1] = -1  # another rank's expert: adds nothing
    tw = torch.rand(m, topk, device=device) + 0.1
    y = fused_moe_nvfp4(x, ids, tw, w13, w2, path="gemv", gemv_config=cfg)
    ref = fused_moe_ref(x, ids, tw, w13, w2)
    torch.testing.assert_close(y.float(), ref.float(), rtol=2e-2,
                               atol=2e-2 * ref.abs().max().item())


def test_moe_path_errors():
    w13, w2 = _experts(2, 32, 16, "cpu")
    with pytest.raises(ValueError, match="path must be"):
        fused_moe_nvfp4(torch.randn(1, 32), torch.zeros(1, 1, dtype=torch.long),
                        torch.ones(1, 1), w13, w2, path="dense")


@pytest.mark.gpu
def test_gpu_gemv_graph_capture():
    torch.manual_seed(0)
    q = quantize_nvfp4(torch.randn(1024, 7168, device="cuda") * 0.02)
    a = (q.weight, q.weight_scale, q.weight_scale_2)
    x = torch.randn(4, 7168, device="cuda", dtype=torch.bfloat16)
    cfg = GemvConfig(128, 2, 8, 1, 1)
    y = nvfp4_gemm(x, *a, torch.float32, cfg)
    ref = nvfp4_gemm_ref(x, *a, torch.float32)
    torch.testing.assert_close(y, ref, rtol=1e-4, atol=1e-4 * ref.abs().max().item())
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = nvfp4_gemm(x, *a)
    x.copy_(torch.randn_like(x))
    g.replay()
    torch.testing.assert_close(out.float(), nvfp4_gemm_ref(x, *a).float(), rtol=2e-2, atol=2e-2)
