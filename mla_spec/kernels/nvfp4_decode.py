"""E2M1 (NVFP4) decoders shared by the W4A16 kernels (``nvfp4_gemm``, ``nvfp4_moe``).

A packed byte holds two E2M1 codes (even element in the low nibble). Placing a code's exponent
and mantissa bits at the bottom of an fp16 exponent / top of its mantissa gives exactly
``E2M1 * 2**-14`` (subnormal codes included), so decoding is shifts and masks, then one multiply
by the block scale (folded with the power-of-two correction). Two decoders:

- ``_decode_pure``: portable Triton (any GPU, the CPU interpreter);
- ``_decode_asm``: sm_90+ inline PTX on four packed bytes at once (``prmt`` + bf16x2 multiply),
  validated against the portable one on the H200; never used by the interpreter.

``_decode(wb, s8, OUT_F32, FAST)`` picks one: ``wb`` bytes ``[.., 8]`` uint8 and e4m3 block
scales ``s8`` ``[.., 1]`` -> ``(low, high)`` values ``E2M1 * s * 2**-8`` (the kernels multiply
the accumulator by ``weight_scale_2 * 256`` at the end).
"""

from __future__ import annotations

import triton
import triton.language as tl

__all__ = ["_decode", "_decode_asm", "_decode_pure"]

_TWO_118 = tl.constexpr(2.0**118)  # jit code may only read constexpr globals

# Four packed bytes ($4) and their scales s * 2**118 as bf16x2 ($5 bytes 0-1, $6 bytes 2-3) ->
# low-nibble values ($0, $1) and high-nibble values ($2, $3) as bf16x2, E2M1 * s * 2**-8.
_ASM = tl.constexpr("""
{
.reg .b32 z, t0, t1, a, b;
mov.b32 z, 0;
prmt.b32 t0, $4, z, 0x4140;
prmt.b32 t1, $4, z, 0x4342;
shl.b32 a, t0, 6; shl.b32 b, t0, 12; or.b32 a, a, b; and.b32 a, a, 0x81C081C0;
mul.rn.bf16x2 $0, a, $5;
shl.b32 a, t1, 6; shl.b32 b, t1, 12; or.b32 a, a, b; and.b32 a, a, 0x81C081C0;
mul.rn.bf16x2 $1, a, $6;
shl.b32 a, t0, 2; and.b32 a, a, 0x01C001C0; shl.b32 b, t0, 8; and.b32 b, b, 0x80008000;
or.b32 a, a, b; mul.rn.bf16x2 $2, a, $5;
shl.b32 a, t1, 2; and.b32 a, a, 0x01C001C0; shl.b32 b, t1, 8; and.b32 b, b, 0x80008000;
or.b32 a, a, b; mul.rn.bf16x2 $3, a, $6;
}
""")


@triton.jit
def _decode_pure(wb, s8, OUT_F32: tl.constexpr):
    """bytes [.., 8] uint8 + e4m3 scales [.., 1] -> (low, high) values E2M1 * s * 2**-8."""
    b = wb.to(tl.uint16)
    lo = ((b & 7) << 9) | ((b & 8) << 12)
    hi = ((b & 0x70) << 5) | ((b & 0x80) << 8)
    s = s8.to(tl.float32) * 64.0
    lo = lo.to(tl.float16, bitcast=True).to(tl.float32) * s
    hi = hi.to(tl.float16, bitcast=True).to(tl.float32) * s
    if not OUT_F32:
        lo = lo.to(tl.bfloat16)
        hi = hi.to(tl.bfloat16)
    return lo, hi


@triton.jit
def _decode_asm(wb, s8):
    """GPU-only packed decoder, same result as ``_decode_pure`` in bf16."""
    sb = (s8.to(tl.float32) * _TWO_118).to(tl.bfloat16)
    sb = tl.broadcast_to(sb, wb.shape)
    lo, hi = tl.inline_asm_elementwise(
        _ASM, "=r,=r,=r,=r,r,r,r", [wb, sb], dtype=(tl.bfloat16, tl.bfloat16),
        is_pure=True, pack=4)
    return lo, hi


@triton.jit
def _decode(wb, s8, OUT_F32: tl.constexpr, FAST: tl.constexpr):
    if FAST and not OUT_F32:
        lo, hi = _decode_asm(wb, s8)
    else:
        lo, hi = _decode_pure(wb, s8, OUT_F32)
    return lo, hi
