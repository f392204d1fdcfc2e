"""Torch references of the MLA kernels: :func:`mla_decode_ref` (vectorized over the batch with one
visibility mask; no code shared with ``attention/torch_ref.py``) and :func:`combine_splits_ref`.
"""

import torch

from mla_spec.quant.fp8 import FP8_DTYPE

__all__ = ["combine_splits_ref", "mla_decode_ref"]


def mla_decode_ref(q_nope, q_pe, kv_flat, req_to_token, req_pool_indices, kv_lens, sm_scale, *,
                   k_scale=1.0, v_scale=1.0, q_len=None, qo_indptr=None, return_lse=False,
                   out=None):
    """See :func:`mla_spec.kernels.mla.mla_decode`; fp32 math on any device."""
    n, h, dv = q_nope.shape
    dev = q_nope.device
    bs = req_pool_indices.numel()
    if qo_indptr is None:
        indptr = torch.arange(bs + 1, device=dev, dtype=torch.int64) * int(q_len)
    else:
        indptr = qo_indptr.to(dev, torch.int64)
    qlens = indptr[1:] - indptr[:-1]
    kvl = kv_lens.to(dev, torch.int64)
    max_q = int(qlens.max()) if bs else 0
    max_kv = int(kvl.max()) if bs else 0
    res = torch.zeros((n, h, dv), dtype=torch.float32, device=dev)
    lse = torch.full((n, h), float("-inf"), dtype=torch.float32, device=dev)
    if n and max_kv:
        # gather KV [bs, max_kv, D]
        pos = torch.arange(max_kv, device=dev)
        valid_kv = pos[None, :] < kvl[:, None]
        r2t = req_to_token[req_pool_indices.to(req_to_token.device, torch.int64)][:, :max_kv]
        slots = torch.where(valid_kv, r2t.to(dev, torch.int64), 0)  # int64 slots, 0 past the end
        src = kv_flat.view(torch.uint8) if kv_flat.dtype == FP8_DTYPE else kv_flat
        rows = src[slots.reshape(-1)]
        if kv_flat.dtype == FP8_DTYPE:
            rows = rows.view(FP8_DTYPE)
        kv = rows.reshape(bs, max_kv, -1).float()
        # pad queries [bs, max_q, H, D]
        qi = torch.arange(max_q, device=dev)
        valid_q = qi[None, :] < qlens[:, None]  # [bs, max_q]
        tok = (indptr[:-1, None] + qi[None, :]).clamp(max=max(n - 1, 0))
        q = torch.cat([q_nope, q_pe], -1).float()[tok]  # [bs, max_q, H, D]
        s = torch.einsum("bqhd,bkd->bqhk", q, kv) * (sm_scale * k_scale)
        bound = kvl[:, None] - qlens[:, None] + qi[None, :] + 1  # [bs, max_q]
        vis = (pos[None, None, :] < bound[:, :, None]) & valid_kv[:, None, :]
        s = s.masked_fill(~vis[:, :, None, :], float("-inf"))
        m = s.amax(-1, keepdim=True)
        m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
        p = torch.exp(s - m)
        den = p.sum(-1, keepdim=True)
        o = torch.einsum("bqhk,bkd->bqhd", p, kv[..., :dv]) * v_scale
        o = torch.where(den > 0, o / den.clamp_min(1e-30), torch.zeros_like(o))
        l_ = torch.where(den > 0, torch.log(den.clamp_min(1e-30)) + m,
                         torch.full_like(m, float("-inf"))).squeeze(-1)
        res[tok[valid_q]] = o[valid_q]
        lse[tok[valid_q]] = l_[valid_q]
    if out is None:
        out = torch.empty((n, h, dv), dtype=q_nope.dtype, device=dev)
    out.copy_(res.to(out.dtype))
    return (out, lse) if return_lse else out


def combine_splits_ref(part: torch.Tensor, part_lse: torch.Tensor, out: torch.Tensor,
                       lse: torch.Tensor | None = None) -> None:
    """Torch twin of ``combine.combine_splits``."""
    n, h, dv = out.shape
    m = part_lse.amax(0)
    m_use = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    w = torch.exp2(part_lse - m_use)  # [S, rows]
    tot = w.sum(0)
    part = torch.where(w[..., None] > 0, part.float(), torch.zeros((), device=part.device))
    res = (w[..., None] * part).sum(0) / tot.clamp_min(1e-30)[:, None]
    res = torch.where(tot[:, None] > 0, res, torch.zeros_like(res))
    out.copy_(res.view(n, h, dv).to(out.dtype))
    if lse is not None:
        val = torch.where(tot > 0, m_use + torch.log2(tot.clamp_min(1e-30)), float("-inf"))
        lse.copy_((val * 0.6931471805599453).view(n, h))
