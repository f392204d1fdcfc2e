"""The small device work between the forwards of a captured step, one launch each.

A whole-step graph (``runtime/step_graph.py``) runs 1-4 forwards on static batches. Between them
sit tensors of a few hundred bytes: each batch's positions, lengths and KV slots derived from the
request rows and their committed lengths, and after the verify the greedy accept. As separate
torch ops that is ~10 launches a batch and ~12 for the accept, each a whole kernel of 1-2 µs in a
graph at batch 1; here each is one launch.

- :func:`refresh_rows`: a sub-batch of ``q`` rows a request at offset ``o``: row ``j`` of request
  ``b`` at position ``lens[b] + o + j`` and KV slot ``req_to_token[rows[b], position]``; per
  request ``lens[b] + delta`` into each length tensor and ``rows[b]`` into each row tensor.
- :func:`greedy_accept_update`: accept lengths of a chain of drafts, the last accepted row of
  each request, the new ``verified_id``.

Twins: :func:`refresh_rows_ref`, :func:`greedy_accept_update_ref` (the CPU path). Lengths must
keep ``lens[b] + o + q <= req_to_token.shape[1]`` (the scheduler's ``max_context_len``): the
kernel masks a slot read past the row (slot 0), the twin raises.
"""

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from mla_spec.device import use_triton

__all__ = ["Accepted", "greedy_accept", "greedy_accept_update", "greedy_accept_update_ref",
           "refresh_rows", "refresh_rows_ref", "store_first_n"]

_MAX_OUTS = 3  # length tensors and row tensors a refresh_rows call writes, each at most


@triton.jit
def store_first_n(p0, p1, p2, at, v0, v1, v2, mask, N: tl.constexpr):
    """``v0 / v1 / v2`` at ``at`` into the first ``N`` of three optional outputs (each converted
    to its tensor's dtype): the refresh kernels' "up to three length / row tensors"."""
    if N > 0:
        tl.store(p0 + at, v0.to(p0.dtype.element_ty), mask=mask)
    if N > 1:
        tl.store(p1 + at, v1.to(p1.dtype.element_ty), mask=mask)
    if N > 2:
        tl.store(p2 + at, v2.to(p2.dtype.element_ty), mask=mask)


@triton.jit(do_not_specialize=["d0", "d1", "d2", "bs", "width", "s_r2t", "offset"])
def _refresh_kernel(rows_ptr, lens_ptr, r2t_ptr, pos_ptr, loc_ptr,
                    l0_ptr, l1_ptr, l2_ptr, d0, d1, d2, r0_ptr, r1_ptr, r2_ptr,
                    bs, width, s_r2t, offset,
                    Q: tl.constexpr, N_LENS: tl.constexpr, N_ROWS: tl.constexpr,
                    BLOCK: tl.constexpr):
    k = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)  # packed row b * Q + j
    b = k // Q
    ok = b < bs
    row = tl.load(rows_ptr + b, mask=ok, other=0)
    pos = tl.load(lens_ptr + b, mask=ok, other=0) + offset + (k % Q)
    tl.store(pos_ptr + k, pos.to(pos_ptr.dtype.element_ty), mask=ok)
    slot = tl.load(r2t_ptr + row.to(tl.int64) * s_r2t + pos, mask=ok & (pos < width), other=0)
    tl.store(loc_ptr + k, slot.to(loc_ptr.dtype.element_ty), mask=ok)
    first = ok & (k % Q == 0)  # one program row per request writes its per-request values
    base = pos - (k % Q) - offset
    store_first_n(l0_ptr, l1_ptr, l2_ptr, b, base + d0, base + d1, base + d2, first, N_LENS)
    store_first_n(r0_ptr, r1_ptr, r2_ptr, b, row, row, row, first, N_ROWS)


