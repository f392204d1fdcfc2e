"""Fused MoE with NVFP4 experts: route, ``SiLU(x W1^T) * (x W3^T)``, ``W2``, weighted sum.

Shapes (hidden K, expert intermediate I, E experts, M tokens, top-k experts per token, P = M*k
(token, expert) pairs):

- ``x [M, K]``, ``topk_ids [M, k]`` int (ids outside ``[0, E)`` are skipped, e.g. -1 for experts
  of another EP rank), ``topk_weights [M, k]`` fp32.
- ``w13``: NVFP4Tensor stacked ``weight [E, 2I, K/2]``, ``weight_scale [E, 2I, K/16]``,
  ``weight_scale_2`` ``[]`` / ``[E]`` / ``[E, 2]`` (gate rows 0..I-1 use column 0, up rows
  column 1). Rows: **gate (w1) first, then up (w3)**, as SGLang's ``w13_weight``.
- ``w2``: NVFP4Tensor ``weight [E, K, I/2]``, ``weight_scale [E, K, I/16]``, scale_2 ``[]``/``[E]``.
- output ``[M, K]`` in x's dtype: ``sum_j topk_weights[m, j] * expert_{ids[m, j]}(x[m])``.

Two paths. Up to ``MOE_GEMV_MAX_M`` tokens, the gemv path (``nvfp4_moe_gemv``): one GEMV
program per (token, expert) pair and row block, no sorting, two launches. Above, the fused-MoE
pattern (``nvfp4_moe_sorted``): pairs sorted by expert into slots of rows that share an expert
(``moe_align``), so that each expert's weights are read once per token tile, then a w13 + SiLU
launch, a w2 launch and the sum over the top k.

``fused_moe_ref`` is the torch twin: dequantize and loop over experts.
"""

from __future__ import annotations

import torch

from mla_spec.device import triton_interpreting, use_triton
from mla_spec.kernels import nvfp4_gemv, nvfp4_moe_gemv
from mla_spec.kernels.nvfp4_configs import NVFP4MmaConfig
from mla_spec.kernels.nvfp4_moe_gemv import MOE_GEMV_MAX_M, moe_gemv, moe_gemv_tiles
from mla_spec.kernels.nvfp4_moe_sorted import MOE_MMAB_CONFIG, moe_align, moe_sorted, scale2_strides
from mla_spec.quant.nvfp4 import NVFP4Tensor, dequantize_nvfp4

__all__ = ["fused_moe_nvfp4", "fused_moe_ref", "moe_align", "MOE_MMAB_CONFIG"]


def _check_moe(x, topk_ids, topk_weights, w13: NVFP4Tensor, w2: NVFP4Tensor) -> tuple[int, int]:
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
    if x.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise ValueError(f"x must be bfloat16, float16 or float32, got {x.dtype}")
    for nm, t in (("topk_ids", topk_ids), ("topk_weights", topk_weights),
                  ("w13.weight", w13.weight), ("w2.weight", w2.weight)):
        if t.device != x.device:
            raise ValueError(f"{nm} is on {t.device}, x on {x.device}: use one device")
    return e, inter


