"""Programmatic dependent launch (PDL, sm_90+; ``options.PDL``, ``options.L2_PREFETCH``, read at
every launch); why and measurements: docs/design.md, docs/bench_layer.md. In a ``USE_GDC`` kernel:

1. ``gdc_wait`` first: nothing is read or written before the previous grid has completed.
2. ``gdc_launch_dependents`` next: the following kernel may launch; at most two grids overlap.
3. Weights may be read before the wait (no decode kernel writes one).
4. L2 prefetches may run before the wait (:func:`prefetch_l2`): a hint cannot change a result.
5. Attention split kernels trigger late (:func:`gdc_launch` after the KV loop).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from mla_spec.device import cuda_capability
from mla_spec.kernels import options

__all__ = ["gdc_enter", "gdc_launch", "gdc_wait", "l2pf_on", "pdl_kwargs", "pdl_on", "prefetch_l2"]


def pdl_on(t: torch.Tensor) -> bool:
    """Whether kernels on ``t``'s device use PDL: ``options.PDL`` and sm_90 or newer."""
    return bool(options.PDL) and t.is_cuda and cuda_capability(t.device)[0] >= 9


def l2pf_on(t: torch.Tensor) -> bool:
    """Whether kernels on ``t``'s device issue L2 prefetches (inline PTX: CUDA only)."""
    return bool(options.L2_PREFETCH) and t.is_cuda


def pdl_kwargs(t: torch.Tensor, allow: bool = True) -> dict:
    """``USE_GDC`` and ``launch_pdl`` of a kernel: :func:`pdl_on` and ``allow``."""
    on = allow and pdl_on(t)
    return {"USE_GDC": on, "launch_pdl": on}


@triton.jit
def gdc_enter(USE_GDC: tl.constexpr):
    """Wait for the previous grid, then let the next one launch (rules 1 and 2)."""
    if USE_GDC:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()


@triton.jit
def gdc_wait(USE_GDC: tl.constexpr):
    """Wait for the previous grid (rule 1 alone; :func:`gdc_launch` comes later, rule 5)."""
    if USE_GDC:
        tl.extra.cuda.gdc_wait()


@triton.jit
def gdc_launch(USE_GDC: tl.constexpr):
    """Let the next grid launch (rule 2), late (rule 5)."""
    if USE_GDC:
        tl.extra.cuda.gdc_launch_dependents()


@triton.jit
def prefetch_l2(ptrs, mask):
    """``prefetch.global.L2`` of ``ptrs`` where ``mask`` (GPU only; rule 4)."""
    tl.inline_asm_elementwise(
        "{ .reg .pred p; setp.ne.b32 p, $2, 0; @p prefetch.global.L2 [$1]; mov.u32 $0, 0; }",
        "=r,l,r", [ptrs, mask.to(tl.int32)], dtype=tl.int32, is_pure=False, pack=1)

