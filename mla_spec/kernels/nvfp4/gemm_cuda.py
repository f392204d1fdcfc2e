"""Launcher of the hand-written NVFP4 ``mma.sync`` kernel (``csrc/nvfp4_mma_sm90.cu`` explains it):
1-16 tokens, bf16 x and y, K a multiple of 128, sm_90 with nvcc; split-K partials summed in order by
the last CTA (``launch.cuda_driver.arrival_counters``).
"""

import ctypes
import functools

import torch

from mla_spec.device import sm_count
from mla_spec.kernels import options
from mla_spec.kernels.launch.cuda_driver import CudaKernel, arrival_counters, cuda_kernels_available
from mla_spec.kernels.launch.pdl import pdl_on
from mla_spec.kernels.nvfp4.configs import (
    PINNED_CUDA,
    PINNED_CUDA_REFUSED,
    CudaMmaConfig,
    m_bucket,
    parse_variant,
)

__all__ = ["CUDA_MMA_BUILT", "CUDA_MMA_MAX_M", "cuda_gemm_supported", "launch_nvfp4_cuda",
           "default_cuda_config", "cuda_auto_config"]

#: the kernel's token tiles: 8 tokens per MMA, one or two MMAs
CUDA_MMA_MAX_M = 16
#: unmeasured shapes take the kernel for these token counts (where it won on every pinned shape)
CUDA_MMA_AUTO_M = range(2, 9)
_CHUNK = 128  # elements of K per load step (64 bytes of a weight row)


class _Params(ctypes.Structure):
    """``Nvfp4GemmParams`` of the ``.cu`` file, field for field."""

    _fields_ = [("w", ctypes.c_void_p), ("ws", ctypes.c_void_p), ("ws2", ctypes.c_void_p),
                ("x", ctypes.c_void_p), ("out", ctypes.c_void_p), ("part", ctypes.c_void_p),
                ("counters", ctypes.c_void_p), ("stride_w", ctypes.c_longlong),
                ("stride_ws", ctypes.c_longlong), ("stride_x", ctypes.c_longlong),
                ("stride_out", ctypes.c_longlong), ("m", ctypes.c_int), ("n", ctypes.c_int),
                ("k", ctypes.c_int), ("splits", ctypes.c_int)]


#: (token tiles of 8, warps, stages, x prefetch, row tiles) compiled in the .cu file (in sync)
CUDA_MMA_BUILT = ((1, 4, 2, True, 1), (1, 4, 4, True, 1), (1, 4, 8, True, 1),
                  (1, 8, 4, True, 1), (1, 4, 4, False, 1), (2, 4, 4, True, 1),
                  (2, 4, 2, False, 1), (2, 4, 4, False, 1), (2, 4, 8, False, 1),
                  (2, 8, 4, False, 1), (1, 4, 4, True, 2), (1, 8, 4, True, 2),
                  (1, 4, 8, True, 2), (2, 4, 4, False, 2), (2, 8, 4, False, 2),
                  (2, 4, 2, False, 2))
_KERNELS = {(nt, w, st, xpf, r): CudaKernel("nvfp4_mma_sm90.cu",
                                            f"nvfp4_mma_n{nt}_w{w}_s{st}_x{int(xpf)}_r{r}",
                                            arch="sm_90a")
            for nt, w, st, xpf, r in CUDA_MMA_BUILT}


def _key(m: int, cfg: CudaMmaConfig) -> tuple[int, int, int, bool, int]:
    return (1 if m <= 8 else 2, cfg.num_warps, cfg.num_stages, cfg.x_prefetch, cfg.row_tiles)


