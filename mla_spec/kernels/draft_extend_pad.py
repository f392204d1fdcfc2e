"""Draft-extend pad / unpad: ragged query rows <-> a fixed ``[bs, max_q, H, D]`` block.

Spec-v1 DRAFT_EXTEND gives request ``b`` a ragged ``L_b = seq_lens_q[b]`` query rows (its accept
length), packed as ``q [total_q, H, D]`` with offsets ``cu_seqlens_q [bs + 1]``. Fixed-q_len MLA
kernels (trtllm-gen, FlashMLA, our ``mla_decode``) want ``[bs, max_q, H, 576]`` and apply the
end-aligned causal rule: row ``i`` of a ``max_q`` block sees KV positions
``< kv_len - max_q + i + 1``.

``align="end"`` (default) puts the ``L`` real rows at rows ``max_q - L .. max_q - 1`` of the block.
Real row ``j`` lands on ``i = max_q - L + j`` and sees ``< kv_len - L + j + 1``: exactly its own
ragged causal window. ``align="start"`` reproduces SGLang's layout (rows ``0 .. L - 1``); its rows
see ``max_q - L`` fewer KV positions than they should (lost context), kept for comparison::

    request with L=2, max_q=4        end            start
    padded rows 0..3              [pad pad r0 r1]  [r0 r1 pad pad]

Padded rows are zero-filled (``fill_padding=True``) or left as they are (``False``: no writes,
what SGLang does; in a CUDA-graph buffer they then hold stale data). Either way each attention
row is independent, so padded rows never change a real row, and ``unpad`` never reads them.

Kernels, two variants per op, picked on the host from sizes known without a sync
(:func:`choose_variant`, threshold :data:`SMALL_CALL_BYTES`; ``variant=`` forces one):

- ``large`` (bandwidth-optimal): one program per (padded slot, chunk of the flattened ``H * D``
  row) on a 3-d grid ``(chunk, slot, request)``, so ``(s, b)`` come from the program ids (up to
  65535 requests). A program reads its request's length / offset, then moves the row (two
  dependent memory round trips) and never touches a padded slot it need not write.
- ``small`` (latency-optimal, one round trip, what a ``copy_`` pays): the unpad (same 3-d grid;
  with the old 1-d grid a division by the runtime ``max_q`` put ~30 sm_90 instructions before its
  first load, now 9) loads its slot (always in bounds) together with the length / offset and
  stores real rows only; the pad is
  token-major, one program per (row ``t`` of q, chunk): the row load does not depend on any
  index, so it goes out together with one vector load of ``cu_seqlens_q[0 : bs + 1]`` (32, 128
  or 1024 requests per binary, not bs): the request ``b`` with ``cu[b] <= t < cu[b + 1]`` and
  its edge come back from ONE int64 sum over a one-hot (no second memory trip); rows
  ``t >= cu[bs]`` (a static graph buffer larger than total_q) store nothing. ``fill_padding``
  adds slot-major programs to the same launch that zero the padded slots.

On the H200 (docs/bench_pad.md) ``small`` was as fast as or faster than ``large`` at every
measured size, up to 688 MB (4% faster at H 128, bs 512, max_q 8; at most 1.3% slower at
H 32, bs 512, max_q 2-4), so the default threshold sends every call with ``bs <= 1024`` to it.

A row of a row-contiguous tensor is one contiguous run of ``H * D`` elements, so programs issue
wide vectorized accesses with no per-head masking. Grids depend only on shapes; lengths are read
on the device and the length-like ints are marked ``do_not_specialize``: a bounded number of
binaries per (dtype, H, D, layout), reusable in a CUDA graph whose lengths change between
replays. With ``out=`` and ``validate=False`` the calls allocate nothing and never synchronize
with the host.

On CUDA the launcher (:mod:`mla_spec.kernels.launch.triton_launcher`) keeps the compiled kernel and
relaunches it directly (keyed by everything Triton specializes on, i.e. dtype, strides, pointer
alignment), which keeps an eager call at a few microseconds. ``compile_count()`` reports how many
binaries Triton's JIT cache holds. The kernels themselves are in
:mod:`mla_spec.kernels.draft_extend_pad_kernels`.
"""

