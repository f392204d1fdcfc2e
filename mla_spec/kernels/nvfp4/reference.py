"""Torch references of the NVFP4 kernels and their shared input checks. ModelOpt's layout, as is:
weight uint8 ``[N, K/2]`` (even element low), weight_scale e4m3 ``[N, K/16]``, weight_scale_2 fp32.
MoE: ``x [M, K]``, ``topk_ids [M, k]`` (ids outside ``[0, E)`` skipped), ``topk_weights [M, k]``
fp32, ``w13.weight [E, 2I, K/2]`` (**gate rows, then up**; scale_2 ``[]`` / ``[E]`` / ``[E, 2]``),
``w2.weight [E, K, I/2]``; output ``sum_j topk_weights[m, j] * expert_{ids[m, j]}(x[m])``.
"""

import torch

from mla_spec.quant.nvfp4 import NVFP4Tensor, dequantize_nvfp4, validate_nvfp4

__all__ = ["check_gemm", "check_moe", "fused_moe_ref", "nvfp4_gemm_ref"]

_X_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def check_gemm(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
               weight_scale_2: torch.Tensor) -> int:
    """K of a valid GEMM call; ValueError saying what is expected otherwise."""
    k = validate_nvfp4(weight, weight_scale, weight_scale_2)
    if weight.dim() != 2:
        raise ValueError(f"weight must be 2-D [N, K/2], got shape {tuple(weight.shape)}")
    if weight_scale_2.numel() != 1:
        raise ValueError(f"weight_scale_2 must be a scalar, got {tuple(weight_scale_2.shape)}")
    if x.dtype not in _X_DTYPES:
        raise ValueError(f"x must be bfloat16, float16 or float32, got {x.dtype}")
    if x.shape[-1] != k:
        raise ValueError(f"x must be [..., K={k}] to match weight {tuple(weight.shape)}, "
                         f"got {tuple(x.shape)}")
    return k


def nvfp4_gemm_ref(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                   weight_scale_2: torch.Tensor, out_dtype: torch.dtype | None = None
                   ) -> torch.Tensor:
    """``x @ dequant(W)^T`` in fp32, cast to ``out_dtype`` (default x's)."""
    check_gemm(x, weight, weight_scale, weight_scale_2)
    w = dequantize_nvfp4(weight, weight_scale, weight_scale_2.reshape(()), torch.float32)
    return (x.float() @ w.t()).to(out_dtype or x.dtype)


def check_moe(x, topk_ids, topk_weights, w13: NVFP4Tensor, w2: NVFP4Tensor) -> tuple[int, int]:
    """``(E, I)`` of a valid fused-MoE call; ValueError saying what is expected otherwise."""
    if w13.weight.dim() != 3 or w2.weight.dim() != 3:
        raise ValueError(f"w13.weight must be [E, 2I, K/2] and w2.weight [E, K, I/2], got "
                         f"{tuple(w13.weight.shape)} and {tuple(w2.weight.shape)}")
    e, two_i, k_half = w13.weight.shape
    inter = two_i // 2
    if x.dim() != 2 or x.shape[1] != 2 * k_half:
        raise ValueError(f"x must be [M, K={2 * k_half}] for w13 {tuple(w13.weight.shape)}, "
                         f"got {tuple(x.shape)}")
    want2 = (e, 2 * k_half, inter // 2)
    if tuple(w2.weight.shape) != want2:
        raise ValueError(f"w2.weight must have shape {want2}, got {tuple(w2.weight.shape)}")
    if inter % 16:
        raise ValueError(f"intermediate size I = {inter} must be a multiple of 16")
    if topk_ids.shape != topk_weights.shape or topk_ids.dim() != 2 \
            or topk_ids.shape[0] != x.shape[0]:
        raise ValueError(f"topk_ids and topk_weights must both be [M={x.shape[0]}, k], got "
                         f"{tuple(topk_ids.shape)} and {tuple(topk_weights.shape)}")
    if topk_ids.is_floating_point():
        raise ValueError(f"topk_ids must be an integer tensor, got {topk_ids.dtype}")
    if x.dtype not in _X_DTYPES:
        raise ValueError(f"x must be bfloat16, float16 or float32, got {x.dtype}")
    for nm, t in (("topk_ids", topk_ids), ("topk_weights", topk_weights),
                  ("w13.weight", w13.weight), ("w2.weight", w2.weight)):
        if t.device != x.device:
            raise ValueError(f"{nm} is on {t.device}, x on {x.device}: use one device")
    return e, inter


def fused_moe_ref(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                  w13: NVFP4Tensor, w2: NVFP4Tensor) -> torch.Tensor:
    """Per active expert: dequantize, ``silu(gate) * up`` (rounded to bf16, fp32 for fp32 x), W2."""
    e, inter = check_moe(x, topk_ids, topk_weights, w13, w2)
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    act_dtype = torch.float32 if x.dtype == torch.float32 else torch.bfloat16
    for ex in torch.unique(topk_ids).tolist():
        if not 0 <= ex < e:
            continue
        tok, slot = (topk_ids == ex).nonzero(as_tuple=True)
        g13 = dequantize_nvfp4(w13.weight[ex], w13.weight_scale[ex], _pick(w13.weight_scale_2,
                               ex, 0))
        if w13.weight_scale_2.dim() == 2:
            g13[inter:] = dequantize_nvfp4(w13.weight[ex, inter:], w13.weight_scale[ex, inter:],
                                           _pick(w13.weight_scale_2, ex, 1))
        w2e = dequantize_nvfp4(w2.weight[ex], w2.weight_scale[ex], _pick(w2.weight_scale_2, ex, 0))
        h = x[tok].float() @ g13.t()
        act = (torch.nn.functional.silu(h[:, :inter]) * h[:, inter:]).to(act_dtype).float()
        y = act @ w2e.t()
        out.index_add_(0, tok, y * topk_weights[tok, slot].float()[:, None])
    return out.to(x.dtype)


def _pick(ws2: torch.Tensor, ex: int, half: int) -> torch.Tensor:
    """Scalar scale_2 of expert ``ex`` (``half`` selects gate / up for ``[E, 2]``)."""
    if ws2.dim() == 0 or ws2.numel() == 1:
        return ws2.reshape(()).float()
    return (ws2[ex] if ws2.dim() == 1 else ws2[ex, half]).float().reshape(())
