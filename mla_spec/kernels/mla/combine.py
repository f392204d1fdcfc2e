"""Merge split-KV partials (Triton :func:`combine_splits`, CUDA ``csrc/mla_combine.cu``;
:func:`combine_splits_fast` takes the faster). Split ``s`` of row ``r`` left a normalized partial
``o_s`` and its log2-sum-exp ``lse_s`` (``-inf``: nothing visible)::

    out = sum_s w_s o_s / sum_s w_s,   w_s = 2 ** (lse_s - max_s lse_s),   lse = log2(sum) + max
"""

from __future__ import annotations

import ctypes

import torch
import triton
import triton.language as tl

from mla_spec.device import use_triton
from mla_spec.kernels.launch.cuda_driver import CudaKernel, cuda_kernels_available
from mla_spec.kernels.launch.pdl import gdc_enter, pdl_kwargs, pdl_on
from mla_spec.kernels.launch.triton_launcher import TritonLauncher
from mla_spec.kernels.mla.reference import combine_splits_ref

__all__ = ["KEEP_PARTIAL_BYTES", "SplitBuffers", "combine_cuda_preferred",
           "combine_cuda_supported", "combine_groups", "combine_splits", "combine_splits_cuda",
           "combine_splits_fast", "combine_splits_ref"]


# One load round up to 128 splits, past that blocks of 64; few rows: 64 columns a program on
# 1-2 warps, from 256 rows whole rows (measured: docs/bench_mla.md).
@triton.jit
def _weighted(ls, part, m_use):
    """``(sum_s w_s, sum_s w_s o_s)`` of a block of splits (an empty split's partial unread)."""
    w = tl.exp2(ls - m_use)
    den = tl.sum(w, 0)
    part = tl.where(w[:, None] > 0.0, part, 0.0)
    return den, tl.sum(part * w[:, None], 0)


@triton.jit
def combine_program(Part, PLse, Out, Lse, num_splits, H, stride_ps, stride_ls,
                    stride_o_t, stride_o_h,
                    DV: tl.constexpr, BLOCK_D: tl.constexpr, S_BLOCK: tl.constexpr,
                    WRITE_LSE: tl.constexpr, ONE_BLOCK: tl.constexpr):
    """One program: row ``program_id(0)``, a ``BLOCK_D`` column slab of all splits in one round."""
    r = tl.program_id(0).to(tl.int64)
    pid_d = tl.program_id(1)
    offs = pid_d * BLOCK_D + tl.arange(0, BLOCK_D)
    offs_s = tl.arange(0, S_BLOCK)
    if ONE_BLOCK:  # every split in one block: the LSEs and the partials in one load round
        mask_s = offs_s < num_splits
        ls = tl.load(PLse + offs_s * stride_ls + r, mask=mask_s, other=float("-inf"))
        part = tl.load(Part + offs_s[:, None] * stride_ps + r * DV + offs[None, :],
                       mask=mask_s[:, None], other=0.0).to(tl.float32)
        m = tl.max(ls, 0)
        m_use = tl.where(m == float("-inf"), 0.0, m)
        den, acc = _weighted(ls, part, m_use)
    else:
        m = tl.max(tl.full([S_BLOCK], float("-inf"), dtype=tl.float32), 0)
        for s0 in range(0, num_splits, S_BLOCK):
            ls = tl.load(PLse + (s0 + offs_s) * stride_ls + r, mask=s0 + offs_s < num_splits,
                         other=float("-inf"))
            m = tl.maximum(m, tl.max(ls, 0))
        m_use = tl.where(m == float("-inf"), 0.0, m)
        den = tl.sum(tl.zeros([S_BLOCK], dtype=tl.float32), 0)
        acc = tl.zeros([BLOCK_D], dtype=tl.float32)
        for s0 in range(0, num_splits, S_BLOCK):
            mask_s = s0 + offs_s < num_splits
            ls = tl.load(PLse + (s0 + offs_s) * stride_ls + r, mask=mask_s, other=float("-inf"))
            part = tl.load(Part + (s0 + offs_s)[:, None] * stride_ps + r * DV + offs[None, :],
                           mask=mask_s[:, None], other=0.0).to(tl.float32)
            d, a = _weighted(ls, part, m_use)
            den += d
            acc += a
    has = den > 0.0
    res = tl.where(has, acc / tl.where(has, den, 1.0), 0.0)
    t = r // H
    h = r % H
    tl.store(Out + t * stride_o_t + h * stride_o_h + offs, res.to(Out.dtype.element_ty))
    if WRITE_LSE:
        if pid_d == 0:
            lse = tl.where(has, m + tl.log2(tl.where(has, den, 1.0)), float("-inf"))
            tl.store(Lse + r, lse * 0.6931471805599453)