from __future__ import annotations

import functools

import torch

from mla_spec.device import use_triton
from mla_spec.kernels.draft_extend_checks import (
    check_common,
    check_out,
    check_values,
)
from mla_spec.kernels.draft_extend_pad_kernels import pad_kernel, pad_small_kernel, unpad_kernel
from mla_spec.kernels.launch.pdl import pdl_on
from mla_spec.kernels.launch.triton_launcher import TritonLauncher as _Launcher
from mla_spec.kernels.launch.triton_launcher import hooks_unset as _hooks_unset  # noqa: F401 - tests

__all__ = ["pad_draft_extend_query", "pad_draft_extend_query_ref", "unpad_draft_extend_output",
           "unpad_draft_extend_output_ref", "compile_count", "choose_variant", "SMALL_CALL_BYTES"]

_INT_VIEW = {1: torch.uint8, 2: torch.int16, 4: torch.int32}  # bit-exact copies (twin, interpreter)
_NUM_WARPS = 4
_TARGET_BYTES = 16384  # bytes per program (one chunk of a row), large calls
#: Calls whose larger tensor (q or the padded block for the pad, raw_out or out for the unpad)
#: holds fewer bytes take the one-round-trip "small" kernels; the rest the bandwidth-optimal
#: "large" ones. Read at call time: the benchmark overrides it (or pass ``variant=``).
SMALL_CALL_BYTES = 1 << 40  # H200: "small" never lost by more than 1.3% (module docstring)
_SMALL_TARGET_BYTES = 4096  # bytes per program, small calls (spread a few rows over more SMs)
_SMALL_NUM_WARPS = 4
# requests the small pad scans per program: the first >= bs. Up to 32 the one-hot search is one
# warp's shuffles; from 33 on it also crosses warps through shared memory (2 barriers on sm_90).
_CU_BLOCKS = (32, 128, 1024)


