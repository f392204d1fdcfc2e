"""The MoE gemv path's w2 launch with the top-k sum inside each program ("w2 loop").

``nvfp4_moe_gemv``'s w2 launch gives each (row block, top-k slot, token) its own program: at 1
token and I = 512 (DeepSeek-V3 at TP 4) that is ``7168 / BN * 8`` programs of two K steps each,
whose fp32 partials the last of the ``topk`` programs of a tile sums after an atomic counter.
Here one program owns a row block of one token and walks its ``topk`` experts itself:

    out[t, rows] = sum_j topk_weights[t, j] * (act[t*topk + j] @ W2[ids[t*topk + j]][rows]^T)

as one flat loop over (slot, K step) with the next iteration's weights, block scales and x
words loaded before this one's math (register double buffering across the expert boundary), no
partials, no counters, the slots summed in order. The per-slot factor ``weight_scale_2[e] *
topk_weights[t, j]`` multiplies the block scales. Expert ids, routing weights and the first
weights are read before the PDL wait (``pdl`` rule 3: the router wrote them two launches back;
read through L2, ``.cg``), the activations after it. Ids outside ``[0, E)`` add nothing.

Packed-fp16 dot products only (``nvfp4_gemv_packed``: bf16 activations); the caller keeps the
per-slot launch otherwise. Twin: ``nvfp4_moe.fused_moe_ref`` (through ``fused_moe_nvfp4``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from mla_spec.kernels.nvfp4_gemv_packed import PACKED_UNIT, dot16_packed, load_xw, x_pairs
from mla_spec.kernels.launch.pdl import gdc_enter, pdl_kwargs

__all__ = ["W2_LOOP_PDL", "W2_LOOP_PDL_MIN_M", "moe_w2_loop"]

#: launch with PDL (read at every launch; ``benchmarks/bench_nvfp4.py --moe-pdl`` times the MoE
#: with it on and off) ...
W2_LOOP_PDL = True
#: ... from this many tokens on. The MoE in a graph chain, H200 (``--moe-pdl``, two sessions):
#: at 1 token the loop without PDL saves 1.8-2.8 µs (29.8 vs 31.6 µs, eighth session); at 2 / 4
#: tokens PDL saves 1.5-1.7 µs (44.2 vs 45.9, 77.2 vs 78.7)
W2_LOOP_PDL_MIN_M = 2


@triton.jit
def _slot_step(it, n_it, tok, TOPK, KB, E, ids_ptr, tw_ptr, w_ptr, ws_ptr, ws2_ptr, a_ptr,
               rows, offs_g, stride_we, stride_wn, stride_se, stride_sn, stride_s2e, stride_am,
               G: tl.constexpr):
    """Iteration ``it`` = (slot ``it // n_it``, K step): weight words, block scales times the
    slot factor, the x-word pointers and the block mask (all zero past the last slot)."""
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
    """``out [M, K] = sum_j tw[:, j] * act[:, j] @ W2[ids[:, j]]^T`` (module docstring).

    ``act`` ``[M * topk, I]`` bf16 (read as int64 words), ``ids`` / ``tw`` flat ``[M * topk]``
    int32 / fp32, ``w64`` the ``[E, K, I / 2]`` NVFP4 codes of W2 viewed as int64 words
    ``[E, K, I / 16]`` (``nvfp4_moe_gemv._w64``), ``w_scale`` its block scales, ``s2`` its
    ``weight_scale_2`` with ``s2_stride`` per expert; ``fast``: the PTX decoder (GPU), else the
    portable twin math."""
    m, k = out.shape
    a64 = act.view(torch.int64)
    _moe_w2_loop_kernel[(triton.cdiv(k, block_n), m)](
        a64, w64, w_scale, s2, out, ids, tw,
        k, w64.shape[-1], w64.shape[0], ids.numel() // max(m, 1), a64.stride(0), w64.stride(0),
        w64.stride(1), w_scale.stride(0), w_scale.stride(1), s2_stride,
        out.stride(0), BN=block_n, G=g, FAST=fast, num_warps=num_warps,
        **pdl_kwargs(act, W2_LOOP_PDL and m >= W2_LOOP_PDL_MIN_M))
