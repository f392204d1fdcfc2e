"""W4A16 GEMM with NVFP4 weights, ``y = x @ dequant(W)^T`` decoded to bf16 in registers (no FP4 MMA
on Hopper): ``W' = E2M1 * s * 2**-8`` exact in bf16, ``weight_scale_2 * 256`` applied on the device.
Default: the CUDA kernel (``gemm_cuda``) where pinned or at 2-8 tokens, else :func:`auto_config`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from mla_spec.device import cuda_capability, triton_interpreting, use_triton
from mla_spec.kernels.launch.pdl import gdc_enter, pdl_kwargs
from mla_spec.kernels.nvfp4.configs import CudaMmaConfig, GemvConfig, NVFP4MmaConfig, pinned_config
from mla_spec.kernels.nvfp4.gemm_cuda import (
    cuda_auto_config,
    cuda_gemm_supported,
    launch_nvfp4_cuda,
)
from mla_spec.kernels.nvfp4.gemv import nvfp4_gemv, packed_gemv_config
from mla_spec.kernels.nvfp4.reference import check_gemm, nvfp4_gemm_ref

__all__ = ["nvfp4_gemm", "default_mma_config", "mma_block_m", "auto_config",
           "PACKED_GEMV_MAX_M", "ptx_decoder_ok", "sum_rows"]

#: Unpinned shapes up to this many tokens take the packed GEMV (faster: docs/bench_nvfp4.md).
PACKED_GEMV_MAX_M = 2
_NUM_SMS = 132


# ---- E2M1 decoders (also the sorted MoE's): shifts, masks and one multiply by the block scale.
_TWO_118 = tl.constexpr(2.0**118)  # jit code may only read constexpr globals

# bytes $4, scales s * 2**118 as bf16x2 ($5, $6) -> low ($0, $1) / high ($2, $3) nibbles as bf16x2
_ASM = tl.constexpr("""
{
.reg .b32 z, t0, t1, a, b;
mov.b32 z, 0;
prmt.b32 t0, $4, z, 0x4140;
prmt.b32 t1, $4, z, 0x4342;
shl.b32 a, t0, 6; shl.b32 b, t0, 12; or.b32 a, a, b; and.b32 a, a, 0x81C081C0;
mul.rn.bf16x2 $0, a, $5;
shl.b32 a, t1, 6; shl.b32 b, t1, 12; or.b32 a, a, b; and.b32 a, a, 0x81C081C0;
mul.rn.bf16x2 $1, a, $6;
shl.b32 a, t0, 2; and.b32 a, a, 0x01C001C0; shl.b32 b, t0, 8; and.b32 b, b, 0x80008000;
or.b32 a, a, b; mul.rn.bf16x2 $2, a, $5;
shl.b32 a, t1, 2; and.b32 a, a, 0x01C001C0; shl.b32 b, t1, 8; and.b32 b, b, 0x80008000;
or.b32 a, a, b; mul.rn.bf16x2 $3, a, $6;
}
""")


@triton.jit
def _decode_pure(wb, s8, OUT_F32: tl.constexpr):
    """bytes [.., 8] uint8 + e4m3 scales [.., 1] -> (low, high) values E2M1 * s * 2**-8."""
    b = wb.to(tl.uint16)
    lo = ((b & 7) << 9) | ((b & 8) << 12)
    hi = ((b & 0x70) << 5) | ((b & 0x80) << 8)
    s = s8.to(tl.float32) * 64.0
    lo = lo.to(tl.float16, bitcast=True).to(tl.float32) * s
    hi = hi.to(tl.float16, bitcast=True).to(tl.float32) * s
    if not OUT_F32:
        lo = lo.to(tl.bfloat16)
        hi = hi.to(tl.bfloat16)
    return lo, hi


@triton.jit
def _decode_asm(wb, s8):
    """GPU-only packed decoder, same result as ``_decode_pure`` in bf16."""
    sb = (s8.to(tl.float32) * _TWO_118).to(tl.bfloat16)
    sb = tl.broadcast_to(sb, wb.shape)
    lo, hi = tl.inline_asm_elementwise(
        _ASM, "=r,=r,=r,=r,r,r,r", [wb, sb], dtype=(tl.bfloat16, tl.bfloat16),
        is_pure=True, pack=4)
    return lo, hi


@triton.jit
def _decode(wb, s8, OUT_F32: tl.constexpr, FAST: tl.constexpr):
    if FAST and not OUT_F32:
        lo, hi = _decode_asm(wb, s8)
    else:
        lo, hi = _decode_pure(wb, s8, OUT_F32)
    return lo, hi


def ptx_decoder_ok(device: torch.device, interp: bool) -> bool:
    """Whether the packed PTX decoder (``mul.rn.bf16x2``: sm_90+) may run on ``device``."""
    return not interp and device.type == "cuda" and cuda_capability(device) >= (9, 0)


@triton.jit
def _nvfp4_mma_kernel(
    x_ptr, w_ptr, ws_ptr, ws2_ptr, out_ptr,
    M, N, K, SPLIT_K, stride_xm, stride_wn, stride_sn, stride_os, stride_om,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
    DOT_F32: tl.constexpr, FAST: tl.constexpr, EVEN_K: tl.constexpr, USE_GDC: tl.constexpr,
):
    """``acc[BM, BN] += x[BM, BK] @ W'[BN, BK]^T``, W' decoded in place."""
    gdc_enter(USE_GDC)
    pid_m = tl.program_id(0)  # fastest: the M tiles of one weight tile run together (L2 reuse)
    pid_n = tl.program_id(1)
    pid_k = tl.program_id(2)
    G: tl.constexpr = BK // 16
    offs_m = pid_m * BM + tl.arange(0, BM)
    offs_n = pid_n * BN + tl.arange(0, BN)
    offs_k = tl.arange(0, BK)
    offs_h = tl.arange(0, BK // 2)
    offs_g = tl.arange(0, G)
    k_iters = tl.cdiv(K, BK)
    per_split = tl.cdiv(k_iters, SPLIT_K)
    it0 = pid_k * per_split
    it1 = tl.minimum(it0 + per_split, k_iters)
    toks = tl.minimum(offs_m, M - 1).to(tl.int64)  # clamped: valid loads, dropped at the store
    rows = tl.minimum(offs_n, N - 1).to(tl.int64)
    x_row = x_ptr + toks[:, None] * stride_xm + offs_k[None, :]
    w_row = w_ptr + rows[:, None] * stride_wn + offs_h[None, :]
    s_row = ws_ptr + rows[:, None] * stride_sn + offs_g[None, :]
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for it in range(it0, it1):
        if EVEN_K:
            xt = tl.load(x_row + it * BK)
            wb = tl.load(w_row + it * (BK // 2))
            s8 = tl.load(s_row + it * G)
        else:
            xt = tl.load(x_row + it * BK, mask=(it * BK + offs_k < K)[None, :], other=0.0)
            wb = tl.load(w_row + it * (BK // 2), mask=(it * (BK // 2) + offs_h < K // 2)[None, :],
                         other=0)
            s8 = tl.load(s_row + it * G, mask=(it * G + offs_g < K // 16)[None, :], other=0.0)
        lo, hi = _decode(tl.reshape(wb, (BN, G, 8)), s8[:, :, None], DOT_F32, FAST)
        w = tl.reshape(tl.join(lo, hi), (BN, BK))  # element 2j = low nibble of byte j
        if DOT_F32:
            acc = tl.dot(xt.to(tl.float32), tl.trans(w), acc)
        else:
            acc = tl.dot(xt.to(tl.bfloat16), tl.trans(w), acc)
    acc = acc * (tl.load(ws2_ptr) * 256.0)
    out = out_ptr + pid_k * stride_os + offs_m[:, None] * stride_om + offs_n[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty),
             mask=(offs_m < M)[:, None] & (offs_n < N)[None, :])


# ---- split-K reduction (also the sorted MoE's): dst[r, :] = src[r].sum(0) in fp32 in a fixed
# order, no atomics. Torch reference: src.sum(1).
@triton.jit
def _sum_rows_kernel(src_ptr, dst_ptr, R, N, S, stride_sr, stride_ss, stride_dr,
                     BLOCK: tl.constexpr, USE_GDC: tl.constexpr):
    """dst[r, n] = sum_s src[r * stride_sr + s * stride_ss + n] (fp32 sum, cast on store)."""
    gdc_enter(USE_GDC)
    r = tl.program_id(0)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < N
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for s in range(0, S):
        acc += tl.load(src_ptr + r * stride_sr + s * stride_ss + offs, mask=ok, other=0.0)
    tl.store(dst_ptr + r * stride_dr + offs, acc.to(dst_ptr.dtype.element_ty), mask=ok)


def sum_rows(src: torch.Tensor, dst: torch.Tensor) -> None:
    """``dst[r, :] = src[r].sum(0)`` for ``src [R, S, N]`` fp32 (last dim contiguous)."""
    r, s, n = src.shape
    block = 1024 if n >= 1024 else triton.next_power_of_2(max(n, 16))
    _sum_rows_kernel[(r, triton.cdiv(n, block))](
        src, dst, r, n, s, src.stride(0), src.stride(1), dst.stride(0), BLOCK=block,
        **pdl_kwargs(src))


def mma_block_m(m: int, cfg: NVFP4MmaConfig | None = None) -> int:
    """Token tile of the MMA kernel: the config's, else 16 / 32 / 64 / 128 by M."""
    if cfg is not None and cfg.block_m:
        return cfg.block_m
    return 16 if m <= 16 else 32 if m <= 32 else 64 if m <= 64 else 128


