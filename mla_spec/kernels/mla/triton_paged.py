"""The paged Triton kernels (``C``, ``CF``, the fallback tiles; swap AB: ``S16``, ``S32w4``), same
result as ``mla_decode``: with ``page_size % BLOCK_N == 0`` a KV tile is ``BLOCK_N`` contiguous
rows of one page (three boxes ``Dv/2 | Dv/2 | Dpe``), found by one ``req_to_token`` read. Swap AB
puts the KV tile on the MMA's M side; FP8 KV: fp16 dots after an exact power-of-two query scale.
Rows past the split end are read but masked (finite: the pool is zeroed). Measurements:
docs/bench_mla.md.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from mla_spec.kernels.launch.pdl import gdc_launch, gdc_wait
from mla_spec.kernels.launch.triton_launcher import TritonLauncher
from mla_spec.kernels.mla.combine import SplitBuffers, combine_splits
from mla_spec.kernels.mla.triton_common import (
    attn_pdl_kwargs,
    block_rows,
    fp16_prescaled,
    kv_descriptors,
    load_kv_tile,
    online_softmax,
    prefetch_kv_tiles,
    request_rows,
    split_window,
)

__all__ = ["launch_paged"]


@triton.jit(do_not_specialize=["H", "q_len_fixed", "num_splits", "stride_r2t", "num_slots",
                               "stride_lse_s"])
def _mla_paged_kernel(
    Qn, Qp, KV, R2T, RPI, KVL, QO, Out, Lse,
    stride_qn_t, stride_qn_h, stride_qp_t, stride_qp_h, stride_r2t,
    stride_o_t, stride_o_h, stride_ps, stride_lse_s, num_slots,
    H, q_len_fixed, num_splits, qk_scale_log2, v_scale,
    DV: tl.constexpr, DPE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    RAGGED: tl.constexpr, SPLIT: tl.constexpr, WRITE_LSE: tl.constexpr,
    DOT_F32: tl.constexpr, F16: tl.constexpr, TMA: tl.constexpr, USE_GDC: tl.constexpr,
    L2PF: tl.constexpr,
):
    DH: tl.constexpr = DV // 2
    DK: tl.constexpr = DV + DPE
    pid_m = tl.program_id(0)
    sid = tl.program_id(1)
    b = tl.program_id(2)
    if L2PF:  # first KV tiles into L2 before the wait (pdl rule 4)
        prefetch_kv_tiles(KV, R2T, RPI, KVL, QO, b, pid_m, sid, H, q_len_fixed, num_splits,
                          stride_r2t, num_slots, DK, BLOCK_M, BLOCK_N, RAGGED, 2)
    gdc_wait(USE_GDC)
    qo_start, q_len, kv_len, n_rows, m0 = request_rows(QO, KVL, b, pid_m, H, q_len_fixed,
                                                       BLOCK_M, RAGGED)
    if m0 < n_rows:
        req, offs_m, mask_m, tok, head = block_rows(RPI, b, m0, n_rows, qo_start, H, BLOCK_M)
        offs_h = tl.arange(0, DH)
        offs_p = tl.arange(0, DPE)
        qrow = Qn + tok[:, None] * stride_qn_t + head[:, None] * stride_qn_h
        q0 = tl.load(qrow + offs_h[None, :], mask=mask_m[:, None], other=0.0)
        q1 = tl.load(qrow + DH + offs_h[None, :], mask=mask_m[:, None], other=0.0)
        qp = tl.load(Qp + tok[:, None] * stride_qp_t + head[:, None] * stride_qp_h
                     + offs_p[None, :], mask=mask_m[:, None], other=0.0)
        row_scale = qk_scale_log2
        if F16:
            q0, q1, qp, row_scale = fp16_prescaled(q0, q1, qp, row_scale)
        elif DOT_F32:
            q0, q1, qp = q0.to(tl.float32), q1.to(tl.float32), qp.to(tl.float32)
        # NOTE: triton_common.split_window written out: inlining the call moves ptxas'
        # sm_90 spills of the 32-row tile (fp8 KV, ragged) by 4 bytes (labels of the inlined range)
        bound = kv_len - q_len + offs_m // H + 1  # [M]: row sees j < bound
        last_row = tl.minimum(m0 + BLOCK_M, n_rows) - 1
        hi_rows = kv_len - q_len + last_row // H + 1
        chunk = tl.cdiv(tl.cdiv(kv_len, num_splits), BLOCK_N) * BLOCK_N
        lo = sid * chunk
        hi = tl.minimum(tl.minimum(lo + chunk, kv_len), hi_rows)
        dsc_v, dsc_p = kv_descriptors(KV, num_slots, DK, DH, DPE, BLOCK_N, TMA)
        m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        acc0 = tl.zeros([BLOCK_M, DH], dtype=tl.float32)
        acc1 = tl.zeros([BLOCK_M, DH], dtype=tl.float32)
        r2t_row = R2T + req * stride_r2t
        offs_r = tl.arange(0, BLOCK_N)
        for start in range(lo, hi, BLOCK_N):
            slot0 = tl.load(r2t_row + start)  # first slot of this tile: rows are contiguous
            k0, k1, kp = load_kv_tile(KV, dsc_v, dsc_p, slot0, start, hi, offs_r, offs_h,
                                      offs_p, DH, DV, DK, TMA, F16, DOT_F32)
            if DOT_F32:
                s = tl.dot(q0, tl.trans(k0), input_precision="ieee")
                s = tl.dot(q1, tl.trans(k1), s, input_precision="ieee")
                s = tl.dot(qp, tl.trans(kp), s, input_precision="ieee")
            else:
                s = tl.dot(q0, tl.trans(k0))
                s = tl.dot(q1, tl.trans(k1), s)
                s = tl.dot(qp, tl.trans(kp), s)
            s = s * row_scale
            offs_n = start + offs_r
            vis = (offs_n[None, :] < bound[:, None]) & (offs_n[None, :] < hi)
            s = tl.where(vis, s, float("-inf"))
            p, alpha, m_new, l_i = online_softmax(s, m_i, l_i)
            acc0 = acc0 * alpha[:, None]
            acc1 = acc1 * alpha[:, None]
            if DOT_F32:
                acc0 = tl.dot(p, k0, acc0, input_precision="ieee")
                acc1 = tl.dot(p, k1, acc1, input_precision="ieee")
            else:
                pc = p.to(k0.dtype)
                acc0 = tl.dot(pc, k0, acc0)
                acc1 = tl.dot(pc, k1, acc1)
            m_i = m_new

        gdc_launch(USE_GDC)  # after the KV loop (pdl rule 5)
        has = l_i > 0.0
        inv = tl.where(has, v_scale / tl.where(has, l_i, 1.0), 0.0)
        o0 = acc0 * inv[:, None]
        o1 = acc1 * inv[:, None]
        lse2 = tl.where(has, m_i + tl.log2(tl.where(has, l_i, 1.0)), float("-inf"))
        rows = tok * H + head
        if SPLIT:
            optr = Out + sid * stride_ps + rows[:, None] * DV + offs_h[None, :]
            tl.store(optr, o0.to(Out.dtype.element_ty), mask=mask_m[:, None])
            tl.store(optr + DH, o1.to(Out.dtype.element_ty), mask=mask_m[:, None])
            tl.store(Lse + sid * stride_lse_s + rows, lse2, mask=mask_m)
        else:
            optr = Out + tok[:, None] * stride_o_t + head[:, None] * stride_o_h + offs_h[None, :]
            tl.store(optr, o0.to(Out.dtype.element_ty), mask=mask_m[:, None])
            tl.store(optr + DH, o1.to(Out.dtype.element_ty), mask=mask_m[:, None])
            if WRITE_LSE:
                tl.store(Lse + rows, lse2 * 0.6931471805599453, mask=mask_m)


@triton.jit(do_not_specialize=["H", "q_len_fixed", "num_splits", "stride_r2t", "num_slots",
                               "stride_lse_s"])
def _mla_swapab_kernel(
    Qn, Qp, KV, R2T, RPI, KVL, QO, Out, Lse,
    stride_qn_t, stride_qn_h, stride_qp_t, stride_qp_h, stride_r2t,
    stride_o_t, stride_o_h, stride_ps, stride_lse_s, num_slots,
    H, q_len_fixed, num_splits, qk_scale_log2, v_scale,
    DV: tl.constexpr, DPE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    RAGGED: tl.constexpr, SPLIT: tl.constexpr, WRITE_LSE: tl.constexpr,
    DOT_F32: tl.constexpr, F16: tl.constexpr, TMA: tl.constexpr, USE_GDC: tl.constexpr,
    L2PF: tl.constexpr,
):
    DH: tl.constexpr = DV // 2
    DK: tl.constexpr = DV + DPE
    pid_m = tl.program_id(0)
    sid = tl.program_id(1)
    b = tl.program_id(2)
    if L2PF:  # first KV tiles into L2 before the wait (pdl rule 4)
        prefetch_kv_tiles(KV, R2T, RPI, KVL, QO, b, pid_m, sid, H, q_len_fixed, num_splits,
                          stride_r2t, num_slots, DK, BLOCK_M, BLOCK_N, RAGGED, 2)
    gdc_wait(USE_GDC)
    qo_start, q_len, kv_len, n_rows, m0 = request_rows(QO, KVL, b, pid_m, H, q_len_fixed,
                                                       BLOCK_M, RAGGED)
    if m0 < n_rows:
        req, offs_m, mask_m, tok, head = block_rows(RPI, b, m0, n_rows, qo_start, H, BLOCK_M)
        offs_h = tl.arange(0, DH)
        offs_p = tl.arange(0, DPE)
        qrow = Qn + tok[None, :] * stride_qn_t + head[None, :] * stride_qn_h
        # queries loaded transposed: [D, BLOCK_M], the B operand of S^T = K @ Q^T
        q0 = tl.load(qrow + offs_h[:, None], mask=mask_m[None, :], other=0.0)
        q1 = tl.load(qrow + DH + offs_h[:, None], mask=mask_m[None, :], other=0.0)
        qp = tl.load(Qp + tok[None, :] * stride_qp_t + head[None, :] * stride_qp_h
                     + offs_p[:, None], mask=mask_m[None, :], other=0.0)
        row_scale = qk_scale_log2
        if F16:
            q0, q1, qp, row_scale = fp16_prescaled(q0, q1, qp, row_scale)
        elif DOT_F32:
            q0, q1, qp = q0.to(tl.float32), q1.to(tl.float32), qp.to(tl.float32)
        bound, lo, hi = split_window(kv_len, q_len, offs_m, m0, n_rows, H, sid, num_splits,
                                     BLOCK_M, BLOCK_N)
        dsc_v, dsc_p = kv_descriptors(KV, num_slots, DK, DH, DPE, BLOCK_N, TMA)
        m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        acc0 = tl.zeros([DH, BLOCK_M], dtype=tl.float32)
        acc1 = tl.zeros([DH, BLOCK_M], dtype=tl.float32)
        r2t_row = R2T + req * stride_r2t
        offs_r = tl.arange(0, BLOCK_N)
        for start in range(lo, hi, BLOCK_N):
            slot0 = tl.load(r2t_row + start)  # first slot of this tile: rows are contiguous
            k0, k1, kp = load_kv_tile(KV, dsc_v, dsc_p, slot0, start, hi, offs_r, offs_h,
                                      offs_p, DH, DV, DK, TMA, F16, DOT_F32)
            if DOT_F32:
                s = tl.dot(k0, q0, input_precision="ieee")
                s = tl.dot(k1, q1, s, input_precision="ieee")
                s = tl.dot(kp, qp, s, input_precision="ieee")
            else:
                s = tl.dot(k0, q0)
                s = tl.dot(k1, q1, s)
                s = tl.dot(kp, qp, s)
            s = s * row_scale  # [BLOCK_N, BLOCK_M]
            offs_n = start + offs_r
            vis = (offs_n[:, None] < bound[None, :]) & (offs_n[:, None] < hi)
            s = tl.where(vis, s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 0))
            m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = tl.exp2(m_i - m_use)
            p = tl.exp2(s - m_use[None, :])
            l_i = l_i * alpha + tl.sum(p, 0)
            acc0 = acc0 * alpha[None, :]
            acc1 = acc1 * alpha[None, :]
            if DOT_F32:
                acc0 = tl.dot(tl.trans(k0), p, acc0, input_precision="ieee")
                acc1 = tl.dot(tl.trans(k1), p, acc1, input_precision="ieee")
            else:
                pc = p.to(k0.dtype)
                acc0 = tl.dot(tl.trans(k0), pc, acc0)
                acc1 = tl.dot(tl.trans(k1), pc, acc1)
            m_i = m_new

        gdc_launch(USE_GDC)  # after the KV loop (pdl rule 5)
        has = l_i > 0.0
        inv = tl.where(has, v_scale / tl.where(has, l_i, 1.0), 0.0)
        o0 = acc0 * inv[None, :]
        o1 = acc1 * inv[None, :]
        lse2 = tl.where(has, m_i + tl.log2(tl.where(has, l_i, 1.0)), float("-inf"))
        rows = tok * H + head
        if SPLIT:
            optr = Out + sid * stride_ps + rows[None, :] * DV + offs_h[:, None]
            tl.store(optr, o0.to(Out.dtype.element_ty), mask=mask_m[None, :])
            tl.store(optr + DH, o1.to(Out.dtype.element_ty), mask=mask_m[None, :])
            tl.store(Lse + sid * stride_lse_s + rows, lse2, mask=mask_m)
        else:
            optr = Out + tok[None, :] * stride_o_t + head[None, :] * stride_o_h + offs_h[:, None]
            tl.store(optr, o0.to(Out.dtype.element_ty), mask=mask_m[None, :])
            tl.store(optr + DH, o1.to(Out.dtype.element_ty), mask=mask_m[None, :])
            if WRITE_LSE:
                tl.store(Lse + rows, lse2 * 0.6931471805599453, mask=mask_m)


_PAGED = TritonLauncher(_mla_paged_kernel)
_SWAP = TritonLauncher(_mla_swapab_kernel)


def launch_paged(q_nope, q_pe, kv_flat, req_to_token, req_pool_indices, kv_lens, qo_indptr,
                 out, lse, qk_scale_log2: float, v_scale: float, *, q_len, m_blocks: int,
                 num_splits: int, cfg, interp: bool, is_fp8: bool, bind: bool = False):
    """Launch the paged (``cfg.swap``: swapped) kernel into ``out`` / ``lse``, then the combine.
    ``bind``: also return ``go(q_nope, ..., qo_indptr, out, lse, qk_scale_log2, v_scale) -> bool``
    relaunching both for tensors of the same shapes, strides, dtypes and alignment (or None)."""
    n, h, dv = q_nope.shape
    dev = q_nope.device
    split = num_splits > 1
    pdt = torch.bfloat16 if cfg.part_bf16 else torch.float32
    shapes = ((num_splits, n * h, dv), (num_splits, n * h))
    if split:
        part = torch.empty(shapes[0], dtype=pdt, device=dev)
        part_lse = torch.empty(shapes[1], dtype=torch.float32, device=dev)
        o_arg, l_arg = part, part_lse
    else:
        o_arg, l_arg = out, (lse if lse is not None else out)
    qo = qo_indptr if qo_indptr is not None else kv_lens  # dummy when fixed
    pdl = attn_pdl_kwargs(q_nope, cfg)
    launcher = _SWAP if cfg.swap else _PAGED
    args = ((m_blocks, num_splits, req_pool_indices.numel()),
            (q_nope, q_pe, kv_flat, req_to_token, req_pool_indices, kv_lens, qo, o_arg, l_arg),
            (q_nope.stride(0), q_nope.stride(1), q_pe.stride(0), q_pe.stride(1),
             req_to_token.stride(0), out.stride(0), out.stride(1),
             (n * h * dv) if split else 0, (n * h) if split else 0, kv_flat.shape[0],
             h, q_len or 0, num_splits, qk_scale_log2, float(v_scale)),
            (dv, q_pe.shape[-1], cfg.block_m, cfg.block_n, qo_indptr is not None, split,
             lse is not None, interp and not is_fp8, is_fp8, cfg.tma, pdl["USE_GDC"], pdl["L2PF"]),
            cfg.num_warps, {"num_stages": cfg.num_stages, "launch_pdl": pdl["launch_pdl"]})
    launcher.launch(*args)
    combine = combine_splits(part, part_lse, out, lse, bind=bind) if split else None
    go = launcher.relauncher(*args) if bind else None
    if go is None or (split and combine is None):
        return None
    head = args[2][:-2]
    bufs = SplitBuffers(shapes, pdt, dev) if split else None

    def relaunch(q_nope, q_pe, kv_flat, req_to_token, req_pool_indices, kv_lens, qo_indptr, out,
                 lse, qk_scale_log2, v_scale) -> bool:
        if split:
            part, part_lse = bufs.get()
            o_arg, l_arg = part, part_lse
        else:
            o_arg, l_arg = out, (lse if lse is not None else out)
        qo = qo_indptr if qo_indptr is not None else kv_lens
        if not go((q_nope.data_ptr(), q_pe.data_ptr(), kv_flat.data_ptr(),
                   req_to_token.data_ptr(), req_pool_indices.data_ptr(), kv_lens.data_ptr(),
                   qo.data_ptr(), o_arg.data_ptr(), l_arg.data_ptr()),
                  head + (qk_scale_log2, float(v_scale))):
            return False
        return combine(part, part_lse, out, lse) if split else True
    return relaunch
