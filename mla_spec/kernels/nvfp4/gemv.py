"""NVFP4 W4A16 GEMV for 1-2 tokens (FMA, no MMA): int64 words ``[N, K/16]`` (one per 16-element
block), a program owns ``BN`` rows x ``MP`` tokens and a K range; a nibble as fp16 bits is ``E2M1
* 2**-14``. The last split of a tile (per-tile counter) sums the partials in order, so split-K
GEMVs must not overlap across streams. Design: docs/design.md, docs/bench_nvfp4.md.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from mla_spec.kernels.launch.pdl import gdc_enter, pdl_kwargs
from mla_spec.kernels.nvfp4.configs import GemvConfig
from mla_spec.kernels.nvfp4.gemv_packed import (
    PACKED_UNIT,
    dot16_packed,
    load_xw,
    packed_prefetch_loop,
    x_pairs,
)

__all__ = ["nvfp4_gemv", "packed_gemv_config", "split_k_for", "packed_ok", "block_dot16",
           "gemv_counters"]

#: The largest token tile of the GEMV (``mp_for``); more tokens take more tiles.
MAX_TOKEN_TILE = 8

# Pair (j, j+4) of a 32-bit word: fp16x2 bits = (w << (9-4j)) & 0x0E000E00 | (w << (12-4j)) &
# 0x80008000, then one cvt.f32.f16 per lane.
_PAIR = """
shl.b32 a, {w}, {sm}; and.b32 a, a, 0x0E000E00; {sgn}
or.b32 p, a, b; mov.b32 {{h0, h1}}, p;
cvt.f32.f16 ${o0}, h0; cvt.f32.f16 ${o1}, h1;"""


def _asm16() -> str:
    body = ["{", ".reg .b32 w0, w1, a, b, p;", ".reg .b16 h0, h1;", "mov.b64 {w0, w1}, $16;"]
    for half, w in enumerate(("w0", "w1")):
        for j in range(4):
            sm = 9 - 4 * j
            shift = f"shl.b32 a, {w}, {sm};" if sm > 0 else f"shr.u32 a, {w}, {-sm};"
            ss = 12 - 4 * j
            sgn = (f"shl.b32 b, {w}, {ss}; and.b32 b, b, 0x80008000;" if ss
                   else f"and.b32 b, {w}, 0x80008000;")
            txt = _PAIR.format(w=w, sm=sm, sgn=sgn, o0=8 * half + j, o1=8 * half + j + 4)
            body.append(txt.replace(f"shl.b32 a, {w}, {sm};", shift))
    body.append("}")
    return "\n".join(body)


_ASM16 = tl.constexpr(_asm16())


@triton.jit
def _decode16_asm(wq):
    """int64 words -> 16 fp32 tensors (element i of each block), E2M1 * 2**-14 (GPU only)."""
    r = tl.inline_asm_elementwise(
        _ASM16, "=r,=r,=r,=r,=r,=r,=r,=r,=r,=r,=r,=r,=r,=r,=r,=r,l", [wq],
        dtype=(tl.int32,) * 16, is_pure=True, pack=1)
    return (r[0].to(tl.float32, bitcast=True), r[1].to(tl.float32, bitcast=True),
            r[2].to(tl.float32, bitcast=True), r[3].to(tl.float32, bitcast=True),
            r[4].to(tl.float32, bitcast=True), r[5].to(tl.float32, bitcast=True),
            r[6].to(tl.float32, bitcast=True), r[7].to(tl.float32, bitcast=True),
            r[8].to(tl.float32, bitcast=True), r[9].to(tl.float32, bitcast=True),
            r[10].to(tl.float32, bitcast=True), r[11].to(tl.float32, bitcast=True),
            r[12].to(tl.float32, bitcast=True), r[13].to(tl.float32, bitcast=True),
            r[14].to(tl.float32, bitcast=True), r[15].to(tl.float32, bitcast=True))


@triton.jit
def _nib(w32, SHIFT: tl.constexpr):
    """Nibble at bit SHIFT of int32 words -> fp32 E2M1 * 2**-14 (portable)."""
    bits = (((w32 >> SHIFT) & 7) << 9) | (((w32 >> (SHIFT + 3)) & 1) << 15)
    return bits.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _decode16_pure(wq):
    lo = wq.to(tl.int32)
    hi = (wq >> 32).to(tl.int32)
    return (_nib(lo, 0), _nib(lo, 4), _nib(lo, 8), _nib(lo, 12), _nib(lo, 16), _nib(lo, 20),
            _nib(lo, 24), _nib(lo, 28), _nib(hi, 0), _nib(hi, 4), _nib(hi, 8), _nib(hi, 12),
            _nib(hi, 16), _nib(hi, 20), _nib(hi, 24), _nib(hi, 28))


@triton.jit
def _xl(xs, IDX: tl.constexpr, xmask, MASKED: tl.constexpr):
    if MASKED:
        v = tl.load(xs + IDX, mask=xmask, other=0.0)
    else:
        v = tl.load(xs + IDX)
    return v.to(tl.float32)


@triton.jit
def block_dot16(wq, xs, xmask, MASKED: tl.constexpr, FAST: tl.constexpr):
    """Per-block ``sum_i decode(wq)_i * x[16 g + i]`` (fp32, units of 2**-14)."""
    if FAST:
        v = _decode16_asm(wq)
    else:
        v = _decode16_pure(wq)
    p = v[0] * _xl(xs, 0, xmask, MASKED)
    for i in tl.static_range(1, 16):  # unrolled: the same sum order as written out
        p += v[i] * _xl(xs, i, xmask, MASKED)
    return p


@triton.jit
def block_x(xs, b, ok, MASKED: tl.constexpr, PACKED: tl.constexpr, FAST: tl.constexpr):
    """Step ``b``'s activations for :func:`block_dot`: x pointers, or (``PACKED``) fp16x2 pairs."""
    if PACKED:
        xa, xb, xc, xd = load_xw(xs, b, ok, MASKED)
        return x_pairs(xa, xb, xc, xd, FAST)
    else:
        return xs + b * 16


