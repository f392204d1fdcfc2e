"""The sorted path of the NVFP4 fused MoE (``fused_moe_nvfp4`` above ``MOE_GEMV_MAX_M`` tokens).

Pairs (token, expert) are sorted by expert and cut into *slots* of ``BM`` rows that all use one
expert (``moe_align``: ``sorted_ids [S*BM]`` pair ids padded with P, ``slot_expert [S]`` with -1
for unused slots; ``S = P // BM + min(E, P)`` bounds the slots without a host sync, so the
launch is CUDA-graph safe). One launch runs w13 for every slot x I-tile, reading the gate and up
tiles of the same rows and writing ``SiLU(gate) * up``; a second runs w2 for every slot x
K-tile, scales each row by its routing weight and writes the pair's row; ``sum_rows`` adds the
k rows of each token. Two kernels run the slots: ``_moe_mma_kernel`` (default, standard
orientation as ``nvfp4_gemm``'s "mmab") and ``_moe_gemm_kernel`` (swap AB, ``sorted_kernel=
"mma"``). Shapes and the twin: ``nvfp4_moe``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from mla_spec.kernels.nvfp4_configs import NVFP4MmaConfig
from mla_spec.kernels.nvfp4_decode import _decode
from mla_spec.kernels.nvfp4_gemm import block_m_for, mma_block_m, ptx_decoder_ok
from mla_spec.kernels.split_sum import sum_rows
from mla_spec.quant.nvfp4 import NVFP4Tensor

__all__ = ["MOE_MMAB_CONFIG", "moe_align", "moe_sorted", "scale2_strides"]

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
def _slot_rows(slot, sorted_ptr, P, TOPK, BM: tl.constexpr, GATED: tl.constexpr):
    """A slot's ``BM`` rows: their offsets, pair ids (``P`` = padding), the mask of real pairs,
    and the activation row each reads (w13: the pair's token, a valid row for padding; w2: the
    slot row of ``act``)."""
    offs_r = slot * BM + tl.arange(0, BM)
    pair = tl.load(sorted_ptr + offs_r)
    r_ok = pair < P
    if GATED:
        a_rows = (tl.minimum(pair, P - 1) // TOPK).to(tl.int64)
    else:
        a_rows = offs_r.to(tl.int64)
    return offs_r, pair, r_ok, a_rows


@triton.jit
def _slot_epilogue(acc, acc_up, ws2_ptr, e64, stride_s2e, stride_s2h, topk_w_ptr, pair, r_ok,
                   offs_r, GATED: tl.constexpr, ROWS_AXIS: tl.constexpr):
    """Apply ``weight_scale_2`` (and the packed decoders' 256 unit); w13: ``SiLU(gate) * up``
    into the slot's rows, w2: the routing weight into the pairs' rows. ``ROWS_AXIS``: the axis
    of ``acc`` that holds the rows (1 for the swap-AB kernel's ``[BN, BM]``). Returns the
    result and the output row of each slot row."""
    acc = acc * (tl.load(ws2_ptr + e64 * stride_s2e) * 256.0)
    if GATED:
        acc_up = acc_up * (tl.load(ws2_ptr + e64 * stride_s2e + stride_s2h) * 256.0)
        acc = acc / (1.0 + tl.exp(-acc)) * acc_up
        rows = offs_r.to(tl.int64)
    else:
        tw = tl.load(topk_w_ptr + pair, mask=r_ok, other=0.0)
        if ROWS_AXIS == 1:
            acc = acc * tw[None, :]
        else:
            acc = acc * tw[:, None]
        rows = pair.to(tl.int64)
    return acc, rows


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
    offs_r, pair, r_ok, a_rows = _slot_rows(slot, sorted_ptr, P, TOPK, BM, GATED)
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
    acc, rows = _slot_epilogue(acc, acc_up, ws2_ptr, e64, stride_s2e, stride_s2h, topk_w_ptr,
                               pair, r_ok, offs_r, GATED, 1)
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
    offs_r, pair, r_ok, a_rows = _slot_rows(slot, sorted_ptr, P, TOPK, BM, GATED)
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
    acc, rows = _slot_epilogue(acc, acc_up, ws2_ptr, e64, stride_s2e, stride_s2h, topk_w_ptr,
                               pair, r_ok, offs_r, GATED, 0)
    out = out_ptr + rows[:, None] * stride_om + offs_n[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=r_ok[:, None] & (offs_n < N)[None, :])


def scale2_strides(ws2: torch.Tensor, gated: bool) -> tuple[torch.Tensor, int, int]:
    """(contiguous fp32 scale_2, stride per expert, stride between gate and up)."""
    ws2 = ws2.float().contiguous()
    if ws2.dim() == 0 or ws2.numel() == 1:
        return ws2.reshape(1), 0, 0
    if ws2.dim() == 1:
        return ws2, 1, 0
    return ws2, ws2.stride(0), ws2.stride(1) if gated else 0


def moe_sorted(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
               w13: NVFP4Tensor, w2: NVFP4Tensor, out: torch.Tensor, e: int, inter: int,
               act_dtype: torch.dtype, mcfg: NVFP4MmaConfig, sorted_kernel: str, block_n: int,
               block_k: int, fast_dequant: bool, interp: bool) -> None:
    """The sorted path into ``out [M, K]`` (arguments as ``fused_moe_nvfp4``'s, checked there;
    ``mcfg`` the "mmab" tiles, ``block_n`` / ``block_k`` the swap-AB kernel's)."""
    m, k_hidden = x.shape
    topk = topk_ids.shape[1]
    p = m * topk
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
    s13, s13e, s13h = scale2_strides(w13.weight_scale_2, True)
    pairs = torch.zeros((p, k_hidden), dtype=torch.float32, device=x.device)
    s2, s2e, _ = scale2_strides(w2.weight_scale_2, False)
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
