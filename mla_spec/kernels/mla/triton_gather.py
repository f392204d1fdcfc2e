"""The gather kernel (``mla_decode``): split-KV absorbed-MLA attention over the paged latent cache,
any page size and slot order. Row ``i`` of ``q_len`` sees ``j < kv_len - q_len + i + 1``::

    out[t, h] = v_scale * softmax_j(sm_scale * k_scale * [q_nope | q_pe][t, h] . s_j) @ s_j[:Dv]

with ``s_j = kv_flat[req_to_token[req, j]]``; a program's ``BLOCK_M`` rows share each KV tile (MQA),
online softmax in fp32; splits write partials for ``combine``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from mla_spec.device import triton_interpreting, use_triton
from mla_spec.kernels.mla.choice import pick_num_splits
from mla_spec.kernels.mla.combine import combine_splits
from mla_spec.kernels.mla.reference import mla_decode_ref
from mla_spec.kernels.mla.triton_common import (
    block_rows,
    check_mla_inputs,
    online_softmax,
    request_rows,
    split_window,
)
from mla_spec.quant.fp8 import FP8_DTYPE, FP8_E4M3_MAX

__all__ = ["MLAKernelConfig", "default_config", "mla_decode"]

_LOG2E = 1.4426950408889634


@dataclass(frozen=True)
class MLAKernelConfig:
    """Tile config: rows per program, KV rows per tile, warps, pipeline stages."""

    block_m: int = 64
    block_n: int = 64
    num_warps: int = 8
    num_stages: int = 2


# Batch-dependent integers stay unspecialized: one binary per tile config, whatever the batch.
@triton.jit(do_not_specialize=["H", "q_len_fixed", "num_splits", "stride_lse_s"])
def _mla_fwd_kernel(
    Qn, Qp, QS, KV, R2T, RPI, KVL, QO, Out, Lse,
    stride_qn_t, stride_qn_h, stride_qp_t, stride_qp_h, stride_kv, stride_r2t,
    stride_o_t, stride_o_h, stride_ps, stride_lse_s,
    H, q_len_fixed, num_splits, qk_scale_log2, v_scale,
    DV: tl.constexpr, DPE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    RAGGED: tl.constexpr, SPLIT: tl.constexpr, WRITE_LSE: tl.constexpr,
    DOT_F32: tl.constexpr, FP8_DOT: tl.constexpr,
):
    b = tl.program_id(0)
    pid_m = tl.program_id(1)
    sid = tl.program_id(2)
    qo_start, q_len, kv_len, n_rows, m0 = request_rows(QO, KVL, b, pid_m, H, q_len_fixed,
                                                       BLOCK_M, RAGGED)
    if m0 < n_rows:
        req, offs_m, mask_m, tok, head = block_rows(RPI, b, m0, n_rows, qo_start, H, BLOCK_M)
        offs_d = tl.arange(0, DV)
        offs_p = tl.arange(0, DPE)
        qn = tl.load(Qn + tok[:, None] * stride_qn_t + head[:, None] * stride_qn_h
                     + offs_d[None, :], mask=mask_m[:, None], other=0.0)
        qp = tl.load(Qp + tok[:, None] * stride_qp_t + head[:, None] * stride_qp_h
                     + offs_p[None, :], mask=mask_m[:, None], other=0.0)
        if DOT_F32:
            qn = qn.to(tl.float32)
            qp = qp.to(tl.float32)
        row_scale = tl.zeros([BLOCK_M], dtype=tl.float32) + qk_scale_log2
        if FP8_DOT:
            row_scale = row_scale * tl.load(QS + tok * H + head, mask=mask_m, other=1.0)
        bound, lo, hi = split_window(kv_len, q_len, offs_m, m0, n_rows, H, sid, num_splits,
                                     BLOCK_M, BLOCK_N)  # row sees j < bound; split [lo, hi)

        m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        acc = tl.zeros([BLOCK_M, DV], dtype=tl.float32)
        for start in range(lo, hi, BLOCK_N):
            offs_n = start + tl.arange(0, BLOCK_N)
            mask_n = offs_n < hi
            slot = tl.load(R2T + req * stride_r2t + offs_n, mask=mask_n, other=0).to(tl.int64)
            kn = tl.load(KV + slot[:, None] * stride_kv + offs_d[None, :],
                         mask=mask_n[:, None], other=0.0)
            kp = tl.load(KV + slot[:, None] * stride_kv + DV + offs_p[None, :],
                         mask=mask_n[:, None], other=0.0)
            if DOT_F32:
                kn = kn.to(tl.float32)
                kp = kp.to(tl.float32)
                kv_op = kn
            elif FP8_DOT:
                kv_op = kn.to(tl.bfloat16)
            else:
                kn = kn.to(qn.dtype)
                kp = kp.to(qn.dtype)
                kv_op = kn
            if DOT_F32:
                s = tl.dot(qn, tl.trans(kn), input_precision="ieee")
                s += tl.dot(qp, tl.trans(kp), input_precision="ieee")
            else:
                s = tl.dot(qn, tl.trans(kn)) + tl.dot(qp, tl.trans(kp))
            s = s * row_scale[:, None]
            vis = (offs_n[None, :] < bound[:, None]) & mask_n[None, :]
            s = tl.where(vis, s, float("-inf"))
            p, alpha, m_new, l_i = online_softmax(s, m_i, l_i)
            if DOT_F32:
                pv = tl.dot(p, kv_op, input_precision="ieee")
            else:
                pv = tl.dot(p.to(kv_op.dtype), kv_op)
            acc = acc * alpha[:, None] + pv
            m_i = m_new

        has = l_i > 0.0
        o = tl.where(has[:, None], acc / tl.where(has, l_i, 1.0)[:, None], 0.0) * v_scale
        lse2 = tl.where(has, m_i + tl.log2(tl.where(has, l_i, 1.0)), float("-inf"))
        rows = tok * H + head  # flattened (token, head) index
        if SPLIT:
            tl.store(Out + sid * stride_ps + rows[:, None] * DV + offs_d[None, :], o,
                     mask=mask_m[:, None])
            tl.store(Lse + sid * stride_lse_s + rows, lse2, mask=mask_m)
        else:
            tl.store(Out + tok[:, None] * stride_o_t + head[:, None] * stride_o_h
                     + offs_d[None, :], o.to(Out.dtype.element_ty), mask=mask_m[:, None])
            if WRITE_LSE:
                tl.store(Lse + rows, lse2 * 0.6931471805599453, mask=mask_m)


def default_config(rows: int, q_dtype: torch.dtype, kv_dtype: torch.dtype,
                   device: torch.device) -> MLAKernelConfig:
    """Tile choice: tiny tiles under the interpreter; on GPU by the rows per request."""
    if device.type != "cuda":
        return MLAKernelConfig(16, 16, 4, 1)
    if q_dtype == torch.float32 or kv_dtype == torch.float32:
        return MLAKernelConfig(16, 32, 4, 2)
    if rows <= 32:
        return MLAKernelConfig(32, 64, 4, 2)
    return MLAKernelConfig(64, 64, 8, 2)


def _quantize_q_rows(q_nope, q_pe):
    """Per-(token, head) e4m3 quantization of the 576-wide query (torch, RTNE)."""
    amax = torch.maximum(q_nope.abs().amax(-1), q_pe.abs().amax(-1)).float()
    scale = torch.where(amax > 0, amax / FP8_E4M3_MAX, torch.ones_like(amax))
    qn8 = (q_nope.float() / scale[..., None]).clamp(-448, 448).to(FP8_DTYPE)
    qp8 = (q_pe.float() / scale[..., None]).clamp(-448, 448).to(FP8_DTYPE)
    return qn8, qp8, scale.contiguous()


def mla_decode(q_nope: torch.Tensor, q_pe: torch.Tensor, kv_flat: torch.Tensor,
               req_to_token: torch.Tensor, req_pool_indices: torch.Tensor, kv_lens: torch.Tensor,
               sm_scale: float, *, k_scale: float = 1.0, v_scale: float = 1.0,
               q_len: int | None = None, qo_indptr: torch.Tensor | None = None,
               max_q: int | None = None, num_splits: int | None = None,
               return_lse: bool = False, out: torch.Tensor | None = None, fp8_dot: int = 0,
               config: MLAKernelConfig | None = None, max_kv: int | None = None):
    """Absorbed MLA (module docstring) -> ``[N, H, Dv]`` (and the natural-log ``lse``)."""
    if q_nope.dim() == 4:
        q_len = q_nope.shape[1] if q_len is None else q_len
        q_nope, q_pe = q_nope.flatten(0, 1), q_pe.flatten(0, 1)
    check_mla_inputs(q_nope, q_pe, kv_flat, req_to_token, req_pool_indices, kv_lens, qo_indptr)
    n, h, dv = q_nope.shape
    dpe = q_pe.shape[-1]
    bs = req_pool_indices.numel()
    if (q_len is None) == (qo_indptr is None):
        raise ValueError("give exactly one of q_len (fixed rows per request) or qo_indptr")
    if kv_flat.shape[-1] != dv + dpe:
        raise ValueError(f"kv rows are {kv_flat.shape[-1]} wide; q needs {dv} + {dpe}")
    if q_len is not None and n != bs * q_len:
        raise ValueError(f"{n} query rows != bs {bs} x q_len {q_len}")
    if dv & (dv - 1) or dpe & (dpe - 1):
        raise ValueError(f"Dv {dv} and Dpe {dpe} must be powers of two (512 / 64 for DeepSeek)")
    if not use_triton(q_nope):
        return mla_decode_ref(q_nope, q_pe, kv_flat, req_to_token, req_pool_indices, kv_lens,
                              sm_scale, k_scale=k_scale, v_scale=v_scale, q_len=q_len,
                              qo_indptr=qo_indptr, return_lse=return_lse, out=out)
    dev = q_nope.device
    interp = triton_interpreting() and dev.type == "cpu"
    is_fp8 = kv_flat.dtype == FP8_DTYPE
    fp8_dot = int(fp8_dot) if (is_fp8 and not interp) else 0
    rows = (q_len if q_len is not None else max_q) * h
    if q_len is None and max_q is None:
        max_q = int((qo_indptr[1:] - qo_indptr[:-1]).max()) if bs else 0
        rows = max_q * h
    cfg = config or default_config(rows, q_nope.dtype, kv_flat.dtype, dev)
    m_blocks = max(1, triton.cdiv(rows, cfg.block_m))
    if num_splits is None:
        mk = max_kv if max_kv is not None else (int(kv_lens.max()) if bs else 0)
        sms = torch.cuda.get_device_properties(dev).multi_processor_count if dev.type == "cuda" \
            else 4
        num_splits = pick_num_splits(bs, m_blocks, mk, cfg.block_n, sms)
    if out is None:
        out = torch.empty((n, h, dv), dtype=q_nope.dtype, device=dev)
    lse = torch.empty((n, h), dtype=torch.float32, device=dev) if return_lse else None
    if n == 0 or bs == 0:
        return (out, lse) if return_lse else out
    qs = out  # dummy pointer when unused
    if fp8_dot:
        q_nope, q_pe, qs = _quantize_q_rows(q_nope, q_pe)
    split = num_splits > 1
    if split:
        part = torch.empty((num_splits, n * h, dv), dtype=torch.float32, device=dev)
        part_lse = torch.empty((num_splits, n * h), dtype=torch.float32, device=dev)
        o_arg, l_arg = part, part_lse
    else:
        o_arg, l_arg = out, (lse if return_lse else out)
    qo = qo_indptr if qo_indptr is not None else kv_lens  # dummy when fixed
    grid = (bs, m_blocks, num_splits)
    _mla_fwd_kernel[grid](
        q_nope, q_pe, qs, kv_flat, req_to_token, req_pool_indices, kv_lens, qo, o_arg, l_arg,
        q_nope.stride(0), q_nope.stride(1), q_pe.stride(0), q_pe.stride(1),
        kv_flat.stride(0), req_to_token.stride(0),
        out.stride(0), out.stride(1), (n * h * dv) if split else 0, (n * h) if split else 0,
        h, q_len or 0, num_splits, float(sm_scale) * float(k_scale) * _LOG2E, float(v_scale),
        DV=dv, DPE=dpe, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
        RAGGED=qo_indptr is not None, SPLIT=split, WRITE_LSE=return_lse,
        DOT_F32=interp or q_nope.dtype == torch.float32 or kv_flat.dtype == torch.float32,
        FP8_DOT=bool(fp8_dot), num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    if split:
        combine_splits(part, part_lse, out, lse)
    return (out, lse) if return_lse else out


assert math.isclose(_LOG2E, 1 / math.log(2))
