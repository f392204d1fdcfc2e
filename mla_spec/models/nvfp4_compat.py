"""The model's bridge to the NVFP4 code in ``mla_spec.quant`` / ``mla_spec.kernels``.

Linears of the model keep the four ModelOpt tensors as buffers (see
``mla_spec.models.linear._TPLinear``); this module turns them into a matmul. On CPU it
dequantizes to the activation dtype and calls ``F.linear`` (the torch twin); on CUDA it uses
the W4A16 kernel of ``mla_spec.kernels.nvfp4_gemm``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from mla_spec.quant.nvfp4 import dequantize_nvfp4, quantize_nvfp4

__all__ = ["dequantize_weight", "nvfp4_linear", "quantize_weight"]


def dequantize_weight(weight: torch.Tensor, weight_scale: torch.Tensor,
                      weight_scale_2: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``[N, K]`` dense weight in ``dtype`` from uint8 ``[N, K/2]`` + e4m3 ``[N, K/16]`` + fp32."""
    return dequantize_nvfp4(weight, weight_scale, weight_scale_2.float(), dtype)


def nvfp4_linear(x: torch.Tensor, lin) -> torch.Tensor:
    """``x [..., K] @ dequant(W)^T -> [..., N]`` in ``x``'s dtype for an NVFP4 linear ``lin``.

    CUDA: the W4A16 Triton GEMM (``mla_spec.kernels.nvfp4_gemm``). CPU: dequantize + F.linear
    (differentiable w.r.t. ``x``; faster than the Triton interpreter).
    """
    if x.is_cuda and not (torch.is_grad_enabled() and x.requires_grad):
        from mla_spec.kernels.nvfp4_gemm import nvfp4_gemm

        return nvfp4_gemm(x, lin.weight, lin.weight_scale, lin.weight_scale_2.reshape(()))
    w = dequantize_weight(lin.weight, lin.weight_scale, lin.weight_scale_2, x.dtype)
    return F.linear(x, w)


def quantize_weight(w: torch.Tensor, input_amax: float | None = None) -> dict[str, torch.Tensor]:
    """Quantize ``w [N, K]`` to the four checkpoint tensors (``input_scale`` from ``input_amax``,
    default 1.0 * 2688 so that ``input_scale`` = 1.0: the W4A16 path never reads it)."""
    q = quantize_nvfp4(w.float(), input_amax=2688.0 if input_amax is None else input_amax)
    return {
        "weight": q.weight,
        "weight_scale": q.weight_scale,
        "weight_scale_2": q.weight_scale_2.reshape(()).float(),
        "input_scale": q.input_scale.reshape(()).float(),
    }
