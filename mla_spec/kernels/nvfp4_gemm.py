"""W4A16 GEMM with NVFP4 weights: ``y = x @ dequant(W)^T``, dequantized in registers.

Hopper has no FP4 matrix units, so the packed weights are decoded to bf16 inside the GEMM and fed
to ordinary bf16 MMAs. At decode batch sizes (M <= 64 tokens) the GEMM is a GEMV in disguise and
its time is the time to stream the weight bytes: 0.5625 B/weight instead of 2, up to 3.56x less.

Layout and tiling (shapes: x ``[M, K]``, weight uint8 ``[N, K/2]``, weight_scale e4m3
``[N, K/16]``, weight_scale_2 fp32 ``[]``, y ``[M, N]``):

- **Swap AB** (``_nvfp4_gemm_kernel``, ``NVFP4GemmConfig``, variants "mma"). Each program
  computes ``y^T[BN, BM] = W'[BN, BK] @ x^T[BK, BM]``: the weight rows are the MMA's M side
  (16..64), the few tokens its N side (16..64), so M = 1 wastes only MMA issue slots, not
  weight bytes.
- **No nibble interleave.** A byte holds the elements ``2j`` (low) and ``2j+1`` (high). Instead of
  interleaving, the low nibbles multiply ``x[:, 0::2]`` and the high ones ``x[:, 1::2]``: two dots
  of K = BK/2 per step.
- **Weights as [BN, BK/16, 8] bytes** (128-byte rows per step for BK = 256: 16-byte loads), the
  e4m3 block scale broadcast over the last axis: one scale load per 16 elements.
- **Decode.** ``W' = E2M1 * s * 2**-8`` is exact in bf16 (E2M1 has 2 significant bits, e4m3 4);
  ``weight_scale_2 * 256`` scales the fp32 accumulator, read from device memory (no host sync;
  CUDA-graph safe). The decoders live in ``nvfp4_decode``: portable (the interpreter) and PTX
  (the default on sm_90+ with bf16 x, ``NVFP4GemmConfig.fast_dequant``).
- **Standard orientation** (``_nvfp4_mma_kernel``, ``NVFP4MmaConfig``, variants "mmab"):
  ``acc[BM, BN] += x[BM, BK] @ W'[BK, BN]``, the usual W4A16 layout. x is a plain bf16 load;
  the packed bytes ``[BN, BK/2]`` decode (same decoders) into low / high values that
  ``tl.join`` + ``tl.reshape`` interleave to ``[BN, BK]`` (element 2j = low nibble), then
  ``tl.trans`` makes the B operand. BM = 16..128 by M (wgmma from BM = 64), the M tiles of
  one weight tile are adjacent program ids (weights read from DRAM about once).
- **Kernel and tile choice** (``auto_config``). For a (N, K, M bucket) measured by the H200
  sweeps, the pinned config of ``nvfp4_configs.PINNED_CONFIGS`` (the packed-fp16 GEMV of
  ``nvfp4_gemv_packed`` at 1-2 tokens, "mmab" above). Otherwise, at 1-2 tokens
  (``PACKED_GEMV_MAX_M``), the packed GEMV with ``packed_gemv_config``; above, the
  standard-orientation kernel (``default_mma_config``; with ``MMA_FOR_SMALL_M`` off, the fp32
  GEMV up to ``GEMV_MAX_M`` tokens). ``set_gemm_config`` pins an MMA config for unpinned
  shapes; pass a ``GemvConfig`` / ``NVFP4GemmConfig`` / ``NVFP4MmaConfig`` as ``config`` to
  force one.
- **The hand-written ``mma.sync`` kernel** (``nvfp4_gemm_cuda``, ``CudaMmaConfig``, variants
  "cuda"; sm_90 with nvcc, bf16, 1-16 tokens, K % 128 == 0) decodes each weight into the MMA's
  register fragment. Without ``config`` it runs first where the H200 sweep pinned it
  (``nvfp4_configs.PINNED_CUDA``) and at 2-8 tokens on unmeasured shapes
  (``nvfp4_gemm_cuda.cuda_auto_config``); where it cannot run, the choice above.
- **Split-K** for few output tiles (small N at small M): partial sums go to an fp32 workspace
  ``[S, M, N]`` and ``split_sum.sum_rows`` adds them (deterministic, no atomics).

``nvfp4_gemm_ref`` is the torch twin (dequantize, then matmul in fp32).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from mla_spec.device import cuda_capability, triton_interpreting, use_triton
from mla_spec.kernels.nvfp4_configs import (
    CudaMmaConfig,
    NVFP4GemmConfig,
    NVFP4MmaConfig,
    m_bucket,
    pinned_config,
)
from mla_spec.kernels.nvfp4_decode import _decode
from mla_spec.kernels.nvfp4_gemm_cuda import (
    cuda_auto_config,
    cuda_gemm_supported,
    launch_nvfp4_cuda,
)
from mla_spec.kernels.nvfp4_gemv import (
    GEMV_MAX_M,
    GemvConfig,
    default_gemv_config,
    nvfp4_gemv,
    packed_gemv_config,
)
from mla_spec.kernels.launch.pdl import gdc_enter, pdl_kwargs
from mla_spec.kernels.split_sum import sum_rows
from mla_spec.quant.nvfp4 import dequantize_nvfp4, validate_nvfp4

__all__ = ["NVFP4GemmConfig", "NVFP4MmaConfig", "nvfp4_gemm", "nvfp4_gemm_ref",
           "default_gemm_config", "default_mma_config", "set_gemm_config", "block_m_for",
           "mma_block_m", "auto_config", "ptx_decoder_ok"]

@triton.jit
def _nvfp4_gemm_kernel(
    x_ptr, w_ptr, ws_ptr, ws2_ptr, out_ptr,
    M, N, K, SPLIT_K, stride_xm, stride_wn, stride_sn, stride_os, stride_om,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
    DOT_F32: tl.constexpr, FAST: tl.constexpr, EVEN_K: tl.constexpr,
):
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    pid_m = tl.program_id(2)
    G: tl.constexpr = BK // 16
    offs_n = pid_n * BN + tl.arange(0, BN)
    offs_m = pid_m * BM + tl.arange(0, BM)
    offs_g = tl.arange(0, G)
    offs_b = tl.arange(0, 8)
    offs_j = tl.arange(0, BK // 2)
    offs_2 = tl.arange(0, 2)
    n_ok = offs_n < N
    k_iters = tl.cdiv(K, BK)
    per_split = tl.cdiv(k_iters, SPLIT_K)
    it0 = pid_k * per_split
    it1 = tl.minimum(it0 + per_split, k_iters)
    # out-of-range rows / tokens are clamped (valid loads, dropped at the store): no masks
    rows = tl.minimum(offs_n, N - 1).to(tl.int64)
    toks = tl.minimum(offs_m, M - 1).to(tl.int64)
    w_row = w_ptr + rows[:, None, None] * stride_wn + (offs_g * 8)[None, :, None] \
        + offs_b[None, None, :]
    s_row = ws_ptr + rows[:, None] * stride_sn + offs_g[None, :]
    x_row = x_ptr + toks[:, None, None] * stride_xm + (2 * offs_j)[None, :, None] \
        + offs_2[None, None, :]
    acc = tl.zeros((BN, BM), dtype=tl.float32)
    for it in range(it0, it1):
        if EVEN_K:
            wb = tl.load(w_row + it * (BK // 2))
            s8 = tl.load(s_row + it * G)
            x3 = tl.load(x_row + it * BK)
        else:
            g_ok = it * G + offs_g < K // 16
            wb = tl.load(w_row + it * (BK // 2), mask=g_ok[None, :, None], other=0)
            s8 = tl.load(s_row + it * G, mask=g_ok[None, :], other=0.0)
            x_ok = (it * BK + 2 * offs_j < K)[None, :, None]
            x3 = tl.load(x_row + it * BK, mask=x_ok, other=0.0)
        lo, hi = _decode(wb, s8[:, :, None], DOT_F32, FAST)
        lo = tl.reshape(lo, (BN, BK // 2))
        hi = tl.reshape(hi, (BN, BK // 2))
        xe, xo = tl.split(x3)  # [BM, BK/2] even / odd columns
        if DOT_F32:
            acc = tl.dot(lo, tl.trans(xe.to(tl.float32)), acc)
            acc = tl.dot(hi, tl.trans(xo.to(tl.float32)), acc)
        else:
            acc = tl.dot(lo, tl.trans(xe.to(tl.bfloat16)), acc)
            acc = tl.dot(hi, tl.trans(xo.to(tl.bfloat16)), acc)
    acc = acc * (tl.load(ws2_ptr) * 256.0)
    out = out_ptr + pid_k * stride_os + offs_m[None, :] * stride_om + offs_n[:, None]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=n_ok[:, None] & (offs_m < M)[None, :])


@triton.jit
def _nvfp4_mma_kernel(
    x_ptr, w_ptr, ws_ptr, ws2_ptr, out_ptr,
    M, N, K, SPLIT_K, stride_xm, stride_wn, stride_sn, stride_os, stride_om,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
    DOT_F32: tl.constexpr, FAST: tl.constexpr, EVEN_K: tl.constexpr, USE_GDC: tl.constexpr,
):
    """Standard orientation: ``acc[BM, BN] += x[BM, BK] @ W'[BN, BK]^T``, W' decoded in place."""
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


_CONFIGS: dict[tuple[int | None, int, int], NVFP4GemmConfig | NVFP4MmaConfig] = {}
_NUM_SMS = 132
MmaConfig = NVFP4GemmConfig | NVFP4MmaConfig


def block_m_for(m: int) -> int:
    """Token tile of the swap-AB kernel: 16 up to 16 tokens, then 32, then 64 (repeating)."""
    return 16 if m <= 16 else 32 if m <= 32 else 64


def mma_block_m(m: int, cfg: NVFP4MmaConfig | None = None) -> int:
    """Token tile of the standard-orientation kernel: the config's, else 16 / 32 / 64 / 128."""
    if cfg is not None and cfg.block_m:
        return cfg.block_m
    return 16 if m <= 16 else 32 if m <= 32 else 64 if m <= 64 else 128