def _check_refresh(rows, lens, req_to_token, q, positions, out_cache_loc, len_outs, row_outs):
    bs = rows.numel()
    if lens.shape != rows.shape or rows.dim() != 1 or q < 1:
        raise ValueError(f"refresh_rows takes rows [bs] and lens [bs] and q >= 1; got "
                         f"{tuple(rows.shape)}, {tuple(lens.shape)}, q={q}")
    if positions.numel() != bs * q or out_cache_loc.numel() != bs * q:
        raise ValueError(f"positions and out_cache_loc need bs * q = {bs * q} entries; got "
                         f"{positions.numel()} and {out_cache_loc.numel()}")
    if len(len_outs) > _MAX_OUTS or len(row_outs) > _MAX_OUTS:
        raise ValueError(f"refresh_rows writes at most {_MAX_OUTS} length and {_MAX_OUTS} row "
                         f"tensors; got {len(len_outs)} and {len(row_outs)}")
    if any(t.numel() != bs for t, _ in len_outs) or any(t.numel() != bs for t in row_outs):
        raise ValueError(f"every length and row tensor needs bs = {bs} entries")
    if req_to_token.dim() != 2 or req_to_token.stride(1) != 1:
        raise ValueError("req_to_token must be [max_reqs, width] with unit last stride")


def refresh_rows_ref(rows, lens, req_to_token, offset: int, q: int, positions, out_cache_loc,
                     len_outs=(), row_outs=()) -> None:
    """Torch twin of :func:`refresh_rows` (several ops; raises on a slot past the row)."""
    _check_refresh(rows, lens, req_to_token, q, positions, out_cache_loc, len_outs, row_outs)
    pos = (lens + offset)[:, None] + torch.arange(q, device=lens.device)
    positions.copy_(pos.view(-1))
    out_cache_loc.copy_(req_to_token[rows[:, None], pos].view(-1))
    for t, delta in len_outs:
        t.copy_(lens + delta)
    for t in row_outs:
        t.copy_(rows)


def refresh_rows(rows: torch.Tensor, lens: torch.Tensor, req_to_token: torch.Tensor,
                 offset: int, q: int, positions: torch.Tensor, out_cache_loc: torch.Tensor,
                 len_outs: tuple = (), row_outs: tuple = ()) -> None:
    """Fill a sub-batch in place from request ``rows [bs]`` and committed ``lens [bs]``:
    ``positions [bs * q]``, ``out_cache_loc [bs * q]`` (the slots in ``req_to_token``), every
    ``(tensor [bs], delta)`` of ``len_outs`` with ``lens + delta`` and every ``tensor [bs]`` of
    ``row_outs`` with ``rows`` (up to three of each). One launch (CUDA-graph safe)."""
    if not use_triton(rows):
        return refresh_rows_ref(rows, lens, req_to_token, offset, q, positions, out_cache_loc,
                                len_outs, row_outs)
    _check_refresh(rows, lens, req_to_token, q, positions, out_cache_loc, len_outs, row_outs)
    bs = rows.numel()
    if bs == 0:
        return None
    lt = [t for t, _ in len_outs] + [positions] * (_MAX_OUTS - len(len_outs))
    ld = [int(d) for _, d in len_outs] + [0] * (_MAX_OUTS - len(len_outs))
    rt = list(row_outs) + [positions] * (_MAX_OUTS - len(row_outs))
    block = 256  # one binary per (q, outputs) whatever the batch
    _refresh_kernel[(triton.cdiv(bs * q, block),)](
        rows, lens, req_to_token, positions, out_cache_loc, *lt, *ld, *rt,
        bs, req_to_token.shape[1], req_to_token.stride(0), int(offset),
        Q=q, N_LENS=len(len_outs), N_ROWS=len(row_outs), BLOCK=block, num_warps=4)
    return None


