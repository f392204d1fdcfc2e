"""Launcher of the Hopper warpgroup-MMA split-KV MLA kernel (``csrc/mla_wgmma_sm90.cu``).

Same contract and result as :func:`mla_spec.kernels.mla_decode_paged.mla_decode_paged` for
the shapes it takes: fixed ``q_len`` (DECODE, TARGET_VERIFY, DRAFT_EXTEND_V2), a contiguous
bf16 cache ``[slots, 576]`` whose page size is a multiple of 64 (one KV tile = 64 consecutive
slots of one page, fetched by TMA), Dv 512 / Dpe 64, bf16 queries with 16-byte aligned rows,
an sm_90 GPU (``wgmma`` exists on Hopper only). 64, 32 or 16 query rows per CTA; more rows
per request run more row blocks, each streaming the KV. Splits merge through
``combine_splits``.

Why it exists: see the ``.cu`` files' headers. Its torch twin is ``mla_decode_ref``
(``tests/kernels/test_mla_decode_cuda.py`` runs every ``cuda`` variant against it on the GPU).
"""

from __future__ import annotations

import ctypes

import torch

from mla_spec.kernels.cuda_driver import CudaKernel, cuda_kernels_available, tensor_map_2d
from mla_spec.kernels.mla_decode_combine import combine_splits
from mla_spec.kernels.pdl import pdl_on

__all__ = ["WGMMA_BLOCK_M", "launch_wgmma_mla", "wgmma_mla_supported", "wgmma_smem"]

_DV, _DPE, _DK, _BN, _STAGES = 512, 64, 576, 64, 2
#: rows per CTA -> (source, threads): 32 / 16 rows split the QK depth between the two consumer
#: warpgroups (``mla_wgmma_sm90.cu``, a producer warp), 64 rows split the rows
#: (``mla_wgmma64_sm90.cu``, a producer warpgroup); keep in sync with the sources' kernels
_SOURCES = {32: ("mla_wgmma_sm90.cu", 288), 16: ("mla_wgmma_sm90.cu", 288),
            64: ("mla_wgmma64_sm90.cu", 384)}
WGMMA_BLOCK_M = tuple(_SOURCES)
_KERNELS = {bm: CudaKernel(src, f"mla_wgmma_m{bm}", arch="sm_90a")
            for bm, (src, _) in _SOURCES.items()}