def default_gemm_config(m: int, n: int, k: int) -> NVFP4GemmConfig:
    """Swap-AB kernel config: the H200 sweep's pinned one for (N, K, M bucket) when it is a
    swap-AB ("mma") entry, else a heuristic from its winners: N >= 4096: bn128 bk128 w8 st3;
    smaller N: bn16 / bn32 bk256 w4 st4. Split K until >= 12 warps per SM, at most 8 and >= 2
    K steps per split. ``nvfp4_gemm`` runs it only when pinned or passed as ``config``."""
    hit = pinned_config(m, n, k)
    if isinstance(hit, NVFP4GemmConfig):
        return hit
    if n >= 4096:
        bn, bk, warps, stages = 128, 128, 8, 3
    else:
        bn, bk, warps, stages = (32 if n >= 2048 else 16), 256, 4, 4
    tiles = triton.cdiv(n, bn) * triton.cdiv(max(m, 1), block_m_for(m))
    k_iters = triton.cdiv(k, bk)
    split = 1
    while (tiles * split * warps < 12 * _NUM_SMS and split * 2 <= 8
           and k_iters // (split * 2) >= 2):
        split *= 2
    return NVFP4GemmConfig(block_n=bn, block_k=bk, split_k=split, num_warps=warps,
                           num_stages=stages)


def default_mma_config(m: int, n: int, k: int, *, block_m: int = 0, block_n: int = 0,
                       block_k: int = 0, num_warps: int = 0, num_stages: int = 0
                       ) -> NVFP4MmaConfig:
    """Standard-orientation kernel config (no measurement needed): token tile by M
    (``mma_block_m``), bn128 (bn64 below N = 2048) bk128, 4 warps up to BM = 64 and 8 for
    BM = 128, 4 stages up to BM = 32 else 3; split K until >= 8 warps per SM (at most 8
    splits, >= 4 K steps each). Nonzero keywords fix a tile field (the split follows them)."""
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


# The H200 sweeps (docs/bench_nvfp4.md) found the standard-orientation MMA kernel faster than the
# FMA GEMV at every measured shape, M = 1 included (e.g. 9216 x 7168: 29.5 vs 34.2 µs), so
# unpinned shapes take it at every M too; False restores the GEMV up to GEMV_MAX_M tokens.
MMA_FOR_SMALL_M = True


# Unpinned shapes at up to this many tokens take the packed, wide, double-buffered GEMV
# (``packed_gemv_config``): it won at M = 1 and 2 on all four measured shapes (fourth session,
# 1.3-1.9x the MMA kernel) and lost to it at M = 4 on three of them.
PACKED_GEMV_MAX_M = 2


def auto_config(m: int, n: int, k: int) -> GemvConfig | MmaConfig:
    """What ``nvfp4_gemm`` runs without ``config``: the pinned GEMV where the table pins one;
    else ``set_gemm_config``'s pin; else, unpinned, the packed GEMV up to
    ``PACKED_GEMV_MAX_M`` tokens (the fp32 GEMV up to ``GEMV_MAX_M`` with ``MMA_FOR_SMALL_M``
    off); else the pinned MMA config (either MMA kernel) or ``default_mma_config``."""
    hit = pinned_config(m, n, k)
    if isinstance(hit, GemvConfig):
        return hit
    mine = _CONFIGS.get((m_bucket(m), n, k))
    if mine is not None:
        return mine
    if hit is None and m <= PACKED_GEMV_MAX_M:
        return packed_gemv_config(m, n, k)
    if hit is None and m <= GEMV_MAX_M and not MMA_FOR_SMALL_M:
        return default_gemv_config(m, n, k)
    return hit or default_mma_config(m, n, k)


def set_gemm_config(m: int, n: int, k: int, config: MmaConfig) -> None:
    """Pin an MMA config (either kernel) for (``m_bucket(m)``, N, K), e.g. after a tuning
    sweep. It applies where ``nvfp4_gemm`` runs an MMA kernel (not in the GEMV regime)."""
    _CONFIGS[(m_bucket(m), n, k)] = config


def _check_gemm(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                weight_scale_2: torch.Tensor) -> int:
    k = validate_nvfp4(weight, weight_scale, weight_scale_2)
    if weight.dim() != 2:
        raise ValueError(f"weight must be 2-D [N, K/2], got shape {tuple(weight.shape)}")
    if weight_scale_2.numel() != 1:
        raise ValueError(f"weight_scale_2 must be a scalar, got {tuple(weight_scale_2.shape)}")
    if x.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise ValueError(f"x must be bfloat16, float16 or float32, got {x.dtype}")
    if x.shape[-1] != k:
        raise ValueError(f"x must be [..., K={k}] to match weight {tuple(weight.shape)}, "
                         f"got {tuple(x.shape)}")
    return k


def nvfp4_gemm(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
               weight_scale_2: torch.Tensor, out_dtype: torch.dtype | None = None,
               config: GemvConfig | MmaConfig | None = None) -> torch.Tensor:
    """``x @ dequant(W)^T`` with NVFP4 weights.

    Parameters
    ----------
    x : torch.Tensor
        ``[..., K]`` bf16 / fp16 / fp32 activations.
    weight, weight_scale, weight_scale_2 : torch.Tensor
        uint8 ``[N, K/2]``, float8_e4m3fn ``[N, K/16]``, fp32 scalar (ModelOpt layout).
    out_dtype : torch.dtype, optional
        default ``x.dtype``.
    config : GemvConfig, NVFP4GemmConfig, NVFP4MmaConfig or CudaMmaConfig, optional
        kernel (GEMV, swap-AB MMA, standard MMA, hand-written CUDA MMA) and tiles; default
        ``cuda_auto_config`` where the CUDA kernel can run the call and is pinned or 2-8 tokens,
        else ``auto_config(M, N, K)``: the H200-pinned config for a measured shape, else the
        packed GEMV up to 2 tokens, else ``default_mma_config``. A ``CudaMmaConfig`` the call
        cannot take raises ValueError with the reason.

    Returns
    -------
    torch.Tensor
        ``[..., N]``. Triton kernel when ``use_triton(x)``, else ``nvfp4_gemm_ref``.
    """
    k = _check_gemm(x, weight, weight_scale, weight_scale_2)
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
    dot_f32 = interp or x.dtype != torch.bfloat16  # fp16 / fp32 x: exact-ish fp32 (tf32) dot
    fast = cfg.fast_dequant and ptx_decoder_ok(x2.device, interp)
    split = cfg.split_k
    dst = out if split == 1 else torch.empty((split, m, n), dtype=torch.float32, device=x.device)
    args = (x2, weight, weight_scale, weight_scale_2, dst, m, n, k, split,
            x2.stride(0), weight.stride(0), weight_scale.stride(0),
            dst.stride(0) if split > 1 else 0, dst.stride(-2))
    if isinstance(cfg, NVFP4MmaConfig):
        if cfg.block_n < 16 or cfg.block_k < 32:
            raise ValueError(f"NVFP4MmaConfig needs block_n >= 16 and block_k >= 32, got {cfg}")
        bm = mma_block_m(m, cfg)
        grid = (triton.cdiv(m, bm), triton.cdiv(n, cfg.block_n), split)
        _nvfp4_mma_kernel[grid](*args, BM=bm, BN=cfg.block_n, BK=cfg.block_k, DOT_F32=dot_f32,
                                FAST=fast, EVEN_K=k % cfg.block_k == 0,
                                num_warps=cfg.num_warps, num_stages=cfg.num_stages,
                                **pdl_kwargs(x2))
    else:
        grid = (triton.cdiv(n, cfg.block_n), split, triton.cdiv(m, block_m_for(m)))
        _nvfp4_gemm_kernel[grid](*args, BM=block_m_for(m), BN=cfg.block_n, BK=cfg.block_k,
                                 DOT_F32=dot_f32, FAST=fast, EVEN_K=k % cfg.block_k == 0,
                                 num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    if split > 1:
        sum_rows(dst.permute(1, 0, 2), out)
    return out.reshape(*lead, n)


def ptx_decoder_ok(device: torch.device, interp: bool) -> bool:
    """Whether the packed PTX decoder (``mul.rn.bf16x2``: sm_90+) may run on ``device``."""
    if interp or device.type != "cuda":
        return False
    return cuda_capability(device) >= (9, 0)


def nvfp4_gemm_ref(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                   weight_scale_2: torch.Tensor, out_dtype: torch.dtype | None = None
                   ) -> torch.Tensor:
    """Torch twin: dequantize to fp32, matmul in fp32, cast to ``out_dtype`` (default x's)."""
    _check_gemm(x, weight, weight_scale, weight_scale_2)
    w = dequantize_nvfp4(weight, weight_scale, weight_scale_2.reshape(()), torch.float32)
    return (x.float() @ w.t()).to(out_dtype or x.dtype)
