"""The Triton kernels of draft-extend pad / unpad (``draft_extend``): a program moves one chunk of a
flattened ``H * D`` row; ``FILL`` programs zero padded slots.
"""

from __future__ import annotations

import triton
import triton.language as tl

from mla_spec.kernels.launch.pdl import gdc_enter

__all__ = ["pad_kernel", "pad_small_kernel", "unpad_kernel"]


@triton.jit
def _load_chunk(src, offs, ROW: tl.constexpr, EVEN: tl.constexpr):
    if EVEN:  # the chunks tile the row exactly: no mask, full-width vector accesses
        x = tl.load(src)
    else:
        x = tl.load(src, mask=offs < ROW)
    return x


@triton.jit
def _store_chunk(dst, x, offs, ROW: tl.constexpr, EVEN: tl.constexpr):
    if EVEN:
        tl.store(dst, x)
    else:
        tl.store(dst, x, mask=offs < ROW)


@triton.jit
def _row_ptr(base, row_off, offs, sh, sd, D: tl.constexpr, CONTIG: tl.constexpr):
    """Pointers to elements ``offs`` of the flattened ``H * D`` row starting at ``row_off``."""
    if CONTIG:
        ptr = base + row_off + offs
    else:
        ptr = base + row_off + (offs // D) * sh + (offs % D) * sd
    return ptr


@triton.jit(do_not_specialize=["max_q"])
def pad_kernel(q_ptr, out_ptr, seq_lens_ptr, cu_ptr, max_q,
               q_st, q_sh, q_sd, o_sb, o_ss, o_sh, o_sd,
               D: tl.constexpr, ROW: tl.constexpr, BLOCK: tl.constexpr, NCHUNK: tl.constexpr,
               EVEN: tl.constexpr, SRC_CONTIG: tl.constexpr, DST_CONTIG: tl.constexpr,
               ALIGN_END: tl.constexpr, FILL: tl.constexpr, USE_GDC: tl.constexpr):
    gdc_enter(USE_GDC)
    # (s, b) from the 3-d grid (no division by the runtime max_q); lengths, then the row
    s = tl.program_id(1)
    b = tl.program_id(2)
    length = tl.load(seq_lens_ptr + b)
    start = tl.load(cu_ptr + b)
    j = s - (max_q - length) if ALIGN_END else s  # row inside the request
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    dst = _row_ptr(out_ptr, b.to(tl.int64) * o_sb + s.to(tl.int64) * o_ss, offs, o_sh, o_sd, D,
                   DST_CONTIG)
    if (j >= 0) & (j < length):
        src = _row_ptr(q_ptr, (start + j).to(tl.int64) * q_st, offs, q_sh, q_sd, D, SRC_CONTIG)
        _store_chunk(dst, _load_chunk(src, offs, ROW, EVEN), offs, ROW, EVEN)
    elif FILL:
        tl.store(dst, tl.zeros([BLOCK], dtype=out_ptr.dtype.element_ty), mask=offs < ROW)


@triton.jit(do_not_specialize=["max_q", "bs", "n_rows"])
def pad_small_kernel(q_ptr, out_ptr, seq_lens_ptr, cu_ptr, max_q, bs, n_rows,
                     q_st, q_sh, q_sd, o_sb, o_ss, o_sh, o_sd,
                     D: tl.constexpr, ROW: tl.constexpr, BLOCK: tl.constexpr,
                     NCHUNK: tl.constexpr, EVEN: tl.constexpr, SRC_CONTIG: tl.constexpr,
                     DST_CONTIG: tl.constexpr, ALIGN_END: tl.constexpr, FILL: tl.constexpr,
                     CU_BLOCK: tl.constexpr, USE_GDC: tl.constexpr):
    gdc_enter(USE_GDC)
    # programs [0, n_rows * NCHUNK) copy row t of q (row and cu_seqlens_q loads in one round
    # trip); with FILL, the programs past them zero the padded slots
    pid = tl.program_id(0)
    row = pid // NCHUNK
    offs = (pid % NCHUNK) * BLOCK + tl.arange(0, BLOCK)
    if row < n_rows:
        src = _row_ptr(q_ptr, row.to(tl.int64) * q_st, offs, q_sh, q_sd, D, SRC_CONTIG)
        x = _load_chunk(src, offs, ROW, EVEN)
        idx = tl.arange(0, CU_BLOCK)
        lo = tl.load(cu_ptr + idx, mask=idx < bs, other=0)  # cu[b], cu[b + 1] for every b
        hi = tl.load(cu_ptr + idx + 1, mask=idx < bs, other=0)
        hit = (lo <= row) & (row < hi)  # exactly one request b holds row (none past cu[bs])
        edge = hi if ALIGN_END else lo
        # one reduction broadcasts (valid, b, edge) packed in an int64 (one non-zero term)
        packed = tl.sum(tl.where(hit, (idx.to(tl.int64) << 32) | edge.to(tl.int64)
                                 | (1 << 62), 0), axis=0)
        if packed != 0:
            b = (packed >> 32) & 0xFFFF
            edge_b = packed & 0x7FFFFFFF  # cu values are int32 >= 0
            s = max_q - (edge_b - row) if ALIGN_END else row - edge_b  # max_q - (end - t)
            dst = _row_ptr(out_ptr, b * o_sb + s * o_ss, offs, o_sh, o_sd, D, DST_CONTIG)
            _store_chunk(dst, x, offs, ROW, EVEN)
    elif FILL:
        slot = row - n_rows
        b = slot // max_q
        s = slot - b * max_q
        length = tl.load(seq_lens_ptr + b)
        j = s - (max_q - length) if ALIGN_END else s
        if (j < 0) | (j >= length):
            dst = _row_ptr(out_ptr, b.to(tl.int64) * o_sb + s.to(tl.int64) * o_ss, offs, o_sh,
                           o_sd, D, DST_CONTIG)
            tl.store(dst, tl.zeros([BLOCK], dtype=out_ptr.dtype.element_ty), mask=offs < ROW)


@triton.jit(do_not_specialize=["max_q"])
def unpad_kernel(raw_ptr, out_ptr, seq_lens_ptr, cu_ptr, max_q,
                 r_sb, r_ss, r_sh, r_sd, o_st, o_sh, o_sd,
                 D: tl.constexpr, ROW: tl.constexpr, BLOCK: tl.constexpr, NCHUNK: tl.constexpr,
                 EVEN: tl.constexpr, SRC_CONTIG: tl.constexpr, DST_CONTIG: tl.constexpr,
                 ALIGN_END: tl.constexpr, PREFETCH: tl.constexpr, USE_GDC: tl.constexpr):
    gdc_enter(USE_GDC)
    # (s, b) from the 3-d grid. PREFETCH: the slot (always in bounds) loads with its request's
    # length and offset in one round trip; else lengths first and padded slots are never read.
    s = tl.program_id(1)
    b = tl.program_id(2)
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    src = _row_ptr(raw_ptr, b.to(tl.int64) * r_sb + s.to(tl.int64) * r_ss, offs, r_sh, r_sd, D,
                   SRC_CONTIG)
    if PREFETCH:
        x = _load_chunk(src, offs, ROW, EVEN)
    length = tl.load(seq_lens_ptr + b)
    start = tl.load(cu_ptr + b)
    j = s - (max_q - length) if ALIGN_END else s
    if (j >= 0) & (j < length):
        dst = _row_ptr(out_ptr, (start + j).to(tl.int64) * o_st, offs, o_sh, o_sd, D, DST_CONTIG)
        if not PREFETCH:
            x = _load_chunk(src, offs, ROW, EVEN)
        _store_chunk(dst, x, offs, ROW, EVEN)
