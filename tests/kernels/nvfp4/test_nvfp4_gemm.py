"""NVFP4 W4A16 GEMM and fused MoE: Triton kernels (interpreter on CPU, compiled on GPU) against
their torch twins, and the twins against plain dequantize-then-matmul."""

from __future__ import annotations

import pytest
import torch

from mla_spec.device import use_triton
from mla_spec.kernels.nvfp4 import (
    NVFP4MmaConfig,
    fused_moe_nvfp4,
    fused_moe_ref,
    nvfp4_gemm,
    nvfp4_gemm_ref,
)
from mla_spec.kernels.nvfp4.moe import moe_align
from mla_spec.quant.nvfp4 import NVFP4Tensor, quantize_nvfp4


def _q(n, k, device="cpu"):
    w = torch.randn(n, k, device=device) * 0.05
    return w, quantize_nvfp4(w)


@pytest.mark.parametrize("m,n,k", [(1, 1, 16), (3, 7, 48), (17, 33, 144), (300, 9, 272),
                                   (64, 129, 400)])
def test_twin_matches_dequant_matmul(m, n, k):
    _, q = _q(n, k)
    x = torch.randn(m, k, dtype=torch.bfloat16)
    y = nvfp4_gemm_ref(x, q.weight, q.weight_scale, q.weight_scale_2)
    ref = (x.float() @ q.dequantize().t()).to(torch.bfloat16)
    assert y.shape == (m, n) and torch.equal(y, ref)


CASES = [  # m, n, k, config (None = heuristic)
    (1, 17, 48, None),
    (2, 33, 160, None),  # the packed GEMV, split K
    (3, 10, 128, NVFP4MmaConfig(block_n=16, block_k=64, split_k=2)),  # K % BK == 0
    # x [BM, BK] @ W'[BK, BN]: K % BK != 0, N % BN != 0, M irregular
    (1, 17, 48, NVFP4MmaConfig(block_m=16, block_n=16, block_k=32)),
    (37, 33, 208, NVFP4MmaConfig(block_m=32, block_n=16, block_k=64, split_k=2)),
    (300, 9, 80, NVFP4MmaConfig(block_n=16, block_k=64)),  # block_m by M: 128, 3 tiles
    (70, 20, 128, NVFP4MmaConfig(block_m=64, block_n=16, block_k=64, split_k=3)),
    (40, 31, 80, NVFP4MmaConfig(block_n=32, block_k=32)),  # block_m by M: 64
    (20, 9, 272, None),  # above 2 tokens the default is the MMA kernel
]


