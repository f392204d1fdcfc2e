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
   rows are written by the kernel just before) and compute everything else after the wait:
   0.1-1.8 µs per call at batch 1 (H200, sixth session). Prefetching a weight kernel's whole
   slice the same way was tried and measured slower (the DECODE layer 119.9 -> 132.6 µs:
   the prefetches compete with the kernel's own loads), so the weight kernels do not. The
   CUDA wgmma kernels keep it off (their ``p`` builds have it): at batch 1 ctx 32k every form
   of it (tensor, bulk, per line) made a call 0.3-5.8 µs slower, and tiles prefetched 6 µs
   ahead still arrived at the HBM pace (H200, twentieth session, docs/bench_mla.md v18).
   Instead, when the caller asks (``early_kv``, a contract on what the kernels ahead wrote:
   ``mla_decode_wgmma.launch_wgmma_mla``), their ``_ek`` builds load the first KV tile into
   shared memory before the wait: batch 1 ctx 32k 2.5-5% faster (v19).
5. *The attention split kernels trigger late.* They wait first (:func:`gdc_wait`) but let the
   next grid (the split combine) launch only after their KV loop (:func:`gdc_launch`). With
   the trigger at the start, the combine's programs were launched at once and sat resident
   through the whole loop: at batch 1 and 32k context the bf16 kernel ran 42.7 µs with PDL
   against 35.7 without; triggered late, 34.0 (``benchmarks/sweep_mla.py``, sixth session).
   The weight GEMVs keep the early trigger (probably because their dependent, in a chain of
   weight kernels, does useful work while it waits: its early weight loads, rule 3); moving
   their trigger after the K loop measured slower (NVFP4 ``mmab`` at 8 tokens 28.4 -> 33.8 µs
   per call in a chain; ``benchmarks/bench_nvfp4.py --pinned``). Short kernels use
   :func:`gdc_enter`. The CUDA wgmma split kernels (``W``, ``W64``, ``WE``, ``WR``, ``WE2`` /
   ``WE8``) trigger later still when the combine kernel follows them: after their stores, so
   that the combine's programs are not launched while the split CTAs still run their epilogue:
   1.4-3.1% a call at batch 1 ctx 16k-32k for ``W`` and ``WE8`` (bf16 and FP8, H200,
   twenty-third session, docs/bench_mla.md v21); ``WR`` at batch 1 unchanged (0.993-1.001,
   v22). With one split, ``W``'s splits merged inside its grid or ``WR``'s inside its cluster
   (no combine: the dependent is the next layer's kernel), they keep the trigger after the
   loop: after the stores, batch 128 ctx 1k was 0.8% slower.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from mla_spec.device import cuda_capability, env_flag

__all__ = ["L2_PREFETCH", "PDL", "gdc_enter", "gdc_launch", "gdc_wait", "l2pf_on", "pdl_kwargs",
           "pdl_on", "prefetch_l2"]

#: On by default on sm_90+ (read at every launch). ``MLA_SPEC_PDL=0`` turns it off at import.
PDL = env_flag("MLA_SPEC_PDL", True)
#: The attention kernels prefetch their first KV tiles into L2 before the PDL wait (rule 4); read
#: at every launch, ``MLA_SPEC_L2PF=0`` turns it off at import.
L2_PREFETCH = env_flag("MLA_SPEC_L2PF", True)


def pdl_on(t: torch.Tensor) -> bool:
    """Whether kernels on ``t``'s device use PDL: ``PDL`` and a CUDA device of sm_90 or newer."""
    return bool(PDL) and t.is_cuda and cuda_capability(t.device)[0] >= 9


def l2pf_on(t: torch.Tensor) -> bool:
    """Whether kernels on ``t``'s device issue L2 prefetches: ``L2_PREFETCH`` and a CUDA tensor
    (inline PTX: never under the interpreter)."""
    return bool(L2_PREFETCH) and t.is_cuda


def pdl_kwargs(t: torch.Tensor, allow: bool = True) -> dict:
    """Launch keywords of a ``USE_GDC`` kernel on ``t``'s device: the constexpr and Triton's
    ``launch_pdl`` option, both :func:`pdl_on` and ``allow`` (a kernel variant measured slower
    with PDL passes False; ``launch_pdl=False`` is Triton's default)."""
    on = allow and pdl_on(t)
    return {"USE_GDC": on, "launch_pdl": on}


@triton.jit
def gdc_enter(USE_GDC: tl.constexpr):
    """Wait for the previous grid, then let the next one launch (module docstring): for short
    kernels."""
    if USE_GDC:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()


@triton.jit
def gdc_wait(USE_GDC: tl.constexpr):
    """Wait for the previous grid (step 1 alone; the kernel calls :func:`gdc_launch` after its
    main loop, rule 5)."""
    if USE_GDC:
        tl.extra.cuda.gdc_wait()


@triton.jit
def gdc_launch(USE_GDC: tl.constexpr):
    """Let the next grid launch (step 2): the attention split kernels call it after their KV
    loop, so the combine's programs are not resident and waiting while the loop runs (rule
    5)."""
    if USE_GDC:
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

