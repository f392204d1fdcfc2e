"""Fused RMSNorm (and residual-add + RMSNorm): one program per row (strided rows allowed; over
``MAX_BLOCK``: two passes), fp32 math, in place of ~8 small torch kernels; equal to
:func:`rms_norm_ref` up to the sum order and ``rsqrt``'s last ulp::

    xn  = (x.float() * rsqrt(mean(x.float()**2, -1) + eps)).to(x.dtype)   # normalize in fp32
    out = weight * xn                                                       # torch promotion
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from mla_spec.device import use_triton
from mla_spec.kernels.launch.pdl import gdc_enter, pdl_on
from mla_spec.kernels.launch.triton_launcher import TritonLauncher

__all__ = ["rms_norm", "rms_norm_ref", "rms_norm_add", "rms_norm_add_ref", "SUPPORTED_DTYPES",
           "MAX_BLOCK"]

SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
#: widest row kept in registers in one tile (7168 -> 8192 lanes on 8 warps)
MAX_BLOCK = 8192


@triton.jit
def _rmsnorm_kernel(x_ptr, r_ptr, w_ptr, out_ptr, s_ptr, eps, N,
                    stride_x, stride_r, stride_o, stride_s,
                    BLOCK: tl.constexpr, NUM_CHUNKS: tl.constexpr, HAS_RES: tl.constexpr,
                    USE_GDC: tl.constexpr):
    gdc_enter(USE_GDC)
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * stride_x
    r_row = r_ptr + row * stride_r
    o_row = out_ptr + row * stride_o
    s_row = s_ptr + row * stride_s
    x_ty = x_ptr.dtype.element_ty
    offs = tl.arange(0, BLOCK)
    if NUM_CHUNKS == 1:
        mask = offs < N
        x = tl.load(x_row + offs, mask=mask, other=0.0).to(tl.float32)
        if HAS_RES:  # s = x + r rounded to x's dtype (fp32 math first: interpreter bf16 is bad)
            r = tl.load(r_row + offs, mask=mask, other=0.0).to(tl.float32)
            s = (x + r).to(x_ty)
            tl.store(s_row + offs, s, mask=mask)
            x = s.to(tl.float32)
        rstd = tl.div_rn(1.0, tl.sqrt_rn(tl.sum(x * x, axis=0) / N + eps))
        xn = (x * rstd).to(x_ty).to(tl.float32)
        w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        tl.store(o_row + offs, (xn * w).to(out_ptr.dtype.element_ty), mask=mask)
    else:
        acc = tl.zeros([BLOCK], dtype=tl.float32)
        for c in range(NUM_CHUNKS):
            o = c * BLOCK + offs
            mask = o < N
            x = tl.load(x_row + o, mask=mask, other=0.0).to(tl.float32)
            if HAS_RES:
                r = tl.load(r_row + o, mask=mask, other=0.0).to(tl.float32)
                s = (x + r).to(x_ty)
                tl.store(s_row + o, s, mask=mask)
                x = s.to(tl.float32)
            acc += x * x
        rstd = tl.div_rn(1.0, tl.sqrt_rn(tl.sum(acc, axis=0) / N + eps))
        for c in range(NUM_CHUNKS):
            o = c * BLOCK + offs
            mask = o < N
            x = tl.load(x_row + o, mask=mask, other=0.0).to(tl.float32)
            if HAS_RES:  # recompute the rounded sum (same value as stored; no re-read)
                r = tl.load(r_row + o, mask=mask, other=0.0).to(tl.float32)
                x = (x + r).to(x_ty).to(tl.float32)
            xn = (x * rstd).to(x_ty).to(tl.float32)
            w = tl.load(w_ptr + o, mask=mask, other=0.0).to(tl.float32)
            tl.store(o_row + o, (xn * w).to(out_ptr.dtype.element_ty), mask=mask)


_LAUNCH = TritonLauncher(_rmsnorm_kernel)


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """Torch reference of :func:`rms_norm`: exactly the model's original ``RMSNorm.forward``."""
    dtype = x.dtype
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(dtype)


def rms_norm_add_ref(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                     eps: float = 1e-6) -> tuple[torch.Tensor, torch.Tensor]:
    """Torch reference of :func:`rms_norm_add`: ``s = x + residual``; ``(rms_norm_ref(s), s)``."""
    s = x + residual
    return rms_norm_ref(s, weight, eps), s