@pytest.mark.triton
@pytest.mark.parametrize("m,n,k,cfg", CASES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_kernel_matches_twin(m, n, k, cfg, dtype, device):
    _, q = _q(n, k, device)
    x = torch.randn(m, k, device=device).to(dtype)
    y = nvfp4_gemm(x, q.weight, q.weight_scale, q.weight_scale_2, out_dtype=torch.float32,
                   config=cfg)
    ref = nvfp4_gemm_ref(x, q.weight, q.weight_scale, q.weight_scale_2, torch.float32)
    tol = 2e-2 if device.type == "cuda" and dtype == torch.float32 else 1e-4  # tf32 on GPU
    if device.type == "cuda" and dtype == torch.bfloat16 and cfg is None and m <= 2:
        tol = 1e-2  # the packed GEMV's fp16 block sums; 4.4e-3 of max measured at K = 48
    torch.testing.assert_close(y, ref, rtol=tol, atol=tol * ref.abs().max().item())
    y16 = nvfp4_gemm(x, q.weight, q.weight_scale, q.weight_scale_2, config=cfg)
    assert y16.dtype == dtype and y16.shape == (m, n)


def test_mma_config_errors():
    _, q = _q(4, 32)
    x = torch.randn(9, 32)
    if use_triton(x):
        with pytest.raises(ValueError, match="block_k >= 32"):
            nvfp4_gemm(x, q.weight, q.weight_scale, q.weight_scale_2,
                       config=NVFP4MmaConfig(block_k=16))


def test_empty_and_leading_dims(device):
    _, q = _q(5, 32, device)
    assert nvfp4_gemm(torch.randn(0, 32, device=device), q.weight, q.weight_scale,
                      q.weight_scale_2).shape == (0, 5)
    x = torch.randn(2, 3, 32, device=device, dtype=torch.bfloat16)
    y = nvfp4_gemm(x, q.weight, q.weight_scale, q.weight_scale_2)
    ref = nvfp4_gemm_ref(x.reshape(6, 32), q.weight, q.weight_scale, q.weight_scale_2)
    torch.testing.assert_close(y.reshape(6, 5).float(), ref.float(), rtol=1e-2, atol=1e-2)


def test_gemm_errors():
    _, q = _q(4, 32)
    x = torch.randn(2, 32)
    with pytest.raises(ValueError, match=r"x must be \[..., K=32\]"):
        nvfp4_gemm(torch.randn(2, 48), q.weight, q.weight_scale, q.weight_scale_2)
    with pytest.raises(ValueError, match=r"weight_scale must have shape \(4, 2\)"):
        nvfp4_gemm(x, q.weight, q.weight_scale[:, :1], q.weight_scale_2)
    with pytest.raises(ValueError, match="multiple of 16"):
        nvfp4_gemm(torch.randn(2, 24), q.weight[:, :12], q.weight_scale, q.weight_scale_2)
    with pytest.raises(ValueError, match="x must be bfloat16"):
        nvfp4_gemm(x.to(torch.int32), q.weight, q.weight_scale, q.weight_scale_2)
    with pytest.raises(ValueError, match="weight_scale_2 must be float32"):
        nvfp4_gemm(x, q.weight, q.weight_scale, q.weight_scale_2.half())


def _stack(qs):
    return NVFP4Tensor(torch.stack([q.weight for q in qs]),
                       torch.stack([q.weight_scale for q in qs]),
                       torch.stack([q.weight_scale_2 for q in qs]))


def _experts(e, k, inter, device, gate_up_scales=False):
    w13 = _stack([quantize_nvfp4(torch.randn(2 * inter, k) * 0.1) for _ in range(e)])
    if gate_up_scales:  # [E, 2]: separate global scales for the gate and up halves
        s2 = torch.stack([w13.weight_scale_2, w13.weight_scale_2 * 1.5], dim=1)
        w13 = NVFP4Tensor(w13.weight, w13.weight_scale, s2)
    w2 = _stack([quantize_nvfp4(torch.randn(k, inter) * 0.1) for _ in range(e)])
    return w13.to(device), w2.to(device)


def test_moe_align_slots():
    ids = torch.tensor([[2, 0], [2, 5], [-1, 2]])
    sorted_ids, slot_expert = moe_align(ids, num_experts=4, block_m=2)
    # pairs by expert: 0 -> [1]; 2 -> [0, 2, 5]; 5 and -1 are skipped (P = 6 pads)
    assert slot_expert.tolist() == [0, 2, 2, -1, -1, -1, -1]  # S = 6 // 2 + min(4, 6)
    assert sorted_ids.tolist()[:6] == [1, 6, 0, 2, 5, 6]


@pytest.mark.parametrize("m,topk,gate_up", [(1, 2, False), (7, 3, True), (0, 2, False)])
def test_fused_moe_matches_twin(m, topk, gate_up, device):
    e, k, inter = 5, 48, 32
    w13, w2 = _experts(e, k, inter, device, gate_up)
    x = torch.randn(m, k, device=device, dtype=torch.bfloat16)
    ids = torch.randint(0, e, (m, topk), device=device)
    if m > 1:
        ids[0, -1] = -1  # an expert of another rank: contributes nothing
    tw = torch.rand(m, topk, device=device)
    y = fused_moe_nvfp4(x, ids, tw, w13, w2)
    ref = fused_moe_ref(x, ids, tw, w13, w2)
    assert y.shape == (m, k) and y.dtype == torch.bfloat16
    if m:
        torch.testing.assert_close(y.float(), ref.float(), rtol=2e-2,
                                   atol=2e-2 * ref.abs().max().item())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("m,topk,e", [(20, 3, 5), (1, 2, 3)])
def test_sorted_moe_kernel_matches_twin(m, topk, e, dtype, device):
    k, inter = 48, 32  # K not a multiple of the 64-wide K step
    w13, w2 = _experts(e, k, inter, device, gate_up_scales=True)
    x = torch.randn(m, k, device=device, dtype=dtype)
    ids = torch.randint(0, e, (m, topk), device=device)
    ids[0, 0] = -1
    tw = torch.rand(m, topk, device=device)
    cfg = NVFP4MmaConfig(block_n=16, block_k=64)
    y = fused_moe_nvfp4(x, ids, tw, w13, w2, path="sorted", sorted_config=cfg)
    ref = fused_moe_ref(x, ids, tw, w13, w2)
    torch.testing.assert_close(y.float(), ref.float(), rtol=2e-2,
                               atol=2e-2 * ref.abs().max().item())


def test_moe_twin_matches_per_token_loop():
    e, k, inter, m, topk = 3, 32, 16, 4, 2
    w13, w2 = _experts(e, k, inter, "cpu")
    x = torch.randn(m, k)
    ids = torch.randint(0, e, (m, topk))
    tw = torch.rand(m, topk)
    g13 = [NVFP4Tensor(w13.weight[i], w13.weight_scale[i], w13.weight_scale_2[i]).dequantize()
           for i in range(e)]
    g2 = [NVFP4Tensor(w2.weight[i], w2.weight_scale[i], w2.weight_scale_2[i]).dequantize()
          for i in range(e)]
    ref = torch.zeros(m, k)
    for t in range(m):
        for j in range(topk):
            h = g13[ids[t, j]] @ x[t]
            ref[t] += tw[t, j] * (g2[ids[t, j]] @ (torch.nn.functional.silu(h[:inter]) * h[inter:]))
    torch.testing.assert_close(fused_moe_ref(x, ids, tw, w13, w2), ref, rtol=1e-4, atol=1e-5)


def test_moe_errors():
    w13, w2 = _experts(2, 32, 16, "cpu")
    x = torch.randn(3, 32)
    ids, tw = torch.zeros(3, 2, dtype=torch.long), torch.ones(3, 2)
    with pytest.raises(ValueError, match=r"x must be \[M, K=32\]"):
        fused_moe_nvfp4(torch.randn(3, 48), ids, tw, w13, w2)
    with pytest.raises(ValueError, match="topk_ids and topk_weights"):
        fused_moe_nvfp4(x, ids[:, :1], tw, w13, w2)
    with pytest.raises(ValueError, match="integer"):
        fused_moe_nvfp4(x, tw, tw, w13, w2)
    with pytest.raises(ValueError, match=r"w2.weight must have shape \(2, 32, 8\)"):
        fused_moe_nvfp4(x, ids, tw, w13, w13)
    with pytest.raises(ValueError, match="path must be"):
        fused_moe_nvfp4(x, ids, tw, w13, w2, path="dense")
    with pytest.raises(ValueError, match="split_k = 1"):
        fused_moe_nvfp4(x, ids, tw, w13, w2, sorted_config=NVFP4MmaConfig(split_k=2))


@pytest.mark.gpu
def test_gpu_ptx_decoder_and_graph_capture():
    torch.manual_seed(0)
    _, q = _q(1024, 7168, "cuda")
    args = (q.weight, q.weight_scale, q.weight_scale_2)
    for m in (1, 4, 16, 64, 200):
        x = torch.randn(m, 7168, device="cuda", dtype=torch.bfloat16)
        ref = nvfp4_gemm_ref(x, *args, torch.float32)
        for split in (1, 4):
            cfg = NVFP4MmaConfig(block_n=64, split_k=split)
            y = nvfp4_gemm(x, *args, out_dtype=torch.float32, config=cfg)
            torch.testing.assert_close(y, ref, rtol=1e-3, atol=1e-3 * ref.abs().max().item())
    x = torch.randn(4, 7168, device="cuda", dtype=torch.bfloat16)
    nvfp4_gemm(x, *args)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = nvfp4_gemm(x, *args)
    x.copy_(torch.randn_like(x))
    g.replay()
    torch.testing.assert_close(out.float(), nvfp4_gemm_ref(x, *args).float(), rtol=2e-2,
                               atol=2e-2)


def test_fused_moe_rejects_bad_x_dtype_and_devices():
    # integer / fp8 activations are refused (they once ran and returned that dtype), and so is
    # routing on another device
    w13, w2 = quantize_nvfp4(torch.randn(3, 32, 32)), quantize_nvfp4(torch.randn(3, 32, 16))
    x, ids, tw = torch.randn(2, 32), torch.tensor([[0, 2], [1, -1]]), torch.rand(2, 2)
    for bad in (x.int(), x.to(torch.float8_e4m3fn)):
        with pytest.raises(ValueError, match="bfloat16, float16 or float32"):
            fused_moe_nvfp4(bad, ids, tw, w13, w2)
    with pytest.raises(ValueError, match="one device"):
        fused_moe_nvfp4(x, ids.to("meta"), tw, w13, w2)
