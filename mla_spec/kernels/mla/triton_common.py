"""Per-program setup of the Triton split-KV MLA kernels and the host-side input checks: a program
owns ``BLOCK_M`` flattened rows ``r = i * H + h`` of request ``b`` and KV split ``sid``.
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
    """Host-side checks (shapes, dtypes, devices; no sync): ValueError saying what is supported."""
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
    """``(req, offs_m, mask_m, tok, head)``: pool index; per row: index, mask, token, head."""
    req = tl.load(RPI + b).to(tl.int64)
    offs_m = m0 + tl.arange(0, BLOCK_M)
    mask_m = offs_m < n_rows
    tok = (qo_start + offs_m // H).to(tl.int64)
    head = (offs_m % H).to(tl.int64)
    return req, offs_m, mask_m, tok, head


@triton.jit
def split_range(kv_len, q_len, m0, n_rows, H, sid, num_splits, BLOCK_M: tl.constexpr,
                BLOCK_N: tl.constexpr):
    """``(lo, hi)`` of split ``sid``: ``BLOCK_N``-aligned chunks cut at the causal bound."""
    last_row = tl.minimum(m0 + BLOCK_M, n_rows) - 1
    hi_rows = kv_len - q_len + last_row // H + 1
    chunk = tl.cdiv(tl.cdiv(kv_len, num_splits), BLOCK_N) * BLOCK_N
    lo = sid * chunk
    hi = tl.minimum(tl.minimum(lo + chunk, kv_len), hi_rows)
    return lo, hi


@triton.jit
def split_window(kv_len, q_len, offs_m, m0, n_rows, H, sid, num_splits,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """``(bound, lo, hi)``: row ``offs_m`` sees ``j < bound``; split ``sid`` covers ``[lo, hi)``."""
    bound = kv_len - q_len + offs_m // H + 1
    lo, hi = split_range(kv_len, q_len, m0, n_rows, H, sid, num_splits, BLOCK_M, BLOCK_N)
    return bound, lo, hi


def attn_pdl_kwargs(q: torch.Tensor, cfg) -> dict:
    """``USE_GDC`` / ``launch_pdl`` (off with ``cfg.pdl`` False) and ``L2PF`` (under PDL only)."""
    kw = pdl_kwargs(q, cfg.pdl)
    return {**kw, "L2PF": kw["USE_GDC"] and l2pf_on(q)}


@triton.jit
def prefetch_kv_tiles(KV, R2T, RPI, KVL, QO, b, pid_m, sid, H, q_len_fixed, num_splits,
                      stride_r2t, num_slots, DK: tl.constexpr, BLOCK_M: tl.constexpr,
                      BLOCK_N: tl.constexpr, RAGGED: tl.constexpr, TILES: tl.constexpr):
    """L2 prefetch of the split's first ``TILES`` KV tiles before the PDL wait (``pdl`` rule 4)."""
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
    """TMA descriptors of the ``[BLOCK_N, Dv/2]`` and ``[BLOCK_N, Dpe]`` boxes (else ``KV``)."""
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
    """``(k0, k1, kp)``: the ``BLOCK_N`` slots from ``slot0`` (fp16 for e4m3, fp32 interpreted)."""
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
    """FP8 path: queries scaled by an exact power of two into ``[2**13, 2**14]``, cast to fp16."""
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
    """One log2-domain online-softmax step ``(p, alpha, m_new, l_i)``; no NaN for empty rows."""
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_use)
    p = tl.exp2(s - m_use[:, None])
    return p, alpha, m_new, l_i * alpha + tl.sum(p, 1)
