"""The model's bridge to the NVFP4 code in ``mla_spec.quant`` / ``mla_spec.kernels``.

Linears of the model keep the four ModelOpt tensors as buffers (see
``mla_spec.models.linear._TPLinear``); this module turns them into a matmul. On CUDA it uses the
W4A16 kernel of ``mla_spec.kernels.nvfp4_gemm`` (dequantization fused into the GEMM). On CPU it
dequantizes to the activation dtype and calls ``F.linear`` (the torch twin); the dense weight
``[out, in]`` is cached on the layer, as ``NVFP4Linear`` does, so a decode step does not pay the
dequantization again (it was about a quarter of CPU decode time). The cache is keyed on the
identity, storage pointer and version counter of ``weight`` / ``weight_scale`` /
``weight_scale_2`` plus the dtype: a reload (``copy_``, ``load_state_dict``, ``to``) or any
in-place write invalidates it. The MoE experts' buffers are views of one stacked storage and share
its version counter, so writing any expert invalidates them all (only the loader writes them).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from mla_spec.quant.nvfp4 import dequantize_nvfp4, quantize_nvfp4

__all__ = ["cached_dense_weight", "dequantize_weight", "nvfp4_linear", "quantize_weight"]

_CACHE_ATTR = "_nvfp4_dense_cache"  # (key, dense weight) in the layer's __dict__
_NAMES = ("weight", "weight_scale", "weight_scale_2")


def dequantize_weight(weight: torch.Tensor, weight_scale: torch.Tensor,
                      weight_scale_2: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``[N, K]`` dense weight in ``dtype`` from uint8 ``[N, K/2]`` + e4m3 ``[N, K/16]`` + fp32."""
    return dequantize_nvfp4(weight, weight_scale, weight_scale_2.float(), dtype)


def _cache_key(lin, dtype: torch.dtype) -> tuple | None:
    """What the dense weight depends on; None when it cannot be tracked (inference tensors)."""
    try:
        return (dtype, *((id(t), t.data_ptr(), t._version)
                         for t in (getattr(lin, n) for n in _NAMES)))
    except RuntimeError:  # tensors made under torch.inference_mode() have no version counter
        return None


def cached_dense_weight(lin, dtype: torch.dtype) -> torch.Tensor:
    """The dequantized weight ``[out, in]`` of an NVFP4 layer ``lin`` in ``dtype``, cached on it.

    Recomputed when a buffer is replaced or written in place, or ``dtype`` changes (one dtype is
    kept per layer). The result is shared: treat it as read-only.
    """
    key = _cache_key(lin, dtype)
    hit = lin.__dict__.get(_CACHE_ATTR)
    if key is not None and hit is not None and hit[0] == key:
        return hit[1]
    w = dequantize_weight(lin.weight, lin.weight_scale, lin.weight_scale_2, dtype)
    if key is not None:
        lin.__dict__[_CACHE_ATTR] = (key, w)
    return w


def nvfp4_linear(x: torch.Tensor, lin) -> torch.Tensor:
    """``x [..., K] @ dequant(W)^T -> [..., N]`` in ``x``'s dtype for an NVFP4 linear ``lin``.

    CUDA: the W4A16 Triton GEMM (``mla_spec.kernels.nvfp4_gemm``). CPU: the cached dense weight
    + F.linear (differentiable w.r.t. ``x``; faster than the Triton interpreter).
    """
    if x.is_cuda and not (torch.is_grad_enabled() and x.requires_grad):
        from mla_spec.kernels.nvfp4_gemm import nvfp4_gemm

        return nvfp4_gemm(x, lin.weight, lin.weight_scale, lin.weight_scale_2.reshape(()))
    if x.is_cuda:  # autograd on a GPU: dequantize per call, keep no dense copy in GPU memory
        return F.linear(x, dequantize_weight(lin.weight, lin.weight_scale, lin.weight_scale_2,
                                             x.dtype))
    return F.linear(x, cached_dense_weight(lin, x.dtype))


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
