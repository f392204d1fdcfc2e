"""Launcher of the CUDA split-KV combine (``csrc/mla_combine.cu``), and the dispatch between it
and the Triton one.

Same contract and result as :func:`mla_spec.kernels.mla_decode_combine.combine_splits` (twin:
``combine_splits_ref``) for the shapes it takes: Dv 512, fp32 or bf16 partials with unit row
stride, a bf16 ``out [N, H, 512]`` with contiguous, 16-byte aligned rows, fewer than 2^21
rows. Why a second combine: see the ``.cu`` file's header (at batch 1 the Triton program's ~1700
instructions run once, from a cold instruction cache). :func:`combine_splits_fast` takes the
CUDA kernel where it runs (a CUDA device of sm_90 or newer, nvcc) and measured faster
(:func:`combine_cuda_preferred`), the Triton one elsewhere.
"""

from __future__ import annotations

import ctypes

import torch

from mla_spec.kernels.launch.cuda_driver import CudaKernel, cuda_kernels_available
from mla_spec.kernels.mla_decode_combine import combine_splits
from mla_spec.kernels.launch.pdl import pdl_on

__all__ = ["combine_cuda_preferred", "combine_cuda_supported", "combine_groups",
           "combine_splits_cuda", "combine_splits_fast"]

_SRC = "mla_combine.cu"
_DV = 512
_GROUPS = (2, 4, 8, 16, 32)  # split groups a row (G); a CTA takes 32 / G rows
_KMAX = 4  # splits a thread loads in its one round (more: a second, serial loop)
_KERNELS = {(bf16, g): CudaKernel(_SRC, f"mla_combine_{'bf16' if bf16 else 'f32'}_g{g}")
            for bf16 in (True, False) for g in _GROUPS}


class _CombineParams(ctypes.Structure):
    _fields_ = [(n, ctypes.c_void_p) for n in ("part", "part_lse", "out", "lse")] + \
        [(n, ctypes.c_longlong) for n in ("s_ps", "s_ls", "s_o_t", "s_o_h")] + \
        [(n, ctypes.c_int) for n in ("rows", "H", "S", "pad")]


def combine_groups(num_splits: int) -> int:
    """Split groups a row (G): the fewest that load every split in one round of ``_KMAX`` a
    thread, between 2 and 32."""
    g = 2
    while g < 32 and g * _KMAX < num_splits:
        g *= 2
    return g


def combine_cuda_supported(part: torch.Tensor, part_lse: torch.Tensor, out: torch.Tensor,
                           lse: torch.Tensor | None = None) -> str | None:
    """None when the CUDA combine takes these tensors, else why not."""
    why = cuda_kernels_available(part.device)
    if why:
        return why
    s, rows, dv = part.shape
    if dv != _DV or part.dtype not in (torch.float32, torch.bfloat16) or \
            part.stride(1) != _DV or part.stride(2) != 1:
        return f"the CUDA combine takes fp32 / bf16 partials [S, rows, {_DV}] with unit row " \
               f"stride (got {part.dtype} {tuple(part.shape)} strides {part.stride()})"
    if part_lse.dtype != torch.float32 or part_lse.stride(1) != 1:
        return "the CUDA combine takes fp32 LSEs [S, rows] with unit row stride"
    if out.dtype != torch.bfloat16 or out.stride(-1) != 1 or out.shape[-1] != _DV or \
            out.stride(0) % 8 or out.stride(1) % 8 or out.data_ptr() % 16:
        return f"the CUDA combine writes a bf16 out [N, H, {_DV}] with contiguous, 16-byte " \
               "aligned rows"
    if lse is not None and (lse.dtype != torch.float32 or not lse.is_contiguous()):
        return "the CUDA combine writes a contiguous fp32 lse"
    if rows >= 1 << 21:
        return "the CUDA combine takes fewer than 2^21 rows"
    if part.data_ptr() % 16:
        return "the CUDA combine reads 16-byte aligned partials"
    return None


def combine_splits_cuda(part: torch.Tensor, part_lse: torch.Tensor, out: torch.Tensor,
                        lse: torch.Tensor | None = None) -> None:
    """Merge ``part [S, N*H, 512]`` / ``part_lse [S, N*H]`` into ``out [N, H, 512]`` (and the
    natural-log ``lse [N, H]``) with the CUDA kernel; ValueError when it does not take them
    (:func:`combine_cuda_supported`)."""
    why = combine_cuda_supported(part, part_lse, out, lse)
    if why:
        raise ValueError(why)
    _launch(part, part_lse, out, lse)


def _launch(part: torch.Tensor, part_lse: torch.Tensor, out: torch.Tensor,
            lse: torch.Tensor | None) -> None:
    """The CUDA combine on tensors :func:`combine_cuda_supported` took."""
    s, rows, _ = part.shape
    n, h, _ = out.shape
    if rows != n * h:
        raise ValueError(f"partials have {rows} rows; out has {n} x {h}")
    if rows == 0:
        return
    g = combine_groups(s)
    p = _CombineParams(part.data_ptr(), part_lse.data_ptr(), out.data_ptr(),
                       lse.data_ptr() if lse is not None else None,
                       part.stride(0), part_lse.stride(0), out.stride(0), out.stride(1),
                       rows, h, s, 0)
    _KERNELS[(part.dtype == torch.bfloat16, g)](
        (-(-rows // (32 // g)), _DV // 64, 1), 256, 0, p, part.device, pdl=pdl_on(part))


def combine_cuda_preferred(num_splits: int, rows: int) -> bool:
    """Whether the CUDA combine measured faster than the Triton one at this shape: 64 splits
    or more, or 16 and more over 512 rows and more. H200, eighteenth session, per call of the
    default split kernel + combine in a graph (``benchmarks/ab_csrc.py --base-combine triton``,
    docs/bench_mla.md v16): faster at 128 splits x 32 rows (FP8 ctx 32k 16.6 -> 14.7 µs; bf16
    the same, 18.9-19.6 / 19.2-19.4) and 16 x 512 (20.8 -> 19.1); slower at 32 splits x 32 or
    128 rows (9.0 -> 9.8, 13.5 -> 14.2) and ~1% slower at 2 and 4 splits."""
    return num_splits >= 64 or (num_splits >= 16 and rows >= 512)


def combine_splits_fast(part: torch.Tensor, part_lse: torch.Tensor, out: torch.Tensor,
                        lse: torch.Tensor | None = None) -> None:
    """:func:`combine_splits_cuda` where it runs and is the faster one
    (:func:`combine_cuda_preferred`), else the Triton :func:`combine_splits`."""
    if combine_cuda_preferred(part.shape[0], part.shape[1]) and \
            combine_cuda_supported(part, part_lse, out, lse) is None:
        _launch(part, part_lse, out, lse)  # checked just above
    else:
        combine_splits(part, part_lse, out, lse)