@triton.jit
def block_dot(wq, xv, ok, MASKED: tl.constexpr, PACKED: tl.constexpr, FAST: tl.constexpr):
    """Per-block dot products in units of ``1 / dot_unit(PACKED)``."""
    if PACKED:
        return dot16_packed(wq, xv, FAST)
    else:
        return block_dot16(wq, xv, ok, MASKED, FAST)


@triton.jit
def dot_unit(PACKED: tl.constexpr):
    """The factor that turns ``block_dot``'s sums into E2M1 * x sums."""
    if PACKED:
        return PACKED_UNIT
    else:
        return 16384.0


@triton.jit(do_not_specialize=["M"])  # the token count follows the batch
def _nvfp4_gemv_kernel(
    x_ptr, w_ptr, ws_ptr, ws2_ptr, out_ptr, part_ptr, cnt_ptr,
    M, N, KB, SPLIT, stride_xm, stride_wn, stride_sn, stride_om,
    MP: tl.constexpr, BN: tl.constexpr, G: tl.constexpr, SPLIT_K: tl.constexpr,
    EVEN: tl.constexpr, FAST: tl.constexpr, PACKED: tl.constexpr, PREFETCH: tl.constexpr,
    USE_GDC: tl.constexpr,
):
    # the double-buffered loop loads its first weights before waiting for the previous grid
    if not PREFETCH:
        gdc_enter(USE_GDC)
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    pid_m = tl.program_id(2)
    offs_n = pid_n * BN + tl.arange(0, BN)
    offs_m = pid_m * MP + tl.arange(0, MP)
    offs_g = tl.arange(0, G)
    rows = tl.minimum(offs_n, N - 1).to(tl.int64)  # clamped: valid loads, dropped at the store
    toks = tl.minimum(offs_m, M - 1).to(tl.int64)
    w3 = w_ptr + rows[:, None, None] * stride_wn + offs_g[None, None, :]
    s3 = ws_ptr + rows[:, None, None] * stride_sn + offs_g[None, None, :]
    if PACKED:  # x as int64 words (4 bf16 each), 4 words per block
        x3 = x_ptr + toks[None, :, None] * stride_xm + (4 * offs_g)[None, None, :]
    else:
        x3 = x_ptr + toks[None, :, None] * stride_xm + (16 * offs_g)[None, None, :]
    n_it = tl.cdiv(KB, G)
    per = tl.cdiv(n_it, SPLIT)
    it0 = pid_k * per
    it1 = tl.minimum(it0 + per, n_it)
    acc = tl.zeros((BN, MP, G), dtype=tl.float32)
    if PREFETCH:  # packed only
        acc, _ = packed_prefetch_loop(w3, s3, x3, 0, 0, it0, it1, KB, offs_g[None, None, :],
                                      acc, acc, False, G, FAST, USE_GDC)
    else:
        for it in range(it0, it1):
            b = it * G
            if EVEN:
                wq = tl.load(w3 + b)
                sc = tl.load(s3 + b).to(tl.float32)
                p = block_dot(wq, block_x(x3, b, None, False, PACKED, FAST), None, False, PACKED,
                              FAST)
            else:
                ok = (b + offs_g < KB)[None, None, :]
                wq = tl.load(w3 + b, mask=ok, other=0)
                sc = tl.load(s3 + b, mask=ok, other=0.0).to(tl.float32)
                p = block_dot(wq, block_x(x3, b, ok, True, PACKED, FAST), ok, True, PACKED, FAST)
            acc += p * sc
    res = tl.sum(acc, axis=2) * (tl.load(ws2_ptr) * dot_unit(PACKED))  # [BN, MP]
    omask = (offs_n < N)[:, None] & (offs_m < M)[None, :]
    optr = out_ptr + offs_m[None, :] * stride_om + offs_n[:, None]
    if not SPLIT_K:
        tl.store(optr, res.to(out_ptr.dtype.element_ty), mask=omask)
    else:
        pm = offs_m[None, :] * N + offs_n[:, None]
        tl.store(part_ptr + pid_k * M * N + pm, res, mask=omask)
        tl.debug_barrier()
        tile = pid_m * tl.num_programs(0) + pid_n
        done = tl.atomic_add(cnt_ptr + tile, 1, sem="acq_rel")
        if done == SPLIT - 1:  # last split of this tile: reduce in split order, reset
            tot = tl.zeros((BN, MP), dtype=tl.float32)
            for s in range(0, SPLIT):
                tot += tl.load(part_ptr + s * M * N + pm, mask=omask, other=0.0,
                               cache_modifier=".cg")
            tl.store(optr, tot.to(out_ptr.dtype.element_ty), mask=omask)
            tl.atomic_xchg(cnt_ptr + tile, 0)


