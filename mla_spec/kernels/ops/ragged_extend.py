"""Spec v1's draft extend laid out on the device in a fixed capacity, for a captured round.

Spec v1 runs the draft extend over the accepted rows only: request ``b`` brings ``a_b`` rows
(``1 <= a_b <= ndt``), packed one request after the other (ragged). Eagerly the host builds that
batch after reading the accept lengths. Inside a CUDA graph the shapes are fixed, so the batch is
captured at its capacity, ``bs * ndt`` rows and ``2 * bs`` requests, and refreshed here from the
accept lengths on the device:

- requests ``0 .. bs-1``: request ``b``'s ``a_b`` rows, packed from row ``start_b`` (the exclusive
  prefix sum of ``a``): row ``j`` at position ``lens[b] + j``, KV slot ``req_to_token[rows[b],
  lens[b] + j]``, verify row ``b * ndt + j`` as its input; KV length ``lens[b] + a_b``;
- requests ``bs .. 2bs-1``: padding that fills the rows ``N = sum(a) .. bs * ndt - 1``, ``ndt`` a
  request (``0`` for the last ones): scratch request row 0, positions ``0 .. ndt-1``, verify row 0
  as input. Every request keeps ``<= ndt`` rows, the attention kernel's ``max_q``.

``lens`` are the committed lengths before the round's accepted tokens. Twin:
:func:`ragged_extend_layout_ref` (the CPU path). The scheduler keeps ``lens[b] + ndt`` within
``req_to_token``'s width; the kernel masks a slot read past it (slot 0), the twin raises.
"""

import torch
import triton
import triton.language as tl

from mla_spec.device import use_triton
from mla_spec.kernels.ops.step_glue import store_first_n

__all__ = ["ragged_extend_layout", "ragged_extend_layout_ref"]

_MAX_OUTS = 3


@triton.jit
def _requests(at, ok, first, q, kv, row, indptr_ptr, qlen_ptr, l0_ptr, l1_ptr, l2_ptr,
              r0_ptr, r1_ptr, r2_ptr, N_LENS: tl.constexpr, N_ROWS: tl.constexpr):
    """Per-request values of requests ``at``: first row, rows, KV length, request row."""
    tl.store(indptr_ptr + at, first.to(tl.int32), mask=ok)
    tl.store(qlen_ptr + at, q.to(tl.int32), mask=ok)
    store_first_n(l0_ptr, l1_ptr, l2_ptr, at, kv, kv, kv, ok, N_LENS)
    store_first_n(r0_ptr, r1_ptr, r2_ptr, at, row, row, row, ok, N_ROWS)


@triton.jit(do_not_specialize=["bs", "width", "s_r2t"])
def _layout_kernel(acc_ptr, rows_ptr, lens_ptr, r2t_ptr, s_r2t, width, bs,
                   pos_ptr, loc_ptr, src_ptr, indptr_ptr, qlen_ptr, last_ptr,
                   l0_ptr, l1_ptr, l2_ptr, r0_ptr, r1_ptr, r2_ptr,
                   NDT: tl.constexpr, N_LENS: tl.constexpr, N_ROWS: tl.constexpr,
                   BS_P2: tl.constexpr, BLOCK: tl.constexpr):
    b = tl.arange(0, BS_P2)
    ok = b < bs
    a = tl.load(acc_ptr + b, mask=ok, other=0).to(tl.int64)
    lens = tl.load(lens_ptr + b, mask=ok, other=0).to(tl.int64)
    row = tl.load(rows_ptr + b, mask=ok, other=0).to(tl.int64)
    start = tl.cumsum(a, 0) - a
    n = tl.sum(a, 0)
    cap = bs * NDT
    pad_start = tl.minimum(n + b * NDT, cap)
    pad_rows = tl.minimum(tl.maximum(cap - n - b * NDT, 0), NDT)
    _requests(b, ok, start, a, lens + a, row, indptr_ptr, qlen_ptr, l0_ptr, l1_ptr, l2_ptr,
              r0_ptr, r1_ptr, r2_ptr, N_LENS, N_ROWS)
    _requests(b + bs, ok, pad_start, pad_rows, pad_rows, row * 0, indptr_ptr, qlen_ptr, l0_ptr,
              l1_ptr, l2_ptr, r0_ptr, r1_ptr, r2_ptr, N_LENS, N_ROWS)
    tl.store(indptr_ptr + 2 * bs + b, (cap + b * 0).to(tl.int32), mask=b == 0)
    tl.store(last_ptr + b, start + a - 1, mask=ok)
    for k0 in range(0, cap, BLOCK):
        k = k0 + tl.arange(0, BLOCK)
        k_ok = k < cap
        real = k < n
        req = tl.sum(((start[None, :] <= k[:, None]) & ok[None, :]).to(tl.int64), 1) - 1
        mine = b[None, :] == req[:, None]  # one-hot: the request's start, length and row
        j = k - tl.sum(tl.where(mine, start[None, :], 0), 1)
        pj = (k - n) % NDT
        pos = tl.where(real, tl.sum(tl.where(mine, lens[None, :], 0), 1) + j, pj)
        r = tl.where(real, tl.sum(tl.where(mine, row[None, :], 0), 1), 0)
        slot = tl.load(r2t_ptr + r * s_r2t + pos, mask=k_ok & (pos < width), other=0)
        tl.store(pos_ptr + k, pos, mask=k_ok)
        tl.store(loc_ptr + k, slot.to(tl.int64), mask=k_ok)
        tl.store(src_ptr + k, tl.where(real, req * NDT + j, 0), mask=k_ok)


