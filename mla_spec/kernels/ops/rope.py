"""Fused rotary embedding of MLA's ``q_pe [N, H, D]`` and ``k_pe [N, D]`` in place of ~24 small
torch kernels: a program computes its token's cos/sin once and rotates 8 rows (row ``H``: ``k_pe``).
For pair ``i`` of DeepSeek's interleaved layout (:func:`rope_qk_ref`)::

    f    = float32(position) * inv_freq[i]                  # fp32
    c, s = cos(f) * attention_factor, sin(f) * attention_factor
    y[2i]   = x[2i] * c - x[2i+1] * s                       # fp32, then cast to x's dtype
    y[2i+1] = x[2i+1] * c + x[2i] * s
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from mla_spec.device import use_triton
from mla_spec.kernels.launch.pdl import gdc_enter, pdl_kwargs

__all__ = ["rope_qk", "rope_qk_ref", "rope_cos_sin", "apply_rope_interleaved", "SUPPORTED_DTYPES"]

SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@triton.jit
def _rotate_row(src, dst, pairs, mask, c, s):
    """Rotate the ``[BP]`` pairs of one row (unit stride) from ``src`` into ``dst``."""
    x1 = tl.load(src + 2 * pairs, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(src + 2 * pairs + 1, mask=mask, other=0.0).to(tl.float32)
    ty = dst.dtype.element_ty
    tl.store(dst + 2 * pairs, (x1 * c - x2 * s).to(ty), mask=mask)
    tl.store(dst + 2 * pairs + 1, (x2 * c + x1 * s).to(ty), mask=mask)


@triton.jit
def _rope_qk_kernel(pos_ptr, freq_ptr, q_ptr, k_ptr, qo_ptr, ko_ptr, attn_factor, H, HALF,
                    stride_qn, stride_qh, stride_kn, stride_qon, stride_qoh, stride_kon,
                    HB: tl.constexpr, BP: tl.constexpr, USE_GDC: tl.constexpr):
    gdc_enter(USE_GDC)
    # 1-d rows in cos/sin's own layout: a [heads, pairs] tile recomputes cos/sin per element
    n = tl.program_id(0).to(tl.int64)
    h0 = tl.program_id(1) * HB
    pairs = tl.arange(0, BP)
    mask = pairs < HALF
    f = tl.load(pos_ptr + n).to(tl.float32) * tl.load(freq_ptr + pairs, mask=mask, other=0.0)
    c = tl.cos(f) * attn_factor
    s = tl.sin(f) * attn_factor
    for i in tl.static_range(HB):
        h = h0 + i
        if h < H:
            _rotate_row(q_ptr + n * stride_qn + h * stride_qh,
                        qo_ptr + n * stride_qon + h * stride_qoh, pairs, mask, c, s)
        elif h == H:
            _rotate_row(k_ptr + n * stride_kn, ko_ptr + n * stride_kon, pairs, mask, c, s)


def rope_cos_sin(positions: torch.Tensor, inv_freq: torch.Tensor, attention_factor: float
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """``[*P, D/2]`` fp32 cos and sin at ``positions`` (attention factor applied)."""
    freqs = positions.to(torch.float32)[..., None] * inv_freq.to(positions.device)
    return freqs.cos() * attention_factor, freqs.sin() * attention_factor


def apply_rope_interleaved(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate adjacent pairs of ``x [..., dim]`` by ``cos`` / ``sin`` ``[..., dim/2]`` in fp32."""
    xf = x.float()
    x1, x2 = xf[..., 0::2], xf[..., 1::2]
    out = torch.stack((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
    return out.flatten(-2).to(x.dtype)


def rope_qk_ref(positions: torch.Tensor, q_pe: torch.Tensor, k_pe: torch.Tensor,
                inv_freq: torch.Tensor, attention_factor: float = 1.0
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """Torch reference of :func:`rope_qk`, for any leading dims."""
    cos, sin = rope_cos_sin(positions, inv_freq, attention_factor)
    return (apply_rope_interleaved(q_pe, cos[..., None, :], sin[..., None, :]),
            apply_rope_interleaved(k_pe, cos, sin))


def _check(positions, q_pe, k_pe, inv_freq) -> None:
    if positions.dim() != 1 or q_pe.dim() != 3 or k_pe.dim() != 2:
        raise ValueError(f"rope_qk expects positions [N], q_pe [N, H, D], k_pe [N, D]; got "
                         f"{tuple(positions.shape)}, {tuple(q_pe.shape)}, {tuple(k_pe.shape)}")
    n, _, d = q_pe.shape
    if positions.shape[0] != n or k_pe.shape != (n, d) or d % 2:
        raise ValueError(f"rope_qk: N and an even D must agree: positions {tuple(positions.shape)}"
                         f", q_pe {tuple(q_pe.shape)}, k_pe {tuple(k_pe.shape)}")
    if inv_freq.shape != (d // 2,) or inv_freq.dtype != torch.float32:
        raise ValueError(f"inv_freq must be fp32 [D/2] = [{d // 2}]; got {inv_freq.dtype} "
                         f"{tuple(inv_freq.shape)}")
    if positions.dtype.is_floating_point or positions.dtype == torch.bool:
        raise ValueError(f"positions must be an integer tensor, got {positions.dtype}")
    for name, t in (("q_pe", q_pe), ("k_pe", k_pe)):
        if t.dtype not in SUPPORTED_DTYPES:
            raise ValueError(f"{name}.dtype = {t.dtype}; supported: {SUPPORTED_DTYPES}")
    devs = {t.device for t in (positions, q_pe, k_pe, inv_freq)}
    if len(devs) != 1:
        raise ValueError(f"rope_qk inputs must share one device, got {sorted(map(str, devs))}")


def rope_qk(positions: torch.Tensor, q_pe: torch.Tensor, k_pe: torch.Tensor,
            inv_freq: torch.Tensor, attention_factor: float = 1.0
            ) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate ``q_pe`` and ``k_pe`` at ``positions [N]``; returns new contiguous tensors."""
    _check(positions, q_pe, k_pe, inv_freq)
    if not use_triton(q_pe):
        return rope_qk_ref(positions, q_pe, k_pe, inv_freq, attention_factor)
    n, h, d = q_pe.shape
    if q_pe.stride(-1) != 1:
        q_pe = q_pe.contiguous()
    if k_pe.stride(-1) != 1:
        k_pe = k_pe.contiguous()
    q_out = torch.empty((n, h, d), dtype=q_pe.dtype, device=q_pe.device)
    k_out = torch.empty((n, d), dtype=k_pe.dtype, device=k_pe.device)
    if n == 0 or h == 0:
        return q_out, k_out
    hb = 8 if h >= 8 else h + 1  # rows per program (row h is k_pe); h + 1 rows in all
    _rope_qk_kernel[(n, triton.cdiv(h + 1, hb))](
        positions, inv_freq, q_pe, k_pe, q_out, k_out, float(attention_factor), h, d // 2,
        q_pe.stride(0), q_pe.stride(1), k_pe.stride(0), q_out.stride(0), q_out.stride(1),
        k_out.stride(0), HB=hb, BP=triton.next_power_of_2(d // 2),
        num_warps=1, **pdl_kwargs(q_pe))
    return q_out, k_out