def fused_moe_nvfp4(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                    w13: NVFP4Tensor, w2: NVFP4Tensor, block_n: int = 32,
                    block_k: int = 256, fast_dequant: bool = True, path: str = "auto",
                    gemv_block_n: int | None = None, gemv_split: int | None = None,
                    gemv_warps: int | None = None, sorted_kernel: str = "mmab",
                    gemv_block_n2: int | None = None, gemv_warps2: int | None = None,
                    gemv_g: int | None = None, gemv_packed: bool | None = None,
                    gemv_prefetch: bool | None = None, gemv_w2_loop: bool | None = None,
                    gemv_g2: int | None = None,
                    mmab_config: NVFP4MmaConfig | None = None) -> torch.Tensor:
    """Routed experts with NVFP4 weights (see the module docstring for shapes).

    ``path``: "gemv" (one program per token-expert pair, ``nvfp4_moe_gemv``), "sorted" (the
    moe_align slots below), or "auto" (gemv up to ``MOE_GEMV_MAX_M`` = 4 tokens: the H200 sweep's
    winner there; the sorted path wins from 16 tokens on, 2.6x). ``block_n`` / ``block_k`` /
    ``fast_dequant`` tune the sorted path (``fast_dequant``: the packed PTX decoder, validated
    on the H200; False = portable; never used in the interpreter or below sm_90), ``gemv_*``
    the gemv path (its decoder follows ``nvfp4_gemv.GEMV_FAST``; ``gemv_*2``: its w2 launch;
    ``gemv_g``: int64 words per row per step; None: by token count, see
    ``nvfp4_moe_gemv.moe_gemv_tiles``; ``gemv_packed``: packed-fp16 dot products, None:
    ``MOE_GEMV_PACKED``; ``gemv_prefetch``: their double-buffered loop, None:
    ``MOE_GEMV_PREFETCH``; ``gemv_w2_loop``: the w2 launch that sums the top-k experts in one
    program, ``nvfp4_moe_w2``, None: ``MOE_W2_LOOP``, with ``gemv_g2`` words per step).
    ``sorted_kernel``: "mmab" (standard orientation,
    ``_moe_mma_kernel``, tiles from ``mmab_config``: default ``MOE_MMAB_CONFIG``; its
    ``block_m`` 0 = by the mean rows per active expert, ``split_k`` must be 1) or "mma" (the
    swap-AB ``_moe_gemm_kernel``, tiles from ``block_n`` / ``block_k``).

    Returns ``[M, K]`` in x's dtype. Triton kernels when ``use_triton(x)``, else ``fused_moe_ref``.
    """
    if path not in ("auto", "gemv", "sorted"):
        raise ValueError(f"path must be 'auto', 'gemv' or 'sorted', got {path!r}")
    if sorted_kernel not in ("mmab", "mma"):
        raise ValueError(f"sorted_kernel must be 'mmab' or 'mma', got {sorted_kernel!r}")
    mcfg = mmab_config or MOE_MMAB_CONFIG
    if mcfg.split_k != 1 or mcfg.block_n < 16 or mcfg.block_k < 32:
        raise ValueError(f"mmab_config needs split_k = 1, block_n >= 16, block_k >= 32: {mcfg}")
    e, inter = _check_moe(x, topk_ids, topk_weights, w13, w2)
    if not use_triton(x):
        return fused_moe_ref(x, topk_ids, topk_weights, w13, w2)
    m, k_hidden = x.shape
    topk = topk_ids.shape[1]
    p = m * topk
    out = torch.empty((m, k_hidden), dtype=x.dtype, device=x.device)
    if p == 0:
        return out
    interp = triton_interpreting()
    act_dtype = torch.float32 if x.dtype == torch.float32 else torch.bfloat16
    if path == "gemv" or (path == "auto" and m <= MOE_GEMV_MAX_M):
        x2 = x if x.stride(-1) == 1 else x.contiguous()
        packed = nvfp4_moe_gemv.MOE_GEMV_PACKED if gemv_packed is None else gemv_packed
        loop = (nvfp4_moe_gemv.MOE_W2_LOOP if gemv_w2_loop is None else gemv_w2_loop) and \
            packed and x.dtype == torch.bfloat16  # what moe_gemv can run it on
        bn, w, bn2, w2_, g, g2 = moe_gemv_tiles(m, gemv_block_n, gemv_warps, gemv_block_n2,
                                                gemv_warps2, gemv_g, loop, gemv_g2)
        return moe_gemv(x2, topk_ids.reshape(-1).to(torch.int32), topk_weights.reshape(-1)
                        .float().contiguous(), w13, w2, scale2_strides(w13.weight_scale_2, True),
                        scale2_strides(w2.weight_scale_2, False), act_dtype, bn,
                        gemv_split, w, not interp and nvfp4_gemv.GEMV_FAST, bn2, w2_, g,
                        gemv_packed, gemv_prefetch, loop, g2)
    moe_sorted(x, topk_ids, topk_weights, w13, w2, out, e, inter, act_dtype, mcfg, sorted_kernel,
               block_n, block_k, fast_dequant, interp)
    return out


def fused_moe_ref(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                  w13: NVFP4Tensor, w2: NVFP4Tensor) -> torch.Tensor:
    """Torch twin: per active expert, dequantize (fp32), ``silu(gate) * up`` rounded to bf16
    (fp32 for fp32 x, as the kernel's intermediate), down-project, weight and sum."""
    e, inter = _check_moe(x, topk_ids, topk_weights, w13, w2)
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
