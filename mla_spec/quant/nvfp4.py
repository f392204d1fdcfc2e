"""NVFP4 weights in NVIDIA ModelOpt's checkpoint format: quantize, pack, unpack, dequantize.

``W [N, K]`` is stored as ``weight`` uint8 ``[N, K/2]`` (two E2M1 codes a byte, element ``2i``
low), ``weight_scale`` e4m3 ``[N, K/16]`` and global ``weight_scale_2`` fp32 (``amax(W) / (6 *
448)``): ``W ~= E2M1[code] * weight_scale[n, k // 16] * weight_scale_2``. E2M1 codes 0..7 are
``{0, 0.5, 1, 1.5, 2, 3, 4, 6}``, bit 3 the sign.

Quantization follows ModelOpt's conventions (own code): block scale ``amax(block) / (6 *
weight_scale_2)`` (1.0 for a zero block, ``>= 2**-9``, RTNE to e4m3); elements round to E2M1 by
counting the bounds ``[0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5]`` below ``|x|`` (ties up at 0.75,
1.75, 2.5, down elsewhere); above 6 saturates. :func:`quantize_nvfp4` rejects NaN / inf;
:func:`check_nvfp4_scales` checks loaded scales; :class:`NVFP4Tensor` checks only dtypes and
shapes (it is built inside CUDA-graph captures). Format details: ``docs/design.md``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from mla_spec.quant.fp8 import require_finite

__all__ = [
    "E2M1_VALUES", "E2M1_BOUNDS", "FP4_MAX", "E4M3_MAX", "BLOCK_SIZE", "NVFP4Tensor",
    "NVFP4ErrorReport", "cast_to_e2m1", "pack_fp4", "unpack_fp4", "global_scale",
    "input_scale_from_amax", "nvfp4_block_scales", "quantize_nvfp4", "dequantize_nvfp4",
    "validate_nvfp4", "check_nvfp4_scales", "nvfp4_error_report", "make_error_report",
]

FP4_MAX = 6.0
E4M3_MAX = 448.0
BLOCK_SIZE = 16
E2M1_VALUES = torch.tensor(
    [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0]
)
E2M1_BOUNDS = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])
_TIES_UP = (0.75, 1.75, 2.5)
_ON_DEVICE: dict[tuple[str, torch.device], torch.Tensor] = {}


def _on(name: str, device: torch.device) -> torch.Tensor:
    """Cached device copy of a table (no host-to-device copy inside a CUDA-graph capture)."""
    key = (name, torch.device(device))
    if key not in _ON_DEVICE:
        _ON_DEVICE[key] = {"values": E2M1_VALUES, "bounds": E2M1_BOUNDS}[name].to(device)
    return _ON_DEVICE[key]


def cast_to_e2m1(x: torch.Tensor) -> torch.Tensor:
    """Round values already divided by their scales (any shape, float) to uint8 E2M1 codes
    0..15 (bit 3 = sign) of the same shape, with ModelOpt's tie rule."""
    x = x.float()
    sign = (x < 0).to(torch.uint8)
    mag = x.abs()
    idx = torch.searchsorted(_on("bounds", x.device), mag.contiguous()).to(torch.uint8)
    tie_up = torch.zeros_like(idx)
    for b in _TIES_UP:
        tie_up |= (mag == b).to(torch.uint8)
    return (sign << 3) | (idx + tie_up)


def pack_fp4(codes: torch.Tensor) -> torch.Tensor:
    """Pack 4-bit codes ``[..., K]`` (K even) into bytes ``[..., K/2]``, even element low."""
    if codes.shape[-1] % 2:
        raise ValueError(f"pack_fp4: last dim must be even, got shape {tuple(codes.shape)}")
    c = codes.to(torch.uint8)
    return (c[..., 0::2] & 0xF) | ((c[..., 1::2] & 0xF) << 4)


def unpack_fp4(packed: torch.Tensor) -> torch.Tensor:
    """Unpack bytes ``[..., K/2]`` into codes ``[..., K]`` (low nibble -> even element)."""
    if packed.dtype != torch.uint8:
        raise ValueError(f"unpack_fp4: expected uint8, got {packed.dtype}")
    lo = packed & 0xF
    hi = packed >> 4
    return torch.stack((lo, hi), dim=-1).flatten(-2)


