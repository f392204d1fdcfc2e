"""Fused MoE with NVFP4 experts: route, ``SiLU(x W1^T) * (x W3^T)``, ``W2``, weighted sum.

Shapes (hidden K, expert intermediate I, E experts, M tokens, top-k experts per token, P = M*k
(token, expert) pairs):

- ``x [M, K]``, ``topk_ids [M, k]`` int (ids outside ``[0, E)`` are skipped, e.g. -1 for experts
  of another EP rank), ``topk_weights [M, k]`` fp32.
- ``w13``: NVFP4Tensor stacked ``weight [E, 2I, K/2]``, ``weight_scale [E, 2I, K/16]``,
  ``weight_scale_2`` ``[]`` / ``[E]`` / ``[E, 2]`` (gate rows 0..I-1 use column 0, up rows
  column 1). Rows: **gate (w1) first, then up (w3)**, as SGLang's ``w13_weight``.
- ``w2``: NVFP4Tensor ``weight [E, K, I/2]``, ``weight_scale [E, K, I/16]``, scale_2 ``[]``/``[E]``.
- output ``[M, K]`` in x's dtype: ``sum_j topk_weights[m, j] * expert_{ids[m, j]}(x[m])``.

The fused-MoE pattern: pairs are sorted by expert and cut into *slots* of ``BM`` rows that
all use one expert (``moe_align``: ``sorted_ids [S*BM]`` pair ids padded with P, ``slot_expert
[S]`` with -1 for unused slots; ``S = P // BM + min(E, P)`` bounds the slots without a host
sync, so the launch is CUDA-graph safe). One launch runs w13 for every slot x I-tile, reading
the gate and up tiles of the same rows and writing ``SiLU(gate) * up`` (bf16, like SGLang's
intermediate cache); a second runs w2 for every slot x K-tile, scales each row by its routing
weight and writes the pair's row; a third sums the k rows of each token. Each expert's weights
are read once per token tile: at decode, the traffic is the active experts' bytes. Two
kernels run the slots: ``_moe_mma_kernel`` (default, standard orientation as ``nvfp4_gemm``'s
"mmab": rows ``[BM, BK]`` as the MMA's A, the decoded expert tile ``[BK, BN]`` as B) and
``_moe_gemm_kernel`` (swap AB, ``sorted_kernel="mma"``).

``fused_moe_ref`` is the torch twin: dequantize and loop over experts.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from mla_spec.device import triton_interpreting, use_triton
from mla_spec.kernels import nvfp4_gemv, nvfp4_moe_gemv
from mla_spec.kernels.nvfp4_configs import NVFP4MmaConfig
from mla_spec.kernels.nvfp4_decode import _decode
from mla_spec.kernels.nvfp4_gemm import (
    block_m_for,
    mma_block_m,
    ptx_decoder_ok,
    sum_rows,
)
from mla_spec.kernels.nvfp4_moe_gemv import MOE_GEMV_MAX_M, moe_gemv, moe_gemv_tiles
from mla_spec.quant.nvfp4 import NVFP4Tensor, dequantize_nvfp4

__all__ = ["fused_moe_nvfp4", "fused_moe_ref", "moe_align", "MOE_MMAB_CONFIG"]

# Tiles of the standard-orientation sorted path (not yet measured on the H200: the
# ``sweep_nvfp4.py --mma-only`` MoE rows compare them with the swap-AB kernel).
MOE_MMAB_CONFIG = NVFP4MmaConfig(block_m=0, block_n=64, block_k=128, num_warps=4, num_stages=3)


def moe_align(topk_ids: torch.Tensor, num_experts: int, block_m: int
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """Sort (token, expert) pairs by expert into slots of ``block_m`` rows, on device.

    Returns
    -------
    sorted_ids : torch.Tensor
        int32 ``[S * block_m]``: pair index ``m * k + j`` or ``P`` (padding).
    slot_expert : torch.Tensor
        int32 ``[S]``: the slot's expert, -1 when unused. ``S = P // block_m + min(E, P)``.
    """
    flat = topk_ids.reshape(-1).long()
    p, e, bm = flat.numel(), num_experts, block_m
    dev = flat.device
    n_slots = p // bm + min(e, p)
    ids = torch.where((flat >= 0) & (flat < e), flat, torch.full_like(flat, e))
    counts = torch.zeros(e + 1, dtype=torch.long, device=dev)
    counts = counts.scatter_add_(0, ids, torch.ones_like(ids))[:e]  # no host sync (bincount)
    blocks = (counts + bm - 1) // bm
    blk_end = torch.cumsum(blocks, 0)
    blk_start = blk_end - blocks
    pair_start = torch.cumsum(counts, 0) - counts
    order = torch.sort(ids, stable=True).indices
    slots = torch.arange(n_slots, device=dev)
    se = torch.searchsorted(blk_end, slots, right=True)
    active = se < e
    se_c = se.clamp(max=e - 1)
    local = slots - blk_start[se_c]
    begin = pair_start[se_c] + local * bm
    rows = torch.where(active, (counts[se_c] - local * bm).clamp(0, bm), 0)
    j = torch.arange(bm, device=dev)
    src = (begin[:, None] + j[None, :]).clamp(max=max(p - 1, 0))
    take = j[None, :] < rows[:, None]
    sorted_ids = torch.where(take, order[src] if p else src, torch.full_like(src, p))
    slot_expert = torch.where(active, se, torch.full_like(se, -1))
    return sorted_ids.reshape(-1).to(torch.int32), slot_expert.to(torch.int32)


@triton.jit
def _moe_gemm_kernel(
    a_ptr, w_ptr, ws_ptr, ws2_ptr, out_ptr, sorted_ptr, slot_expert_ptr, topk_w_ptr,
    N, K, P, TOPK,
    stride_am, stride_we, stride_wn, stride_se, stride_sn, stride_s2e, stride_s2h, stride_om,
    GATED: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
    DOT_F32: tl.constexpr, FAST: tl.constexpr,
):
    """GATED (w13): rows = x[pair // TOPK], out[slot row, n] = silu(gate) * up, n < N = I.
    not GATED (w2): rows = act[slot row], out[pair, n] = topk_w[pair] * (act @ W2^T)[n]."""
    slot = tl.program_id(1)
    expert = tl.load(slot_expert_ptr + slot)
    if expert < 0:
        return
    pid_n = tl.program_id(0)
    G: tl.constexpr = BK // 16
    offs_r = slot * BM + tl.arange(0, BM)
    pair = tl.load(sorted_ptr + offs_r)
    r_ok = pair < P
    if GATED:
        a_rows = (pair // TOPK).to(tl.int64)
    else:
        a_rows = offs_r.to(tl.int64)
    offs_n = pid_n * BN + tl.arange(0, BN)
    n_ok = offs_n < N
    offs_g = tl.arange(0, G)
    offs_b = tl.arange(0, 8)
    offs_j = tl.arange(0, BK // 2)
    e64 = expert.to(tl.int64)
    w_row = w_ptr + e64 * stride_we + offs_n.to(tl.int64)[:, None, None] * stride_wn
    s_row = ws_ptr + e64 * stride_se + offs_n.to(tl.int64)[:, None] * stride_sn
    a_col = a_ptr + a_rows[None, :] * stride_am
    acc = tl.zeros((BN, BM), dtype=tl.float32)
    acc_up = tl.zeros((BN, BM), dtype=tl.float32)
    for it in range(0, tl.cdiv(K, BK)):
        g = it * G + offs_g
        g_ok = g < K // 16
        wmask = n_ok[:, None, None] & g_ok[None, :, None]
        smask = n_ok[:, None] & g_ok[None, :]
        kk = it * BK + 2 * offs_j
        x_ok = (kk < K)[:, None] & r_ok[None, :]
        xe = tl.load(a_col + kk[:, None], mask=x_ok, other=0.0)
        xo = tl.load(a_col + kk[:, None] + 1, mask=x_ok, other=0.0)
        if DOT_F32:
            xe = xe.to(tl.float32)
            xo = xo.to(tl.float32)
        else:
            xe = xe.to(tl.bfloat16)
            xo = xo.to(tl.bfloat16)
        wp = w_row + (g * 8)[None, :, None] + offs_b[None, None, :]
        wb = tl.load(wp, mask=wmask, other=0)
        s8 = tl.load(s_row + g[None, :], mask=smask, other=0.0)
        lo, hi = _decode(wb, s8[:, :, None], DOT_F32, FAST)
        acc = tl.dot(tl.reshape(lo, (BN, BK // 2)), xe, acc)
        acc = tl.dot(tl.reshape(hi, (BN, BK // 2)), xo, acc)
        if GATED:
            wb = tl.load(wp + N * stride_wn, mask=wmask, other=0)
            s8 = tl.load(s_row + N * stride_sn + g[None, :], mask=smask, other=0.0)
            lo, hi = _decode(wb, s8[:, :, None], DOT_F32, FAST)
            acc_up = tl.dot(tl.reshape(lo, (BN, BK // 2)), xe, acc_up)
            acc_up = tl.dot(tl.reshape(hi, (BN, BK // 2)), xo, acc_up)
    acc = acc * (tl.load(ws2_ptr + e64 * stride_s2e) * 256.0)
    if GATED:
        acc_up = acc_up * (tl.load(ws2_ptr + e64 * stride_s2e + stride_s2h) * 256.0)
        acc = acc / (1.0 + tl.exp(-acc)) * acc_up
        rows = offs_r.to(tl.int64)
    else:
        acc = acc * tl.load(topk_w_ptr + pair, mask=r_ok, other=0.0)[None, :]
        rows = pair.to(tl.int64)
    out = out_ptr + rows[None, :] * stride_om + offs_n[:, None]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=n_ok[:, None] & r_ok[None, :])


@triton.jit
def _moe_w_tile(w_row, s_row, it, K, BN: tl.constexpr, BK: tl.constexpr, EVEN_K: tl.constexpr,
                DOT_F32: tl.constexpr, FAST: tl.constexpr):
    """Decoded weight tile ``[BN, BK]`` (element 2j = low nibble of byte j), block-scaled."""
    G: tl.constexpr = BK // 16
    if EVEN_K:
        wb = tl.load(w_row + it * (BK // 2))
        s8 = tl.load(s_row + it * G)
    else:
        h_ok = it * (BK // 2) + tl.arange(0, BK // 2) < K // 2
        wb = tl.load(w_row + it * (BK // 2), mask=h_ok[None, :], other=0)
        g_ok = it * G + tl.arange(0, G) < K // 16
        s8 = tl.load(s_row + it * G, mask=g_ok[None, :], other=0.0)
    lo, hi = _decode(tl.reshape(wb, (BN, G, 8)), s8[:, :, None], DOT_F32, FAST)
    return tl.reshape(tl.join(lo, hi), (BN, BK))


@triton.jit
def _moe_mma_kernel(
    a_ptr, w_ptr, ws_ptr, ws2_ptr, out_ptr, sorted_ptr, slot_expert_ptr, topk_w_ptr,
    N, K, P, TOPK,
    stride_am, stride_we, stride_wn, stride_se, stride_sn, stride_s2e, stride_s2h, stride_om,
    GATED: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
    DOT_F32: tl.constexpr, FAST: tl.constexpr, EVEN_K: tl.constexpr,
):
    """Standard orientation of ``_moe_gemm_kernel`` (same inputs and outputs):
    ``acc[BM rows, BN] += a[BM, BK] @ W'_e[BK, BN]``; slots are the fastest program id, so
    the slots of one expert read its weight tile together."""
    slot = tl.program_id(0)
    expert = tl.load(slot_expert_ptr + slot)
    if expert < 0:
        return
    pid_n = tl.program_id(1)
    G: tl.constexpr = BK // 16
    offs_r = slot * BM + tl.arange(0, BM)
    pair = tl.load(sorted_ptr + offs_r)
    r_ok = pair < P
    if GATED:
        a_rows = (tl.minimum(pair, P - 1) // TOPK).to(tl.int64)  # padding: a valid row
    else:
        a_rows = offs_r.to(tl.int64)
    offs_n = pid_n * BN + tl.arange(0, BN)
    rows_n = tl.minimum(offs_n, N - 1).to(tl.int64)
    offs_k = tl.arange(0, BK)
    e64 = expert.to(tl.int64)
    a_row = a_ptr + a_rows[:, None] * stride_am + offs_k[None, :]
    w_row = w_ptr + e64 * stride_we + rows_n[:, None] * stride_wn + tl.arange(0, BK // 2)[None, :]
    s_row = ws_ptr + e64 * stride_se + rows_n[:, None] * stride_sn + tl.arange(0, G)[None, :]
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    acc_up = tl.zeros((BM, BN), dtype=tl.float32)
    for it in range(0, tl.cdiv(K, BK)):
        if EVEN_K:  # padding rows read 0 (w2: their act rows were never written)
            xt = tl.load(a_row + it * BK, mask=r_ok[:, None], other=0.0)
        else:
            xt = tl.load(a_row + it * BK, mask=r_ok[:, None] & (it * BK + offs_k < K)[None, :],
                         other=0.0)
        xt = xt.to(tl.float32) if DOT_F32 else xt.to(tl.bfloat16)
        w = _moe_w_tile(w_row, s_row, it, K, BN, BK, EVEN_K, DOT_F32, FAST)
        acc = tl.dot(xt, tl.trans(w), acc)
        if GATED:
            w = _moe_w_tile(w_row + N * stride_wn, s_row + N * stride_sn, it, K, BN, BK, EVEN_K,
                            DOT_F32, FAST)
            acc_up = tl.dot(xt, tl.trans(w), acc_up)
    acc = acc * (tl.load(ws2_ptr + e64 * stride_s2e) * 256.0)
    if GATED:
        acc_up = acc_up * (tl.load(ws2_ptr + e64 * stride_s2e + stride_s2h) * 256.0)
        acc = acc / (1.0 + tl.exp(-acc)) * acc_up
        rows = offs_r.to(tl.int64)
    else:
        acc = acc * tl.load(topk_w_ptr + pair, mask=r_ok, other=0.0)[:, None]
        rows = pair.to(tl.int64)
    out = out_ptr + rows[:, None] * stride_om + offs_n[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=r_ok[:, None] & (offs_n < N)[None, :])


def _scale2_strides(ws2: torch.Tensor, gated: bool) -> tuple[torch.Tensor, int, int]:
    """(contiguous fp32 scale_2, stride per expert, stride between gate and up)."""
    ws2 = ws2.float().contiguous()
    if ws2.dim() == 0 or ws2.numel() == 1:
        return ws2.reshape(1), 0, 0
    if ws2.dim() == 1:
        return ws2, 1, 0
    return ws2, ws2.stride(0), ws2.stride(1) if gated else 0


def _check_moe(x, topk_ids, topk_weights, w13: NVFP4Tensor, w2: NVFP4Tensor) -> tuple[int, int]:
    if w13.weight.dim() != 3 or w2.weight.dim() != 3:
        raise ValueError(f"w13.weight must be [E, 2I, K/2] and w2.weight [E, K, I/2], got "
                         f"{tuple(w13.weight.shape)} and {tuple(w2.weight.shape)}")
    e, two_i, k_half = w13.weight.shape
    inter = two_i // 2
    if x.dim() != 2 or x.shape[1] != 2 * k_half:
        raise ValueError(f"x must be [M, K={2 * k_half}] for w13 {tuple(w13.weight.shape)}, "
                         f"got {tuple(x.shape)}")
    want2 = (e, 2 * k_half, inter // 2)
    if tuple(w2.weight.shape) != want2:
        raise ValueError(f"w2.weight must have shape {want2}, got {tuple(w2.weight.shape)}")
    if inter % 16:
        raise ValueError(f"intermediate size I = {inter} must be a multiple of 16")
    if topk_ids.shape != topk_weights.shape or topk_ids.dim() != 2 \
            or topk_ids.shape[0] != x.shape[0]:
        raise ValueError(f"topk_ids and topk_weights must both be [M={x.shape[0]}, k], got "
                         f"{tuple(topk_ids.shape)} and {tuple(topk_weights.shape)}")
    if topk_ids.is_floating_point():
        raise ValueError(f"topk_ids must be an integer tensor, got {topk_ids.dtype}")
    if x.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise ValueError(f"x must be bfloat16, float16 or float32, got {x.dtype}")
    for nm, t in (("topk_ids", topk_ids), ("topk_weights", topk_weights),
                  ("w13.weight", w13.weight), ("w2.weight", w2.weight)):
        if t.device != x.device:
            raise ValueError(f"{nm} is on {t.device}, x on {x.device}: use one device")
    return e, inter


def fused_moe_nvfp4(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                    w13: NVFP4Tensor, w2: NVFP4Tensor, block_n: int = 32,
                    block_k: int = 256, fast_dequant: bool = True, path: str = "auto",
                    gemv_block_n: int | None = None, gemv_split: int | None = None,
                    gemv_warps: int | None = None, sorted_kernel: str = "mmab",
                    gemv_block_n2: int | None = None, gemv_warps2: int | None = None,
                    gemv_g: int | None = None, gemv_packed: bool | None = None,
                    gemv_prefetch: bool | None = None, gemv_w2_loop: bool | None = None,
                    gemv_g2: int | None = None,
                    mmab_config: NVFP4MmaConfig | None = None) -> torch.Tensor:
    """Routed experts with NVFP4 weights (see the module docstring for shapes).

    ``path``: "gemv" (one program per token-expert pair, ``nvfp4_moe_gemv``), "sorted" (the
    moe_align slots below), or "auto" (gemv up to ``MOE_GEMV_MAX_M`` = 4 tokens: the H200 sweep's
    winner there; the sorted path wins from 16 tokens on, 2.6x). ``block_n`` / ``block_k`` /
    ``fast_dequant`` tune the sorted path (``fast_dequant``: the packed PTX decoder, validated
    on the H200; False = portable; never used in the interpreter or below sm_90), ``gemv_*``
    the gemv path (its decoder follows ``nvfp4_gemv.GEMV_FAST``; ``gemv_*2``: its w2 launch;
    ``gemv_g``: int64 words per row per step; None: by token count, see
    ``nvfp4_moe_gemv.moe_gemv_tiles``; ``gemv_packed``: packed-fp16 dot products, None:
    ``MOE_GEMV_PACKED``; ``gemv_prefetch``: their double-buffered loop, None:
    ``MOE_GEMV_PREFETCH``; ``gemv_w2_loop``: the w2 launch that sums the top-k experts in one
    program, ``nvfp4_moe_w2``, None: ``MOE_W2_LOOP``, with ``gemv_g2`` words per step).
    ``sorted_kernel``: "mmab" (standard orientation,
    ``_moe_mma_kernel``, tiles from ``mmab_config``: default ``MOE_MMAB_CONFIG``; its
    ``block_m`` 0 = by the mean rows per active expert, ``split_k`` must be 1) or "mma" (the
    swap-AB ``_moe_gemm_kernel``, tiles from ``block_n`` / ``block_k``).

    Returns ``[M, K]`` in x's dtype. Triton kernels when ``use_triton(x)``, else ``fused_moe_ref``.
    """
    if path not in ("auto", "gemv", "sorted"):
        raise ValueError(f"path must be 'auto', 'gemv' or 'sorted', got {path!r}")
    if sorted_kernel not in ("mmab", "mma"):
        raise ValueError(f"sorted_kernel must be 'mmab' or 'mma', got {sorted_kernel!r}")
    mcfg = mmab_config or MOE_MMAB_CONFIG
    if mcfg.split_k != 1 or mcfg.block_n < 16 or mcfg.block_k < 32:
        raise ValueError(f"mmab_config needs split_k = 1, block_n >= 16, block_k >= 32: {mcfg}")
    e, inter = _check_moe(x, topk_ids, topk_weights, w13, w2)
    if not use_triton(x):
        return fused_moe_ref(x, topk_ids, topk_weights, w13, w2)
    m, k_hidden = x.shape
    topk = topk_ids.shape[1]
    p = m * topk
    out = torch.empty((m, k_hidden), dtype=x.dtype, device=x.device)
    if p == 0:
        return out
    interp = triton_interpreting()
    act_dtype = torch.float32 if x.dtype == torch.float32 else torch.bfloat16
    if path == "gemv" or (path == "auto" and m <= MOE_GEMV_MAX_M):
        x2 = x if x.stride(-1) == 1 else x.contiguous()
        packed = nvfp4_moe_gemv.MOE_GEMV_PACKED if gemv_packed is None else gemv_packed
        loop = (nvfp4_moe_gemv.MOE_W2_LOOP if gemv_w2_loop is None else gemv_w2_loop) and \
            packed and x.dtype == torch.bfloat16  # what moe_gemv can run it on
        bn, w, bn2, w2_, g, g2 = moe_gemv_tiles(m, gemv_block_n, gemv_warps, gemv_block_n2,
                                                gemv_warps2, gemv_g, loop, gemv_g2)
        return moe_gemv(x2, topk_ids.reshape(-1).to(torch.int32), topk_weights.reshape(-1)
                        .float().contiguous(), w13, w2, _scale2_strides(w13.weight_scale_2, True),
                        _scale2_strides(w2.weight_scale_2, False), act_dtype, bn,
                        gemv_split, w, not interp and nvfp4_gemv.GEMV_FAST, bn2, w2_, g,
                        gemv_packed, gemv_prefetch, loop, g2)
    mean_rows = triton.cdiv(p, min(e, p))  # rows per active expert, at most
    mmab = sorted_kernel == "mmab"
    bm = (mcfg.block_m or mma_block_m(mean_rows)) if mmab else block_m_for(mean_rows)
    sorted_ids, slot_expert = moe_align(topk_ids, e, bm)
    n_slots = slot_expert.numel()
    dot_f32 = interp or x.dtype != torch.bfloat16  # fp16 / fp32 x: exact-ish fp32 (tf32) dot
    fast = fast_dequant and (mcfg.fast_dequant or not mmab) and ptx_decoder_ok(x.device, interp)
    act = torch.empty((n_slots * bm, inter), dtype=act_dtype, device=x.device)
    x2 = x if x.stride(-1) == 1 else x.contiguous()
    tw = topk_weights.reshape(-1).float().contiguous()
    s13, s13e, s13h = _scale2_strides(w13.weight_scale_2, True)
    pairs = torch.zeros((p, k_hidden), dtype=torch.float32, device=x.device)
    s2, s2e, _ = _scale2_strides(w2.weight_scale_2, False)
    a13 = (x2, w13.weight, w13.weight_scale, s13, act, sorted_ids, slot_expert, tw,
           inter, k_hidden, p, topk, x2.stride(0), *w13.weight.stride()[:2],
           *w13.weight_scale.stride()[:2], s13e, s13h, act.stride(0))
    a2 = (act, w2.weight, w2.weight_scale, s2, pairs, sorted_ids, slot_expert, tw,
          k_hidden, inter, p, topk, act.stride(0), *w2.weight.stride()[:2],
          *w2.weight_scale.stride()[:2], s2e, 0, pairs.stride(0))
    if mmab:
        bn, opts = mcfg.block_n, dict(num_warps=mcfg.num_warps, num_stages=mcfg.num_stages)
        for args, n_out, k_in, gated in ((a13, inter, k_hidden, True),
                                         (a2, k_hidden, inter, False)):
            bk = min(mcfg.block_k, triton.next_power_of_2(k_in))
            _moe_mma_kernel[(n_slots, triton.cdiv(n_out, bn))](
                *args, GATED=gated, BM=bm, BN=bn, BK=bk, DOT_F32=dot_f32, FAST=fast,
                EVEN_K=k_in % bk == 0, **opts)
    else:
        bn13 = min(block_n, 16) if n_slots * triton.cdiv(inter, block_n) < 264 else block_n
        _moe_gemm_kernel[(triton.cdiv(inter, bn13), n_slots)](
            *a13, GATED=True, BM=bm, BN=bn13, BK=block_k, DOT_F32=dot_f32, FAST=fast)
        _moe_gemm_kernel[(triton.cdiv(k_hidden, block_n), n_slots)](
            *a2, GATED=False, BM=bm, BN=block_n, BK=min(block_k, triton.next_power_of_2(inter)),
            DOT_F32=dot_f32, FAST=fast)
    sum_rows(pairs.view(m, topk, k_hidden), out)
    return out


def fused_moe_ref(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                  w13: NVFP4Tensor, w2: NVFP4Tensor) -> torch.Tensor:
    """Torch twin: per active expert, dequantize (fp32), ``silu(gate) * up`` rounded to bf16
    (fp32 for fp32 x, as the kernel's intermediate), down-project, weight and sum."""
    e, inter = _check_moe(x, topk_ids, topk_weights, w13, w2)
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    act_dtype = torch.float32 if x.dtype == torch.float32 else torch.bfloat16
    for ex in torch.unique(topk_ids).tolist():
        if not 0 <= ex < e:
            continue
        tok, slot = (topk_ids == ex).nonzero(as_tuple=True)
        g13 = dequantize_nvfp4(w13.weight[ex], w13.weight_scale[ex], _pick(w13.weight_scale_2,
                               ex, 0))
        if w13.weight_scale_2.dim() == 2:
            g13[inter:] = dequantize_nvfp4(w13.weight[ex, inter:], w13.weight_scale[ex, inter:],
                                           _pick(w13.weight_scale_2, ex, 1))
        w2e = dequantize_nvfp4(w2.weight[ex], w2.weight_scale[ex], _pick(w2.weight_scale_2, ex, 0))
        h = x[tok].float() @ g13.t()
        act = (torch.nn.functional.silu(h[:, :inter]) * h[:, inter:]).to(act_dtype).float()
        y = act @ w2e.t()
        out.index_add_(0, tok, y * topk_weights[tok, slot].float()[:, None])
    return out.to(x.dtype)


def _pick(ws2: torch.Tensor, ex: int, half: int) -> torch.Tensor:
    """Scalar scale_2 of expert ``ex`` (``half`` selects gate / up for ``[E, 2]``)."""
    if ws2.dim() == 0 or ws2.numel() == 1:
        return ws2.reshape(()).float()
    return (ws2[ex] if ws2.dim() == 1 else ws2[ex, half]).float().reshape(())
