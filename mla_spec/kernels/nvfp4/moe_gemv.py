"""Fused MoE at up to 4 tokens without sorting or host sync. w13 + SiLU, grid ``(I / BN, S, P)``:
the last K split to arrive writes ``act[p] = SiLU(gate) * up`` (ids outside ``[0, E)``: return).
w2: bf16 activations take :func:`moe_w2_loop`, fp32 ones a grid ``(K / BN, topk, M)`` whose last
program of a tile sums the slots in order.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from mla_spec.kernels.launch.pdl import gdc_enter, pdl_kwargs
from mla_spec.kernels.nvfp4.configs import MoeGemvConfig
from mla_spec.kernels.nvfp4.gemv import block_dot16, dot_unit, gemv_counters, packed_ok, split_k_for
from mla_spec.kernels.nvfp4.gemv_packed import (
    PACKED_UNIT,
    dot16_packed,
    load_xw,
    packed_prefetch_loop,
    x_pairs,
)

__all__ = ["W2_LOOP_PDL_MIN_M", "moe_gemv", "moe_w2_loop"]

#: The w2 loop launch uses PDL from this many tokens on (faster below without; 2026-11-30,
#: ``python3 benchmarks/bench_floors.py --moe-pdl``). Read at every launch.
W2_LOOP_PDL_MIN_M = 2


@triton.jit(do_not_specialize=["R"])  # token x top-k rows follow the batch
def _moe_gemv_kernel(
    x_ptr, w_ptr, ws_ptr, ws2_ptr, out_ptr, part_ptr, cnt_ptr, ids_ptr, tw_ptr,
    N, KB, E, TOPK, R, SPLIT,
    stride_xm, stride_we, stride_wn, stride_se, stride_sn, stride_s2e, stride_s2h, stride_om,
    GATED: tl.constexpr, BN: tl.constexpr, G: tl.constexpr, SPLIT_K: tl.constexpr,
    EVEN: tl.constexpr, FAST: tl.constexpr, PACKED: tl.constexpr, USE_GDC: tl.constexpr,
):
    """GATED: the w13 launch, else the per-slot w2 launch; ``PACKED``: packed-fp16 math."""
    gdc_enter(USE_GDC)
    pid_n = tl.program_id(0)
    pid_s = tl.program_id(1)
    pid_r = tl.program_id(2)  # pair (GATED) or token
    if GATED:
        pair = pid_r
        xrow = pair // TOPK
    else:
        pair = pid_r * TOPK + pid_s
        xrow = pair
    expert = tl.load(ids_ptr + pair).to(tl.int32)
    valid = (expert >= 0) & (expert < E)
    if GATED:
        if not valid:
            return
    e64 = tl.where(valid, expert, 0).to(tl.int64)
    offs_n = pid_n * BN + tl.arange(0, BN)
    offs_g = tl.arange(0, G)
    rows = tl.minimum(offs_n, N - 1).to(tl.int64)
    wrow = w_ptr + e64 * stride_we + rows[:, None] * stride_wn + offs_g[None, :]
    srow = ws_ptr + e64 * stride_se + rows[:, None] * stride_sn + offs_g[None, :]
    if PACKED:  # int64 words of 4 bf16
        xb = x_ptr + xrow.to(tl.int64) * stride_xm + (4 * offs_g)[None, :]
    else:
        xb = x_ptr + xrow.to(tl.int64) * stride_xm + (16 * offs_g)[None, :]
    n_it = tl.cdiv(KB, G)
    if GATED:
        per = tl.cdiv(n_it, SPLIT)
        it0 = pid_s * per
        it1 = tl.minimum(it0 + per, n_it)
    else:
        it0 = 0
        it1 = tl.where(valid, n_it, 0)
    acc = tl.zeros((BN, G), dtype=tl.float32)
    acc_u = tl.zeros((BN, G), dtype=tl.float32)
    if PACKED:
        acc, acc_u = packed_prefetch_loop(wrow, srow, xb, N * stride_wn, N * stride_sn, it0,
                                          it1, KB, offs_g[None, :], acc, acc_u, GATED, G, FAST)
    else:
        for it in range(it0, it1):
            b = it * G
            if EVEN:
                wq = tl.load(wrow + b)
                sc = tl.load(srow + b).to(tl.float32)
                acc += block_dot16(wq, xb + b * 16, None, False, FAST) * sc
                if GATED:
                    wq = tl.load(wrow + N * stride_wn + b)
                    sc = tl.load(srow + N * stride_sn + b).to(tl.float32)
                    acc_u += block_dot16(wq, xb + b * 16, None, False, FAST) * sc
            else:
                ok = (b + offs_g < KB)[None, :]
                wq = tl.load(wrow + b, mask=ok, other=0)
                sc = tl.load(srow + b, mask=ok, other=0.0).to(tl.float32)
                acc += block_dot16(wq, xb + b * 16, ok, True, FAST) * sc
                if GATED:
                    wq = tl.load(wrow + N * stride_wn + b, mask=ok, other=0)
                    sc = tl.load(srow + N * stride_sn + b, mask=ok, other=0.0).to(tl.float32)
                    acc_u += block_dot16(wq, xb + b * 16, ok, True, FAST) * sc
    s2 = ws2_ptr + e64 * stride_s2e
    res = tl.sum(acc, axis=1) * (tl.load(s2) * dot_unit(PACKED))
    if GATED:
        res_u = tl.sum(acc_u, axis=1) * (tl.load(s2 + stride_s2h) * dot_unit(PACKED))
        prow = 2 * N
    else:
        res = res * tl.load(tw_ptr + pair).to(tl.float32)
        res_u = res
        prow = N
    n_ok = offs_n < N
    optr = out_ptr + pid_r.to(tl.int64) * stride_om + offs_n
    if not SPLIT_K:
        if GATED:
            res = res / (1.0 + tl.exp(-res)) * res_u
        tl.store(optr, res.to(out_ptr.dtype.element_ty), mask=n_ok)
    else:
        pp = part_ptr + pid_r.to(tl.int64) * prow + offs_n
        tl.store(pp + pid_s * R * prow, res, mask=n_ok)
        if GATED:
            tl.store(pp + pid_s * R * prow + N, res_u, mask=n_ok)
        tl.debug_barrier()
        tile = pid_r * tl.num_programs(0) + pid_n
        done = tl.atomic_add(cnt_ptr + tile, 1, sem="acq_rel")
        if done == SPLIT - 1:
            tot = tl.zeros((BN,), dtype=tl.float32)
            tot_u = tl.zeros((BN,), dtype=tl.float32)
            for s in range(0, SPLIT):
                tot += tl.load(pp + s * R * prow, mask=n_ok, other=0.0, cache_modifier=".cg")
                if GATED:
                    tot_u += tl.load(pp + s * R * prow + N, mask=n_ok, other=0.0,
                                     cache_modifier=".cg")
            if GATED:
                tot = tot / (1.0 + tl.exp(-tot)) * tot_u
            tl.store(optr, tot.to(out_ptr.dtype.element_ty), mask=n_ok)
            tl.atomic_xchg(cnt_ptr + tile, 0)


@triton.jit
def _slot_step(it, n_it, tok, TOPK, KB, E, ids_ptr, tw_ptr, w_ptr, ws_ptr, ws2_ptr, a_ptr,
               rows, offs_g, stride_we, stride_wn, stride_se, stride_sn, stride_s2e, stride_am,
               G: tl.constexpr):
    """Iteration ``it`` = (slot, K step): weight words, scaled block scales, x pointers, mask."""
    j = it // n_it
    b = (it - j * n_it) * G
    pair = tok * TOPK + tl.minimum(j, TOPK - 1)
    e = tl.load(ids_ptr + pair, cache_modifier=".cg").to(tl.int32)
    valid = (j < TOPK) & (e >= 0) & (e < E)
    e64 = tl.where(valid, e, 0).to(tl.int64)
    coef = tl.load(ws2_ptr + e64 * stride_s2e) * tl.load(tw_ptr + pair, cache_modifier=".cg")
    coef = tl.where(valid, coef.to(tl.float32), 0.0)
    ok = (b + offs_g < tl.where(valid, KB, 0))[None, :]
    wq = tl.load(w_ptr + e64 * stride_we + rows[:, None] * stride_wn + b + offs_g[None, :],
                 mask=ok, other=0)
    sc = tl.load(ws_ptr + e64 * stride_se + rows[:, None] * stride_sn + b + offs_g[None, :],
                 mask=ok, other=0.0).to(tl.float32) * coef
    xb = a_ptr + pair.to(tl.int64) * stride_am + (4 * offs_g)[None, :]
    return wq, sc, xb, b, ok


@triton.jit(do_not_specialize=["TOPK"])
def _moe_w2_loop_kernel(a_ptr, w_ptr, ws_ptr, ws2_ptr, out_ptr, ids_ptr, tw_ptr,
                        N, KB, E, TOPK, stride_am, stride_we, stride_wn, stride_se, stride_sn,
                        stride_s2e, stride_om,
                        BN: tl.constexpr, G: tl.constexpr, FAST: tl.constexpr,
                        USE_GDC: tl.constexpr):
    pid_n = tl.program_id(0)
    tok = tl.program_id(1)
    offs_n = pid_n * BN + tl.arange(0, BN)
    offs_g = tl.arange(0, G)
    rows = tl.minimum(offs_n, N - 1).to(tl.int64)
    n_it = tl.cdiv(KB, G)
    total = TOPK * n_it
    wq, sc, xb, b, ok = _slot_step(0, n_it, tok, TOPK, KB, E, ids_ptr, tw_ptr, w_ptr, ws_ptr,
                                   ws2_ptr, a_ptr, rows, offs_g, stride_we, stride_wn,
                                   stride_se, stride_sn, stride_s2e, stride_am, G)
    gdc_enter(USE_GDC)
    xa, xb_, xc, xd = load_xw(xb, b, ok)
    acc = tl.zeros((BN, G), dtype=tl.float32)
    for it in range(0, total):
        nwq, nsc, nxb, nb, nok = _slot_step(it + 1, n_it, tok, TOPK, KB, E, ids_ptr, tw_ptr,
                                            w_ptr, ws_ptr, ws2_ptr, a_ptr, rows, offs_g,
                                            stride_we, stride_wn, stride_se, stride_sn,
                                            stride_s2e, stride_am, G)
        nxa, nxb_, nxc, nxd = load_xw(nxb, nb, nok)
        acc += dot16_packed(wq, x_pairs(xa, xb_, xc, xd, FAST), FAST) * sc
        wq, sc, xa, xb_, xc, xd = nwq, nsc, nxa, nxb_, nxc, nxd
    res = tl.sum(acc, axis=1) * PACKED_UNIT
    tl.store(out_ptr + tok.to(tl.int64) * stride_om + offs_n,
             res.to(out_ptr.dtype.element_ty), mask=offs_n < N)


def moe_w2_loop(act: torch.Tensor, ids: torch.Tensor, tw: torch.Tensor, w64: torch.Tensor,
                w_scale: torch.Tensor, s2: torch.Tensor, s2_stride: int, out: torch.Tensor,
                block_n: int, num_warps: int, g: int, fast: bool) -> None:
    """``out [M, K] = sum_j tw[:, j] * act[:, j] @ W2[ids[:, j]]^T`` for bf16 ``act``."""
    m, k = out.shape
    a64 = act.view(torch.int64)
    _moe_w2_loop_kernel[(triton.cdiv(k, block_n), m)](
        a64, w64, w_scale, s2, out, ids, tw,
        k, w64.shape[-1], w64.shape[0], ids.numel() // max(m, 1), a64.stride(0), w64.stride(0),
        w64.stride(1), w_scale.stride(0), w_scale.stride(1), s2_stride,
        out.stride(0), BN=block_n, G=g, FAST=fast, num_warps=num_warps,
        **pdl_kwargs(act, m >= W2_LOOP_PDL_MIN_M))


def _w64(w: torch.Tensor) -> torch.Tensor:
    """uint8 ``[E, N, K/2]`` viewed as int64 words ``[E, N, K/16]`` (one per 16-block)."""
    return (w if w.is_contiguous() else w.contiguous()).view(torch.int64)


def moe_gemv(x: torch.Tensor, ids: torch.Tensor, tw: torch.Tensor, w13, w2,
             s13: tuple[torch.Tensor, int, int], s2: tuple[torch.Tensor, int, int],
             act_dtype: torch.dtype, cfg: MoeGemvConfig, fast: bool) -> torch.Tensor:
    """Routed experts without sorting; ``s13`` / ``s2``: (scale_2, per-expert stride, up stride)."""
    m, k = x.shape
    p = ids.numel()
    topk = p // m
    e, two_i, _ = w13.weight.shape
    inter = two_i // 2
    dev = x.device
    out = torch.empty((m, k), dtype=x.dtype, device=dev)
    act = torch.empty((p, inter), dtype=act_dtype, device=dev)
    w13w, w2w = _w64(w13.weight), _w64(w2.weight)
    kb13, kb2, g = k // 16, inter // 16, cfg.groups
    bn13 = min(cfg.block_n, triton.next_power_of_2(inter))
    tiles13 = triton.cdiv(inter, bn13)
    split13 = cfg.split_k or split_k_for(tiles13 * p, triton.cdiv(kb13, g), 8)
    part13 = torch.empty((split13, p, 2 * inter) if split13 > 1 else (1,), dtype=torch.float32,
                         device=dev)
    cnt = gemv_counters(dev, max(tiles13 * p, triton.cdiv(k, cfg.block_n) * m))
    pk13 = packed_ok(x, fast)
    x13 = x.view(torch.int64) if pk13 else x
    _moe_gemv_kernel[(tiles13, split13, p)](
        x13, w13w, w13.weight_scale, s13[0], act, part13, cnt, ids, tw,
        inter, kb13, e, topk, p, split13, x13.stride(0), w13w.stride(0), w13w.stride(1),
        w13.weight_scale.stride(0), w13.weight_scale.stride(1), s13[1], s13[2], act.stride(0),
        GATED=True, BN=bn13, G=g, SPLIT_K=split13 > 1, EVEN=kb13 % g == 0, FAST=fast,
        PACKED=pk13, num_warps=cfg.num_warps, **pdl_kwargs(x))
    if packed_ok(act, fast):
        moe_w2_loop(act, ids, tw, w2w, w2.weight_scale, s2[0], s2[1], out, cfg.block_n2,
                    cfg.num_warps2, cfg.groups2, fast)
        return out
    part2 = torch.empty((topk, m, k) if topk > 1 else (1,), dtype=torch.float32, device=dev)
    _moe_gemv_kernel[(triton.cdiv(k, cfg.block_n), topk, m)](
        act, w2w, w2.weight_scale, s2[0], out, part2, cnt, ids, tw,
        k, kb2, e, topk, m, topk, act.stride(0), w2w.stride(0), w2w.stride(1),
        w2.weight_scale.stride(0), w2.weight_scale.stride(1), s2[1], 0, out.stride(0),
        GATED=False, BN=cfg.block_n, G=g, SPLIT_K=topk > 1, EVEN=kb2 % g == 0, FAST=fast,
        PACKED=False, num_warps=cfg.num_warps, **pdl_kwargs(x))
    return out