def global_scale(amax: torch.Tensor | float) -> torch.Tensor:
    """Per-tensor scale ``amax / (6 * 448)`` as an fp32 scalar tensor (``amax == 0`` -> 1/2688).
    Raises ``ValueError`` when ``amax`` is negative, NaN or inf."""
    a = torch.as_tensor(amax, dtype=torch.float32)
    if not bool(torch.all(torch.isfinite(a) & (a >= 0))):
        raise ValueError(f"NVFP4 global scale from amax {a.tolist()}: amax must be finite and "
                         ">= 0")
    a = torch.where(a > 0, a, torch.ones_like(a))
    return a / (FP4_MAX * E4M3_MAX)


def input_scale_from_amax(amax: torch.Tensor | float) -> torch.Tensor:
    """Activation ``input_scale = amax(x) / (6 * 448)`` (fp32 scalar), as ModelOpt exports it."""
    return global_scale(amax)


def nvfp4_block_scales(w: torch.Tensor, weight_scale_2: torch.Tensor) -> torch.Tensor:
    """e4m3 block scales ``[..., K/16]`` of ``w [..., K]`` for a given global scale."""
    blocks = w.float().unflatten(-1, (-1, BLOCK_SIZE))
    amax = blocks.abs().amax(-1)
    s = amax / (FP4_MAX * weight_scale_2.float().to(w.device))
    s = torch.where(s == 0, torch.ones_like(s), s)
    return s.clamp(min=2.0**-9, max=E4M3_MAX).to(torch.float8_e4m3fn)


@dataclass(frozen=True)
class NVFP4Tensor:
    """One NVFP4 weight, named like the checkpoint tensors; leading dims stack experts. ``weight``
    uint8 ``[..., N, K/2]``, ``weight_scale`` e4m3 ``[..., N, K/16]``, ``weight_scale_2`` fp32
    scalar (``[E]`` / ``[E, 2]`` stacked), ``input_scale`` fp32 or None."""

    weight: torch.Tensor
    weight_scale: torch.Tensor
    weight_scale_2: torch.Tensor
    input_scale: torch.Tensor | None = None

    def __post_init__(self) -> None:
        validate_nvfp4(self.weight, self.weight_scale, self.weight_scale_2)

    @property
    def shape(self) -> tuple[int, ...]:
        """Logical (dequantized) shape ``[..., N, K]``."""
        return (*self.weight.shape[:-1], self.weight.shape[-1] * 2)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """``[..., N, K]`` in ``dtype`` (2-D tensors with a scalar ``weight_scale_2`` only)."""
        return dequantize_nvfp4(self.weight, self.weight_scale, self.weight_scale_2, dtype)

    def to(self, device: torch.device | str) -> NVFP4Tensor:
        """Copy of all four tensors on ``device``."""
        mv = lambda t: None if t is None else t.to(device)
        return NVFP4Tensor(mv(self.weight), mv(self.weight_scale), mv(self.weight_scale_2),
                           mv(self.input_scale))


