"""RMSNorm as DeepSeek-V3 (and transformers' ``DeepseekV3RMSNorm``) computes it.

``y = weight * (x / sqrt(mean(x^2) + eps))``, normalized in fp32 and cast back before the
weight multiplies (bf16 parity with transformers). CUDA inference runs a fused Triton kernel.
"""

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
        """Whether the Triton kernel runs: CUDA (not the interpreter), no autograd, its dtypes."""
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
        """Residual add fused with the norm: ``s = x + residual``; returns ``(self(s), s)``. ``x``,
        ``residual`` ``[..., hidden]`` of one dtype; one kernel on CUDA, the same results."""
        if self._fused(x, residual) and residual.dtype == x.dtype \
                and residual.shape == x.shape:
            return rms_norm_add(x, residual, self.weight, self.eps)
        return rms_norm_add_ref(x, residual, self.weight, self.eps)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}"
