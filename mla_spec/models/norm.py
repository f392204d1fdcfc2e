"""RMSNorm as DeepSeek-V3 (and Hugging Face transformers) computes it.

``y = weight * (x / sqrt(mean(x^2) + eps))``: the normalization runs in fp32, the result is cast
back to the input dtype *before* the weight multiplies it (the order matters for bf16 bit-parity
with transformers' ``DeepseekV3RMSNorm``).
"""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["RMSNorm"]


class RMSNorm(nn.Module):
    """Root-mean-square norm over the last dimension; ``weight`` ``[hidden]``."""

    def __init__(self, hidden_size: int, eps: float = 1e-6, *, dtype=torch.float32,
                 device=None) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size, dtype=dtype, device=device))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` ``[..., hidden]`` -> same shape and dtype."""
        dtype = x.dtype
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(dtype)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}"
