"""Packed-fp16 block dot products for the NVFP4 GEMV (bf16 x): a code moved into an e4m3 byte is
``E2M1 * 2**-6``, one ``cvt.rn.f16x2.e4m3x2`` (sm_89+) makes two weights and ``fma.rn.f16x2``
multiplies two (docs/bench_nvfp4.md). x must fit fp16 (overflow: inf, unchecked). ``*_pure`` twins
(fp32, same order) run in the interpreter.
"""

from __future__ import annotations

import triton
import triton.language as tl

from mla_spec.kernels.launch.pdl import gdc_enter

__all__ = ["x_pairs", "dot16_packed", "packed_prefetch_loop", "step_mask", "load_w", "load_xw",
           "PACKED_UNIT"]

# the unit of the packed block sums (E2M1 * 2**-6 weights), applied once at the end
PACKED_UNIT = tl.constexpr(64.0)


def _xconv_asm() -> str:
    """4 int64 words of bf16 x -> 8 fp16x2 pairs, per 8-group: (0,2) (4,6) (1,3) (5,7)."""
    body = ["{", ".reg .b32 a0, a1, b0, b1, lo, hi;"]
    out = 0
    for grp in range(2):
        # group grp: x[8grp .. 8grp+3] in word $(8 + 2 grp), x[8grp+4 ..] in $(9 + 2 grp)
        body.append(f"mov.b64 {{a0, a1}}, ${8 + 2 * grp}; mov.b64 {{b0, b1}}, ${9 + 2 * grp};")
        # a0 = (x0, x1), a1 = (x2, x3), b0 = (x4, x5), b1 = (x6, x7)
        for src0, src1, odd in (("a0", "a1", False), ("b0", "b1", False),
                                ("a0", "a1", True), ("b0", "b1", True)):
            if odd:
                body.append(f"and.b32 lo, {src0}, 0xFFFF0000; and.b32 hi, {src1}, 0xFFFF0000;")
            else:
                body.append(f"shl.b32 lo, {src0}, 16; shl.b32 hi, {src1}, 16;")
            body.append(f"cvt.rn.f16x2.f32 ${out}, hi, lo;")
            out += 1
    body.append("}")
    return "\n".join(body)


def _dot_asm() -> str:
    """int64 word of 16 codes ($9) . 8 fp16x2 x pairs ($1..$8) -> fp32 bits ($0), units 2**-6."""
    body = ["{", ".reg .b32 w0, w1, t, u, L, H, p, acc;", ".reg .b16 c0, c1;",
            ".reg .f32 f0, f1;", "mov.b64 {w0, w1}, $9;"]
    first = True
    for grp, w in enumerate(("w0", "w1")):
        body.append(f"shl.b32 t, {w}, 2; and.b32 t, t, 0x1C1C1C1C; shl.b32 u, {w}, 4; "
                    f"and.b32 u, u, 0x80808080; or.b32 L, t, u;")
        body.append(f"shr.u32 t, {w}, 2; and.b32 t, t, 0x1C1C1C1C; and.b32 u, {w}, 0x80808080; "
                    f"or.b32 H, t, u;")
        for k, (reg, half) in enumerate((("L", 0), ("L", 1), ("H", 0), ("H", 1))):
            xr = 1 + 4 * grp + k
            if half == 0:
                body.append(f"mov.b32 {{c0, c1}}, {reg};")
            body.append(f"cvt.rn.f16x2.e4m3x2 p, c{half};")
            if first:
                body.append(f"mul.rn.f16x2 acc, p, ${xr};")
                first = False
            else:
                body.append(f"fma.rn.f16x2 acc, p, ${xr}, acc;")
    body += ["mov.b32 {c0, c1}, acc;", "cvt.f32.f16 f0, c0;", "cvt.f32.f16 f1, c1;",
             "add.f32 f0, f0, f1;", "mov.b32 $0, f0;", "}"]
    return "\n".join(body)


_XCONV = tl.constexpr(_xconv_asm())
_DOT = tl.constexpr(_dot_asm())


@triton.jit
def _x_pairs_asm(xa, xb, xc, xd):
    return tl.inline_asm_elementwise(
        _XCONV, "=r,=r,=r,=r,=r,=r,=r,=r,l,l,l,l", [xa, xb, xc, xd],
        dtype=(tl.int32,) * 8, is_pure=True, pack=1)


@triton.jit
def _bf16_lo(w32):
    return (w32 << 16).to(tl.float32, bitcast=True)


@triton.jit
def _bf16_hi(w32):
    return (w32 & -65536).to(tl.float32, bitcast=True)


