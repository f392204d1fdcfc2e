"""FP8 e4m3 (``float8_e4m3fn``) quantization with a per-tensor or per-row scale, and error bounds.

e4m3: finite range ``±448``, smallest normal ``2**-6``, no infinity. ``stored = sat(x / scale)``
in fp32, clamped to ``±448`` (so inf saturates), cast round-to-nearest-even: relative error
``<= 2**-4`` in the normal range, absolute ``<= 2**-10 * scale`` below it. :func:`quantize_fp8`
does not check for NaN / inf (it runs on every cache write; a check would sync); functions that
derive a scale from ``amax`` raise ``ValueError`` on them. The interpreter's cast does not round
like Hopper's, so the launchers use these functions when interpreting.
"""

import math

import torch

__all__ = [
    "FP8_E4M3_MAX", "FP8_DTYPE", "quantize_fp8", "dequantize_fp8", "require_finite",
    "fp8_scale_for", "fp8_e4m3_values", "fp8_kv_attention_error_bound",
    "quantize_rows_e4m3", "e4m3_rows_round_trip", "fp8_query_attention_error_bound", "P8_SCALE",
    "round_probabilities_e4m3", "fp8_probability_attention_error_bound",
]

FP8_DTYPE = torch.float8_e4m3fn
FP8_E4M3_MAX = 448.0
FP8_E4M3_REL_ERR = 2.0**-4  # half an ulp of a 3-bit mantissa: worst relative error (normals)


def require_finite(x: torch.Tensor, what: str) -> None:
    """Raise ``ValueError`` naming ``what``, the NaN / inf count and the first index (integer and
    bool pass; e4m3 checked for its NaN code). One sync: a finite ``x.sum()`` proves all finite."""
    if x.dtype == FP8_DTYPE:
        bad = (x.view(torch.uint8) & 0x7F) == 0x7F
        if not bool(bad.any()):
            return
    elif x.is_floating_point():
        if x.element_size() == 1:  # other 8-bit floats have no isfinite kernel
            x = x.float()
        if bool(torch.isfinite(x.sum())):
            return
        bad = ~torch.isfinite(x)
        if not bool(bad.any()):
            return
    else:
        return
    first = tuple(int(i) for i in bad.nonzero()[0])
    value = float(x[first].float())
    raise ValueError(f"{what}: {int(bad.sum())} of {x.numel()} values are NaN or inf (first "
                     f"{value} at index {list(first)}, shape {list(x.shape)}); only finite values "
                     "are supported")


def _check_scale(scale: float | torch.Tensor) -> None:
    if isinstance(scale, torch.Tensor):
        ok = bool(torch.all(torch.isfinite(scale) & (scale > 0)))
    else:
        ok = scale > 0 and math.isfinite(scale)
    if not ok:
        raise ValueError(f"fp8 scale {scale!r}: must be positive and finite")


def _scale_for(x: torch.Tensor, scale: float | torch.Tensor) -> float | torch.Tensor:
    """``scale`` as fp32 on ``x``'s device; a tensor scale must broadcast to ``x`` unchanged."""
    if not isinstance(scale, torch.Tensor):
        return scale
    try:
        shape = torch.broadcast_shapes(x.shape, scale.shape)
    except RuntimeError:
        shape = None
    if shape != x.shape:
        raise ValueError(f"fp8 scale of shape {tuple(scale.shape)} does not broadcast to x "
                         f"{tuple(x.shape)}: use a scalar (per tensor) or a per-row shape such "
                         f"as {(*x.shape[:-1], 1)}")
    return scale.to(device=x.device, dtype=torch.float32)


def quantize_fp8(x: torch.Tensor, scale: float | torch.Tensor = 1.0) -> torch.Tensor:
    """``sat(x / scale)`` (RTNE) as ``float8_e4m3fn``, shape of ``x`` (any float dtype). ``scale``:
    a positive float, or a tensor broadcastable to ``x`` (per tensor or per row)."""
    _check_scale(scale)
    scale = _scale_for(x, scale)
    y = x.to(torch.float32) / scale
    return y.clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(FP8_DTYPE)


