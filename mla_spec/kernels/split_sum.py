"""Deterministic split-K reduction: ``dst[r, :] = src[r].sum(0)`` in fp32, one Triton launch.

The NVFP4 GEMM (``nvfp4_gemm``, split-K tiles) and the sorted fused MoE (``nvfp4_moe_sorted``,
its top-k rows per token) write fp32 partials ``[R, S, N]`` and sum them here in a fixed order:
no atomics, so results do not depend on scheduling. Launched with PDL (it waits for its
producer first). Its twin is ``src.sum(1)``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from mla_spec.kernels.launch.pdl import gdc_enter, pdl_kwargs

__all__ = ["sum_rows"]


@triton.jit
def _sum_rows_kernel(src_ptr, dst_ptr, R, N, S, stride_sr, stride_ss, stride_dr,
                     BLOCK: tl.constexpr, USE_GDC: tl.constexpr):
    """dst[r, n] = sum_s src[r * stride_sr + s * stride_ss + n] (fp32 sum, cast on store)."""
    gdc_enter(USE_GDC)
    r = tl.program_id(0)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < N
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for s in range(0, S):
        acc += tl.load(src_ptr + r * stride_sr + s * stride_ss + offs, mask=ok, other=0.0)
    tl.store(dst_ptr + r * stride_dr + offs, acc.to(dst_ptr.dtype.element_ty), mask=ok)


def sum_rows(src: torch.Tensor, dst: torch.Tensor) -> None:
    """``dst[r, :] = src[r].sum(0)`` for ``src [R, S, N]`` fp32 (last dim contiguous)."""
    r, s, n = src.shape
    block = 1024 if n >= 1024 else triton.next_power_of_2(max(n, 16))
    _sum_rows_kernel[(r, triton.cdiv(n, block))](
        src, dst, r, n, s, src.stride(0), src.stride(1), dst.stride(0), BLOCK=block,
        **pdl_kwargs(src))