def _check(accept, rows, lens, req_to_token, ndt, positions, out_cache_loc, qo_indptr,
           seq_lens_q, len_outs, row_outs):
    bs = accept.numel()
    if rows.shape != (bs,) or lens.shape != (bs,) or accept.dim() != 1 or ndt < 1:
        raise ValueError(f"ragged_extend_layout takes accept, rows and lens [bs] and ndt >= 1; "
                         f"got {tuple(accept.shape)}, {tuple(rows.shape)}, {tuple(lens.shape)}, "
                         f"ndt={ndt}")
    if positions.numel() != bs * ndt or out_cache_loc.numel() != bs * ndt:
        raise ValueError(f"positions and out_cache_loc need the capacity bs * ndt = {bs * ndt} "
                         f"rows; got {positions.numel()} and {out_cache_loc.numel()}")
    if qo_indptr.numel() != 2 * bs + 1 or seq_lens_q.numel() != 2 * bs:
        raise ValueError(f"a capacity layout has 2 * bs = {2 * bs} requests (qo_indptr "
                         f"{2 * bs + 1}); got {qo_indptr.numel()} and {seq_lens_q.numel()}")
    if len(len_outs) > _MAX_OUTS or len(row_outs) > _MAX_OUTS or \
            any(t.numel() != 2 * bs for t in (*len_outs, *row_outs)):
        raise ValueError(f"up to {_MAX_OUTS} length and {_MAX_OUTS} row tensors of 2 * bs "
                         f"entries each")
    if req_to_token.dim() != 2 or req_to_token.stride(1) != 1:
        raise ValueError("req_to_token must be [max_reqs, width] with unit last stride")


def ragged_extend_layout_ref(accept, rows, lens, req_to_token, ndt: int, positions, out_cache_loc,
                             qo_indptr, seq_lens_q, len_outs=(), row_outs=()):
    """Torch twin of :func:`ragged_extend_layout`."""
    _check(accept, rows, lens, req_to_token, ndt, positions, out_cache_loc, qo_indptr,
           seq_lens_q, len_outs, row_outs)
    bs, dev = accept.numel(), accept.device
    if bs == 0:
        qo_indptr.zero_()
        empty = torch.empty(0, dtype=torch.int64, device=dev)
        return empty, empty.clone()
    a, cap = accept.to(torch.int64), bs * ndt
    end = torch.cumsum(a, 0)
    start, n = end - a, end[-1:]
    k = torch.arange(cap, device=dev)
    real = k < n
    req = torch.searchsorted(end, k, right=True).clamp(max=bs - 1)
    j = k - start[req]
    pos = torch.where(real, lens.to(torch.int64)[req] + j, (k - n) % ndt)
    r = torch.where(real, rows.to(torch.int64)[req], 0)
    positions.copy_(pos)
    out_cache_loc.copy_(req_to_token[r, pos])
    p = torch.arange(bs, device=dev)
    pad = (cap - n - p * ndt).clamp(0, ndt)
    qo_indptr.copy_(torch.cat([start, (n + p * ndt).clamp(max=cap),
                               torch.full((1,), cap, device=dev, dtype=torch.int64)]))
    seq_lens_q.copy_(torch.cat([a, pad]))
    for t in len_outs:
        t.copy_(torch.cat([lens.to(torch.int64) + a, pad]))
    for t in row_outs:
        t.copy_(torch.cat([rows.to(torch.int64), torch.zeros_like(p)]))
    return torch.where(real, req * ndt + j, 0), start + a - 1


def ragged_extend_layout(accept: torch.Tensor, rows: torch.Tensor, lens: torch.Tensor,
                         req_to_token: torch.Tensor, ndt: int, positions: torch.Tensor,
                         out_cache_loc: torch.Tensor, qo_indptr: torch.Tensor,
                         seq_lens_q: torch.Tensor, len_outs: tuple = (), row_outs: tuple = ()):
    """Fill a DRAFT_EXTEND batch captured at capacity (module docstring) from the accept lengths
    ``accept [bs]`` (``1..ndt``), request ``rows [bs]`` and committed ``lens [bs]``:
    ``positions`` and ``out_cache_loc`` ``[bs * ndt]``, ``qo_indptr [2bs + 1]``, ``seq_lens_q``
    and every tensor of ``len_outs`` (KV lengths) and ``row_outs`` (request rows) ``[2bs]``.
    Returns ``src [bs * ndt]`` (the verify row each row takes its token and hidden state from)
    and ``last [bs]`` (each request's last row), int64. One launch (CUDA-graph safe)."""
    if not use_triton(accept):
        return ragged_extend_layout_ref(accept, rows, lens, req_to_token, ndt, positions,
                                        out_cache_loc, qo_indptr, seq_lens_q, len_outs, row_outs)
    _check(accept, rows, lens, req_to_token, ndt, positions, out_cache_loc, qo_indptr,
           seq_lens_q, len_outs, row_outs)
    bs, dev = accept.numel(), accept.device
    src = torch.empty(bs * ndt, dtype=torch.int64, device=dev)
    last = torch.empty(bs, dtype=torch.int64, device=dev)
    if bs == 0:
        qo_indptr.zero_()
        return src, last
    lt = list(len_outs) + [seq_lens_q] * (_MAX_OUTS - len(len_outs))
    rt = list(row_outs) + [seq_lens_q] * (_MAX_OUTS - len(row_outs))
    _layout_kernel[(1,)](
        accept, rows, lens, req_to_token, req_to_token.stride(0), req_to_token.shape[1], bs,
        positions, out_cache_loc, src, qo_indptr, seq_lens_q, last, *lt, *rt,
        NDT=ndt, N_LENS=len(len_outs), N_ROWS=len(row_outs),
        BS_P2=max(2, triton.next_power_of_2(bs)), BLOCK=64, num_warps=4)
    return src, last
