"""Merge the split-KV partials of ``mla_decode`` (flash-decoding's second pass).

Split ``s`` of row ``r`` (a flattened (token, head)) left a normalized partial ``o_s [Dv]`` and
its log2-sum-exp ``lse_s`` (``-inf`` when the split saw no visible KV). The exact result is

    out = sum_s w_s o_s / sum_s w_s,   w_s = 2 ** (lse_s - max_s lse_s),   lse = log2(sum) + max

(zeros and ``-inf`` when every split was empty). Kernel grid ``(rows, Dv / BLOCK_D)``: one
program loads the ``[S, BLOCK_D]`` slab of its row in one shot (no serial walk over the
splits, whose dependent load latencies dominated small batches) and reduces it; partials may be
fp32 or bf16.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from mla_spec.device import use_triton
from mla_spec.kernels.launch.pdl import gdc_enter, pdl_kwargs

__all__ = ["combine_splits", "combine_splits_ref"]


# One load round up to 128 splits: the block is the split count's power of two (2 ... 128; one
# binary each, compiled once), past 128 the splits are walked in fixed blocks of 64, LSEs first.
# The program shape follows the row count (ninth session, H200, per call in a graph): few rows
# (batch 1) take 64 columns per program and 1-2 warps (32 splits x 32 rows 2.16 -> 1.75 µs);
# many rows take whole rows (2 splits x 2048 rows: 16-split blocks of 128 columns 25.2 µs,
# [2, 512] blocks 3.05 µs; 4 x 1024: 13.7 -> 2.87). 16-blocks at 128 splits made 16 dependent
# load rounds, ~10 µs at batch 1 (eighth session). Fourteenth session (sweep_combine.py, every
# (columns, warps) at 2-16 splits x 512-8192 rows): whole rows everywhere from 256 rows, on 4
# warps for fp32 partials (16 x 512: 7.08 -> 5.39 µs) and 2 for bf16 ones, which the old
# shapes had made slower than fp32 (16 x 512: 12.62 -> 4.85; 4 x 1024: 6.88 -> 2.92; 8 x 1024:
# 8.28 -> 4.49).
@triton.jit
def _weighted(ls, part, m_use):
    """One block of splits: ``(sum_s w_s, sum_s w_s o_s)`` with ``w_s = 2 ** (lse_s - m_use)``
    (0 for an empty or absent split, whose partial is never read)."""
    w = tl.exp2(ls - m_use)
    den = tl.sum(w, 0)
    part = tl.where(w[:, None] > 0.0, part, 0.0)
    return den, tl.sum(part * w[:, None], 0)


@triton.jit
def combine_program(Part, PLse, Out, Lse, num_splits, H, stride_ps, stride_ls,
                    stride_o_t, stride_o_h,
                    DV: tl.constexpr, BLOCK_D: tl.constexpr, S_BLOCK: tl.constexpr,
                    WRITE_LSE: tl.constexpr, ONE_BLOCK: tl.constexpr):
    """One program's work, once the previous grid is done: row ``program_id(0)``, columns
    ``program_id(1) * BLOCK_D ..`` (a function of its own so that a benchmark can wrap it in
    timer reads: ``benchmarks/bench_call_timeline.py``)."""
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


def combine_splits(part: torch.Tensor, part_lse: torch.Tensor, out: torch.Tensor,
                   lse: torch.Tensor | None = None) -> None:
    """Merge ``part [S, N*H, Dv]`` (fp32 or bf16) / ``part_lse [S, N*H]`` fp32 (log2) into
    ``out [N, H, Dv]``.

    ``lse`` (optional, ``[N, H]`` fp32) receives the natural-log LSE.
    """
    s, rows, dv = part.shape
    n, h, _ = out.shape
    if rows != n * h:
        raise ValueError(f"partials have {rows} rows; out has {n} x {h}")
    if not use_triton(part):
        combine_splits_ref(part, part_lse, out, lse)
        return
    if rows == 0:
        return
    s_block = max(2, triton.next_power_of_2(s)) if s <= 128 else 64
    if not part.is_cuda:
        block_d, warps = dv, 4
    elif s > 128:
        block_d, warps = min(dv, 128), 4
    elif rows >= 256:  # whole rows; bf16 partials on 2 warps (benchmarks/sweep_combine.py)
        block_d, warps = dv, 2 if part.dtype == torch.bfloat16 else 4
    else:
        block_d, warps = min(dv, 64), 2 if s_block >= 128 else 1
    _combine_kernel[(rows, triton.cdiv(dv, block_d))](
        part, part_lse, out, lse if lse is not None else part_lse, s, h,
        part.stride(0), part_lse.stride(0), out.stride(0), out.stride(1),
        DV=dv, BLOCK_D=block_d, S_BLOCK=s_block, WRITE_LSE=lse is not None,
        ONE_BLOCK=s <= s_block,
        num_warps=warps, **pdl_kwargs(part),
    )


def combine_splits_ref(part: torch.Tensor, part_lse: torch.Tensor, out: torch.Tensor,
                       lse: torch.Tensor | None = None) -> None:
    """Torch twin of :func:`combine_splits`."""
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