def cuda_gemm_supported(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                        weight_scale_2: torch.Tensor, out_dtype: torch.dtype,
                        cfg: CudaMmaConfig | None = None) -> str | None:
    """None when the kernel (``cfg``'s build, if given) takes the call, else why not."""
    m = x.shape[0]
    if cfg is not None and 1 <= m <= CUDA_MMA_MAX_M and _key(m, cfg) not in _KERNELS:
        return (f"{cfg} is not built for {m} tokens; built (token tiles, warps, stages, "
                f"x prefetch, row tiles): {CUDA_MMA_BUILT}")
    why = cuda_kernels_available(x.device)
    if why is not None:
        return why
    k = x.shape[1]
    if not 1 <= m <= CUDA_MMA_MAX_M:
        return f"the cuda NVFP4 kernel takes 1..{CUDA_MMA_MAX_M} tokens, got {m}"
    if x.dtype != torch.bfloat16 or out_dtype != torch.bfloat16:
        return f"the cuda NVFP4 kernel takes bf16 x and y, got {x.dtype} -> {out_dtype}"
    if k % _CHUNK:
        return f"the cuda NVFP4 kernel needs K a multiple of {_CHUNK}, got {k}"
    if weight_scale.dtype != torch.float8_e4m3fn or weight_scale_2.dtype != torch.float32:
        return "the cuda NVFP4 kernel takes e4m3 weight_scale and an fp32 weight_scale_2"
    for name, t, esz in (("x", x, 2), ("weight", weight, 1)):
        if t.stride(-1) != 1 or (t.stride(0) * esz) % 16 or t.data_ptr() % 16:
            return f"the cuda NVFP4 kernel needs 16-byte aligned, unit-stride rows of {name}"
    if weight_scale.stride(-1) != 1 or weight_scale.stride(0) % 2 or weight_scale.data_ptr() % 2:
        return "the cuda NVFP4 kernel needs 2-byte aligned rows of weight_scale"
    if not (x.device == weight.device == weight_scale.device == weight_scale_2.device):
        return "x and the NVFP4 tensors must be on one device"
    return None


def default_cuda_config(m: int, n: int, k: int, sms: int = 132) -> CudaMmaConfig:
    """Unmeasured shapes: 4 warps, 4 stages, K splits until ~4 CTAs per SM (two chunks a warp)."""
    tiles = -(-n // 16)
    split = 1
    while tiles * split < 4 * sms and k // (_CHUNK * 4 * split * 2) >= 1:
        split *= 2
    return CudaMmaConfig(num_warps=4, num_stages=4, split_k=split, x_prefetch=m <= 8)


@functools.lru_cache(maxsize=4096)
def _auto(m: int, n: int, k: int, sms: int) -> CudaMmaConfig | None:
    key = (n, k, m_bucket(m))
    if key in PINNED_CUDA:
        return parse_variant(PINNED_CUDA[key])
    if key in PINNED_CUDA_REFUSED or m not in CUDA_MMA_AUTO_M:
        return None
    return default_cuda_config(m, n, k, sms)


def cuda_auto_config(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                     weight_scale_2: torch.Tensor, out_dtype: torch.dtype
                     ) -> CudaMmaConfig | None:
    """The ``mma.sync`` config without ``config``: pinned or 2-8 tokens; None when off or unfit."""
    if not options.NVFP4_CUDA or not x.is_cuda or x.dim() != 2:
        return None
    m, k = x.shape
    cfg = _auto(m, weight.shape[0], k, sm_count(x.device))
    ok = cfg is not None and cuda_gemm_supported(x, weight, weight_scale, weight_scale_2,
                                                 out_dtype, cfg) is None
    return cfg if ok else None


def launch_nvfp4_cuda(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                      weight_scale_2: torch.Tensor, out: torch.Tensor,
                      cfg: CudaMmaConfig) -> torch.Tensor:
    """``out [M, N] = x @ dequant(W)^T`` in bf16 (:func:`cuda_gemm_supported` checked)."""
    m, k = x.shape
    n = weight.shape[0]
    chunks = k // _CHUNK
    split = max(1, min(cfg.split_k, chunks))
    tiles = -(-n // (16 * cfg.row_tiles))
    part = counters = None
    if split > 1:
        part = torch.empty((split, m, n), dtype=torch.float32, device=x.device)
        counters = arrival_counters(tiles, x.device)
    p = _Params(weight.data_ptr(), weight_scale.data_ptr(), weight_scale_2.data_ptr(),
                x.data_ptr(), out.data_ptr(), part.data_ptr() if part is not None else 0,
                counters.data_ptr() if counters is not None else 0, weight.stride(0),
                weight_scale.stride(0), x.stride(0), out.stride(0), m, n, k, split)
    kernel = _KERNELS[_key(m, cfg)]
    kernel((tiles, split, 1), 32 * cfg.num_warps, 0, p, x.device, pdl=pdl_on(x))
    return out