def dequantize_fp8(x8: torch.Tensor, scale: float | torch.Tensor = 1.0,
                   dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``x8 * scale`` computed in fp32, returned in ``dtype`` (shape of ``x8``)."""
    if x8.dtype != FP8_DTYPE:
        raise ValueError(f"dequantize_fp8 expects {FP8_DTYPE}, got {x8.dtype}")
    scale = _scale_for(x8, scale)
    return (x8.to(torch.float32) * scale).to(dtype)


def fp8_scale_for(x: torch.Tensor, margin: float = 1.0) -> float:
    """Per-tensor scale ``amax / 448 * margin`` (1.0 for an all-zero ``x``). Raises ``ValueError``
    on NaN / inf in ``x`` or a ``margin`` not positive and finite."""
    if not (margin > 0 and math.isfinite(margin)):
        raise ValueError(f"fp8_scale_for: margin {margin!r} must be positive and finite")
    amax = float(x.detach().abs().max()) if x.numel() else 0.0
    if amax != amax or amax == float("inf"):
        require_finite(x.detach(), "fp8_scale_for: x")
    if not amax:
        return 1.0
    return amax / FP8_E4M3_MAX * margin


def fp8_e4m3_values(include_negative: bool = False) -> torch.Tensor:
    """Every finite e4m3fn value, sorted (fp32): the grid the cache stores (127 non-negative)."""
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    vals = codes.view(FP8_DTYPE).to(torch.float32)
    vals = vals[torch.isfinite(vals)]
    if not include_negative:
        vals = vals[vals >= 0]
    return torch.unique(vals)  # unique also merges +0 / -0 and sorts


def fp8_kv_attention_error_bound(q: torch.Tensor, kv: torch.Tensor, dv: int, sm_scale: float,
                                 scale: float = 1.0) -> float:
    """Worst-case max-abs change of an attention output when its KV rows go through e4m3.

    Each element moves by at most ``d_x = 2**-4 |x| + 2**-10 scale``, every score by ``eps =
    sm_scale * max_j sum_d |q_d| d_x[j, d]``, so ``|out' - out| <= (exp(2 eps) - 1) max|v'| +
    max|v' - v|`` (fp32 rounding ignored)."""
    qf, x = q.to(torch.float64), kv.to(torch.float64)
    dx = 2.0**-4 * x.abs() + 2.0**-10 * scale
    eps = float(sm_scale * (qf.abs() @ dx.T).max()) if qf.numel() and x.numel() else 0.0
    v_max = float(x[:, :dv].abs().max() * (1 + 2.0**-4) + 2.0**-10 * scale) if x.numel() else 0.0
    dv_max = float(dx[:, :dv].max()) if x.numel() else 0.0
    return (torch.tensor(2 * eps, dtype=torch.float64).exp().item() - 1) * v_max + dv_max


def quantize_rows_e4m3(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Queries to e4m3 with one scale per row, as the ``WE`` kernel does before its e4m3 Q K.

    ``x [..., D]`` -> ``(q8, scale [...] fp32)``, ``scale = amax / 448`` (0 for a zero row), ``q8 =
    sat_rtne(x * (448 / amax))``. Raises ``ValueError`` on NaN / inf (one sync)."""
    require_finite(x, "quantize_rows_e4m3: x")
    xf = x.to(torch.float32)
    amax = xf.abs().amax(dim=-1) if x.shape[-1] else xf.new_zeros(x.shape[:-1])
    inv = torch.where(amax > 0, FP8_E4M3_MAX / amax.clamp_min(torch.finfo(torch.float32).tiny),
                      torch.zeros_like(amax))
    q8 = (xf * inv[..., None]).clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(FP8_DTYPE)
    return q8, amax * (1.0 / FP8_E4M3_MAX)


def e4m3_rows_round_trip(x: torch.Tensor) -> torch.Tensor:
    """``x`` through :func:`quantize_rows_e4m3` and back, in fp32 (shape of ``x``): the
    queries the ``WE`` kernel multiplies, for its twin."""
    q8, scale = quantize_rows_e4m3(x)
    return q8.to(torch.float32) * scale[..., None]


def fp8_query_attention_error_bound(q: torch.Tensor, kv: torch.Tensor, dv: int,
                                    sm_scale: float) -> float:
    """Worst-case max-abs change of an attention output when its queries go through
    :func:`quantize_rows_e4m3`: with ``d_q = 2**-4 |q| + 2**-10 amax_r / 448``, ``eps = sm_scale *
    max sum_d d_q |kv|`` and ``|out' - out| <= (exp(2 eps) - 1) max|v|``."""
    if not q.numel() or not kv.numel():
        return 0.0
    qf, x = q.to(torch.float64), kv.to(torch.float64)
    amax = qf.abs().amax(dim=-1, keepdim=True)
    dq = 2.0**-4 * qf.abs() + 2.0**-10 * amax / FP8_E4M3_MAX
    eps = float(sm_scale * (dq @ x.abs().T).max())
    v_max = float(x[:, :dv].abs().max())
    return (torch.tensor(2 * eps, dtype=torch.float64).exp().item() - 1) * v_max


#: ``WE8`` scales its softmax weights (<= 1) by this before rounding them to e4m3: weights down
#: to 2^-14 stay normal and 256 stays below 448 (``csrc/sm90_e4m3.cuh``)
P8_SCALE = 256.0


def round_probabilities_e4m3(p: torch.Tensor) -> torch.Tensor:
    """Softmax weights ``p`` (``0 <= p <= 1``, any shape) as the ``WE8`` kernel's P V
    multiplies them: ``e4m3(256 p) / 256`` (RTNE), in fp32."""
    return dequantize_fp8(quantize_fp8(p, 1.0 / P8_SCALE), 1.0 / P8_SCALE)


def fp8_probability_attention_error_bound(kv_len: int, v_max: float) -> float:
    """Worst-case max-abs change of an attention output element when its softmax weights go
    through :func:`round_probabilities_e4m3` (``WE8``'s e4m3 P V): ``(2**-4 + kv_len * 2**-18)
    v_max``, since a weight moves by at most ``2**-4 p`` or ``2**-18``, the denominator >= 1"""
    return (FP8_E4M3_REL_ERR + max(int(kv_len), 0) * 2.0**-10 / P8_SCALE) * float(v_max)
