"""Torch twin of the split-KV merge inside the wgmma split kernel (``csrc/sm90_grid_merge.cuh``).

Why the kernel was written: at batch 1 a call's combine kernel costs ~4.6 µs between the
split kernel's last store and the next call's release (docs/bench_mla.md v16); here the split CTAs
of a (request, row block) meet at a barrier in global memory and each merges a share of the
rows, so there is no second kernel. This module mirrors what each CTA computes, in the same
order, so that the CPU tests can check the deal of work (:func:`merge_chunk_ranges`: every
8-column chunk of a row block merged exactly once, whatever the split count) and the merge
arithmetic (:func:`grid_merge_ref`: online over a thread's splits, then the two split groups
of a warp, then the 8 warps at their common max; empty splits, whose partials may be NaN,
weigh 0) against ``combine_splits_ref``. The kernel is off by default
(``mla_decode_wgmma.GRID_MERGE``): at batch 1 ctx 32k it measured no faster than the CUDA
combine (docs/bench_mla.md v17).
"""

from __future__ import annotations

import math

import torch

__all__ = ["CHUNK", "GROUPS", "ROUND", "grid_merge_ref", "merge_chunk_ranges"]

#: columns a chunk (one 16-byte bf16 store), split groups (threads a chunk: 256 / 16 chunks a
#: pass), splits a thread loads per round
CHUNK, GROUPS, ROUND = 8, 16, 8
_LN2 = math.log(2.0)


def merge_chunk_ranges(rows: int, splits: int, dv: int = 512) -> list[tuple[int, int]]:
    """The chunk range ``[lo, hi)`` that split CTA ``s`` merges in a row block of ``rows``
    rows (``rows * dv / 8`` chunks, row-major: chunk ``c`` is row ``c // 64``, columns
    ``8 (c % 64)..``): contiguous ranges of ``ceil(chunks / splits)``; the last CTAs may get
    none (``lo >= hi``)."""
    if rows < 0 or splits < 1:
        raise ValueError(f"rows >= 0 and splits >= 1 (got {rows}, {splits})")
    nck = rows * (dv // CHUNK)
    per = -(-nck // splits)
    return [(s * per, min(s * per + per, nck)) for s in range(splits)]


def _merge(m, den, acc, m2, den2, acc2):
    """(m, den, acc) and (m2, den2, acc2) rescaled to their common max and added."""
    mx = torch.maximum(m, m2)
    mu = torch.where(mx == -math.inf, torch.zeros_like(mx), mx)
    a, c = torch.exp2(m - mu), torch.exp2(m2 - mu)
    return mx, den * a + den2 * c, acc * a[..., None] + acc2 * c[..., None]


def grid_merge_ref(part: torch.Tensor, part_lse: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge split partials as the kernel does: ``part [S, rows, Dv]`` (normalized, fp32 or
    bf16; a split with ``part_lse = -inf`` saw no KV and its partial is not read) and
    ``part_lse [S, rows]`` (log2-sum-exp) -> ``(out [rows, Dv] fp32, lse [rows])`` (natural
    log; zeros and -inf for a row no split saw). Split group ``g`` of a chunk takes splits
    ``g, g + 16, ...`` in rounds of 8 (running max, rescaled sums); groups ``2 w`` and ``2 w +
    1`` (warp ``w``) then merge, and the 8 warps' sums add up at their common max."""
    s, rows, dv = part.shape
    if part_lse.shape != (s, rows):
        raise ValueError(f"part_lse must be [{s}, {rows}] (got {tuple(part_lse.shape)})")
    pad = -s % GROUPS
    v = part.float()
    lse = part_lse.float()
    if pad:
        v = torch.cat([v, v.new_zeros(pad, rows, dv)])
        lse = torch.cat([lse, lse.new_full((pad, rows), -math.inf)])
    per_group = v.shape[0] // GROUPS
    v = v.view(per_group, GROUPS, rows, dv)  # [k, group g] is split g + 16 k
    lse = lse.view(per_group, GROUPS, rows)
    m = torch.full((GROUPS, rows), -math.inf)
    den = torch.zeros(GROUPS, rows)
    acc = torch.zeros(GROUPS, rows, dv)
    for k0 in range(0, per_group, ROUND):
        lk, vk = lse[k0:k0 + ROUND], v[k0:k0 + ROUND]
        mx = torch.maximum(m, lk.amax(0))
        mu = torch.where(mx == -math.inf, torch.zeros_like(mx), mx)
        a = torch.exp2(m - mu)
        w = torch.exp2(lk - mu)
        den = den * a + w.sum(0)
        acc = acc * a[..., None] + torch.where(w[..., None] > 0, w[..., None] * vk, 0.0).sum(0)
        m = mx
    m, den, acc = _merge(m[0::2], den[0::2], acc[0::2], m[1::2], den[1::2], acc[1::2])
    mx = m.amax(0)  # the 8 warps at their common max
    mu = torch.where(mx == -math.inf, torch.zeros_like(mx), mx)
    w = torch.exp2(m - mu)
    m, den, acc = mx, (w * den).sum(0), (w[..., None] * acc).sum(0)
    inv = torch.where(den > 0, 1.0 / den.clamp_min(torch.finfo(torch.float32).tiny), 0.0)
    out = acc * inv[:, None]
    lse_out = torch.where(den > 0, (m + torch.log2(den.clamp_min(1e-38))) * _LN2, -math.inf)
    return out, lse_out
