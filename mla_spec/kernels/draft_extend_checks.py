"""Boundary checks of the draft-extend pad / unpad calls (``draft_extend_pad``).

Cheap shape / dtype / device checks always run; the value checks (``cu_seqlens_q`` consistent
with ``seq_lens_q``, lengths within ``max_q``, enough rows) need one host sync and are skipped
while a CUDA graph is being captured. Every failure is a ValueError saying what is expected.
"""

from __future__ import annotations

import torch

__all__ = ["SUPPORTED_DTYPES", "check_common", "check_out", "check_values"]

SUPPORTED_DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.float8_e4m3fn)


def check_common(x, name, rank, seq_lens_q, cu_seqlens_q, align, variant):
    if not isinstance(x, torch.Tensor) or x.dim() != rank:
        shape = "[total_q, H, D]" if rank == 3 else "[bs, max_q, H, Dv]"
        got = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
        raise ValueError(f"{name} must be a {rank}-d tensor {shape}; got {got}")
    if x.dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"{name}.dtype = {x.dtype}; supported: {SUPPORTED_DTYPES}")
    for nm, t in (("seq_lens_q", seq_lens_q), ("cu_seqlens_q", cu_seqlens_q)):
        if not isinstance(t, torch.Tensor) or t.dim() != 1 or t.dtype != torch.int32:
            got = (t.dtype, tuple(t.shape)) if isinstance(t, torch.Tensor) else type(t).__name__
            raise ValueError(f"{nm} must be a 1-d int32 tensor; got {got}")
        if t.device != x.device:
            raise ValueError(f"{nm} is on {t.device}, {name} on {x.device}: use one device")
    if cu_seqlens_q.numel() != seq_lens_q.numel() + 1:
        raise ValueError(f"cu_seqlens_q has {cu_seqlens_q.numel()} entries; expected bs + 1 = "
                         f"{seq_lens_q.numel() + 1} (seq_lens_q has bs = {seq_lens_q.numel()})")
    if align not in ("end", "start"):
        raise ValueError(f"align = {align!r}; expected 'end' (exact causal windows) or 'start'")
    if variant not in ("auto", "small", "large"):
        raise ValueError(f"variant = {variant!r}; expected 'auto', 'small' or 'large'")


def check_out(out, shape, like, name="out"):
    if out is None:
        return
    if tuple(out.shape) != tuple(shape) or out.dtype != like.dtype or out.device != like.device:
        raise ValueError(f"{name} must be {list(shape)} {like.dtype} on {like.device}; got "
                         f"{list(out.shape)} {out.dtype} on {out.device}")


def check_values(seq_lens_q, cu_seqlens_q, max_q, rows_avail, rows_name):
    """Device-value checks (one host sync); skipped while a CUDA graph is being captured."""
    if seq_lens_q.is_cuda and torch.cuda.is_current_stream_capturing():
        return
    cu = cu_seqlens_q.to(torch.int64)
    sl = seq_lens_q.to(torch.int64)
    bs = sl.numel()
    stats = torch.stack([
        cu[0], (cu[1:] - cu[:-1] != sl).sum(), sl.min() if bs else cu[0] * 0,
        sl.max() if bs else cu[0] * 0, cu[-1],
    ]).tolist()
    first, mismatches, lo, hi, total = stats
    if first != 0 or mismatches:
        raise ValueError(f"cu_seqlens_q must be [0, cumsum(seq_lens_q)]; it starts at {first} and "
                         f"disagrees with seq_lens_q at {mismatches} of {bs} requests")
    if lo < 0 or hi > max_q:
        raise ValueError(f"seq_lens_q must lie in 0..max_q = {max_q}; got min {lo}, max {hi}")
    if total > rows_avail:
        raise ValueError(f"the lengths add up to {total} rows but {rows_name} has {rows_avail}")
