"""Write new latent KV rows ``[ckv | kpe]`` into a layer's paged cache ``[num_slots, 576]`` at slots
``loc`` (negative: skip), as ``saturate(x / scale)`` e4m3 for an FP8 cache, else cast (the
interpreter's e4m3 cast is not RTNE, triton#8322: it quantizes with torch first).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from mla_spec.device import triton_interpreting, use_triton
from mla_spec.kernels.launch.pdl import gdc_enter, pdl_kwargs
from mla_spec.quant.fp8 import FP8_DTYPE, FP8_E4M3_MAX, quantize_fp8

__all__ = ["store_kv", "store_kv_ref"]


@triton.jit
def _store_kv_kernel(buf_ptr, loc_ptr, ckv_ptr, kpe_ptr, inv_scale, stride_buf, stride_ckv,
                     stride_kpe, D_CKV: tl.constexpr, D_KPE: tl.constexpr,
                     BLOCK_CKV: tl.constexpr, BLOCK_KPE: tl.constexpr, IS_FP8: tl.constexpr,
                     PREQUANT: tl.constexpr, USE_GDC: tl.constexpr):
    gdc_enter(USE_GDC)
    t = tl.program_id(0)
    slot = tl.load(loc_ptr + t).to(tl.int64)
    if slot >= 0:
        oc = tl.arange(0, BLOCK_CKV)
        op = tl.arange(0, BLOCK_KPE)
        mc = oc < D_CKV
        mp = op < D_KPE
        c = tl.load(ckv_ptr + t.to(tl.int64) * stride_ckv + oc, mask=mc, other=0.0)
        p = tl.load(kpe_ptr + t.to(tl.int64) * stride_kpe + op, mask=mp, other=0.0)
        row = buf_ptr + slot * stride_buf
        if IS_FP8 and not PREQUANT:
            c = tl.clamp(c.to(tl.float32) * inv_scale, -448.0, 448.0)
            p = tl.clamp(p.to(tl.float32) * inv_scale, -448.0, 448.0)
        tl.store(row + oc, c.to(buf_ptr.dtype.element_ty), mask=mc)
        tl.store(row + D_CKV + op, p.to(buf_ptr.dtype.element_ty), mask=mp)


def _same_device(a: torch.device, b: torch.device) -> bool:
    return a.type == b.type and (a.index is None or b.index is None or a.index == b.index)


def _check(buf: torch.Tensor, loc: torch.Tensor, ckv: torch.Tensor, kpe: torch.Tensor):
    if buf.dim() != 2 or buf.stride(1) != 1:
        raise ValueError(f"buf must be a [num_slots, D] view, unit last stride; got {buf.shape}")
    n = loc.numel()
    for nm, t in (("loc", loc), ("ckv", ckv), ("kpe", kpe)):
        if not _same_device(t.device, buf.device):
            raise ValueError(f"{nm} is on {t.device}, the cache on {buf.device}: use one device")
    if n and loc.is_floating_point():  # (an empty IDLE loc may be a float tensor)
        raise ValueError(f"loc must be an integer tensor of slots, got {loc.dtype}")
    for nm, t in (("ckv", ckv), ("kpe", kpe)):
        rows = t.numel() // t.shape[-1] if t.dim() and t.shape[-1] else t.numel()
        if t.dim() == 0 or rows != n:
            raise ValueError(f"{nm} {tuple(t.shape)} has {rows} rows; loc has {n} (one row per "
                             f"slot: [N, D] or [N, 1, D])")
    if n and not buf.is_cuda:  # a host-side range check is free here (no device sync)
        top, slots = int(loc.max()), buf.shape[0]
        if top >= slots:
            raise ValueError(f"loc has slot {top}; the cache has slots 0..{slots - 1}")
    ckv2 = ckv.reshape(n, -1) if ckv.numel() else ckv.reshape(0, buf.shape[1] - kpe.shape[-1])
    kpe2 = kpe.reshape(n, -1) if kpe.numel() else kpe.reshape(0, kpe.shape[-1])
    if ckv2.shape[1] + kpe2.shape[1] != buf.shape[1]:
        raise ValueError(f"ckv width {ckv2.shape[1]} + kpe width {kpe2.shape[1]} != cache row "
                         f"width {buf.shape[1]}")
    if ckv2.stride(-1) != 1 or kpe2.stride(-1) != 1:
        ckv2, kpe2 = ckv2.contiguous(), kpe2.contiguous()
    return ckv2, kpe2


def store_kv(buf: torch.Tensor, loc: torch.Tensor, ckv: torch.Tensor, kpe: torch.Tensor,
             scale: float = 1.0) -> None:
    """``buf[loc[t]] = [ckv[t] | kpe[t]]`` in place (``[N, D]`` or ``[N, 1, D]`` inputs)."""
    ckv2, kpe2 = _check(buf, loc, ckv, kpe)
    n = loc.numel()
    if n == 0:
        return
    if not use_triton(buf):
        store_kv_ref(buf, loc, ckv2, kpe2, scale)
        return
    is_fp8 = buf.dtype == FP8_DTYPE
    prequant = is_fp8 and triton_interpreting()
    if prequant:
        ckv2, kpe2 = quantize_fp8(ckv2, scale), quantize_fp8(kpe2, scale)
    dc, dp = ckv2.shape[1], kpe2.shape[1]
    _store_kv_kernel[(n,)](
        buf, loc.contiguous(), ckv2, kpe2, 1.0 / float(scale),
        buf.stride(0), ckv2.stride(0), kpe2.stride(0), D_CKV=dc, D_KPE=dp,
        BLOCK_CKV=triton.next_power_of_2(dc), BLOCK_KPE=triton.next_power_of_2(dp),
        IS_FP8=is_fp8, PREQUANT=prequant, num_warps=4, **pdl_kwargs(buf))


def store_kv_ref(buf: torch.Tensor, loc: torch.Tensor, ckv: torch.Tensor, kpe: torch.Tensor,
                 scale: float = 1.0) -> None:
    """Torch reference of :func:`store_kv` (same arguments, same result)."""
    n = loc.numel()
    if n == 0:
        return
    keep = loc >= 0
    idx = loc[keep].to(torch.int64)
    row = torch.cat([ckv.reshape(n, -1), kpe.reshape(n, -1)], dim=-1)[keep]
    if buf.dtype == FP8_DTYPE:
        q = (row.float() / scale).clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(FP8_DTYPE)
        buf.view(torch.uint8).index_copy_(0, idx, q.view(torch.uint8))
    else:
        buf.index_copy_(0, idx, row.to(buf.dtype))
