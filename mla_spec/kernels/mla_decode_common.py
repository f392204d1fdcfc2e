"""Per-program setup shared by the split-KV MLA decode kernels (generic, paged, V-split).

Every MLA decode kernel (``mla_decode``, ``mla_decode_paged``, ``mla_decode_vsplit``) runs one
program per (request ``b``, row block ``pid_m``, KV split ``sid``). A program owns ``BLOCK_M``
*flattened* query rows ``r = i * H + h`` of request ``b`` (token ``i`` of its ``q_len``, head
``h``) and the KV positions of split ``sid``; row ``r`` sees positions ``j < kv_len - q_len + i +
1`` (causal, end-aligned). The three helpers below compute that setup in the order the kernels
use it, so the kernels differ only in how they load and multiply tiles:

1. :func:`request_rows` (before the ``m0 < n_rows`` early-out): where the request's query rows
   start (``qo_indptr[b]`` when ``RAGGED``, else ``b * q_len_fixed``), ``q_len``, ``kv_len``,
   ``n_rows = q_len * H`` and the block's first row ``m0``.
2. :func:`block_rows`: the request's pool index and, per row of the block, its flattened index
   ``offs_m [BLOCK_M]``, mask, token and head (int64, for pointer arithmetic).
3. :func:`split_window`: the per-row causal bound ``bound [BLOCK_M]`` and the KV range
   ``[lo, hi)`` of split ``sid``: splits are ``BLOCK_N``-aligned chunks of ``cdiv(kv_len,
   num_splits)`` positions, cut at the last row's causal bound.

They are ``@triton.jit`` functions returning tuples; Triton inlines them, so the kernels compile
to the same instructions as with the code written out (checked on sm_90 with Triton 3.6: same
PTX, same ``ptxas`` registers / spills, see ``mla_decode_sm90``). One exception:
``mla_decode_paged`` writes :func:`split_window` out, because the debug labels of the inlined
range move ptxas' spills of one variant by a few bytes (NOTE there). Constexpr flags are passed
through as ``tl.constexpr``.
"""

from __future__ import annotations

import triton
import triton.language as tl

__all__ = ["block_rows", "request_rows", "split_window"]


@triton.jit
def request_rows(QO, KVL, b, pid_m, H, q_len_fixed, BLOCK_M: tl.constexpr,
                 RAGGED: tl.constexpr):
    """``(qo_start, q_len, kv_len, n_rows, m0)`` of row block ``pid_m`` of request ``b``."""
    if RAGGED:
        qo_start = tl.load(QO + b)
        q_len = tl.load(QO + b + 1) - qo_start
    else:
        qo_start = b * q_len_fixed
        q_len = q_len_fixed
    kv_len = tl.load(KVL + b)
    n_rows = q_len * H
    m0 = pid_m * BLOCK_M
    return qo_start, q_len, kv_len, n_rows, m0


@triton.jit
def block_rows(RPI, b, m0, n_rows, qo_start, H, BLOCK_M: tl.constexpr):
    """``(req, offs_m, mask_m, tok, head)``: pool index of request ``b`` and its block's rows
    (``[BLOCK_M]`` flattened row, in-range mask, int64 token and head)."""
    req = tl.load(RPI + b).to(tl.int64)
    offs_m = m0 + tl.arange(0, BLOCK_M)
    mask_m = offs_m < n_rows
    tok = (qo_start + offs_m // H).to(tl.int64)
    head = (offs_m % H).to(tl.int64)
    return req, offs_m, mask_m, tok, head


@triton.jit
def split_window(kv_len, q_len, offs_m, m0, n_rows, H, sid, num_splits,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """``(bound, lo, hi)``: row ``offs_m`` sees ``j < bound`` (``[BLOCK_M]``); split ``sid``
    covers ``[lo, hi)``, empty when ``lo >= hi``."""
    bound = kv_len - q_len + offs_m // H + 1
    last_row = tl.minimum(m0 + BLOCK_M, n_rows) - 1
    hi_rows = kv_len - q_len + last_row // H + 1
    chunk = tl.cdiv(tl.cdiv(kv_len, num_splits), BLOCK_N) * BLOCK_N
    lo = sid * chunk
    hi = tl.minimum(tl.minimum(lo + chunk, kv_len), hi_rows)
    return bound, lo, hi