def default_mma_config(m: int, n: int, k: int, *, block_m: int = 0, block_n: int = 0,
                       block_k: int = 0, num_warps: int = 0, num_stages: int = 0
                       ) -> NVFP4MmaConfig:
    """MMA config of an unmeasured shape: tiles by M and N, split K until >= 8 warps per SM."""
    bm = block_m or mma_block_m(m)
    bn, bk = block_n or (128 if n >= 2048 else 64), block_k or 128
    warps = num_warps or (4 if bm <= 64 else 8)
    stages = num_stages or (4 if bm <= 32 else 3)
    tiles = triton.cdiv(n, bn) * triton.cdiv(max(m, 1), bm)
    k_iters = triton.cdiv(k, bk)
    split = 1
    while (tiles * split * warps < 8 * _NUM_SMS and split * 2 <= 8
           and k_iters // (split * 2) >= 4):
        split *= 2
    return NVFP4MmaConfig(block_m=bm, block_n=bn, block_k=bk, split_k=split, num_warps=warps,
                          num_stages=stages)


def auto_config(m: int, n: int, k: int) -> GemvConfig | NVFP4MmaConfig:
    """Triton config without ``config``: pinned, the packed GEMV (few tokens) or the MMA default."""
    return (pinned_config(m, n, k)
            or (packed_gemv_config(m, n, k) if m <= PACKED_GEMV_MAX_M
                else default_mma_config(m, n, k)))


def nvfp4_gemm(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
               weight_scale_2: torch.Tensor, out_dtype: torch.dtype | None = None,
               config: GemvConfig | NVFP4MmaConfig | CudaMmaConfig | None = None
               ) -> torch.Tensor:
    """``x [..., K] @ dequant(W)^T`` -> ``[..., N]`` in ``out_dtype`` (default x's)."""
    k = check_gemm(x, weight, weight_scale, weight_scale_2)
    if config is not None and not isinstance(config, GemvConfig | NVFP4MmaConfig | CudaMmaConfig):
        raise ValueError(f"config must be a GemvConfig, NVFP4MmaConfig or CudaMmaConfig, got "
                         f"{type(config).__name__}")
    out_dtype = out_dtype or x.dtype
    if not use_triton(x):
        return nvfp4_gemm_ref(x, weight, weight_scale, weight_scale_2, out_dtype)
    lead = x.shape[:-1]
    x2 = x.reshape(-1, k)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    m, n = x2.shape[0], weight.shape[0]
    out = torch.empty((m, n), dtype=out_dtype, device=x.device)
    if m == 0:
        return out.reshape(*lead, n)
    interp = triton_interpreting()
    cfg = config or cuda_auto_config(x2, weight, weight_scale, weight_scale_2,
                                     out_dtype) or auto_config(m, n, k)
    if isinstance(cfg, CudaMmaConfig):
        # cuda_auto_config only returns a config that passed this check
        why = config is not None and cuda_gemm_supported(x2, weight, weight_scale,
                                                         weight_scale_2, out_dtype, cfg)
        if why:
            raise ValueError(f"{cfg} cannot run this call: {why}")
        return launch_nvfp4_cuda(x2, weight, weight_scale, weight_scale_2, out,
                                 cfg).reshape(*lead, n)
    if isinstance(cfg, GemvConfig):
        w = weight if weight.data_ptr() % 8 == 0 else weight.clone()
        return nvfp4_gemv(x2, w, weight_scale, weight_scale_2, out, cfg, interp).reshape(*lead, n)
    if cfg.block_n < 16 or cfg.block_k < 32:
        raise ValueError(f"NVFP4MmaConfig needs block_n >= 16 and block_k >= 32, got {cfg}")
    dot_f32 = interp or x.dtype != torch.bfloat16  # fp16 / fp32 x: exact-ish fp32 (tf32) dot
    split = cfg.split_k
    dst = out if split == 1 else torch.empty((split, m, n), dtype=torch.float32, device=x.device)
    bm = mma_block_m(m, cfg)
    grid = (triton.cdiv(m, bm), triton.cdiv(n, cfg.block_n), split)
    _nvfp4_mma_kernel[grid](
        x2, weight, weight_scale, weight_scale_2, dst, m, n, k, split, x2.stride(0),
        weight.stride(0), weight_scale.stride(0), dst.stride(0) if split > 1 else 0,
        dst.stride(-2), BM=bm, BN=cfg.block_n, BK=cfg.block_k, DOT_F32=dot_f32,
        FAST=ptx_decoder_ok(x2.device, interp), EVEN_K=k % cfg.block_k == 0,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, **pdl_kwargs(x2))
    if split > 1:
        sum_rows(dst.permute(1, 0, 2), out)
    return out.reshape(*lead, n)
