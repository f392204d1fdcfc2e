"""Rotary position embedding of DeepSeek-V3: YaRN-scaled frequencies, interleaved pairs.

Only ``q_pe`` and ``k_pe`` (64 wide) rotate; pair ``i`` is the adjacent ``(x[2i], x[2i+1])``
(SGLang's ``is_neox=False``), kept interleaved as the KV cache stores it. YaRN as transformers'
``_compute_yarn_parameters``: ``inv_freq = interp * (1 - m) + extrap * m``, ``extrap =
base^(-2i/dim)``, ``interp = extrap / factor``, ``m`` a linear ramp from 1 to 0 over
``[floor(d(beta_fast)), ceil(d(beta_slow))]``, ``d(r) = dim * ln(L / (2 pi r)) / (2 ln base)``.
"""

import math
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from mla_spec.config import yarn_mscale
from mla_spec.device import triton_interpreting, use_triton
from mla_spec.kernels.ops import apply_rope_interleaved, rope_cos_sin, rope_qk, rope_qk_ref
from mla_spec.kernels.ops.rope import SUPPORTED_DTYPES

__all__ = ["DeepseekRotaryEmbedding", "yarn_inv_freq", "apply_rope_interleaved"]


def yarn_inv_freq(dim: int, base: float, rope_scaling: Mapping[str, Any] | None,
                  max_position_embeddings: int) -> tuple[torch.Tensor, float]:
    """Inverse frequencies ``[dim / 2]`` (fp32) and the cos/sin attention factor. ``rope_scaling``
    None (or type "default") gives plain RoPE."""
    pos = base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    rs = dict(rope_scaling or {})
    kind = rs.get("rope_type", rs.get("type", "default"))
    if kind in ("default", None):
        return 1.0 / pos, 1.0
    if kind != "yarn":
        raise ValueError(f"rope_scaling type {kind!r}: supported 'yarn' and default")
    orig = rs.get("original_max_position_embeddings", max_position_embeddings)
    factor = rs.get("factor")
    if factor is None:
        factor = max_position_embeddings / orig
    attn = rs.get("attention_factor")
    if attn is None:
        m, m_all = rs.get("mscale"), rs.get("mscale_all_dim")
        attn = (yarn_mscale(factor, m) / yarn_mscale(factor, m_all) if m and m_all
                else yarn_mscale(factor))
    beta_fast = rs.get("beta_fast") or 32
    beta_slow = rs.get("beta_slow") or 1

    def corr(rot: float) -> float:
        return dim * math.log(orig / (rot * 2 * math.pi)) / (2 * math.log(base))

    low, high = corr(beta_fast), corr(beta_slow)
    if rs.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    extrap_w = 1 - ramp
    inv_freq = (1.0 / (factor * pos)) * (1 - extrap_w) + (1.0 / pos) * extrap_w
    return inv_freq, float(attn)


class DeepseekRotaryEmbedding(nn.Module):
    """``(q_pe, k_pe) -> roped (q_pe, k_pe)`` at ``positions``. Shapes: ``positions`` ``[*P]``
    (``[N]`` packed rows or ``[T]`` for a dense batch), ``q_pe`` ``[*B, *P, H, 64]``, ``k_pe``
    ``[*B, *P, 64]`` (leading batch dims broadcast)."""

    def __init__(self, cfg, device=None) -> None:
        super().__init__()
        inv_freq, attn = yarn_inv_freq(cfg.qk_rope_head_dim, float(cfg.rope_theta),
                                       cfg.rope_scaling, cfg.max_position_embeddings)
        self.register_buffer("inv_freq", inv_freq.to(device), persistent=False)
        self.attention_factor = attn

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``[*P, dim/2]`` fp32 cos and sin (attention factor applied)."""
        return rope_cos_sin(positions, self.inv_freq, self.attention_factor)

    def _fused(self, positions: torch.Tensor, q_pe: torch.Tensor, k_pe: torch.Tensor) -> bool:
        """Whether the fused Triton kernel (``kernels.ops.rope``) runs: CUDA (not the
        interpreter), shapes ``[N]`` / ``[N, H, D]`` / ``[N, D]``, no autograd."""
        if not use_triton(q_pe) or triton_interpreting():
            return False
        if positions.dim() != 1 or q_pe.dim() != 3 or k_pe.dim() != 2:
            return False
        if torch.is_grad_enabled() and (q_pe.requires_grad or k_pe.requires_grad):
            return False
        return q_pe.dtype in SUPPORTED_DTYPES and k_pe.dtype in SUPPORTED_DTYPES \
            and self.inv_freq.device == q_pe.device == positions.device

    def forward(self, positions: torch.Tensor, q_pe: torch.Tensor,
                k_pe: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self._fused(positions, q_pe, k_pe):
            return rope_qk(positions, q_pe, k_pe, self.inv_freq, self.attention_factor)
        return rope_qk_ref(positions, q_pe, k_pe, self.inv_freq, self.attention_factor)
