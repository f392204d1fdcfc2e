"""Launcher of the hand-written Hopper split-KV MLA kernel (``csrc/mla_splitkv_sm90.cu``).

Same contract and result as :func:`mla_spec.kernels.mla_decode_paged.mla_decode_paged` for
the shapes it takes: fixed ``q_len`` (DECODE, TARGET_VERIFY, DRAFT_EXTEND_V2), a bf16 cache
``[slots, 576]`` with page-aligned slots and a page size that is a multiple of the tile,
Dv 512 / Dpe 64 (DeepSeek), bf16 queries with 16-byte aligned rows. Splits merge through
``combine_splits`` (PDL-launched after the split kernel's own late trigger).

Why it exists, and what its tile parameters mean: see the ``.cu`` file's header. Its torch
twin is ``mla_decode_ref`` (``tests/kernels/test_mla_decode_cuda.py`` compares them on the
GPU); on the CPU it does not run (:func:`cuda_mla_supported` says why).
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

import torch

from mla_spec.kernels.launch.cuda_driver import CudaKernel, cuda_kernels_available
from mla_spec.kernels.mla_decode_combine import combine_splits
from mla_spec.kernels.launch.pdl import pdl_on

__all__ = ["CUDA_TILES", "CudaTile", "call_supported", "cuda_mla_supported", "launch_cuda_mla",
           "split_params"]

_SRC = "mla_splitkv_sm90.cu"
_DV, _DPE = 512, 64
_SK = _DV + _DPE + 8  # shared-memory row stride (elements), as in the .cu


@dataclass(frozen=True)
class CudaTile:
    """One compiled instantiation: ``block_m`` query rows per CTA, ``block_n`` KV tokens per
    stage, ``stages`` bulk-copy stages, ``warps`` warps."""

    block_m: int = 32
    block_n: int = 64
    stages: int = 2
    warps: int = 4

    @property
    def name(self) -> str:
        return f"mla_splitkv_m{self.block_m}_n{self.block_n}_s{self.stages}_w{self.warps}"

    @property
    def smem(self) -> int:
        """Dynamic shared memory: barriers, Q, KV stages, P, the cross-warp reduction."""
        return (128 + 2 * self.block_m * _SK + 2 * self.stages * self.block_n * _SK
                + 2 * self.block_m * (self.block_n + 8) + 4 * self.warps * self.block_m)


#: The instantiations the ``.cu`` file compiles (keep in sync with its ``MLA_SPLITKV`` lines).
CUDA_TILES = (CudaTile(32, 64, 2, 4), CudaTile(32, 64, 2, 8), CudaTile(32, 32, 4, 4),
              CudaTile(16, 64, 2, 4), CudaTile(16, 32, 4, 4), CudaTile(16, 32, 2, 4))
_KERNELS = {t: CudaKernel(_SRC, t.name) for t in CUDA_TILES}


class _Params(ctypes.Structure):
    _fields_ = [(n, ctypes.c_void_p) for n in ("qn", "qp", "kv", "r2t", "rpi", "kv_lens", "part",
                                               "part_lse", "out", "lse")] + \
        [(n, ctypes.c_longlong) for n in ("s_qn_t", "s_qn_h", "s_qp_t", "s_qp_h", "s_r2t",
                                          "s_o_t", "s_o_h", "s_ps", "s_ls")] + \
        [(n, ctypes.c_int) for n in ("H", "q_len", "num_splits", "rpi_i64", "kvl_i64", "split",
                                     "write_lse", "part_bf16")] + \
        [("qk_scale_log2", ctypes.c_float), ("v_scale", ctypes.c_float)]


def call_supported(q_nope: torch.Tensor, q_pe: torch.Tensor, kv_flat: torch.Tensor,
                   page_size: int, block_n: int, q_len: int | None, kernel: str,
                   kv_dtypes: tuple[torch.dtype, ...] = (torch.bfloat16,)) -> str | None:
    """What every hand-written MLA kernel needs of a call (None when met, else why not): the
    CUDA kernels can run here, fixed rows, bf16 queries and a cache of ``kv_dtypes`` at
    DeepSeek's dims, page-sized tiles of ``block_n`` tokens, 16-byte aligned query rows and a
    contiguous cache."""
    why = cuda_kernels_available(q_nope.device)
    if why:
        return why
    if q_len is None:
        return f"the {kernel} takes fixed q_len only (ragged rows: the Triton kernels)"
    if kv_flat.dtype not in kv_dtypes or q_nope.dtype != torch.bfloat16 or \
            q_pe.dtype != torch.bfloat16:
        return f"the {kernel} takes a {' or '.join(map(str, kv_dtypes))} cache and bf16 " \
               f"queries (got {kv_flat.dtype} / {q_nope.dtype})"
    if q_nope.shape[-1] != _DV or q_pe.shape[-1] != _DPE:
        return f"the {kernel} is built for Dv {_DV} / Dpe {_DPE}"
    if page_size % block_n:
        return f"page_size {page_size} is not a multiple of the {kernel}'s {block_n}-token tile"
    for nm, t in (("q_nope", q_nope), ("q_pe", q_pe)):
        if t.stride(-1) != 1 or t.stride(0) % 8 or t.stride(1) % 8 or t.data_ptr() % 16:
            return f"{nm} rows must be contiguous and 16-byte aligned"
    if not kv_flat.is_contiguous() or kv_flat.shape[-1] != _DV + _DPE or kv_flat.data_ptr() % 16:
        return f"kv_flat must be a contiguous, 16-byte aligned [slots, {_DV + _DPE}]"
    return None


def cuda_mla_supported(q_nope: torch.Tensor, q_pe: torch.Tensor, kv_flat: torch.Tensor,
                       page_size: int, tile: CudaTile, q_len: int | None) -> str | None:
    """None when the CUDA kernel takes this call, else why not (the caller falls back)."""
    if tile not in _KERNELS:
        return f"tile {tile} is not compiled (one of {[t.name for t in CUDA_TILES]})"
    return call_supported(q_nope, q_pe, kv_flat, page_size, tile.block_n, q_len, "CUDA kernel")


def split_params(q_nope, q_pe, kv_flat, req_to_token, req_pool_indices, kv_lens, out, lse,
                 qk_scale_log2: float, v_scale: float, q_len: int, num_splits: int,
                 part_bf16: bool = False, partials: bool = True):
    """The kernel parameters (``_Params``, the ``MlaParams`` of ``csrc/mla_params.cuh``) of a
    call, and the split partials it writes (``part [S, N*H, Dv]`` fp32, or bf16 with
    ``part_bf16``; ``part_lse [S, N*H]`` fp32; ``out`` itself twice when there is one split,
    or when the kernel merges its splits without them: ``partials=False``)."""
    n, h, dv = q_nope.shape
    split = num_splits > 1
    if split and partials:
        part = torch.empty((num_splits, n * h, dv), device=q_nope.device,
                           dtype=torch.bfloat16 if part_bf16 else torch.float32)
        part_lse = torch.empty((num_splits, n * h), dtype=torch.float32, device=q_nope.device)
    else:
        part = part_lse = out
    r2t = req_to_token if req_to_token.dtype == torch.int32 else req_to_token.int()
    p = _Params(q_nope.data_ptr(), q_pe.data_ptr(), kv_flat.data_ptr(), r2t.data_ptr(),
                req_pool_indices.data_ptr(), kv_lens.data_ptr(), part.data_ptr(),
                part_lse.data_ptr(), out.data_ptr(),
                lse.data_ptr() if lse is not None else out.data_ptr(),
                q_nope.stride(0), q_nope.stride(1), q_pe.stride(0), q_pe.stride(1),
                r2t.stride(0), out.stride(0), out.stride(1),
                n * h * dv if split and partials else 0, n * h if split and partials else 0,
                h, q_len, num_splits, int(req_pool_indices.dtype == torch.int64),
                int(kv_lens.dtype == torch.int64), int(split), int(lse is not None),
                int(split and part_bf16), qk_scale_log2, v_scale)
    p._keep = r2t  # an int32 copy of req_to_token must outlive the launch
    return p, part, part_lse


def launch_cuda_mla(q_nope, q_pe, kv_flat, req_to_token, req_pool_indices, kv_lens, out, lse,
                    qk_scale_log2: float, v_scale: float, *, q_len: int, m_blocks: int,
                    num_splits: int, tile: CudaTile) -> None:
    """Run the split kernel (and the combine when ``num_splits > 1``) into ``out`` / ``lse``
    (see :func:`mla_spec.kernels.mla_decode_paged.mla_decode_paged` for the arguments)."""
    if out.dtype != torch.bfloat16 or out.stride(-1) != 1 or out.stride(0) % 2 or \
            out.stride(1) % 2:
        raise ValueError("the CUDA kernel writes a bf16 out with contiguous, 4-byte aligned rows")
    p, part, part_lse = split_params(q_nope, q_pe, kv_flat, req_to_token, req_pool_indices,
                                     kv_lens, out, lse, qk_scale_log2, v_scale, q_len,
                                     num_splits)
    _KERNELS[tile]((num_splits, m_blocks, req_pool_indices.numel()), 32 * tile.warps, tile.smem,
                   p, q_nope.device, pdl=pdl_on(q_nope))
    if num_splits > 1:
        combine_splits(part, part_lse, out, lse)