_NUM_SMS = 132
_COUNTERS: dict[torch.device, torch.Tensor] = {}
_MAX_TILES = 1 << 14


def split_k_for(tiles: int, steps: int, per_split: int, ctas_per_sm: int = 4) -> int:
    """Split-K of ``tiles`` programs: doubled while under ``ctas_per_sm`` per SM and steps allow."""
    split = 1
    while tiles * split < ctas_per_sm * _NUM_SMS and steps >= per_split * split:
        split *= 2
    return split


def packed_gemv_config(m: int, n: int, k: int) -> GemvConfig:
    """The packed GEMV for an unpinned shape at 1-2 tokens, fitted to the pinned M = 1 winners."""
    kb = k // 16
    g = min(64, triton.next_power_of_2(max(kb, 1)))
    bn, warps = (8, 2) if n >= 4096 else (4, 1)
    split = split_k_for(triton.cdiv(n, bn), triton.cdiv(kb, g), 2)
    return GemvConfig(block_n=bn, groups=g, split_k=split, num_warps=warps, packed=True,
                      prefetch=True)


def mp_for(m: int) -> int:
    """Token tile of the GEMV: next power of two, at most ``MAX_TOKEN_TILE``."""
    return min(triton.next_power_of_2(max(m, 1)), MAX_TOKEN_TILE)


def gemv_counters(device: torch.device, tiles: int) -> torch.Tensor:
    if tiles > _MAX_TILES:
        return torch.zeros(tiles, dtype=torch.int32, device=device)
    buf = _COUNTERS.get(device)
    if buf is None:
        buf = _COUNTERS[device] = torch.zeros(_MAX_TILES, dtype=torch.int32, device=device)
    return buf


def nvfp4_gemv(x2: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
               weight_scale_2: torch.Tensor, out: torch.Tensor, config: GemvConfig,
               interpret: bool = False) -> torch.Tensor:
    """``out [M, N] = x2 [M, K] @ dequant(W)^T`` (validated by ``nvfp4_gemm``)."""
    m, k = x2.shape
    n = weight.shape[0]
    kb = k // 16
    w64 = weight.view(torch.int64) if weight.stride(0) % 8 == 0 and weight.stride(1) == 1 \
        else weight.contiguous().view(torch.int64)
    fast = not interpret
    packed = config.packed and packed_ok(x2, fast)
    xk = x2.view(torch.int64) if packed else x2  # 4 bf16 per word
    mp = mp_for(m)
    g = min(config.groups, triton.next_power_of_2(kb))
    split = max(1, min(config.split_k, triton.cdiv(kb, g)))
    grid = (triton.cdiv(n, config.block_n), split, triton.cdiv(m, mp))
    if split > 1:
        part = torch.empty((split, m, n), dtype=torch.float32, device=x2.device)
        cnt = gemv_counters(x2.device, grid[0] * grid[2])
    else:
        part = cnt = out
    _nvfp4_gemv_kernel[grid](
        xk, w64, weight_scale, weight_scale_2, out, part, cnt,
        m, n, kb, split, xk.stride(0), w64.stride(0), weight_scale.stride(0), out.stride(0),
        MP=mp, BN=config.block_n, G=g, SPLIT_K=split > 1, EVEN=kb % g == 0, FAST=fast,
        PACKED=packed, PREFETCH=packed and config.prefetch, num_warps=config.num_warps,
        num_stages=config.num_stages, **pdl_kwargs(x2))
    return out


def packed_ok(x2: torch.Tensor, fast: bool) -> bool:
    """Whether the packed path can read ``x2`` (bf16 rows of int64 words; PTX: sm_89+)."""
    if x2.dtype != torch.bfloat16 or x2.stride(1) != 1 or x2.stride(0) % 4 \
            or x2.data_ptr() % 8:
        return False
    return not fast or (x2.is_cuda and torch.cuda.get_device_capability(x2.device) >= (8, 9))
