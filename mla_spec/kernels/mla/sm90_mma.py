"""What the hand-written MLA launchers share (``csrc/mla_params.cuh``'s struct, partials, checks)
and the mma.sync split-KV launcher (``K``, ``csrc/mla_splitkv_sm90.cu``; sm_90+, bf16 cache and
queries).
"""

import ctypes
from dataclasses import dataclass

import torch

from mla_spec.kernels.launch.cuda_driver import CudaKernel, cuda_kernels_available
from mla_spec.kernels.launch.pdl import pdl_on
from mla_spec.kernels.mla.combine import combine_splits

__all__ = ["CUDA_TILES", "DPE", "DV", "CudaTile", "MlaParams", "call_supported",
           "cuda_mla_supported", "launch_cuda_mla", "split_params"]

DV, DPE = 512, 64


class MlaParams(ctypes.Structure):
    """``MlaParams`` of ``csrc/mla_params.cuh`` (passed by value)."""

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
    """None when a hand-written MLA kernel takes the call (fixed rows, bf16 queries, a ``kv_dtypes``
    cache at DeepSeek's dims, page-sized tiles, aligned rows), else why not."""
    why = cuda_kernels_available(q_nope.device)
    if why:
        return why
    if q_len is None:
        return f"the {kernel} takes fixed q_len only (ragged rows: the Triton kernels)"
    if kv_flat.dtype not in kv_dtypes or q_nope.dtype != torch.bfloat16 or \
            q_pe.dtype != torch.bfloat16:
        return f"the {kernel} takes a {' or '.join(map(str, kv_dtypes))} cache and bf16 " \
               f"queries (got {kv_flat.dtype} / {q_nope.dtype})"
    if q_nope.shape[-1] != DV or q_pe.shape[-1] != DPE:
        return f"the {kernel} is built for Dv {DV} / Dpe {DPE}"
    if page_size % block_n:
        return f"page_size {page_size} is not a multiple of the {kernel}'s {block_n}-token tile"
    for nm, t in (("q_nope", q_nope), ("q_pe", q_pe)):
        if t.stride(-1) != 1 or t.stride(0) % 8 or t.stride(1) % 8 or t.data_ptr() % 16:
            return f"{nm} rows must be contiguous and 16-byte aligned"
    if not kv_flat.is_contiguous() or kv_flat.shape[-1] != DV + DPE or kv_flat.data_ptr() % 16:
        return f"kv_flat must be a contiguous, 16-byte aligned [slots, {DV + DPE}]"
    return None


def split_params(q_nope, q_pe, kv_flat, req_to_token, req_pool_indices, kv_lens, out, lse,
                 qk_scale_log2: float, v_scale: float, q_len: int, num_splits: int,
                 part_bf16: bool = False, partials: bool = True):
    """A call's parameters and split partials (``out`` itself with one split or no partials)."""
    n, h, dv = q_nope.shape
    split = num_splits > 1
    if split and partials:
        part = torch.empty((num_splits, n * h, dv), device=q_nope.device,
                           dtype=torch.bfloat16 if part_bf16 else torch.float32)
        part_lse = torch.empty((num_splits, n * h), dtype=torch.float32, device=q_nope.device)
    else:
        part = part_lse = out
    r2t = req_to_token if req_to_token.dtype == torch.int32 else req_to_token.int()
    p = MlaParams(q_nope.data_ptr(), q_pe.data_ptr(), kv_flat.data_ptr(), r2t.data_ptr(),
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


_SRC = "mla_splitkv_sm90.cu"
_SK = DV + DPE + 8  # shared-memory row stride (elements), as in the .cu


@dataclass(frozen=True)
class CudaTile:
    """One compiled instantiation: query rows per CTA, KV tokens per stage, stages, warps."""

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
CUDA_TILES = (CudaTile(32, 64, 2, 4),)
_KERNELS = {t: CudaKernel(_SRC, t.name) for t in CUDA_TILES}


def cuda_mla_supported(q_nope: torch.Tensor, q_pe: torch.Tensor, kv_flat: torch.Tensor,
                       page_size: int, tile: CudaTile, q_len: int | None) -> str | None:
    """None when the CUDA kernel takes this call, else why not (the caller falls back)."""
    if tile not in _KERNELS:
        return f"tile {tile} is not compiled (one of {[t.name for t in CUDA_TILES]})"
    return call_supported(q_nope, q_pe, kv_flat, page_size, tile.block_n, q_len, "CUDA kernel")


def launch_cuda_mla(q_nope, q_pe, kv_flat, req_to_token, req_pool_indices, kv_lens, out, lse,
                    qk_scale_log2: float, v_scale: float, *, q_len: int, m_blocks: int,
                    num_splits: int, tile: CudaTile) -> None:
    """Run the split kernel, then the combine; arguments as ``mla_decode_paged``'s."""
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
