"""``NVFP4Linear``: a bias-free linear layer whose weight lives in ModelOpt's NVFP4 format.

The buffers carry the checkpoint's names, so ``load_state_dict`` on a dict read from an NVIDIA
FP4 safetensors shard fills them unchanged:

- ``weight``         uint8          ``[out, in/2]``   two E2M1 codes per byte, even element low
- ``weight_scale``   float8_e4m3fn  ``[out, in/16]``  per-16 block scales
- ``weight_scale_2`` float32        ``[]``            global weight scale
- ``input_scale``    float32        ``[]``            activation scale (unused by W4A16)

``forward(x [..., in]) -> [..., out]`` in x's dtype. On a GPU it runs the Triton W4A16 GEMM
(`mla_spec.kernels.nvfp4_gemm`); on CPU the torch twin, dequantizing once and caching the fp32
weight, keyed on the buffers' identity and version counters so that a reload (``copy_``,
``load_state_dict``, ``to``) invalidates it.
"""

from __future__ import annotations

import torch
from torch import nn

from mla_spec.device import use_triton
from mla_spec.kernels.nvfp4_gemm import nvfp4_gemm
from mla_spec.quant.nvfp4 import dequantize_nvfp4, quantize_nvfp4, validate_nvfp4

__all__ = ["NVFP4Linear"]

_NAMES = ("weight", "weight_scale", "weight_scale_2")


class NVFP4Linear(nn.Module):
    """``y = x @ dequant(W)^T (+ bias)`` with an NVFP4 weight ``[out_features, in_features]``."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False,
                 device: torch.device | str | None = None) -> None:
        super().__init__()
        if in_features % 16:
            raise ValueError(f"NVFP4Linear: in_features must be a multiple of 16, "
                             f"got {in_features}")
        self.in_features = in_features
        self.out_features = out_features
        self.register_buffer("weight", torch.zeros(out_features, in_features // 2,
                                                   dtype=torch.uint8, device=device))
        self.register_buffer("weight_scale", torch.ones(
            out_features, in_features // 16, device=device).to(torch.float8_e4m3fn))
        self.register_buffer("weight_scale_2", torch.ones((), device=device))
        self.register_buffer("input_scale", torch.ones((), device=device))
        self.bias = nn.Parameter(torch.zeros(out_features, device=device)) if bias else None
        self._cache_key: tuple | None = None
        self._cache: torch.Tensor | None = None

    @classmethod
    def from_float(cls, w: torch.Tensor, bias: torch.Tensor | None = None,
                   input_amax: float | None = None) -> NVFP4Linear:
        """Quantize a float weight ``[out, in]`` (ModelOpt conventions) into a new layer."""
        q = quantize_nvfp4(w, input_amax=input_amax)
        mod = cls(w.shape[1], w.shape[0], bias=bias is not None, device=w.device)
        mod.weight.copy_(q.weight)
        mod.weight_scale.copy_(q.weight_scale)
        mod.weight_scale_2.copy_(q.weight_scale_2.reshape(()))
        if q.input_scale is not None:
            mod.input_scale.copy_(q.input_scale.reshape(()))
        if bias is not None:
            mod.bias.data.copy_(bias)
        return mod

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        # Checkpoints store the scalar scales as [] or [1]; accept both.
        for name in ("weight_scale_2", "input_scale"):
            t = state_dict.get(prefix + name)
            if t is not None and t.numel() == 1:
                state_dict[prefix + name] = t.reshape(())
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)

    def dequantized_weight(self) -> torch.Tensor:
        """fp32 ``[out, in]``, cached until a buffer is replaced or written."""
        key = tuple((id(getattr(self, n)), getattr(self, n)._version,
                     getattr(self, n).data_ptr()) for n in _NAMES)
        if self._cache is None or key != self._cache_key:
            validate_nvfp4(self.weight, self.weight_scale, self.weight_scale_2, "NVFP4Linear")
            self._cache = dequantize_nvfp4(self.weight, self.weight_scale,
                                           self.weight_scale_2.reshape(()))
            self._cache_key = key
        return self._cache

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[-1] != self.in_features:
            raise ValueError(f"NVFP4Linear: x must be [..., {self.in_features}], "
                             f"got {tuple(x.shape)}")
        if use_triton(x) and x.is_cuda:
            y = nvfp4_gemm(x, self.weight, self.weight_scale, self.weight_scale_2.reshape(()))
        else:
            y = (x.float() @ self.dequantized_weight().t()).to(x.dtype)
        if self.bias is not None:
            y = y + self.bias.to(y.dtype)
        return y

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias is not None}, format=NVFP4")