@triton.jit(do_not_specialize=["bs"])  # one binary whatever the batch (eager rounds too)
def _accept_kernel(pred_ptr, drafts_ptr, rows_ptr, vid_ptr, acc_ptr, acc32_ptr, last_ptr, bs,
                   NDT: tl.constexpr, NDT_P2: tl.constexpr, BLOCK: tl.constexpr):
    b = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = b < bs
    j = tl.arange(0, NDT_P2)
    jm = j[None, :] < NDT - 1
    m = ok[:, None] & jm
    pred = tl.load(pred_ptr + b[:, None] * NDT + j[None, :], mask=m, other=0)
    drafts = tl.load(drafts_ptr + b[:, None] * (NDT - 1) + j[None, :], mask=m, other=-1)
    miss = jm & (pred != drafts)
    first_miss = tl.min(tl.where(miss, j[None, :], NDT - 1), axis=1)  # leading matches
    acc = first_miss + 1
    tl.store(acc_ptr + b, acc.to(acc_ptr.dtype.element_ty), mask=ok)
    tl.store(acc32_ptr + b, acc.to(tl.int32), mask=ok)
    tl.store(last_ptr + b, (b * NDT + acc - 1).to(last_ptr.dtype.element_ty), mask=ok)
    vid = tl.load(pred_ptr + b * NDT + acc - 1, mask=ok, other=0)
    row = tl.load(rows_ptr + b, mask=ok, other=0)
    tl.store(vid_ptr + row, vid, mask=ok)


class Accepted(NamedTuple):
    """:func:`greedy_accept_update`'s results, ``[bs]`` each."""

    accept: torch.Tensor  # int64 in 1..ndt, the bonus token included
    accept_i32: torch.Tensor  # the same, int32 (a batch's ``accept_length``)
    last_row: torch.Tensor  # int64 b * ndt + accept - 1: the last accepted verify row


def greedy_accept(predict: torch.Tensor, drafts: torch.Tensor) -> torch.Tensor:
    """Accept lengths ``[bs]`` int64 in ``1..ndt`` (bonus included) of a chain of drafts: 1 + the
    number of leading ``j`` with ``drafts[:, j] == predict[:, j]`` (torch ops, no host sync).
    ``predict [bs, ndt]``: target argmax per verify row; ``drafts [bs, ndt - 1]``."""
    match = (drafts == predict[:, : drafts.shape[1]]).to(torch.int64)
    return 1 + torch.cumprod(match, dim=1).sum(dim=1)


def greedy_accept_update_ref(predict: torch.Tensor, drafts: torch.Tensor, rows: torch.Tensor,
                             verified_id: torch.Tensor) -> Accepted:
    """Torch twin of :func:`greedy_accept_update`."""
    _check_accept(predict, drafts, rows)
    accept = greedy_accept(predict, drafts)
    verified_id[rows] = predict.gather(1, (accept - 1)[:, None]).squeeze(1)
    last = torch.arange(predict.shape[0], device=predict.device) * predict.shape[1] + accept - 1
    return Accepted(accept, accept.to(torch.int32), last)


def _check_accept(predict, drafts, rows):
    bs, ndt = predict.shape
    if drafts.shape != (bs, ndt - 1) or rows.shape != (bs,):
        raise ValueError(f"greedy_accept_update takes predict [bs, ndt], drafts [bs, ndt - 1], "
                         f"rows [bs]; got {tuple(predict.shape)}, {tuple(drafts.shape)}, "
                         f"{tuple(rows.shape)}")


def greedy_accept_update(predict: torch.Tensor, drafts: torch.Tensor, rows: torch.Tensor,
                         verified_id: torch.Tensor) -> Accepted:
    """Greedy accept of a chain of drafts, on the device: ``predict [bs, ndt]`` (the target's
    argmax per verify row), ``drafts [bs, ndt - 1]``, request ``rows [bs]``: :class:`Accepted`
    (:func:`greedy_accept`'s lengths, as int64 and int32, and each request's last accepted row);
    sets ``verified_id[rows] = predict[b, accept - 1]``. One launch (CUDA-graph safe)."""
    if not use_triton(predict):
        return greedy_accept_update_ref(predict, drafts, rows, verified_id)
    _check_accept(predict, drafts, rows)
    bs, ndt = predict.shape
    dev = predict.device
    accept = torch.empty(bs, dtype=torch.int64, device=dev)
    acc32 = torch.empty(bs, dtype=torch.int32, device=dev)
    last = torch.empty(bs, dtype=torch.int64, device=dev)
    if bs:
        block = 128
        _accept_kernel[(triton.cdiv(bs, block),)](
            predict.contiguous(), drafts.contiguous(), rows, verified_id, accept, acc32, last, bs,
            NDT=ndt, NDT_P2=max(2, triton.next_power_of_2(ndt)), BLOCK=block, num_warps=1)
    return Accepted(accept, acc32, last)
