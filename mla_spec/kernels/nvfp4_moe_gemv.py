"""Fused MoE at decode batch sizes: one GEMV program per (token-expert pair, row block, K split).

With M <= 16 tokens x top-8, nearly every (token, expert) pair has its own expert, so sorting
pairs by expert (``moe_align``) buys nothing and costs launches. Two launches instead, no
routing work, no host sync (CUDA-graph safe):

1. **w13 + SiLU-and-multiply.** Grid ``(I / BN, S, P)``: program (n, s, p) reads expert
   ``e = topk_ids[p]``'s gate rows ``n*BN..`` and the matching up rows (``I + n*BN..``) over the
   s-th K range, against token ``p // topk``'s x. Split-K partials ``[S, P, 2, I]`` fp32 are
   reduced by the last program to arrive (per-tile counter, see ``nvfp4_gemv``), which writes
   ``act[p] = SiLU(gate) * up`` (bf16, fp32 for fp32 x). Pairs with an id outside ``[0, E)``
   (another EP rank) return at once.
2. **w2 + routing weights + sum over top-k.** Grid ``(K / BN, topk, M)``: the split index is
   the top-k slot j: program (n, j, t) computes ``topk_weights[t, j] * (act[t*topk+j] @ W2[e]^T)``
   for rows ``n*BN..`` (the whole I = K of W2 in one program); the last of the ``topk``
   programs of a tile sums them in slot order and writes ``out[t]``. By default
   (``MOE_W2_LOOP``, bf16 activations) the w2 launch is ``nvfp4_moe_w2``'s instead: one
   program per (row block, token) walks the top-k experts itself, no partials (H200: the MoE
   at 1 / 4 tokens 34.3 / 98.8 -> 32.3 / 77.2 µs).

The dot products are ``block_dot16`` of ``nvfp4_gemv`` (16 E2M1 per int64 word, fp32 FMA, block
scale per 16). Twin: ``fused_moe_ref`` in ``nvfp4_moe``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from mla_spec.kernels.nvfp4_gemv import (
    _counters,
    block_dot,
    block_x,
    dot_unit,
    packed_ok,
    split_k_for,
)
from mla_spec.kernels.nvfp4_gemv_packed import packed_prefetch_loop
from mla_spec.kernels.nvfp4_moe_w2 import moe_w2_loop
from mla_spec.kernels.launch.pdl import gdc_enter, pdl_kwargs

__all__ = ["moe_gemv", "moe_gemv_tiles", "MOE_GEMV_MAX_M", "MOE_GEMV_TILES", "MOE_GEMV_PACKED",
           "MOE_GEMV_PREFETCH", "MOE_W2_LOOP", "MOE_W2_LOOP_TILE"]

# Packed-fp16 dot products (nvfp4_gemv_packed) for bf16 activations: with the wide tiles below
# they won at 1 and 4 tokens on the H200 (fp32 math with the same tiles: slower, its x loads
# are per row). fp16 x and fp32 x keep the fp32 math.
MOE_GEMV_PACKED = True
# The packed K loop with register double buffering (dense gate/up GEMV at 1 token: 20.3 -> 15.2
# µs). In the MoE, H200: 1 token 34.8 -> 34.8, 2 tokens 58.2 -> 56.7, 4 tokens 101.0 -> 99.0.
MOE_GEMV_PREFETCH = True
# The w2 launch as one program per (row block, token) walking its top-k experts
# (``nvfp4_moe_w2``) instead of one per (row block, slot, token) summed through partials. H200,
# seventh session (benchmarks/sweep_gemv.py --moe --moe-w2-loop), µs per MoE call in a graph:
# 1 / 2 / 4 tokens 34.3 / 56.2 / 98.8 -> 32.3 / 44.5 / 77.2 with MOE_W2_LOOP_TILE; alone, the
# per-slot w2 launch read its 16.5 MB at 1.03 TB/s at 1 token (the w13 launch: 2.0 TB/s).
MOE_W2_LOOP = True
#: (block_n2, num_warps2, g2) of the loop launch: the sweep's best at 1, 2 and 4 tokens (8 rows
#: and one warp per program: 896 programs at 1 token; 4 rows within 3%, 16+ rows 1.2x slower)
MOE_W2_LOOP_TILE = (8, 1, 32)

# tokens; above, the sorted (moe_align) path reads each expert once. H200, 256 experts top-8:
# this path 58 / 208 / 1100 µs at M = 1 / 4 / 16 (1.86x / 2.0x / 1.27x the bf16 GEMMs); the
# first pass's sorted path took 257 / 462 / 1342 µs (docs/bench_nvfp4.md).
MOE_GEMV_MAX_M = 4  # H200: 123 µs at 4 tokens vs 203 for sorted "mmab", which is 2.6x faster at 16

# Tiles per token count (bucket: the smallest key >= M): (block_n, num_warps) of the w13 launch,
# (block_n2, num_warps2) of the w2 launch, g words per step. H200 sweeps (256 experts top-8,
# K 7168, I 512), µs per MoE call in a CUDA graph:
# - third session (benchmarks/sweep_moe_gemv.py, fp32 math, g 2-4: lanes across rows):
#   1 token 59.0 -> 40.8, 2 tokens 100.4 -> 69.6, 4 tokens 202.7 -> 123.1;
# - fourth session (benchmarks/sweep_gemv.py --moe, packed math, g 16: lanes along K, each warp
#   streaming 256 contiguous bytes of a row): 1 token 40.6 -> 34.7 (3.12x the bf16 cuBLAS
#   GEMMs), 4 tokens 123.5 -> 100.7 (4.14x); with double buffering (MOE_GEMV_PREFETCH) 1 / 2 / 4
#   tokens 34.8 / 56.7 / 99.0 (3.16x / 3.75x / 4.35x).
MOE_GEMV_TILES: dict[int, tuple[int, int, int, int, int]] = {
    1: (16, 4, 16, 4, 16),
    2: (16, 4, 16, 4, 16),
    4: (16, 4, 16, 4, 16),
}


def moe_gemv_tiles(m: int, block_n: int | None = None, num_warps: int | None = None,
                   block_n2: int | None = None, num_warps2: int | None = None,
                   g: int | None = None, w2_loop: bool = False,
                   g2: int | None = None) -> tuple[int, int, int, int, int, int]:
    """``(block_n, num_warps, block_n2, num_warps2, g, g2)`` for ``m`` tokens:
    ``MOE_GEMV_TILES`` (the smallest bucket >= m) with the given values over it, and for the
    w2 loop launch (``w2_loop``) ``MOE_W2_LOOP_TILE`` under the given w2 values. A ``block_n``
    / ``num_warps`` given without their w2 twins sets the per-slot w2 launch alike and ``g`` 2
    (the single-tile behaviour the sweeps compare against)."""
    t = next((MOE_GEMV_TILES[b] for b in sorted(MOE_GEMV_TILES) if m <= b),
             MOE_GEMV_TILES[max(MOE_GEMV_TILES)])
    if block_n is not None or num_warps is not None:
        bn, w = block_n or t[0], num_warps or t[1]
        t = (bn, w, bn, w, 2)
    g = t[4] if g is None else g
    if w2_loop:
        t = (t[0], t[1], *MOE_W2_LOOP_TILE[:2])
        g2 = MOE_W2_LOOP_TILE[2] if g2 is None else g2
    return (t[0], t[1], t[2] if block_n2 is None else block_n2,
            t[3] if num_warps2 is None else num_warps2, g, g if g2 is None else g2)


@triton.jit(do_not_specialize=["R"])  # token x top-k rows follow the batch
def _moe_gemv_kernel(
    x_ptr, w_ptr, ws_ptr, ws2_ptr, out_ptr, part_ptr, cnt_ptr, ids_ptr, tw_ptr,
    N, KB, E, TOPK, R, SPLIT,
    stride_xm, stride_we, stride_wn, stride_se, stride_sn, stride_s2e, stride_s2h, stride_om,
    GATED: tl.constexpr, BN: tl.constexpr, G: tl.constexpr, SPLIT_K: tl.constexpr,
    EVEN: tl.constexpr, FAST: tl.constexpr, PACKED: tl.constexpr, PREFETCH: tl.constexpr,
    USE_GDC: tl.constexpr,
):
    # The w2 launch (not GATED) reads its expert ids and first weights before waiting for the
    # previous grid: the ids come from the router, two launches back (``pdl`` rule 3).
    EARLY: tl.constexpr = USE_GDC and PREFETCH and not GATED
    if not EARLY:
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
    if EARLY:  # from L2: no SM's L1 may hold an earlier layer's ids
        expert = tl.load(ids_ptr + pair, cache_modifier=".cg").to(tl.int32)
    else:
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
    if PREFETCH:  # packed only
        acc, acc_u = packed_prefetch_loop(wrow, srow, xb, N * stride_wn, N * stride_sn, it0,
                                          it1, KB, offs_g[None, :], acc, acc_u, GATED, G, FAST,
                                          EARLY)
    else:
        for it in range(it0, it1):
            b = it * G
            if EVEN:
                xv = block_x(xb, b, None, False, PACKED, FAST)
                wq = tl.load(wrow + b)
                sc = tl.load(srow + b).to(tl.float32)
                acc += block_dot(wq, xv, None, False, PACKED, FAST) * sc
                if GATED:
                    wq = tl.load(wrow + N * stride_wn + b)
                    sc = tl.load(srow + N * stride_sn + b).to(tl.float32)
                    acc_u += block_dot(wq, xv, None, False, PACKED, FAST) * sc
            else:
                ok = (b + offs_g < KB)[None, :]
                xv = block_x(xb, b, ok, True, PACKED, FAST)
                wq = tl.load(wrow + b, mask=ok, other=0)
                sc = tl.load(srow + b, mask=ok, other=0.0).to(tl.float32)
                acc += block_dot(wq, xv, ok, True, PACKED, FAST) * sc
                if GATED:
                    wq = tl.load(wrow + N * stride_wn + b, mask=ok, other=0)
                    sc = tl.load(srow + N * stride_sn + b, mask=ok, other=0.0).to(tl.float32)
                    acc_u += block_dot(wq, xv, ok, True, PACKED, FAST) * sc
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


def _w64(w: torch.Tensor) -> torch.Tensor:
    """uint8 ``[E, N, K/2]`` viewed as int64 words ``[E, N, K/16]`` (one per 16-block)."""
    return (w if w.is_contiguous() else w.contiguous()).view(torch.int64)


def moe_gemv(x: torch.Tensor, ids: torch.Tensor, tw: torch.Tensor, w13, w2,
             s13: tuple[torch.Tensor, int, int], s2: tuple[torch.Tensor, int, int],
             act_dtype: torch.dtype, block_n: int = 128, split13: int | None = None,
             num_warps: int = 1, fast: bool = True, block_n2: int | None = None,
             num_warps2: int | None = None, g: int = 2, packed: bool | None = None,
             prefetch: bool | None = None, w2_loop: bool | None = None,
             g2: int | None = None) -> torch.Tensor:
    """Routed experts without sorting (see the module docstring). ``ids`` / ``tw`` flat
    ``[M * topk]`` int32 / fp32; ``s13`` / ``s2``: (scale_2, stride per expert, gate/up).

    ``block_n`` / ``num_warps``: rows and warps per program of the w13 launch; ``block_n2`` /
    ``num_warps2`` of the w2 launch (default: the same); ``g``: 16-element blocks (int64 words)
    per row per loop step, both launches; ``packed``: the packed-fp16 math of
    ``nvfp4_gemv_packed`` where ``packed_ok`` (None: ``MOE_GEMV_PACKED``); ``prefetch``: its
    double-buffered K loop (None: ``MOE_GEMV_PREFETCH``); ``w2_loop``: the w2 launch of
    ``nvfp4_moe_w2`` when the packed path can read the activations (None: ``MOE_W2_LOOP``),
    with ``g2`` words per step (default ``g``)."""
    block_n2 = block_n if block_n2 is None else block_n2
    num_warps2 = num_warps if num_warps2 is None else num_warps2
    m, k = x.shape
    p = ids.numel()
    topk = p // m
    e, two_i, _ = w13.weight.shape
    inter = two_i // 2
    dev = x.device
    out = torch.empty((m, k), dtype=x.dtype, device=dev)
    act = torch.empty((p, inter), dtype=act_dtype, device=dev)
    w13w, w2w = _w64(w13.weight), _w64(w2.weight)
    kb13, kb2 = k // 16, inter // 16
    bn13 = min(block_n, triton.next_power_of_2(inter))
    tiles13 = triton.cdiv(inter, bn13)
    if split13 is None:
        split13 = split_k_for(tiles13 * p, triton.cdiv(kb13, g), 8)
    part13 = torch.empty((split13, p, 2 * inter) if split13 > 1 else (1,), dtype=torch.float32,
                         device=dev)
    cnt = _counters(dev, max(tiles13 * p, triton.cdiv(k, block_n2) * m))
    packed = MOE_GEMV_PACKED if packed is None else packed
    prefetch = MOE_GEMV_PREFETCH if prefetch is None else prefetch
    pk13, pk2 = packed and packed_ok(x, fast), packed and packed_ok(act, fast)
    x13 = x.view(torch.int64) if pk13 else x
    a2 = act.view(torch.int64) if pk2 else act
    _moe_gemv_kernel[(tiles13, split13, p)](
        x13, w13w, w13.weight_scale, s13[0], act, part13, cnt, ids, tw,
        inter, kb13, e, topk, p, split13, x13.stride(0), w13w.stride(0), w13w.stride(1),
        w13.weight_scale.stride(0), w13.weight_scale.stride(1), s13[1], s13[2], act.stride(0),
        GATED=True, BN=bn13, G=g, SPLIT_K=split13 > 1, EVEN=kb13 % g == 0, FAST=fast,
        PACKED=pk13, PREFETCH=pk13 and prefetch, num_warps=num_warps,
        **pdl_kwargs(x))
    if (MOE_W2_LOOP if w2_loop is None else w2_loop) and pk2:
        moe_w2_loop(act, ids, tw, w2w, w2.weight_scale, s2[0], s2[1], out, block_n2,
                    num_warps2, g2 or g, fast)
        return out
    part2 = torch.empty((topk, m, k) if topk > 1 else (1,), dtype=torch.float32, device=dev)
    _moe_gemv_kernel[(triton.cdiv(k, block_n2), topk, m)](
        a2, w2w, w2.weight_scale, s2[0], out, part2, cnt, ids, tw,
        k, kb2, e, topk, m, topk, a2.stride(0), w2w.stride(0), w2w.stride(1),
        w2.weight_scale.stride(0), w2.weight_scale.stride(1), s2[1], 0, out.stride(0),
        GATED=False, BN=block_n2, G=g, SPLIT_K=topk > 1, EVEN=kb2 % g == 0, FAST=fast,
        PACKED=pk2, PREFETCH=pk2 and prefetch, num_warps=num_warps2,
        **pdl_kwargs(x))
    return out