# ---- launch machinery ----------------------------------------------------------------------------
@functools.lru_cache(maxsize=1024)
def _consts(h: int, d: int, elsize: int, src_hd: tuple, dst_hd: tuple, target: int,
            *flags) -> tuple:
    """Constexprs ``(D, ROW, BLOCK, NCHUNK, EVEN, SRC_CONTIG, DST_CONTIG, *flags)`` of a launch.

    BLOCK (elements per program) is ~``target`` bytes, a power of two, halved while more than
    1/8 of the lanes of the last chunk would idle. ``src_hd`` / ``dst_hd``: (head, dim) strides.
    """
    row = h * d
    block = max(16, target // elsize)
    while block >= 2 * row and block > 16:
        block //= 2
    while block > 256 and (-(-row // block) * block - row) * 8 > row:
        block //= 2
    contig = lambda hd: (hd[1] == 1 or d == 1) and (hd[0] == d or h == 1)
    return (d, row, block, -(-row // block), row % block == 0, contig(src_hd), contig(dst_hd),
            *flags)


_PAD = _Launcher(pad_kernel, unspecialized=(4,))  # args[4] = max_q: do_not_specialize
_PAD_SMALL = _Launcher(pad_small_kernel, unspecialized=(4, 5, 6))  # max_q, bs, n_rows
_UNPAD = _Launcher(unpad_kernel, unspecialized=(4,))


def compile_count() -> int:
    """Number of compiled pad + unpad binaries (Triton's JIT cache; launched specializations
    under the interpreter). It must not grow with batch size or lengths: at most
    1 (large pad) + 3 (small pad, one per cu block) + 2 (unpad variants) per (dtype, H, D,
    layout, align, fill)."""
    return _PAD.compile_count() + _PAD_SMALL.compile_count() + _UNPAD.compile_count()


def choose_variant(nbytes: int, bs: int, op: str = "pad") -> str:
    """``"small"`` (one memory round trip) or ``"large"`` (bandwidth-optimal) for a call whose
    larger tensor holds ``nbytes`` bytes; host-known sizes only, no sync. Small needs
    ``nbytes < SMALL_CALL_BYTES`` and, for the pad, ``bs <= 1024`` (one cu_seqlens_q load)."""
    if nbytes >= SMALL_CALL_BYTES or (op == "pad" and bs > _CU_BLOCKS[-1]):
        return "large"
    return "small"


def _variant(variant, nbytes, bs, op):
    if variant == "auto":
        return choose_variant(nbytes, bs, op)
    if variant not in ("small", "large"):
        raise ValueError(f"variant = {variant!r}; expected 'auto', 'small' or 'large'")
    return "large" if op == "pad" and bs > _CU_BLOCKS[-1] else variant


_GRID_YZ_MAX = 65535  # CUDA's limit on grid axes 1 and 2


def _slot_grid(nchunk: int, max_q: int, bs: int) -> tuple[int, int, int]:
    """(chunks, slots, requests): the slot-major kernels read (s, b) from their program ids."""
    if max_q > _GRID_YZ_MAX or bs > _GRID_YZ_MAX:
        raise ValueError(f"bs = {bs}, max_q = {max_q}: the slot-major pad / unpad kernels "
                         f"support up to {_GRID_YZ_MAX} of each (CUDA grid axes 1 and 2)")
    return nchunk, max_q, bs


def _launch(launcher, grid, src, dst, ss, ds, seq_lens_q, cu_seqlens_q, ints, consts, warps):
    """Shared tail of both launchers: the spec key, the bit views under the interpreter."""
    tensors = (src, dst, seq_lens_q, cu_seqlens_q)
    ptrs = (src.data_ptr(), dst.data_ptr(), seq_lens_q.data_ptr(), cu_seqlens_q.data_ptr())
    gdc = pdl_on(src)
    key = (consts, ss, ds, src.dtype, seq_lens_q.dtype, cu_seqlens_q.dtype, src.get_device(),
           ptrs[0] & 15, ptrs[1] & 15, ptrs[2] & 15, ptrs[3] & 15, warps, gdc)
    if not src.is_cuda:
        tensors = (_as_bits(src), _as_bits(dst), seq_lens_q, cu_seqlens_q)
    launcher(grid, key, tensors, ptrs, (*ints, *ss, *ds, *consts, gdc), warps, {"launch_pdl": gdc})


def _as_bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(_INT_VIEW[t.element_size()])


# ---- pad -----------------------------------------------------------------------------------------
def pad_draft_extend_query(q, seq_lens_q, cu_seqlens_q, max_q, *, align="end", out=None,
                           fill_padding=True, validate=True, variant="auto"):
    """Scatter ragged draft-extend query rows into a fixed ``[bs, max_q, H, D]`` block.

    Parameters
    ----------
    q : Tensor ``[total_q, H, D]`` (bf16, fp16, fp32 or float8_e4m3fn), any strides
        (e.g. a view into a wider buffer). It may have more rows than ``sum(seq_lens_q)``.
    seq_lens_q : int32 ``[bs]``, rows per request, each in ``0..max_q``.
    cu_seqlens_q : int32 ``[bs + 1]``, ``[0, cumsum(seq_lens_q)]`` (``qo_indptr``).
    max_q : int, rows of the padded block.
    align : ``"end"`` (real rows at the bottom of the block: exact causal windows) or ``"start"``
        (SGLang's layout: rows at the top).
    out : optional ``[bs, max_q, H, D]`` tensor of q's dtype (any strides); written in place.
    fill_padding : zero the padded rows (True) or leave them as they are (False).
    validate : check shapes and, outside graph capture, the lengths (one host sync).
    variant : ``"auto"`` (by :data:`SMALL_CALL_BYTES`), ``"small"`` (token-major, one memory
        round trip; falls back to large when ``bs > 1024``) or ``"large"`` (slot-major).

    Returns
    -------
    Tensor ``[bs, max_q, H, D]`` (``out`` when given).
    """
    if validate:
        check_common(q, "q", 3, seq_lens_q, cu_seqlens_q, align, variant)
        if not isinstance(max_q, int) or max_q < 0:
            raise ValueError(f"max_q = {max_q!r}; expected an int >= 0")
        check_out(out, (seq_lens_q.shape[0], max_q, *q.shape[1:]), q)
        check_values(seq_lens_q, cu_seqlens_q, max_q, q.shape[0], "q")
    bs, (n_rows, h, d) = seq_lens_q.shape[0], q.shape
    if out is None:
        out = torch.empty((bs, max_q, h, d), dtype=q.dtype, device=q.device)
    if not q.is_cuda and not use_triton(q):
        return pad_draft_extend_query_ref(q, seq_lens_q, cu_seqlens_q, max_q, align=align,
                                          out=out, fill_padding=fill_padding)
    if bs * max_q == 0 or h * d == 0:
        return out
    qs, os_, el, fill = q.stride(), out.stride(), q.element_size(), bool(fill_padding)
    if _variant(variant, max(n_rows, bs * max_q) * h * d * el, bs, "pad") == "large":
        consts = _consts(h, d, el, qs[1:], os_[2:], _TARGET_BYTES, align == "end", fill)
        _launch(_PAD, _slot_grid(consts[3], max_q, bs), q, out, qs, os_, seq_lens_q,
                cu_seqlens_q, (max_q,), consts, _NUM_WARPS)
        return out
    cu_block = next(c for c in _CU_BLOCKS if c >= bs)
    consts = _consts(h, d, el, qs[1:], os_[2:], _SMALL_TARGET_BYTES, align == "end", fill,
                     cu_block)
    grid0 = (n_rows + (bs * max_q if fill else 0)) * consts[3]
    if grid0:
        _launch(_PAD_SMALL, grid0, q, out, qs, os_, seq_lens_q, cu_seqlens_q,
                (max_q, bs, n_rows), consts, _SMALL_NUM_WARPS)
    return out


def pad_draft_extend_query_ref(q, seq_lens_q, cu_seqlens_q, max_q, *, align="end", out=None,
                               fill_padding=True):
    """Torch twin of :func:`pad_draft_extend_query` (same bytes; no host sync; graph-safe)."""
    bs, (_, h, d) = seq_lens_q.shape[0], q.shape
    if out is None:
        out = torch.empty((bs, max_q, h, d), dtype=q.dtype, device=q.device)
    src_rows, real = _padded_row_map(seq_lens_q, cu_seqlens_q, max_q, align)
    if q.shape[0] == 0 or bs * max_q == 0:
        rows = torch.zeros((bs * max_q, h, d), dtype=q.dtype, device=q.device)
    else:
        rows = q.index_select(0, src_rows.clamp(0, q.shape[0] - 1))
    rows, out_bits = _as_bits(rows).view(bs, max_q, h, d), _as_bits(out)
    keep = out_bits if not fill_padding else torch.zeros_like(rows)
    out_bits.copy_(torch.where(real.view(bs, max_q, 1, 1), rows, keep))
    return out


def _padded_row_map(seq_lens_q, cu_seqlens_q, max_q, align):
    """Per padded row ``(b, s)``: its packed source row and whether it is real (``[bs*max_q]``)."""
    lens = seq_lens_q.to(torch.int64)[:, None]
    s = torch.arange(max_q, device=seq_lens_q.device)[None, :]
    j = s - (max_q - lens) if align == "end" else s.expand(lens.shape[0], max_q)
    real = (j >= 0) & (j < lens)
    return (cu_seqlens_q[:-1].to(torch.int64)[:, None] + j).reshape(-1), real.reshape(-1)


# ---- unpad ---------------------------------------------------------------------------------------
def unpad_draft_extend_output(raw_out, seq_lens_q, cu_seqlens_q, total_q, *, align="end",
                              out=None, validate=True, variant="auto"):
    """Gather the real rows of a padded ``[bs, max_q, H, Dv]`` attention output back to packed rows.

    Parameters
    ----------
    raw_out : Tensor ``[bs, max_q, H, Dv]`` (any strides), laid out as
        :func:`pad_draft_extend_query` with the same ``align`` placed the queries.
    seq_lens_q, cu_seqlens_q : int32 ``[bs]`` / ``[bs + 1]`` as for the pad.
    total_q : int, rows of the result, ``>= sum(seq_lens_q)``. Rows past the real total are not
        written (in a CUDA graph whose lengths vary, pass the capacity and an ``out`` that size).
    align : the alignment the pad used.
    out : optional ``[total_q, H, Dv]`` tensor of raw_out's dtype (any strides).
    validate : check shapes and, outside graph capture, the lengths (one host sync).
    variant : ``"auto"`` (by :data:`SMALL_CALL_BYTES`), ``"small"`` (every slot read with its
        length, one round trip) or ``"large"`` (padded slots never read).

    Returns
    -------
    Tensor ``[total_q, H, Dv]`` (``out`` when given). Padded rows of ``raw_out`` are never read.
    """
    if validate:
        check_common(raw_out, "raw_out", 4, seq_lens_q, cu_seqlens_q, align, variant)
        if raw_out.shape[0] != seq_lens_q.shape[0]:
            raise ValueError(f"raw_out has {raw_out.shape[0]} requests; seq_lens_q has "
                             f"{seq_lens_q.shape[0]}")
        if not isinstance(total_q, int) or total_q < 0:
            raise ValueError(f"total_q = {total_q!r}; expected an int >= 0")
        check_out(out, (total_q, *raw_out.shape[2:]), raw_out)
        check_values(seq_lens_q, cu_seqlens_q, raw_out.shape[1], total_q, "the output (total_q)")
    bs, max_q, h, d = raw_out.shape
    if out is None:
        out = torch.empty((total_q, h, d), dtype=raw_out.dtype, device=raw_out.device)
    if not raw_out.is_cuda and not use_triton(raw_out):
        return unpad_draft_extend_output_ref(raw_out, seq_lens_q, cu_seqlens_q, total_q,
                                             align=align, out=out)
    if bs * max_q == 0 or h * d == 0 or total_q == 0:
        return out
    rs, os_ = raw_out.stride(), out.stride()
    nbytes = max(bs * max_q, total_q) * h * d * raw_out.element_size()
    small = _variant(variant, nbytes, bs, "unpad") == "small"
    consts = _consts(h, d, raw_out.element_size(), rs[2:], os_[1:],
                     _SMALL_TARGET_BYTES if small else _TARGET_BYTES, align == "end", small)
    _launch(_UNPAD, _slot_grid(consts[3], max_q, bs), raw_out, out, rs, os_, seq_lens_q,
            cu_seqlens_q,
            (max_q,), consts, _SMALL_NUM_WARPS if small else _NUM_WARPS)
    return out


def unpad_draft_extend_output_ref(raw_out, seq_lens_q, cu_seqlens_q, total_q, *, align="end",
                                  out=None):
    """Torch twin of :func:`unpad_draft_extend_output` (same bytes; no host sync; graph-safe)."""
    bs, max_q, h, d = raw_out.shape
    if out is None:
        out = torch.empty((total_q, h, d), dtype=raw_out.dtype, device=raw_out.device)
    if total_q == 0 or bs * max_q == 0:
        return out
    r = torch.arange(total_q, device=raw_out.device)
    cu = cu_seqlens_q.to(torch.int64)
    b = torch.searchsorted(cu[1:].contiguous(), r, right=True)  # request of each packed row
    valid = b < bs
    b = b.clamp(max=bs - 1)
    lens = seq_lens_q.to(torch.int64)[b]
    s = r - cu[b] + ((max_q - lens) if align == "end" else 0)
    src_rows = (b * max_q + s).clamp(0, bs * max_q - 1)
    rows = raw_out.reshape(bs * max_q, h, d).index_select(0, src_rows)
    out_bits = _as_bits(out)
    out_bits.copy_(torch.where(valid.view(-1, 1, 1), _as_bits(rows), out_bits))
    return out
