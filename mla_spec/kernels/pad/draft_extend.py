"""Draft-extend pad / unpad: ragged query rows ``q [total_q, H, D]`` (offsets ``cu_seqlens_q``) <->
a fixed ``[bs, max_q, H, D]`` block for fixed-q_len MLA kernels. ``align="end"`` puts the real rows
last, so each sees exactly its ragged window (``"start"``: SGLang's layout); padded rows are zeroed
(``fill_padding``) or left stale and never reach a real row. Layouts, kernels: docs/bench_pad.md.
"""

import functools

import torch

from mla_spec.device import use_triton
from mla_spec.kernels.launch.pdl import pdl_on
from mla_spec.kernels.launch.triton_launcher import TritonLauncher as _Launcher
from mla_spec.kernels.pad.kernels import pad_kernel, pad_small_kernel, unpad_kernel

__all__ = ["pad_draft_extend_query", "unpad_draft_extend_output", "compile_count",
           "choose_variant", "SMALL_CALL_BYTES", "pad_draft_extend_query_ref",
           "unpad_draft_extend_output_ref"]

_NUM_WARPS = 4
_TARGET_BYTES = 16384  # bytes per program (one chunk of a row), large calls
#: Calls whose larger tensor holds fewer bytes take the "small" kernels, the rest the "large"
#: ones. Read at call time (the benchmark overrides it).
SMALL_CALL_BYTES = 1 << 40
_SMALL_TARGET_BYTES = 4096  # bytes per program, small calls (spread a few rows over more SMs)
_SMALL_NUM_WARPS = 4
# requests the small pad scans per program: the first >= bs (up to 32: one warp's shuffles)
_CU_BLOCKS = (32, 128, 1024)


@functools.lru_cache(maxsize=1024)
def _consts(h: int, d: int, elsize: int, src_hd: tuple, dst_hd: tuple, target: int,
            *flags) -> tuple:
    """Constexprs of a launch; BLOCK ~``target`` bytes, halved while the last chunk idles > 1/8."""
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
    """Compiled pad + unpad binaries: at most 6 per (dtype, H, D, layout, align, fill)."""
    return _PAD.compile_count() + _PAD_SMALL.compile_count() + _UNPAD.compile_count()


def choose_variant(nbytes: int, bs: int, op: str = "pad") -> str:
    """``"small"`` below ``SMALL_CALL_BYTES`` (pad: up to 1024 requests), else ``"large"``."""
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
        tensors = (as_bits(src), as_bits(dst), seq_lens_q, cu_seqlens_q)
    launcher(grid, key, tensors, ptrs, (*ints, *ss, *ds, *consts, gdc), warps, {"launch_pdl": gdc})


# ---- input checks: ValueError saying what is expected --------------------------------------------
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
    first, mismatches, lo, hi, total = torch.stack([
        cu[0], (cu[1:] - cu[:-1] != sl).sum(), sl.min() if bs else cu[0] * 0,
        sl.max() if bs else cu[0] * 0, cu[-1]]).tolist()
    if first != 0 or mismatches:
        raise ValueError(f"cu_seqlens_q must be [0, cumsum(seq_lens_q)]; it starts at {first} and "
                         f"disagrees with seq_lens_q at {mismatches} of {bs} requests")
    if lo < 0 or hi > max_q:
        raise ValueError(f"seq_lens_q must lie in 0..max_q = {max_q}; got min {lo}, max {hi}")
    if total > rows_avail:
        raise ValueError(f"the lengths add up to {total} rows but {rows_name} has {rows_avail}")


def pad_draft_extend_query(q, seq_lens_q, cu_seqlens_q, max_q, *, align="end", out=None,
                           fill_padding=True, validate=True, variant="auto"):
    """Scatter ``q [total_q, H, D]`` (any strides) into ``[bs, max_q, H, D]``. ``seq_lens_q`` int32
    ``[bs]``, ``cu_seqlens_q`` ``[0, cumsum]``; ``validate``: also the lengths (one host sync)."""
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
    consts = _consts(h, d, el, qs[1:], os_[2:], _SMALL_TARGET_BYTES, align == "end", fill, cu_block)
    grid0 = (n_rows + (bs * max_q if fill else 0)) * consts[3]
    if grid0:
        _launch(_PAD_SMALL, grid0, q, out, qs, os_, seq_lens_q, cu_seqlens_q,
                (max_q, bs, n_rows), consts, _SMALL_NUM_WARPS)
    return out


def unpad_draft_extend_output(raw_out, seq_lens_q, cu_seqlens_q, total_q, *, align="end",
                              out=None, validate=True, variant="auto"):
    """Gather the real rows of ``raw_out [bs, max_q, H, Dv]`` into ``[total_q, H, Dv]``."""
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
            cu_seqlens_q, (max_q,), consts, _SMALL_NUM_WARPS if small else _NUM_WARPS)
    return out


# ---- torch references: the same bytes, no host sync (the CPU path without the interpreter) ------
_INT_VIEW = {1: torch.uint8, 2: torch.int16, 4: torch.int32}  # bit-exact copies


def as_bits(t: torch.Tensor) -> torch.Tensor:
    """``t`` viewed as an integer tensor of its element size (copies move bits, not values)."""
    return t.view(_INT_VIEW[t.element_size()])


def pad_draft_extend_query_ref(q, seq_lens_q, cu_seqlens_q, max_q, *, align="end", out=None,
                               fill_padding=True):
    """Torch reference of :func:`~mla_spec.kernels.pad.draft_extend.pad_draft_extend_query`."""
    bs, (_, h, d) = seq_lens_q.shape[0], q.shape
    if out is None:
        out = torch.empty((bs, max_q, h, d), dtype=q.dtype, device=q.device)
    src_rows, real = _padded_row_map(seq_lens_q, cu_seqlens_q, max_q, align)
    if q.shape[0] == 0 or bs * max_q == 0:
        rows = torch.zeros((bs * max_q, h, d), dtype=q.dtype, device=q.device)
    else:
        rows = q.index_select(0, src_rows.clamp(0, q.shape[0] - 1))
    rows, out_bits = as_bits(rows).view(bs, max_q, h, d), as_bits(out)
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


def unpad_draft_extend_output_ref(raw_out, seq_lens_q, cu_seqlens_q, total_q, *, align="end",
                                  out=None):
    """Torch reference of :func:`~mla_spec.kernels.pad.draft_extend.unpad_draft_extend_output`."""
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
    out_bits = as_bits(out)
    out_bits.copy_(torch.where(valid.view(-1, 1, 1), as_bits(rows), out_bits))
    return out
