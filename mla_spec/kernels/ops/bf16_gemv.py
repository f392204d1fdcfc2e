"""BF16 GEMV for the attention projections at 1-2 tokens: ``y[b, m, n] = sum_k x[b, m, k] * w[b, n,
k]`` in fp32, any strides, next step's loads in flight. Used on CUDA for the ``PINNED`` shapes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from mla_spec.device import use_triton
from mla_spec.kernels import options
from mla_spec.kernels.launch.pdl import gdc_enter, pdl_kwargs

__all__ = ["BF16_GEMV_MAX_M", "BgemvConfig", "bgemv", "bgemv_config", "bgemv_ref",
           "bgemv_supported", "gemv_linear"]

#: Tokens up to which the GEMV runs (above: cuBLAS, an MMA kernel is right there).
BF16_GEMV_MAX_M = 2
_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


@dataclass(frozen=True)
class BgemvConfig:
    """``block_n`` outputs x ``block_k`` elements per step, ``num_warps``."""

    block_n: int = 16
    block_k: int = 512
    num_warps: int = 4


#: (B, M, N, K, contiguous axis) -> tile where the GEMV beat cuBLAS by >= 3% in two runs
#: (2026-11-29, ``python3 benchmarks/bench_bf16_gemv.py``); other shapes keep cuBLAS.
PINNED: dict[tuple[int, int, int, int, str], BgemvConfig] = {
    (1, 1, 2112, 7168, "k"): BgemvConfig(2, 1024, 2),  # joint q_a / kv_a
    (1, 2, 2112, 7168, "k"): BgemvConfig(4, 512, 4),
    (1, 1, 7168, 4096, "k"): BgemvConfig(4, 512, 4),  # o_proj TP 4
    (32, 1, 512, 128, "n"): BgemvConfig(64, 64, 8),  # W_UK TP 4
    (32, 1, 128, 512, "k"): BgemvConfig(4, 512, 2),  # W_UV TP 4
    (32, 2, 128, 512, "k"): BgemvConfig(16, 512, 4),
    (1, 1, 7168, 16384, "k"): BgemvConfig(4, 512, 4),  # o_proj TP 1
    (1, 1, 7168, 14336, "k"): BgemvConfig(4, 512, 4),  # eh_proj (MTP)
}


def _key(b: int, m: int, n: int, k: int, k_contiguous: bool
         ) -> tuple[int, int, int, int, str]:
    return (b, m, n, k, "k" if k_contiguous else "n")


def bgemv_config(b: int, m: int, n: int, k: int, k_contiguous: bool) -> BgemvConfig:
    """``PINNED``, else 4 x 1024 tiles for K-contiguous weights, 64 x 32 for N-contiguous ones."""
    pinned = PINNED.get(_key(b, m, n, k, k_contiguous))
    if pinned is not None:
        return pinned
    if k_contiguous:
        return BgemvConfig(min(4, triton.next_power_of_2(n)), min(1024, triton.next_power_of_2(k)),
                           4)
    return BgemvConfig(min(64, triton.next_power_of_2(n)), min(32, triton.next_power_of_2(k)), 4)


# N and K stay specializable (multiples of 16 keep the masked loads 16-byte vector loads).
@triton.jit(do_not_specialize=["M"])
def _bgemv_kernel(x_ptr, w_ptr, y_ptr, M, N, K,
                  s_xb, s_xm, s_xk, s_wb, s_wn, s_wk, s_yb, s_ym, s_yn,
                  MP: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, USE_GDC: tl.constexpr,
                  W_EARLY: tl.constexpr):
    if not W_EARLY:
        gdc_enter(USE_GDC)
    pid_n = tl.program_id(0)
    b = tl.program_id(1).to(tl.int64)
    offs_m = tl.arange(0, MP)
    offs_n = pid_n * BN + tl.arange(0, BN)
    offs_k = tl.arange(0, BK)
    m_ok = offs_m < M
    n_ok = offs_n < N
    x_ptrs = x_ptr + b * s_xb + offs_m[:, None] * s_xm + offs_k[None, :] * s_xk
    w_ptrs = (w_ptr + b * s_wb + offs_n[:, None].to(tl.int64) * s_wn
              + offs_k[None, :] * s_wk)
    k_ok = offs_k < K
    w_cur = tl.load(w_ptrs, mask=n_ok[:, None] & k_ok[None, :], other=0.0)
    if W_EARLY:  # the first weight step is in flight while the previous grid finishes
        gdc_enter(USE_GDC)
    x_cur = tl.load(x_ptrs, mask=m_ok[:, None] & k_ok[None, :], other=0.0)
    # per-lane partial sums: the cross-lane reduction runs once, after the loop
    acc = tl.zeros([MP, BN, BK], dtype=tl.float32)
    for k0 in range(BK, K + BK, BK):
        k_ok = k0 + offs_k < K
        x_nxt = tl.load(x_ptrs + k0 * s_xk, mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        w_nxt = tl.load(w_ptrs + k0 * s_wk, mask=n_ok[:, None] & k_ok[None, :], other=0.0)
        acc += x_cur.to(tl.float32)[:, None, :] * w_cur.to(tl.float32)[None, :, :]
        x_cur = x_nxt
        w_cur = w_nxt
    acc = tl.sum(acc, 2)
    y_ptrs = y_ptr + b * s_yb + offs_m[:, None] * s_ym + offs_n[None, :] * s_yn
    tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


def bgemv_ref(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor | None = None
              ) -> torch.Tensor:
    """Torch reference: ``x [B, M, K]``, ``w [B, N, K]`` -> ``[B, M, N]`` (fp32 math, x's dtype)."""
    y = torch.matmul(x.float(), w.float().transpose(1, 2)).to(x.dtype)
    return y if out is None else out.copy_(y)


def bgemv_supported(x: torch.Tensor, w: torch.Tensor) -> str | None:
    """None if :func:`bgemv` runs its kernel on these operands, else why not."""
    if not options.BF16_GEMV:
        return "options.BF16_GEMV is off"
    if not x.is_cuda or not use_triton(x):
        return "not a CUDA tensor"
    if x.dim() != 3 or w.dim() != 3:
        return "x must be [B, M, K] and w [B, N, K]"
    if x.shape[1] > BF16_GEMV_MAX_M:
        return f"M = {x.shape[1]} > BF16_GEMV_MAX_M = {BF16_GEMV_MAX_M}"
    if x.dtype not in _DTYPES or w.dtype != x.dtype:
        return f"dtypes {x.dtype} / {w.dtype}: one of {_DTYPES} for both"
    if torch.is_grad_enabled() and (x.requires_grad or w.requires_grad):
        return "autograd"
    if _key(x.shape[0], x.shape[1], w.shape[1], x.shape[2], w.stride(2) == 1) not in PINNED:
        return "no measured tile for this shape (cuBLAS reads it as fast)"
    return None


def bgemv(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor | None = None,
          cfg: BgemvConfig | None = None, static_w: bool = False) -> torch.Tensor:
    """``y[b] = x[b] @ w[b]^T`` -> ``[B, M, N]`` (``out`` may be strided). ``static_w``: ``w`` is a
    weight, so under PDL its first step loads before the wait (``pdl`` rule 3)."""
    if x.dim() != 3 or w.dim() != 3 or x.shape[0] != w.shape[0] or x.shape[2] != w.shape[2]:
        raise ValueError(f"bgemv expects x [B, M, K] and w [B, N, K]; got {tuple(x.shape)} and "
                         f"{tuple(w.shape)}")
    bsz, m, k = x.shape
    n = w.shape[1]
    if out is not None and (out.shape != (bsz, m, n) or out.dtype != x.dtype):
        raise ValueError(f"out must be {x.dtype} [{bsz}, {m}, {n}], got {out.dtype} "
                         f"{tuple(out.shape)}")
    if x.device != w.device:
        raise ValueError(f"x on {x.device}, w on {w.device}: one device expected")
    if not use_triton(x) or x.dtype not in _DTYPES or w.dtype != x.dtype:
        return bgemv_ref(x, w, out)
    y = out if out is not None else torch.empty((bsz, m, n), dtype=x.dtype, device=x.device)
    if y.numel() == 0:
        return y
    if k == 0:
        return y.zero_()
    cfg = cfg or bgemv_config(bsz, m, n, k, w.stride(2) == 1)
    _bgemv_kernel[(triton.cdiv(n, cfg.block_n), bsz)](
        x, w, y, m, n, k, x.stride(0), x.stride(1), x.stride(2), w.stride(0), w.stride(1),
        w.stride(2), y.stride(0), y.stride(1), y.stride(2),
        MP=max(triton.next_power_of_2(m), 1), BN=cfg.block_n, BK=cfg.block_k,
        W_EARLY=static_w, num_warps=cfg.num_warps, **pdl_kwargs(x))
    return y


def gemv_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``F.linear(x, weight)`` (no bias), through :func:`bgemv` where it applies."""
    if x.is_cuda and options.BF16_GEMV:
        x2 = x.reshape(-1, x.shape[-1])
        if bgemv_supported(x2[None], weight[None]) is None:
            return bgemv(x2[None], weight[None], static_w=True)[0].view(
                *x.shape[:-1], weight.shape[0])
    return torch.nn.functional.linear(x, weight)
