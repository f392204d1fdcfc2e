"""RMSNorm as DeepSeek-V3 (and Hugging Face transformers) computes it.

``y = weight * (x / sqrt(mean(x^2) + eps))``: the normalization runs in fp32, the result is cast
back to the input dtype *before* the weight multiplies it (the order matters for bf16 bit-parity
with transformers' ``DeepseekV3RMSNorm``), and the multiply follows torch's type promotion (an
fp32 weight on a bf16 activation returns fp32).

On a CUDA tensor, outside autograd, the forward is one fused Triton kernel
(``mla_spec.kernels.ops.rms_norm``: one program per row, fp32 math, CUDA-graph capturable)
instead of ~8 torch kernels. Everywhere else (CPU, including CPU runs under the Triton
interpreter; training; unsupported dtypes) it runs the torch code, which is the kernel's twin
``rms_norm_ref`` and bit-identical to the original module.
"""

from __future__ import annotations

import torch
from torch import nn

from mla_spec.device import triton_interpreting, use_triton
from mla_spec.kernels.ops import rms_norm, rms_norm_add, rms_norm_add_ref, rms_norm_ref
from mla_spec.kernels.ops.rmsnorm import SUPPORTED_DTYPES

__all__ = ["RMSNorm"]


class RMSNorm(nn.Module):
    """Root-mean-square norm over the last dimension; ``weight`` ``[hidden]``."""

    def __init__(self, hidden_size: int, eps: float = 1e-6, *, dtype=torch.float32,
                 device=None) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size, dtype=dtype, device=device))
        self.eps = eps

    def _fused(self, *xs: torch.Tensor) -> bool:
        """Whether the Triton kernel runs: a CUDA tensor (not the CPU interpreter), no autograd
        graph to build, dtypes and devices the kernel supports."""
        x, w = xs[0], self.weight
        if not use_triton(x) or triton_interpreting() or w.device != x.device:
            return False
        if torch.is_grad_enabled() and (w.requires_grad or any(t.requires_grad for t in xs)):
            return False
        return all(t.dtype in SUPPORTED_DTYPES for t in (*xs, w))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` ``[..., hidden]`` -> same shape, dtype ``promote_types(weight.dtype, x.dtype)``."""
        if self._fused(x):
            return rms_norm(x, self.weight, self.eps)
        return rms_norm_ref(x, self.weight, self.eps)

    def forward_add(self, x: torch.Tensor, residual: torch.Tensor
                    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Residual add fused with the norm: ``s = x + residual``; returns ``(self(s), s)``.

        ``x``, ``residual`` ``[..., hidden]`` of one dtype. Same results as the two torch steps;
        one kernel on CUDA (for a pre-norm layer: ``h = h + attn_out`` then
        ``post_attention_layernorm(h)``).
        """
        if self._fused(x, residual) and residual.dtype == x.dtype \
                and residual.shape == x.shape:
            return rms_norm_add(x, residual, self.weight, self.eps)
        return rms_norm_add_ref(x, residual, self.weight, self.eps)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}"