def validate_nvfp4(weight: torch.Tensor, weight_scale: torch.Tensor,
                   weight_scale_2: torch.Tensor, name: str = "") -> int:
    """Check dtypes and shapes of one (possibly expert-stacked) NVFP4 weight; return K."""
    p = f"{name}." if name else ""
    if weight.dtype != torch.uint8:
        raise ValueError(f"{p}weight must be uint8 [..., N, K/2] (two E2M1 codes per byte), "
                         f"got {weight.dtype}")
    if weight.dim() < 2:
        raise ValueError(f"{p}weight must be [..., N, K/2], got shape {tuple(weight.shape)}")
    k = weight.shape[-1] * 2
    if k % BLOCK_SIZE:
        raise ValueError(f"{p}weight: K = {k} (2 * {weight.shape[-1]}) is not a multiple of "
                         f"the group size {BLOCK_SIZE}; NVFP4 needs in_features to be a "
                         f"multiple of {BLOCK_SIZE}")
    if weight_scale.dtype != torch.float8_e4m3fn:
        raise ValueError(f"{p}weight_scale must be float8_e4m3fn, got {weight_scale.dtype}")
    want = (*weight.shape[:-1], k // BLOCK_SIZE)
    if tuple(weight_scale.shape) != want:
        raise ValueError(f"{p}weight_scale must have shape {want} (one per 16 elements of "
                         f"weight {tuple(weight.shape)}), got {tuple(weight_scale.shape)}")
    if weight_scale_2.dtype != torch.float32:
        raise ValueError(f"{p}weight_scale_2 must be float32, got {weight_scale_2.dtype}")
    lead = tuple(weight.shape[:-2])
    ok = [(), (1,)] + ([(lead[0],), (lead[0], 2)] if len(lead) == 1 else [])
    if tuple(weight_scale_2.shape) not in ok:
        raise ValueError(f"{p}weight_scale_2 must have shape one of {ok} for weight "
                         f"{tuple(weight.shape)}, got {tuple(weight_scale_2.shape)}")
    return k


def check_nvfp4_scales(weight_scale: torch.Tensor | None = None,
                       weight_scale_2: torch.Tensor | None = None,
                       input_scale: torch.Tensor | None = None, name: str = "") -> None:
    """Check an NVFP4 weight's scales (None skips one; a sync per tensor): global scales positive
    and finite, block scales without NaN or negatives. ``ValueError`` names the first bad value."""
    p = f"{name}." if name else ""
    for what, t in (("weight_scale_2", weight_scale_2), ("input_scale", input_scale)):
        if t is None or not t.numel():
            continue
        lo, hi = (float(v) for v in t.float().aminmax())  # NaN reaches both
        if lo > 0 and math.isfinite(hi):
            continue
        bad = ~(torch.isfinite(t) & (t > 0))
        first = [int(i) for i in bad.nonzero()[0]]
        raise ValueError(f"{p}{what}: {float(t[tuple(first)])} at index {first} (shape "
                         f"{list(t.shape)}): an NVFP4 global scale must be positive and finite")
    if weight_scale is not None and weight_scale.numel():
        codes = weight_scale.view(torch.uint8)
        if int(codes.max()) < 0x7F:  # every code a positive finite e4m3 value (or +0)
            return
        require_finite(weight_scale, f"{p}weight_scale")
        neg = (codes & 0x80).bool() & (codes & 0x7F).bool()
        if bool(neg.any()):
            first = [int(i) for i in neg.nonzero()[0]]
            raise ValueError(f"{p}weight_scale: {float(weight_scale[tuple(first)].float())} at "
                             f"index {first}: NVFP4 block scales must be >= 0")


def quantize_nvfp4(w: torch.Tensor, weight_scale_2: torch.Tensor | None = None,
                   input_amax: float | torch.Tensor | None = None,
                   name: str = "") -> NVFP4Tensor:
    """Quantize a float ``w [..., N, K]`` (K % 16 == 0) to NVFP4 with ModelOpt's conventions.
    ``weight_scale_2`` defaults to ``amax(|w|) / 2688``; ``input_amax`` sets ``input_scale``.
    Raises ``ValueError`` on NaN / inf or a bad global scale or ``input_amax``."""
    if not w.is_floating_point():
        raise ValueError(f"quantize_nvfp4: w must be a float tensor, got {w.dtype}")
    if w.dim() < 2 or w.shape[-1] % BLOCK_SIZE:
        raise ValueError(f"quantize_nvfp4: w must be [..., N, K] with K % 16 == 0, "
                         f"got {tuple(w.shape)}")
    w32 = w.float()
    what = f"quantize_nvfp4: {name or 'w'}"
    require_finite(w32, what)
    ws2 = global_scale(w32.abs().amax()) if weight_scale_2 is None else weight_scale_2.float()
    ws2 = ws2.to(w.device)
    if weight_scale_2 is not None:
        check_nvfp4_scales(weight_scale_2=ws2, name=name or "quantize_nvfp4")
    validate_nvfp4(torch.zeros((*w.shape[:-1], w.shape[-1] // 2), dtype=torch.uint8,
                               device="meta"),
                   torch.zeros((*w.shape[:-1], w.shape[-1] // BLOCK_SIZE),
                               dtype=torch.float8_e4m3fn, device="meta"), ws2, "quantize_nvfp4")
    ws2_rows = _expand_scale_2(ws2, w.shape)  # [] or [..., N, 1]: per expert (gate / up) scales
    scale = nvfp4_block_scales(w32, ws2_rows)
    scaled = w32.unflatten(-1, (-1, BLOCK_SIZE)) / (scale.float() * ws2_rows).unsqueeze(-1)
    codes = cast_to_e2m1(scaled.flatten(-2))
    inp = None if input_amax is None else input_scale_from_amax(input_amax).to(w.device)
    return NVFP4Tensor(pack_fp4(codes), scale, ws2.reshape(ws2.shape), inp)


def dequantize_nvfp4(weight: torch.Tensor, weight_scale: torch.Tensor,
                     weight_scale_2: torch.Tensor, dtype: torch.dtype = torch.float32
                     ) -> torch.Tensor:
    """``E2M1[code] * weight_scale * weight_scale_2`` -> ``[..., N, K]`` in ``dtype``.
    ``weight_scale_2``: scalar, ``[E]`` per stacked expert, or ``[E, 2]`` (gate / up halves of a
    stacked w13: the first N/2 rows use column 0)."""
    validate_nvfp4(weight, weight_scale, weight_scale_2)
    codes = unpack_fp4(weight).long()
    vals = _on("values", weight.device)[codes]
    per_block = weight_scale.float() * _expand_scale_2(weight_scale_2, weight.shape)
    out = vals.unflatten(-1, (-1, BLOCK_SIZE)) * per_block.unsqueeze(-1)
    return out.flatten(-2).to(dtype)


def _expand_scale_2(ws2: torch.Tensor, wshape: torch.Size) -> torch.Tensor:
    """Broadcast a scalar / ``[E]`` / ``[E, 2]`` global scale to ``[..., N, 1]``."""
    ws2 = ws2.float()
    if ws2.dim() == 0 or ws2.numel() == 1 and len(wshape) == 2:
        return ws2.reshape(())
    if ws2.dim() == 1:
        return ws2.reshape(-1, 1, 1)
    n = wshape[-2]
    half = torch.arange(n, device=ws2.device) >= n // 2
    return ws2[:, half.long()].unsqueeze(-1)


@dataclass(frozen=True)
class NVFP4ErrorReport:
    """How well a quantized tensor reproduces the original: ``rel_error`` ||W - Q|| / ||W||,
    ``max_error`` max |W - Q|, ``clipped_block_share`` share of blocks with an element beyond
    +-6 after scaling, ``sqnr_db`` 20 log10(||W|| / ||W - Q||), ``bits_per_weight``."""

    rel_error: float
    max_error: float
    clipped_block_share: float
    sqnr_db: float
    bits_per_weight: float = 4.5


def nvfp4_error_report(w: torch.Tensor, q: NVFP4Tensor | None = None) -> NVFP4ErrorReport:
    """Quantize ``w [..., N, K]`` (unless ``q`` is given) and measure the error."""
    q = quantize_nvfp4(w) if q is None else q
    w32 = w.float()
    dq = dequantize_nvfp4(q.weight, q.weight_scale, q.weight_scale_2)
    blocks = w32.unflatten(-1, (-1, BLOCK_SIZE))
    denom = q.weight_scale.float() * _expand_scale_2(q.weight_scale_2, q.weight.shape)
    clipped = (blocks.abs() / denom.unsqueeze(-1) > FP4_MAX).any(-1)
    return make_error_report(w32, dq, clipped.float().mean().item(), 4.5)


def make_error_report(w32: torch.Tensor, dq: torch.Tensor, clipped: float,
                      bits: float) -> NVFP4ErrorReport:
    """Error report of a dequantized ``dq`` against ``w32`` (also used for MXFP4 / int4)."""
    err = (w32 - dq).norm().item()
    ref = w32.norm().item()
    rel = err / ref if ref > 0 else 0.0
    sqnr = float("inf") if err == 0 else 20.0 * torch.log10(torch.tensor(ref / err)).item()
    return NVFP4ErrorReport(rel, (w32 - dq).abs().max().item(), clipped, sqnr, bits)