@triton.jit(do_not_specialize=["num_splits", "H", "stride_ls"])
def _combine_kernel(Part, PLse, Out, Lse, num_splits, H, stride_ps, stride_ls,
                    stride_o_t, stride_o_h,
                    DV: tl.constexpr, BLOCK_D: tl.constexpr, S_BLOCK: tl.constexpr,
                    WRITE_LSE: tl.constexpr, ONE_BLOCK: tl.constexpr, USE_GDC: tl.constexpr):
    gdc_enter(USE_GDC)
    combine_program(Part, PLse, Out, Lse, num_splits, H, stride_ps, stride_ls, stride_o_t,
                    stride_o_h, DV, BLOCK_D, S_BLOCK, WRITE_LSE, ONE_BLOCK)


_COMBINE = TritonLauncher(_combine_kernel)

#: split partials up to this size stay with a bound call (:class:`SplitBuffers`)
KEEP_PARTIAL_BYTES = 8 << 20


class SplitBuffers:
    """A bound call's split partials ``(part, part_lse)``: one pair kept and reused on the stream
    the call was bound on (stream order makes that safe: the next call's split kernel writes them
    after this call's combine read them, under PDL too, since the attention kernels write only
    after their wait); a fresh pair on another stream (a graph capture's) or above
    :data:`KEEP_PARTIAL_BYTES`."""

    def __init__(self, shapes: tuple, dtype: torch.dtype, device: torch.device):
        self.shapes, self.dtype, self.device = shapes, dtype, device
        self.stream = torch._C._cuda_getCurrentRawStream(device.index)
        small = torch.Size(shapes[0]).numel() * dtype.itemsize <= KEEP_PARTIAL_BYTES
        self.kept = self.fresh() if small else None

    def fresh(self) -> tuple[torch.Tensor, torch.Tensor]:
        return (torch.empty(self.shapes[0], dtype=self.dtype, device=self.device),
                torch.empty(self.shapes[1], dtype=torch.float32, device=self.device))

    def get(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self.kept is not None and \
                torch._C._cuda_getCurrentRawStream(self.device.index) == self.stream:
            return self.kept
        return self.fresh()


def combine_splits(part: torch.Tensor, part_lse: torch.Tensor, out: torch.Tensor,
                   lse: torch.Tensor | None = None, *, bind: bool = False):
    """Merge ``part [S, N*H, Dv]`` / ``part_lse [S, N*H]`` into ``out [N, H, Dv]`` (and ``lse``).
    ``bind``: also return ``go(part, part_lse, out, lse) -> bool`` relaunching the same binary on
    tensors of the same shapes, strides, dtypes and alignment (None where it cannot)."""
    s, rows, dv = part.shape
    n, h, _ = out.shape
    if rows != n * h:
        raise ValueError(f"partials have {rows} rows; out has {n} x {h}")
    if not use_triton(part):
        combine_splits_ref(part, part_lse, out, lse)
        return None
    if rows == 0:
        return None
    s_block = max(2, triton.next_power_of_2(s)) if s <= 128 else 64
    if not part.is_cuda:
        block_d, warps = dv, 4
    elif s > 128:
        block_d, warps = min(dv, 128), 4
    elif rows >= 256:  # whole rows; bf16 partials on 2 warps
        block_d, warps = dv, 2 if part.dtype == torch.bfloat16 else 4
    else:
        block_d, warps = min(dv, 64), 2 if s_block >= 128 else 1
    pdl = pdl_kwargs(part)
    args = ((rows, triton.cdiv(dv, block_d)),
            (part, part_lse, out, lse if lse is not None else part_lse),
            (s, h, part.stride(0), part_lse.stride(0), out.stride(0), out.stride(1)),
            (dv, block_d, s_block, lse is not None, s <= s_block, pdl["USE_GDC"]),
            warps, {"launch_pdl": pdl["launch_pdl"]})
    _COMBINE.launch(*args)
    go = _COMBINE.relauncher(*args) if bind else None
    if go is None:
        return None
    scal = args[2]
    return lambda part, part_lse, out, lse: go(
        (part.data_ptr(), part_lse.data_ptr(), out.data_ptr(),
         (lse if lse is not None else part_lse).data_ptr()), scal)

_SRC = "mla_combine.cu"
_DV = 512
_GROUPS = (2, 4, 8, 16, 32)  # split groups a row (G); a CTA takes 32 / G rows
_KMAX = 4  # splits a thread loads in its one round (more: a second, serial loop)
_KERNELS = {(bf16, g): CudaKernel(_SRC, f"mla_combine_{'bf16' if bf16 else 'f32'}_g{g}")
            for bf16 in (True, False) for g in _GROUPS}


class _CombineParams(ctypes.Structure):
    """``CombineParams`` of ``csrc/mla_combine.cu``."""

    _fields_ = [(n, ctypes.c_void_p) for n in ("part", "part_lse", "out", "lse")] + \
        [(n, ctypes.c_longlong) for n in ("s_ps", "s_ls", "s_o_t", "s_o_h")] + \
        [(n, ctypes.c_int) for n in ("rows", "H", "S", "pad")]


def combine_groups(num_splits: int) -> int:
    """Split groups per row: the fewest (2..32) that load every split in one round of ``_KMAX``."""
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
    """:func:`combine_splits` on the CUDA kernel; ValueError where it does not apply."""
    why = combine_cuda_supported(part, part_lse, out, lse)
    if why:
        raise ValueError(why)
    _launch_cuda(part, part_lse, out, lse)


def _launch_cuda(part: torch.Tensor, part_lse: torch.Tensor, out: torch.Tensor,
                 lse: torch.Tensor | None, bind: bool = False):
    """The CUDA combine on tensors :func:`combine_cuda_supported` took (``bind``: as in
    :func:`combine_splits`)."""
    s, rows, _ = part.shape
    n, h, _ = out.shape
    if rows != n * h:
        raise ValueError(f"partials have {rows} rows; out has {n} x {h}")
    if rows == 0:
        return None
    g = combine_groups(s)
    p = _CombineParams(part.data_ptr(), part_lse.data_ptr(), out.data_ptr(),
                       lse.data_ptr() if lse is not None else None,
                       part.stride(0), part_lse.stride(0), out.stride(0), out.stride(1),
                       rows, h, s, 0)
    launch = _KERNELS[(part.dtype == torch.bfloat16, g)].prepared(
        (-(-rows // (32 // g)), _DV // 64, 1), 256, 0, part.device, pdl=pdl_on(part))
    launch(p)
    if not bind:
        return None

    def go(part, part_lse, out, lse) -> bool:
        p.part, p.part_lse, p.out = part.data_ptr(), part_lse.data_ptr(), out.data_ptr()
        p.lse = lse.data_ptr() if lse is not None else None
        launch(p)
        return True
    return go


def combine_cuda_preferred(num_splits: int, rows: int) -> bool:
    """Where the CUDA combine measured faster: 64+ splits, or 16+ over 512+ rows."""
    return num_splits >= 64 or (num_splits >= 16 and rows >= 512)


def combine_splits_fast(part: torch.Tensor, part_lse: torch.Tensor, out: torch.Tensor,
                        lse: torch.Tensor | None = None, *, bind: bool = False):
    """:func:`combine_splits_cuda` where it runs and is faster, else :func:`combine_splits`
    (``bind``: as there)."""
    if combine_cuda_preferred(part.shape[0], part.shape[1]) and \
            combine_cuda_supported(part, part_lse, out, lse) is None:
        return _launch_cuda(part, part_lse, out, lse, bind)  # checked just above
    return combine_splits(part, part_lse, out, lse, bind=bind)
