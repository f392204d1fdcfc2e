"""Fused MoE with NVFP4 experts (shapes: ``reference``): the gemv path (``moe_gemv``) up to
``MOE_GEMV_MAX_M`` tokens, else the sorted path: :func:`moe_align` sorts the pairs into slots of
``BM`` rows of one expert on the device (no sync), then a w13 + SiLU and a w2 launch.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from mla_spec.device import triton_interpreting, use_triton
from mla_spec.kernels.nvfp4.configs import MoeGemvConfig, NVFP4MmaConfig
from mla_spec.kernels.nvfp4.gemm import _decode, mma_block_m, ptx_decoder_ok, sum_rows
from mla_spec.kernels.nvfp4.moe_gemv import moe_gemv
from mla_spec.kernels.nvfp4.reference import check_moe, fused_moe_ref
from mla_spec.quant.nvfp4 import NVFP4Tensor

__all__ = ["fused_moe_nvfp4", "MOE_GEMV_MAX_M", "MOE_SORTED_CONFIG", "moe_align", "moe_sorted",
           "scale2_strides"]

#: Tokens up to which ``path="auto"`` takes the gemv path.
MOE_GEMV_MAX_M = 4
#: Tiles of the sorted path (``block_m`` 0: by the mean rows per active expert).
MOE_SORTED_CONFIG = NVFP4MmaConfig(block_m=0, block_n=64, block_k=128, num_warps=4, num_stages=3)


def fused_moe_nvfp4(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                    w13: NVFP4Tensor, w2: NVFP4Tensor, path: str = "auto",
                    gemv_config: MoeGemvConfig | None = None,
                    sorted_config: NVFP4MmaConfig | None = None) -> torch.Tensor:
    """Routed experts -> ``[M, K]`` in x's dtype; ``path``: "gemv", "sorted" or "auto"."""
    if path not in ("auto", "gemv", "sorted"):
        raise ValueError(f"path must be 'auto', 'gemv' or 'sorted', got {path!r}")
    scfg = sorted_config or MOE_SORTED_CONFIG
    if scfg.split_k != 1 or scfg.block_n < 16 or scfg.block_k < 32:
        raise ValueError(f"sorted_config needs split_k = 1, block_n >= 16, block_k >= 32: {scfg}")
    e, inter = check_moe(x, topk_ids, topk_weights, w13, w2)
    if not use_triton(x):
        return fused_moe_ref(x, topk_ids, topk_weights, w13, w2)
    m, k_hidden = x.shape
    out = torch.empty((m, k_hidden), dtype=x.dtype, device=x.device)
    if m * topk_ids.shape[1] == 0:
        return out
    interp = triton_interpreting()
    act_dtype = torch.float32 if x.dtype == torch.float32 else torch.bfloat16
    if path == "gemv" or (path == "auto" and m <= MOE_GEMV_MAX_M):
        x2 = x if x.stride(-1) == 1 else x.contiguous()
        return moe_gemv(x2, topk_ids.reshape(-1).to(torch.int32),
                        topk_weights.reshape(-1).float().contiguous(), w13, w2,
                        scale2_strides(w13.weight_scale_2, True),
                        scale2_strides(w2.weight_scale_2, False), act_dtype,
                        gemv_config or MoeGemvConfig(), fast=not interp)
    moe_sorted(x, topk_ids, topk_weights, w13, w2, out, e, inter, act_dtype, scfg, interp)
    return out


def moe_align(topk_ids: torch.Tensor, num_experts: int, block_m: int
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """``sorted_ids [S * block_m]`` (pair, ``P``: padding) and ``slot_expert [S]`` (-1: unused)."""
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
    """A slot's row offsets, pair ids, real-pair mask and activation rows."""
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
                   offs_r, GATED: tl.constexpr):
    """Scales; w13: ``SiLU(gate) * up``; w2: routing weights. Returns the result and its rows."""
    acc = acc * (tl.load(ws2_ptr + e64 * stride_s2e) * 256.0)
    if GATED:
        acc_up = acc_up * (tl.load(ws2_ptr + e64 * stride_s2e + stride_s2h) * 256.0)
        acc = acc / (1.0 + tl.exp(-acc)) * acc_up
        rows = offs_r.to(tl.int64)
    else:
        tw = tl.load(topk_w_ptr + pair, mask=r_ok, other=0.0)
        acc = acc * tw[:, None]
        rows = pair.to(tl.int64)
    return acc, rows


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
    """w13 (GATED) or w2 for a slot and column tile (one expert's slots are adjacent ids)."""
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
                               pair, r_ok, offs_r, GATED)
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
               act_dtype: torch.dtype, cfg: NVFP4MmaConfig, interp: bool) -> None:
    """The sorted path into ``out [M, K]`` (arguments checked by ``fused_moe_nvfp4``)."""
    m, k_hidden = x.shape
    topk = topk_ids.shape[1]
    p = m * topk
    mean_rows = triton.cdiv(p, min(e, p))  # rows per active expert, at most
    bm = cfg.block_m or mma_block_m(mean_rows)
    sorted_ids, slot_expert = moe_align(topk_ids, e, bm)
    n_slots = slot_expert.numel()
    dot_f32 = interp or x.dtype != torch.bfloat16  # fp16 / fp32 x: exact-ish fp32 (tf32) dot
    fast = ptx_decoder_ok(x.device, interp)
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
    for args, n_out, k_in, gated in ((a13, inter, k_hidden, True), (a2, k_hidden, inter, False)):
        bk = min(cfg.block_k, triton.next_power_of_2(k_in))
        _moe_mma_kernel[(n_slots, triton.cdiv(n_out, cfg.block_n))](
            *args, GATED=gated, BM=bm, BN=cfg.block_n, BK=bk, DOT_F32=dot_f32, FAST=fast,
            EVEN_K=k_in % bk == 0, num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    sum_rows(pairs.view(m, topk, k_hidden), out)
