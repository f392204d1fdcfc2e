"""The V-split paged MLA kernel (``G4``): four sibling programs per row block each compute the full
``Q . K^T`` and softmax but only 128 of the 512 columns of ``P . V`` (adjacent on grid axis 0,
sharing tiles in L2); each sums chunks in its own rotated order, so each writes its LSE (sibling
0's is final).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from mla_spec.kernels.launch.pdl import gdc_launch, gdc_wait
from mla_spec.kernels.mla.combine import combine_splits
from mla_spec.kernels.mla.triton_common import (
    attn_pdl_kwargs,
    block_rows,
    online_softmax,
    prefetch_kv_tiles,
    request_rows,
    split_window,
)

__all__ = ["launch_vsplit"]

#: sibling programs per row block, each owning DV / NV output columns
NV = 4


@triton.jit
def _scaled_f16(x, pw):
    return (x.to(tl.float32) * pw).to(tl.float16)


@triton.jit(do_not_specialize=["H", "q_len_fixed", "num_splits", "stride_r2t", "num_slots",
                               "stride_lse_v", "stride_lse_s"])
def _mla_vsplit_kernel(
    Qn, Qp, KV, R2T, RPI, KVL, QO, Out, Lse, Part, PLse,
    stride_qn_t, stride_qn_h, stride_qp_t, stride_qp_h, stride_r2t,
    stride_o_t, stride_o_h, stride_ps, stride_lse_v, stride_lse_s, num_slots,
    H, q_len_fixed, num_splits, qk_scale_log2, v_scale,
    DV: tl.constexpr, DPE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    NV: tl.constexpr, RAGGED: tl.constexpr, SPLIT: tl.constexpr, WRITE_LSE: tl.constexpr,
    DOT_F32: tl.constexpr, F16: tl.constexpr, TMA: tl.constexpr, USE_GDC: tl.constexpr,
    L2PF: tl.constexpr,
):
    DC: tl.constexpr = DV // NV
    DK: tl.constexpr = DV + DPE
    pid0 = tl.program_id(0)
    vid = pid0 % NV  # fastest-varying: siblings of one KV tile run side by side
    pid_m = pid0 // NV
    sid = tl.program_id(1)
    b = tl.program_id(2)
    if L2PF:  # first KV tiles into L2 before the wait (pdl rule 4)
        if vid == 0:  # the siblings read the same tiles
            prefetch_kv_tiles(KV, R2T, RPI, KVL, QO, b, pid_m, sid, H, q_len_fixed, num_splits,
                              stride_r2t, num_slots, DK, BLOCK_M, BLOCK_N, RAGGED, 2)
    gdc_wait(USE_GDC)
    qo_start, q_len, kv_len, n_rows, m0 = request_rows(QO, KVL, b, pid_m, H, q_len_fixed,
                                                       BLOCK_M, RAGGED)
    if m0 < n_rows:
        req, offs_m, mask_m, tok, head = block_rows(RPI, b, m0, n_rows, qo_start, H, BLOCK_M)
        offs_c = tl.arange(0, DC)
        offs_p = tl.arange(0, DPE)
        # column offsets of the chunks, own chunk first
        oa = (vid % NV) * DC
        ob = ((vid + 1) % NV) * DC
        oc = ((vid + 2) % NV) * DC
        od = ((vid + 3) % NV) * DC
        qrow = Qn + tok[:, None] * stride_qn_t + head[:, None] * stride_qn_h + offs_c[None, :]
        qa = tl.load(qrow + oa, mask=mask_m[:, None], other=0.0)
        qb = tl.load(qrow + ob, mask=mask_m[:, None], other=0.0)
        qc = tl.load(qrow + oc, mask=mask_m[:, None], other=0.0)
        qd = tl.load(qrow + od, mask=mask_m[:, None], other=0.0)
        qp = tl.load(Qp + tok[:, None] * stride_qp_t + head[:, None] * stride_qp_h
                     + offs_p[None, :], mask=mask_m[:, None], other=0.0)
        row_scale = qk_scale_log2
        if F16:
            # exact power-of-two pre-scale so that max|q| lands in [2**13, 2**14]
            amax = tl.maximum(tl.max(tl.max(tl.abs(qa.to(tl.float32)), 1), 0),
                              tl.max(tl.max(tl.abs(qb.to(tl.float32)), 1), 0))
            amax = tl.maximum(amax, tl.max(tl.max(tl.abs(qp.to(tl.float32)), 1), 0))
            amax = tl.maximum(amax, tl.max(tl.max(tl.abs(qc.to(tl.float32)), 1), 0))
            amax = tl.maximum(amax, tl.max(tl.max(tl.abs(qd.to(tl.float32)), 1), 0))
            e = tl.where(amax > 0, 14 - tl.ceil(tl.log2(tl.maximum(amax, 1e-30))), 0.0)
            e = tl.minimum(tl.maximum(e, -100.0), 100.0).to(tl.int32)
            pw = ((e + 127) << 23).to(tl.float32, bitcast=True)
            ipw = ((127 - e) << 23).to(tl.float32, bitcast=True)
            qa, qb, qp = _scaled_f16(qa, pw), _scaled_f16(qb, pw), _scaled_f16(qp, pw)
            qc, qd = _scaled_f16(qc, pw), _scaled_f16(qd, pw)
            row_scale = row_scale * ipw
        elif DOT_F32:
            qa, qb, qp = qa.to(tl.float32), qb.to(tl.float32), qp.to(tl.float32)
            qc, qd = qc.to(tl.float32), qd.to(tl.float32)
        bound, lo, hi = split_window(kv_len, q_len, offs_m, m0, n_rows, H, sid, num_splits,
                                     BLOCK_M, BLOCK_N)  # row sees j < bound; split [lo, hi)
        if TMA:
            dsc_v = tl.make_tensor_descriptor(KV, shape=[num_slots, DK], strides=[DK, 1],
                                              block_shape=[BLOCK_N, DC])
            dsc_p = tl.make_tensor_descriptor(KV, shape=[num_slots, DK], strides=[DK, 1],
                                              block_shape=[BLOCK_N, DPE])
        m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        acc0 = tl.zeros([BLOCK_M, DC], dtype=tl.float32)
        r2t_row = R2T + req * stride_r2t
        offs_r = tl.arange(0, BLOCK_N)
        for start in range(lo, hi, BLOCK_N):
            slot0 = tl.load(r2t_row + start)  # first slot of this tile: rows are contiguous
            if TMA:
                ka = dsc_v.load([slot0, oa])
                kb = dsc_v.load([slot0, ob])
                kc = dsc_v.load([slot0, oc])
                kd = dsc_v.load([slot0, od])
                kp = dsc_p.load([slot0, DV])
            else:
                kptr = KV + (slot0.to(tl.int64) + offs_r)[:, None] * DK
                mask_r = ((start + offs_r) < hi)[:, None]
                ka = tl.load(kptr + oa + offs_c[None, :], mask=mask_r, other=0.0)
                kb = tl.load(kptr + ob + offs_c[None, :], mask=mask_r, other=0.0)
                kc = tl.load(kptr + oc + offs_c[None, :], mask=mask_r, other=0.0)
                kd = tl.load(kptr + od + offs_c[None, :], mask=mask_r, other=0.0)
                kp = tl.load(kptr + DV + offs_p[None, :], mask=mask_r, other=0.0)
            if F16:
                ka, kb, kp = ka.to(tl.float16), kb.to(tl.float16), kp.to(tl.float16)
                kc, kd = kc.to(tl.float16), kd.to(tl.float16)
            elif DOT_F32:
                ka, kb, kp = ka.to(tl.float32), kb.to(tl.float32), kp.to(tl.float32)
                kc, kd = kc.to(tl.float32), kd.to(tl.float32)
            if DOT_F32:
                s = tl.dot(qa, tl.trans(ka), input_precision="ieee")
                s = tl.dot(qb, tl.trans(kb), s, input_precision="ieee")
                s = tl.dot(qc, tl.trans(kc), s, input_precision="ieee")
                s = tl.dot(qd, tl.trans(kd), s, input_precision="ieee")
                s = tl.dot(qp, tl.trans(kp), s, input_precision="ieee")
            else:
                s = tl.dot(qa, tl.trans(ka))
                s = tl.dot(qb, tl.trans(kb), s)
                s = tl.dot(qc, tl.trans(kc), s)
                s = tl.dot(qd, tl.trans(kd), s)
                s = tl.dot(qp, tl.trans(kp), s)
            s = s * row_scale
            offs_n = start + offs_r
            vis = (offs_n[None, :] < bound[:, None]) & (offs_n[None, :] < hi)
            s = tl.where(vis, s, float("-inf"))
            p, alpha, m_new, l_i = online_softmax(s, m_i, l_i)
            if DOT_F32:
                acc0 = tl.dot(p, ka, acc0 * alpha[:, None], input_precision="ieee")
            else:
                pc = p.to(ka.dtype)
                acc0 = tl.dot(pc, ka, acc0 * alpha[:, None])
            m_i = m_new

        gdc_launch(USE_GDC)  # after the KV loop (pdl rule 5)
        has = l_i > 0.0
        inv = tl.where(has, v_scale / tl.where(has, l_i, 1.0), 0.0)
        lse2 = tl.where(has, m_i + tl.log2(tl.where(has, l_i, 1.0)), float("-inf"))
        rows = tok * H + head
        if SPLIT:
            pbase = Part + sid * stride_ps + rows[:, None] * DV + offs_c[None, :]
            tl.store(pbase + oa, (acc0 * inv[:, None]).to(Part.dtype.element_ty),
                     mask=mask_m[:, None])
            plse = PLse + vid * stride_lse_v
            tl.store(plse + sid * stride_lse_s + rows, lse2, mask=mask_m)
        else:
            optr = (Out + tok[:, None] * stride_o_t + head[:, None] * stride_o_h
                    + offs_c[None, :])
            tl.store(optr + oa, (acc0 * inv[:, None]).to(Out.dtype.element_ty),
                     mask=mask_m[:, None])
            if WRITE_LSE:
                if vid == 0:
                    tl.store(Lse + rows, lse2 * 0.6931471805599453, mask=mask_m)


def launch_vsplit(q_nope, q_pe, kv_flat, req_to_token, req_pool_indices, kv_lens, qo_indptr,
                  out, lse, qk_scale_log2: float, v_scale: float, *, q_len: int | None,
                  m_blocks: int, num_splits: int, cfg, interp: bool, is_fp8: bool) -> None:
    """Launch the V-split kernel into ``out`` / ``lse``, then the combine."""
    n, h, dv = q_nope.shape
    dpe = q_pe.shape[-1]
    bs = req_pool_indices.numel()
    dev = q_nope.device
    if cfg.vsplit != NV or dv % (2 * NV):
        raise ValueError(f"the V-split kernel takes vsplit {NV} and Dv a multiple of {2 * NV} "
                         f"(got {cfg.vsplit}, Dv {dv})")
    if cfg.tma and dv // NV * kv_flat.element_size() < 16:
        raise ValueError(f"TMA boxes need >= 16 bytes: Dv / {NV} columns are too narrow")
    split = num_splits > 1
    if split:
        pdt = torch.bfloat16 if cfg.part_bf16 else torch.float32
        part = torch.empty((num_splits, n * h, dv), dtype=pdt, device=dev)
        part_lse = torch.empty((NV, num_splits, n * h), dtype=torch.float32, device=dev)
    else:
        part = part_lse = out
    qo = qo_indptr if qo_indptr is not None else kv_lens  # dummy when fixed
    _mla_vsplit_kernel[(m_blocks * NV, num_splits, bs)](
        q_nope, q_pe, kv_flat, req_to_token, req_pool_indices, kv_lens, qo, out,
        lse if lse is not None else out, part, part_lse,
        q_nope.stride(0), q_nope.stride(1), q_pe.stride(0), q_pe.stride(1),
        req_to_token.stride(0), out.stride(0), out.stride(1),
        (n * h * dv) if split else 0, (num_splits * n * h) if split else 0,
        (n * h) if split else 0, kv_flat.shape[0],
        h, q_len or 0, num_splits, qk_scale_log2, float(v_scale),
        DV=dv, DPE=dpe, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, NV=NV,
        RAGGED=qo_indptr is not None, SPLIT=split, WRITE_LSE=lse is not None,
        DOT_F32=interp and not is_fp8, F16=is_fp8, TMA=cfg.tma,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, **attn_pdl_kwargs(q_nope, cfg),
    )
    if split:
        combine_splits(part, part_lse[0], out, lse)