@triton.jit
def _x_vals_pure(xa, xb, xc, xd):
    """4 int64 words of bf16 -> 16 fp32 values in element order (the interpreter's)."""
    a0 = xa.to(tl.int32)
    a1 = (xa >> 32).to(tl.int32)
    b0 = xb.to(tl.int32)
    b1 = (xb >> 32).to(tl.int32)
    c0 = xc.to(tl.int32)
    c1 = (xc >> 32).to(tl.int32)
    d0 = xd.to(tl.int32)
    d1 = (xd >> 32).to(tl.int32)
    return (_bf16_lo(a0), _bf16_hi(a0), _bf16_lo(a1), _bf16_hi(a1),
            _bf16_lo(b0), _bf16_hi(b0), _bf16_lo(b1), _bf16_hi(b1),
            _bf16_lo(c0), _bf16_hi(c0), _bf16_lo(c1), _bf16_hi(c1),
            _bf16_lo(d0), _bf16_hi(d0), _bf16_lo(d1), _bf16_hi(d1))


@triton.jit
def x_pairs(xa, xb, xc, xd, FAST: tl.constexpr):
    """x words (four int64 tensors) -> 8 fp16x2 pairs (GPU) or 16 fp32 values."""
    if FAST:
        return _x_pairs_asm(xa, xb, xc, xd)
    else:
        return _x_vals_pure(xa, xb, xc, xd)


@triton.jit
def _nib(w32, SHIFT: tl.constexpr):
    """Nibble at bit SHIFT of int32 words -> fp32 E2M1 * 2**-6 (through fp16 bits * 2**8)."""
    bits = (((w32 >> SHIFT) & 7) << 9) | (((w32 >> (SHIFT + 3)) & 1) << 15)
    return bits.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32) * 256.0


@triton.jit
def _dot_pure(wq, xv):
    lo = wq.to(tl.int32)
    hi = (wq >> 32).to(tl.int32)
    p = _nib(lo, 0) * xv[0]
    for i in tl.static_range(1, 8):  # unrolled: the same sum order as written out
        p += _nib(lo, 4 * i) * xv[i]
    for i in tl.static_range(8):
        p += _nib(hi, 4 * i) * xv[8 + i]
    return p


@triton.jit
def dot16_packed(wq, xp, FAST: tl.constexpr):
    """Block dot products (fp32, units of 2**-6) of ``wq [BN, MP, G]`` and :func:`x_pairs`."""
    if FAST:
        r = tl.inline_asm_elementwise(
            _DOT, "=r,r,r,r,r,r,r,r,r,l",
            [xp[0], xp[1], xp[2], xp[3], xp[4], xp[5], xp[6], xp[7], wq],
            dtype=tl.int32, is_pure=True, pack=1)
        return r.to(tl.float32, bitcast=True)
    else:
        return _dot_pure(wq, xp)


@triton.jit
def step_mask(it, it1, KB, goffs, G: tl.constexpr):
    """Which of step ``it``'s 16-blocks exist (none past ``it1``)."""
    return it * G + goffs < tl.where(it < it1, KB, 0)


@triton.jit
def load_w(w, s, b, ok):
    """Weight words and fp32 block scales at block ``b`` (zeros where masked)."""
    return tl.load(w + b, mask=ok, other=0), tl.load(s + b, mask=ok, other=0.0).to(tl.float32)


@triton.jit
def load_xw(x, b, ok, MASKED: tl.constexpr = True):
    """The 4 int64 x words of each block at block ``b`` (zeros where masked)."""
    xw = x + b * 4
    if MASKED:
        return (tl.load(xw, mask=ok, other=0), tl.load(xw + 1, mask=ok, other=0),
                tl.load(xw + 2, mask=ok, other=0), tl.load(xw + 3, mask=ok, other=0))
    else:
        return tl.load(xw), tl.load(xw + 1), tl.load(xw + 2), tl.load(xw + 3)


@triton.jit
def packed_prefetch_loop(w, s, x, up_w, up_s, it0, it1, KB, goffs, acc, acc_u,
                         GATED: tl.constexpr, G: tl.constexpr, FAST: tl.constexpr,
                         EARLY_GDC: tl.constexpr = False):
    """The packed K loop, the next step's loads issued before this step's math (zeros past ``it1``).
    ``GATED``: also the up rows into ``acc_u``; ``EARLY_GDC``: first weights before the PDL wait."""
    ok = step_mask(it0, it1, KB, goffs, G)
    wq, sc = load_w(w, s, it0 * G, ok)
    wu, su = wq, sc
    if GATED:
        wu, su = load_w(w + up_w, s + up_s, it0 * G, ok)
    gdc_enter(EARLY_GDC)
    xa, xb, xc, xd = load_xw(x, it0 * G, ok)
    for it in range(it0, it1):
        ok = step_mask(it + 1, it1, KB, goffs, G)
        nwq, nsc = load_w(w, s, (it + 1) * G, ok)
        nwu, nsu = nwq, nsc
        if GATED:
            nwu, nsu = load_w(w + up_w, s + up_s, (it + 1) * G, ok)
        nxa, nxb, nxc, nxd = load_xw(x, (it + 1) * G, ok)
        xp = x_pairs(xa, xb, xc, xd, FAST)
        acc += dot16_packed(wq, xp, FAST) * sc
        if GATED:
            acc_u += dot16_packed(wu, xp, FAST) * su
        wq, sc, wu, su, xa, xb, xc, xd = nwq, nsc, nwu, nsu, nxa, nxb, nxc, nxd
    return acc, acc_u