def wgmma_smem(block_m: int) -> int:
    """Dynamic shared memory of one CTA (as laid out in the ``.cu`` files): 1 KB of alignment
    slack, the KV stages, the queries, P^T, then the S^T exchange (16 / 32 rows) or the
    per-row rescale factors (64), the reductions, the stage barriers."""
    base = 1024 + _STAGES * 9 * _BN * 128 + 9 * block_m * 128 + block_m * 128 + 16 * _STAGES
    if block_m == 64:
        return base + 8 * 32 * 4 + 2 * block_m * 4
    return base + 2 * (block_m // 2) * 128 * 4 + 8 * block_m * 4 + 2 * block_m * 4


class _WgParams(ctypes.Structure):
    _fields_ = [("kv_map", ctypes.c_ubyte * 128)] + \
        [(n, ctypes.c_void_p) for n in ("qn", "qp", "r2t", "rpi", "kv_lens", "part",
                                        "part_lse", "out", "lse")] + \
        [(n, ctypes.c_longlong) for n in ("s_qn_t", "s_qn_h", "s_qp_t", "s_qp_h", "s_r2t",
                                          "s_o_t", "s_o_h", "s_ps", "s_ls")] + \
        [(n, ctypes.c_int) for n in ("H", "q_len", "num_splits", "rpi_i64", "kvl_i64", "split",
                                     "write_lse")] + \
        [("qk_scale_log2", ctypes.c_float), ("v_scale", ctypes.c_float),
         ("_pad", ctypes.c_ubyte * 12)]  # the C struct is 64-byte aligned: 320 bytes


_MAPS: dict[tuple[int, int, int], bytes] = {}


def _tensor_map(kv_flat: torch.Tensor) -> bytes:
    """The cache's TMA descriptor (it depends on the address and the slot count only: the
    dtype, the row length and contiguity are checked before)."""
    key = (kv_flat.data_ptr(), kv_flat.shape[0], kv_flat.device.index or 0)
    got = _MAPS.get(key)
    if got is None:
        if len(_MAPS) >= 64:
            _MAPS.clear()
        got = _MAPS[key] = tensor_map_2d(kv_flat, 64, _BN)
    return got


def wgmma_mla_supported(q_nope: torch.Tensor, q_pe: torch.Tensor, kv_flat: torch.Tensor,
                        page_size: int, block_m: int, q_len: int | None) -> str | None:
    """None when the wgmma kernel takes this call, else why not (the caller falls back)."""
    why = cuda_kernels_available(q_nope.device)
    if why:
        return why
    if torch.cuda.get_device_capability(q_nope.device) != (9, 0):
        return "the wgmma kernel needs sm_90 (Hopper): wgmma does not exist elsewhere"
    if block_m not in _KERNELS:
        return f"block_m {block_m} is not compiled (one of {WGMMA_BLOCK_M})"
    if q_len is None:
        return "the wgmma kernel takes fixed q_len only (ragged rows: the Triton kernels)"
    if kv_flat.dtype != torch.bfloat16 or q_nope.dtype != torch.bfloat16:
        return f"the wgmma kernel takes a bf16 cache and bf16 queries (got {kv_flat.dtype} / " \
               f"{q_nope.dtype})"
    if q_nope.shape[-1] != _DV or q_pe.shape[-1] != _DPE:
        return f"the wgmma kernel is built for Dv {_DV} / Dpe {_DPE}"
    if page_size % _BN:
        return f"page_size {page_size} is not a multiple of the wgmma tile's {_BN} tokens"
    if not kv_flat.is_contiguous() or kv_flat.shape[-1] != _DK or kv_flat.data_ptr() % 16:
        return f"kv_flat must be a contiguous, 16-byte aligned [slots, {_DK}]"
    for nm, t in (("q_nope", q_nope), ("q_pe", q_pe)):
        if t.stride(-1) != 1 or t.stride(0) % 8 or t.stride(1) % 8 or t.data_ptr() % 16:
            return f"{nm} rows must be contiguous and 16-byte aligned"
    return None


def launch_wgmma_mla(q_nope, q_pe, kv_flat, req_to_token, req_pool_indices, kv_lens, out, lse,
                     qk_scale_log2: float, v_scale: float, *, q_len: int, m_blocks: int,
                     num_splits: int, block_m: int) -> None:
    """Run the split kernel (and the combine when ``num_splits > 1``) into ``out`` / ``lse``
    (see :func:`mla_spec.kernels.mla_decode_paged.mla_decode_paged` for the arguments)."""
    n, h, dv = q_nope.shape
    bs = req_pool_indices.numel()
    dev = q_nope.device
    if out.dtype != torch.bfloat16 or out.stride(-1) != 1 or out.stride(0) % 4 or \
            out.stride(1) % 4 or out.data_ptr() % 8:
        raise ValueError("the wgmma kernel writes a bf16 out with contiguous, 8-byte aligned "
                         "rows")
    split = num_splits > 1
    if split:
        part = torch.empty((num_splits, n * h, dv), dtype=torch.float32, device=dev)
        part_lse = torch.empty((num_splits, n * h), dtype=torch.float32, device=dev)
    else:
        part = part_lse = out
    r2t = req_to_token if req_to_token.dtype == torch.int32 else req_to_token.int()
    p = _WgParams()
    ctypes.memmove(p.kv_map, _tensor_map(kv_flat), 128)
    for name, val in (("qn", q_nope.data_ptr()), ("qp", q_pe.data_ptr()), ("r2t", r2t.data_ptr()),
                      ("rpi", req_pool_indices.data_ptr()), ("kv_lens", kv_lens.data_ptr()),
                      ("part", part.data_ptr()), ("part_lse", part_lse.data_ptr()),
                      ("out", out.data_ptr()),
                      ("lse", lse.data_ptr() if lse is not None else out.data_ptr()),
                      ("s_qn_t", q_nope.stride(0)), ("s_qn_h", q_nope.stride(1)),
                      ("s_qp_t", q_pe.stride(0)), ("s_qp_h", q_pe.stride(1)),
                      ("s_r2t", r2t.stride(0)), ("s_o_t", out.stride(0)),
                      ("s_o_h", out.stride(1)), ("s_ps", n * h * dv if split else 0),
                      ("s_ls", n * h if split else 0), ("H", h), ("q_len", q_len),
                      ("num_splits", num_splits),
                      ("rpi_i64", int(req_pool_indices.dtype == torch.int64)),
                      ("kvl_i64", int(kv_lens.dtype == torch.int64)), ("split", int(split)),
                      ("write_lse", int(lse is not None)), ("qk_scale_log2", qk_scale_log2),
                      ("v_scale", v_scale)):
        setattr(p, name, val)
    _KERNELS[block_m]((num_splits, m_blocks, bs), _SOURCES[block_m][1], wgmma_smem(block_m), p, dev,
                      pdl=pdl_on(q_nope))
    if split:
        combine_splits(part, part_lse, out, lse)
