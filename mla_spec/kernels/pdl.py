"""Programmatic dependent launch (PDL) for the decode path's Triton kernels (Hopper and newer).

Why: at decode batch sizes a layer is ~20 kernels of a few µs each, and in a CUDA graph each
kernel boundary still costs ~0.8 µs (H200 profile of one layer: 17.5 µs of gaps in 137.6 µs,
``benchmarks/profile_layer.py``). With PDL a kernel is launched while its predecessor is still
running: its programs are scheduled and run their prologue, then wait in ``griddepcontrol.wait``
until the predecessor has finished and its writes are visible.

The protocol, in every kernel that takes ``USE_GDC`` (:func:`gdc_enter` as its first
statement):

1. ``gdc_wait`` first: nothing is read or written before the previous grid has completed, so
   the kernel is correct whatever ran before it (ours, cuBLAS, torch), PDL or not.
2. ``gdc_launch_dependents`` next: the following kernel may be launched once every program of
   this one has started; it then waits for this one's completion in its own step 1. Since a
   dependent is launched only after all programs of its predecessor are resident, it never
   takes an SM from a program of the predecessor, and at most two grids overlap.
3. *Weights may be read before the wait.* When a kernel starts, every grid before its
   predecessor has completed (the predecessor only released it after its own wait), and no
   kernel of a decode step writes a weight. So the GEMVs (NVFP4 dense and MoE w2, BF16 with
   ``static_w``) load their first weight step, then wait, then read activations: the weight
   reads overlap the previous kernel's tail. The MoE w2 launch also reads its expert ids early
   (the router wrote them two launches back), from L2.
4. *L2 prefetches may run before the wait* (:func:`prefetch_l2`): a hint returns nothing, so
   even an address computed from data the previous grid is still writing cannot change a
   result. The attention kernels prefetch their first KV tiles this way (the KV cache's new
   rows are written by the kernel just before) and compute everything else after the wait;
   the weight kernels (NVFP4 GEMV, ``mmab``, MoE gemv, BF16 GEMV) prefetch their program's
   whole weight slice (:func:`prefetch_rows_l2`, ``L2_PREFETCH``; the MoE's w13 launch after
   the wait, once its expert is known).

Measured on the H200 (``benchmarks/profile_layer.py``, one DeepSeek-V3 layer at bs 1): launch
gaps 17.5 -> 8.3 µs, the layer 131.6 -> 124.6 µs; small pad / unpad calls in a graph
1.83-2.46 -> 1.50-1.83 µs (``benchmarks/bench_pad.py``).

Launchers pass ``**pdl_kwargs(t)`` (``USE_GDC`` and ``launch_pdl``, a compile option of Triton
>= 3.4; the cached launcher takes ``pdl_on(t)`` and ``{"launch_pdl": ...}`` separately). Off
the GPU (the interpreter) both are off and nothing changes. A kernel launched normally after
one of ours simply waits for it to finish (stream order).
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

__all__ = ["L2_PREFETCH", "PDL", "gdc_enter", "l2pf_on", "pdl_kwargs", "pdl_on", "prefetch_l2",
           "prefetch_rows_l2"]

#: On by default on sm_90+ (read at every launch). ``MLA_SPEC_PDL=0`` turns it off at import.
PDL = os.environ.get("MLA_SPEC_PDL", "1") not in ("0", "", "false", "False")
#: Weight kernels prefetch their whole slice into L2 first (:func:`prefetch_rows_l2`); read at
#: every launch, ``MLA_SPEC_L2PF=0`` turns it off at import.
L2_PREFETCH = os.environ.get("MLA_SPEC_L2PF", "1") not in ("0", "", "false", "False")


@functools.cache
def _capable(index: int) -> bool:
    return torch.cuda.get_device_capability(index)[0] >= 9


def pdl_on(t: torch.Tensor) -> bool:
    """Whether kernels on ``t``'s device use PDL: ``PDL`` and a CUDA device of sm_90 or newer."""
    return bool(PDL) and t.is_cuda and _capable(t.get_device())


def l2pf_on(t: torch.Tensor) -> bool:
    """Whether kernels on ``t``'s device issue L2 prefetches: ``L2_PREFETCH`` and a CUDA tensor
    (inline PTX: never under the interpreter)."""
    return bool(L2_PREFETCH) and t.is_cuda


def pdl_kwargs(t: torch.Tensor) -> dict:
    """Launch keywords of a ``USE_GDC`` kernel on ``t``'s device: the constexpr and Triton's
    ``launch_pdl`` option, both :func:`pdl_on` (``launch_pdl=False`` is Triton's default)."""
    on = pdl_on(t)
    return {"USE_GDC": on, "launch_pdl": on}


@triton.jit
def gdc_enter(USE_GDC: tl.constexpr):
    """Wait for the previous grid, then let the next one launch (module docstring)."""
    if USE_GDC:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()


@triton.jit
def prefetch_l2(ptrs, mask):
    """``prefetch.global.L2`` of the 128-byte lines at ``ptrs`` where ``mask`` (GPU only: inline
    PTX, not for the interpreter). A hint without a result: it cannot make a kernel read stale
    data (L2 is where writes land), so it may run before :func:`gdc_enter` on addresses taken
    from inputs the previous grid might still write, as long as they stay inside a buffer.
    Use a tensor of at least as many elements as the program has threads, so that no element
    is replicated across threads (each replica would issue its own prefetch)."""
    tl.inline_asm_elementwise(
        "{ .reg .pred p; setp.ne.b32 p, $2, 0; @p prefetch.global.L2 [$1]; mov.u32 $0, 0; }",
        "=r,l,r", [ptrs, mask.to(tl.int32)], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def prefetch_rows_l2(base, row_stride, n_rows, row_bytes, LINES: tl.constexpr):
    """L2 prefetch of ``n_rows`` rows of ``row_bytes`` bytes each, ``row_stride`` bytes apart
    from ``base`` (an int8 pointer), at most ``LINES`` 128-byte lines, issued column-major (the
    first lines of every row first: a K loop reads all its rows in step). Addresses are clamped
    into each row, so nothing outside the slice is touched.

    Why: a weight GEMV at decode sizes is latency-bound (a few KB in flight per warp), and a
    prefetch costs one instruction per line and no registers; issued for a program's whole
    slice up front, the DRAM reads of the slice overlap each other, and before the PDL wait
    (weights are static, rule 3) the previous kernel's tail too. ``LINES`` should be at least
    the program's thread count (see :func:`prefetch_l2`)."""
    offs = tl.arange(0, LINES)
    rows = tl.maximum(n_rows, 1)
    r = offs % rows
    c = offs // rows
    lpr = tl.cdiv(row_bytes, 128)
    col = tl.minimum(c * 128, tl.maximum(row_bytes - 1, 0))
    prefetch_l2(base + r.to(tl.int64) * row_stride + col, (c < lpr) & (r < n_rows))
