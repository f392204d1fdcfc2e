"""Formats to compare NVFP4 against, for error studies (``notebooks/05_nvfp4_weights.ipynb``).

MXFP4: E2M1 with 32-element blocks and a power-of-two scale ``2**(floor(log2(amax)) - 2)``
(4.25 bits a weight). int4-group: -8..7 times ``amax / 7`` per 128 elements (4.125 bits).
Nothing in the serving path uses them.
"""

from dataclasses import dataclass

import torch

from mla_spec.quant.nvfp4 import E2M1_VALUES, NVFP4ErrorReport, cast_to_e2m1, make_error_report

__all__ = [
    "MXFP4Tensor", "quantize_mxfp4", "dequantize_mxfp4", "mxfp4_error_report",
    "quantize_int4_group", "dequantize_int4_group", "int4_group_error_report",
]

MX_BLOCK = 32
_E2M1_EMAX = 2


@dataclass(frozen=True)
class MXFP4Tensor:
    """``codes`` uint8 ``[..., K]`` (unpacked E2M1 codes), ``scale_e8m0`` uint8 ``[..., K/32]``
    (biased exponent: scale = 2**(e - 127))."""

    codes: torch.Tensor
    scale_e8m0: torch.Tensor


def quantize_mxfp4(w: torch.Tensor) -> MXFP4Tensor:
    """Quantize ``w [..., K]`` (K % 32 == 0) to MXFP4 (E2M1 elements, E8M0 block scales)."""
    if w.shape[-1] % MX_BLOCK:
        raise ValueError(f"quantize_mxfp4: K must be a multiple of 32, got shape {tuple(w.shape)}")
    blocks = w.float().unflatten(-1, (-1, MX_BLOCK))
    amax = blocks.abs().amax(-1)
    tiny = torch.finfo(torch.float32).tiny
    exp = torch.floor(torch.log2(amax.clamp(min=tiny))) - _E2M1_EMAX
    exp = torch.where(amax > 0, exp, torch.full_like(exp, -127.0)).clamp(-127, 127)
    scaled = blocks / torch.exp2(exp).unsqueeze(-1)
    codes = cast_to_e2m1(scaled.flatten(-2))
    return MXFP4Tensor(codes, (exp + 127).to(torch.uint8))


def dequantize_mxfp4(q: MXFP4Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``E2M1[code] * 2**(e - 127)`` -> ``[..., K]``."""
    vals = E2M1_VALUES.to(q.codes.device)[q.codes.long()].unflatten(-1, (-1, MX_BLOCK))
    scale = torch.exp2(q.scale_e8m0.float() - 127.0)
    return (vals * scale.unsqueeze(-1)).flatten(-2).to(dtype)


def mxfp4_error_report(w: torch.Tensor) -> NVFP4ErrorReport:
    """Error of MXFP4 on ``w``; a block is clipped when its amax exceeds 6 * scale."""
    q = quantize_mxfp4(w)
    amax = w.float().unflatten(-1, (-1, MX_BLOCK)).abs().amax(-1)
    clipped = (amax > 6.0 * torch.exp2(q.scale_e8m0.float() - 127.0)).float().mean().item()
    return make_error_report(w.float(), dequantize_mxfp4(q), clipped, 4.25)


def quantize_int4_group(w: torch.Tensor, group_size: int = 128
                        ) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int4 per group: ``(q int8 [..., K] in -8..7, scale fp32 [..., K/g])``."""
    if w.shape[-1] % group_size:
        raise ValueError(f"quantize_int4_group: K must be a multiple of {group_size}, "
                         f"got shape {tuple(w.shape)}")
    g = w.float().unflatten(-1, (-1, group_size))
    scale = (g.abs().amax(-1) / 7.0).to(torch.bfloat16).float()
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = torch.round(g / scale.unsqueeze(-1)).clamp(-8, 7).to(torch.int8)
    return q.flatten(-2), scale


def dequantize_int4_group(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``q * scale`` -> fp32 ``[..., K]``."""
    g = q.float().unflatten(-1, (scale.shape[-1], -1))
    return (g * scale.unsqueeze(-1)).flatten(-2)


def int4_group_error_report(w: torch.Tensor, group_size: int = 128) -> NVFP4ErrorReport:
    """Error of int4-group on ``w`` (no clipping by construction: amax maps to 7)."""
    q, s = quantize_int4_group(w, group_size)
    return make_error_report(w.float(), dequantize_int4_group(q, s), 0.0, 4.0 + 16.0 / group_size)
