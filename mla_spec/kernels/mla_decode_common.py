"""Per-program setup shared by the split-KV MLA decode kernels (generic, paged, V-split).

Every MLA decode kernel (``mla_decode``, ``mla_decode_paged``, ``mla_decode_vsplit``) runs one
program per (request ``b``, row block ``pid_m``, KV split ``sid``). A program owns ``BLOCK_M``
*flattened* query rows ``r = i * H + h`` of request ``b`` (token ``i`` of its ``q_len``, head
``h``) and the KV positions of split ``sid``; row ``r`` sees positions ``j < kv_len - q_len + i +
1`` (causal, end-aligned). The three helpers below compute that setup in the order the kernels
use it, so the kernels differ only in how they load and multiply tiles:

1. :func:`request_rows` (before the ``m0 < n_rows`` early-out): where the request's query rows
   start (``qo_indptr[b]`` when ``RAGGED``, else ``b * q_len_fixed``), ``q_len``, ``kv_len``,
   ``n_rows = q_len * H`` and the block's first row ``m0``.
2. :func:`block_rows`: the request's pool index and, per row of the block, its flattened index
   ``offs_m [BLOCK_M]``, mask, token and head (int64, for pointer arithmetic).
3. :func:`split_window`: the per-row causal bound ``bound [BLOCK_M]`` and the KV range
   ``[lo, hi)`` of split ``sid``: splits are ``BLOCK_N``-aligned chunks of ``cdiv(kv_len,
   num_splits)`` positions, cut at the last row's causal bound.

Two more serve the page-granular kernels (``mla_decode_paged``, ``mla_decode_swapab``):
:func:`kv_descriptors` (the TMA boxes), :func:`load_kv_tile` (one page-contiguous KV tile,
by TMA or pointer loads, converted for the dots) and :func:`fp16_prescaled` (the FP8 path's
exact power-of-two query scaling). :func:`online_softmax` is the log2-domain softmax update of
every row-major kernel (generic, paged, V-split); the swap-AB kernel reduces over the other axis.

They are ``@triton.jit`` functions returning tuples; Triton inlines them, so the kernels compile
to the same instructions as with the code written out (checked on sm_90 with Triton 3.6: same
PTX, same ``ptxas`` registers / spills, see ``mla_decode_sm90``). One exception:
``mla_decode_paged`` writes :func:`split_window` out, because the debug labels of the inlined
range move ptxas' spills of one variant by a few bytes (NOTE there). Constexpr flags are passed
through as ``tl.constexpr``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from mla_spec.kernels.launch.pdl import l2pf_on, pdl_kwargs, prefetch_l2

__all__ = ["attn_pdl_kwargs", "block_rows", "prefetch_kv_tiles", "request_rows", "split_range",
           "split_window", "check_mla_inputs", "kv_descriptors", "load_kv_tile", "fp16_prescaled",
           "online_softmax"]

Q_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
KV_DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.float8_e4m3fn)


def _names(dtypes) -> str:
    return ", ".join(str(d).replace("torch.", "") for d in dtypes)


def check_mla_inputs(q_nope, q_pe, kv_flat, req_to_token, req_pool_indices, kv_lens,
                     qo_indptr=None) -> None:
    """Host-side checks shared by the MLA decode launchers (shapes, dtypes, devices; no sync).

    Raises ValueError saying what is supported.
    """
    if q_nope.dim() != 3 or q_pe.dim() != 3 or q_pe.shape[:2] != q_nope.shape[:2]:
        raise ValueError(f"q_nope {tuple(q_nope.shape)} / q_pe {tuple(q_pe.shape)}: expected "
                         "[N, H, Dv] / [N, H, Dpe] with the same N and H")
    if q_nope.dtype not in Q_DTYPES or q_pe.dtype != q_nope.dtype:
        raise ValueError(f"q_nope {q_nope.dtype} / q_pe {q_pe.dtype}: queries must share one "
                         f"dtype among {_names(Q_DTYPES)}")
    if kv_flat.dim() != 2 or kv_flat.dtype not in KV_DTYPES:
        raise ValueError(f"kv_flat {tuple(kv_flat.shape)} {kv_flat.dtype}: expected "
                         f"[num_slots, Dv + Dpe] in one of {_names(KV_DTYPES)}")
    if req_to_token.dim() != 2 or req_to_token.is_floating_point():
        raise ValueError(f"req_to_token must be an integer [max_reqs, max_ctx] table, got "
                         f"{tuple(req_to_token.shape)} {req_to_token.dtype}")
    bs = req_pool_indices.numel()
    if kv_lens.numel() != bs:
        raise ValueError(f"kv_lens has {kv_lens.numel()} entries; req_pool_indices has bs = {bs}")
    if qo_indptr is not None and qo_indptr.numel() != bs + 1:
        raise ValueError(f"qo_indptr has {qo_indptr.numel()} entries; expected bs + 1 = {bs + 1}")
    dev = q_nope.device
    named = (("q_pe", q_pe), ("kv_flat", kv_flat), ("req_to_token", req_to_token),
             ("req_pool_indices", req_pool_indices), ("kv_lens", kv_lens),
             ("qo_indptr", qo_indptr))
    for nm, t in named:
        if t is not None and not (t.device.type == dev.type and t.device.index == dev.index):
            raise ValueError(f"{nm} is on {t.device}, q_nope on {dev}: all inputs must be on "
                             "one device")
    if bs and not kv_lens.is_cuda and int(kv_lens.max()) > req_to_token.shape[1]:
        raise ValueError(f"kv_lens max {int(kv_lens.max())} > req_to_token width "
                         f"{req_to_token.shape[1]} (max_context_len)")


@triton.jit
def request_rows(QO, KVL, b, pid_m, H, q_len_fixed, BLOCK_M: tl.constexpr,
                 RAGGED: tl.constexpr):
    """``(qo_start, q_len, kv_len, n_rows, m0)`` of row block ``pid_m`` of request ``b``."""
    if RAGGED:
        qo_start = tl.load(QO + b)
        q_len = tl.load(QO + b + 1) - qo_start
    else:
        qo_start = b * q_len_fixed
        q_len = q_len_fixed
    kv_len = tl.load(KVL + b)
    n_rows = q_len * H
    m0 = pid_m * BLOCK_M
    return qo_start, q_len, kv_len, n_rows, m0


@triton.jit
def block_rows(RPI, b, m0, n_rows, qo_start, H, BLOCK_M: tl.constexpr):
    """``(req, offs_m, mask_m, tok, head)``: pool index of request ``b`` and its block's rows
    (``[BLOCK_M]`` flattened row, in-range mask, int64 token and head)."""
    req = tl.load(RPI + b).to(tl.int64)
    offs_m = m0 + tl.arange(0, BLOCK_M)
    mask_m = offs_m < n_rows
    tok = (qo_start + offs_m // H).to(tl.int64)
    head = (offs_m % H).to(tl.int64)
    return req, offs_m, mask_m, tok, head


@triton.jit
def split_range(kv_len, q_len, m0, n_rows, H, sid, num_splits, BLOCK_M: tl.constexpr,
                BLOCK_N: tl.constexpr):
    """``(lo, hi)``: the KV positions split ``sid`` of the row block at ``m0`` covers, empty
    when ``lo >= hi`` (no row of the block sees past ``hi``)."""
    last_row = tl.minimum(m0 + BLOCK_M, n_rows) - 1
    hi_rows = kv_len - q_len + last_row // H + 1
    chunk = tl.cdiv(tl.cdiv(kv_len, num_splits), BLOCK_N) * BLOCK_N
    lo = sid * chunk
    hi = tl.minimum(tl.minimum(lo + chunk, kv_len), hi_rows)
    return lo, hi


@triton.jit
def split_window(kv_len, q_len, offs_m, m0, n_rows, H, sid, num_splits,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """``(bound, lo, hi)``: row ``offs_m`` sees ``j < bound`` (``[BLOCK_M]``); split ``sid``
    covers ``[lo, hi)`` (:func:`split_range`)."""
    bound = kv_len - q_len + offs_m // H + 1
    lo, hi = split_range(kv_len, q_len, m0, n_rows, H, sid, num_splits, BLOCK_M, BLOCK_N)
    return bound, lo, hi


def attn_pdl_kwargs(q: torch.Tensor, cfg) -> dict:
    """Launch keywords of a split kernel: ``USE_GDC`` / ``launch_pdl`` (off for a variant with
    ``cfg.pdl`` False) and ``L2PF``, the KV prefetch before the wait, which only runs under PDL
    (``pdl`` rules 4 and 5)."""
    kw = pdl_kwargs(q, cfg.pdl)
    return {**kw, "L2PF": kw["USE_GDC"] and l2pf_on(q)}


@triton.jit
def prefetch_kv_tiles(KV, R2T, RPI, KVL, QO, b, pid_m, sid, H, q_len_fixed, num_splits,
                      stride_r2t, num_slots, DK: tl.constexpr, BLOCK_M: tl.constexpr,
                      BLOCK_N: tl.constexpr, RAGGED: tl.constexpr, TILES: tl.constexpr):
    """L2 prefetch of the first ``TILES`` KV tiles of this program's split window, issued
    before the PDL wait (``pdl`` rule 4) so that the tiles stream in while the previous kernel
    (typically the KV store of this step's rows) finishes. Everything read here is only used
    for prefetch addresses: the kernel recomputes its window after the wait, and the slot is
    clamped into the cache, so stale metadata could cost a wasted prefetch, never a result."""
    qo_start, q_len, kv_len, n_rows, m0 = request_rows(QO, KVL, b, pid_m, H, q_len_fixed,
                                                       BLOCK_M, RAGGED)
    if m0 < n_rows:
        req = tl.load(RPI + b).to(tl.int64)
        lo, hi = split_range(kv_len, q_len, m0, n_rows, H, sid, num_splits, BLOCK_M, BLOCK_N)
        ROW: tl.constexpr = DK * (KV.dtype.element_ty.primitive_bitwidth // 8)
        offs = tl.arange(0, 1024) * 128  # bytes; 1024 lines = the largest tile (bf16, 64 rows)
        for t in tl.static_range(TILES):
            start = lo + t * BLOCK_N
            if start < hi:
                slot0 = tl.load(R2T + req * stride_r2t + start)
                slot0 = tl.maximum(tl.minimum(slot0, num_slots - 1), 0).to(tl.int64)
                rows = tl.minimum(tl.minimum(hi - start, BLOCK_N), num_slots - slot0)
                base = (KV + slot0 * DK).to(tl.pointer_type(tl.int8))
                prefetch_l2(base + offs, offs < rows * ROW)


@triton.jit
def kv_descriptors(KV, num_slots, DK: tl.constexpr, DH: tl.constexpr, DPE: tl.constexpr,
                   BLOCK_N: tl.constexpr, TMA: tl.constexpr):
    """``(dsc_v, dsc_p)``: TMA descriptors of the ``[BLOCK_N, Dv/2]`` and ``[BLOCK_N, Dpe]``
    boxes of the flat cache ``[num_slots, DK]`` (``KV`` itself twice when not ``TMA``)."""
    if TMA:
        dsc_v = tl.make_tensor_descriptor(KV, shape=[num_slots, DK], strides=[DK, 1],
                                          block_shape=[BLOCK_N, DH])
        dsc_p = tl.make_tensor_descriptor(KV, shape=[num_slots, DK], strides=[DK, 1],
                                          block_shape=[BLOCK_N, DPE])
        return dsc_v, dsc_p
    else:
        return KV, KV


@triton.jit
def load_kv_tile(KV, dsc_v, dsc_p, slot0, start, hi, offs_r, offs_h, offs_p,
                 DH: tl.constexpr, DV: tl.constexpr, DK: tl.constexpr, TMA: tl.constexpr,
                 F16: tl.constexpr, DOT_F32: tl.constexpr):
    """``(k0, k1, kp)`` ``[BLOCK_N, Dv/2]`` x 2 and ``[BLOCK_N, Dpe]``: the tile of ``BLOCK_N``
    contiguous slots from ``slot0`` (one page), rows at or past ``hi`` zeroed on the pointer
    path; converted for the dots (fp16 for an e4m3 cache, fp32 under the interpreter)."""
    if TMA:
        k0 = dsc_v.load([slot0, 0])
        k1 = dsc_v.load([slot0, DH])
        kp = dsc_p.load([slot0, DV])
    else:
        kptr = KV + (slot0.to(tl.int64) + offs_r)[:, None] * DK
        mask_r = (start + offs_r) < hi
        k0 = tl.load(kptr + offs_h[None, :], mask=mask_r[:, None], other=0.0)
        k1 = tl.load(kptr + DH + offs_h[None, :], mask=mask_r[:, None], other=0.0)
        kp = tl.load(kptr + DV + offs_p[None, :], mask=mask_r[:, None], other=0.0)
    if F16:
        k0, k1, kp = k0.to(tl.float16), k1.to(tl.float16), kp.to(tl.float16)
    elif DOT_F32:
        k0, k1, kp = k0.to(tl.float32), k1.to(tl.float32), kp.to(tl.float32)
    return k0, k1, kp


@triton.jit
def fp16_prescaled(q0, q1, qp, row_scale):
    """FP8-KV path: the query tiles scaled by an exact power of two ``2**e`` that puts their
    ``max |q|`` in ``[2**13, 2**14]`` and cast to fp16 (no overflow; the only rounding is fp16's
    ``2**-11``), and ``row_scale * 2**-e`` so the scores come out unscaled."""
    q0f, q1f, qpf = q0.to(tl.float32), q1.to(tl.float32), qp.to(tl.float32)
    amax = tl.maximum(tl.maximum(tl.max(tl.max(tl.abs(q0f), 1), 0),
                                 tl.max(tl.max(tl.abs(q1f), 1), 0)),
                      tl.max(tl.max(tl.abs(qpf), 1), 0))
    e = tl.where(amax > 0, 14 - tl.ceil(tl.log2(tl.maximum(amax, 1e-30))), 0.0)
    e = tl.minimum(tl.maximum(e, -100.0), 100.0).to(tl.int32)
    pw = ((e + 127) << 23).to(tl.float32, bitcast=True)
    ipw = ((127 - e) << 23).to(tl.float32, bitcast=True)
    return ((q0f * pw).to(tl.float16), (q1f * pw).to(tl.float16), (qpf * pw).to(tl.float16),
            row_scale * ipw)


@triton.jit
def online_softmax(s, m_i, l_i):
    """One online-softmax step (log2 domain) over masked scores ``s [BLOCK_M, BLOCK_N]``
    (``-inf`` where invisible): ``(p, alpha, m_new, l_i)``, where ``alpha`` rescales the running
    accumulator and ``p`` the tile's unnormalized probabilities. A row with nothing visible yet
    keeps ``m = -inf`` and gets ``p = 0``, ``alpha = 1`` (never NaN)."""
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_use)
    p = tl.exp2(s - m_use[:, None])
    return p, alpha, m_new, l_i * alpha + tl.sum(p, 1)