def _check(x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor | None = None) -> None:
    if not isinstance(x, torch.Tensor) or x.dim() == 0:
        raise ValueError(f"x must be a tensor [..., N]; got {type(x).__name__} "
                         f"{tuple(getattr(x, 'shape', ()))}")
    n = x.shape[-1]
    if weight.dim() != 1 or weight.shape[0] != n:
        raise ValueError(f"weight must be [N] = [{n}] (x's last dim); got {tuple(weight.shape)}")
    if weight.device != x.device:
        raise ValueError(f"weight is on {weight.device}, x on {x.device}: use one device")
    for nm, t in (("x", x), ("weight", weight)) + ((("residual", residual),) if residual
                                                     is not None else ()):
        if t.dtype not in SUPPORTED_DTYPES:
            raise ValueError(f"{nm}.dtype = {t.dtype}; supported: {SUPPORTED_DTYPES}")
    if residual is not None:
        if residual.shape != x.shape or residual.dtype != x.dtype or residual.device != x.device:
            raise ValueError(f"residual must match x (shape {tuple(x.shape)}, {x.dtype}, "
                             f"{x.device}); got {tuple(residual.shape)}, {residual.dtype}, "
                             f"{residual.device}")


def _rows(t: torch.Tensor) -> torch.Tensor:
    """``[..., N]`` -> ``[R, N]`` with unit last stride (a view whenever possible)."""
    t2 = t.reshape(-1, t.shape[-1])
    return t2 if t2.stride(-1) == 1 or t2.shape[-1] <= 1 else t2.contiguous()


def _blocks(n: int, max_block: int) -> tuple[int, int, int]:
    block = min(triton.next_power_of_2(max(n, 1)), triton.next_power_of_2(max_block))
    warps = 8 if block >= 4096 else 4 if block >= 1024 else 2 if block >= 256 else 1
    return block, triton.cdiv(n, block), warps


def _launch(x2, r2, weight, out2, s2, eps, max_block):
    rows, n = x2.shape
    if rows == 0 or n == 0:
        return
    block, chunks, warps = _blocks(n, max_block)
    has_res = r2 is not None
    r2 = r2 if has_res else x2  # unused pointers: any valid tensor
    s2 = s2 if has_res else out2
    gdc = pdl_on(x2)
    key = (x2.dtype, weight.dtype, out2.dtype, n, x2.stride(0), r2.stride(0), out2.stride(0),
           s2.stride(0), x2.get_device(), x2.data_ptr() & 15, r2.data_ptr() & 15,
           weight.data_ptr() & 15, out2.data_ptr() & 15, s2.data_ptr() & 15, block, chunks,
           has_res, warps, gdc)
    tensors = (x2, r2, weight, out2, s2)
    scalars = (float(eps), n, x2.stride(0), r2.stride(0), out2.stride(0), s2.stride(0), block,
               chunks, has_res, gdc)
    _LAUNCH(rows, key, tensors, tuple(t.data_ptr() for t in tensors), scalars, warps,
            {"launch_pdl": gdc})


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6, *,
             max_block: int = MAX_BLOCK) -> torch.Tensor:
    """RMSNorm of ``x [..., N]`` by ``weight [N]``; the result in ``promote_types(weight, x)``."""
    _check(x, weight)
    if not use_triton(x):
        return rms_norm_ref(x, weight, eps)
    out = torch.empty(x.shape, dtype=torch.promote_types(weight.dtype, x.dtype), device=x.device)
    _launch(_rows(x), None, weight.contiguous(), out.view(-1, x.shape[-1]), None, eps, max_block)
    return out


def rms_norm_add(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                 eps: float = 1e-6, *, max_block: int = MAX_BLOCK
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """``s = x + residual`` (x's dtype) and ``rms_norm(s)`` in one kernel: new ``(out, s)``."""
    _check(x, weight, residual)
    if not use_triton(x):
        return rms_norm_add_ref(x, residual, weight, eps)
    n = x.shape[-1]
    out = torch.empty(x.shape, dtype=torch.promote_types(weight.dtype, x.dtype), device=x.device)
    s = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    _launch(_rows(x), _rows(residual), weight.contiguous(), out.view(-1, n), s.view(-1, n), eps,
            max_block)
    return out, s
