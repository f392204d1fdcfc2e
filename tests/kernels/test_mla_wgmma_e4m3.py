"""CPU models of the index arithmetic of ``csrc/mla_wgmma_e4m3_sm90.cu`` (variant ``WE``).

The kernel feeds ``wgmma`` its V^T operand from registers that each thread builds from the
e4m3 tile's bytes: an 8-byte load per token, one ``prmt`` per token pair, ``cvt.f16x2.e4m3x2``.
These tests replay that arithmetic lane by lane, with symbolic bytes ``(token, dim)``, and
check it against what ``wgmma`` expects of an m64k16 A fragment, that the output staging puts
every accumulator at the dim its fragment row stands for, and that the loads of a half-warp hit
16 distinct 8-byte bank pairs in the 128-byte-swizzled stage. The GPU twin tests are in
``test_mla_decode_wgmma.py``.
"""

from __future__ import annotations

import re

from mla_spec.kernels import mla_decode_wgmma as mw
from mla_spec.kernels.cuda_driver import CSRC
from mla_spec.kernels.mla_decode_paged import PAGED_VARIANTS

SRC, HDR = CSRC / "mla_wgmma_e4m3_sm90.cu", CSRC / "sm90_wgmma.cuh"


def _lanes():
    """(wg, wq, g, t4) of the 256 consumer threads."""
    for tid in range(256):
        wg, wt = tid >> 7, tid & 127
        lane = tid & 31
        yield wg, wt >> 5, lane >> 2, lane & 3


def _prmt(a, b, sel):
    """PTX ``prmt.b32`` (default mode) on lists of 4 symbolic bytes each."""
    src = list(a) + list(b)
    return [src[(sel >> (4 * i)) & 7] for i in range(4)]


def _load_v(wg, wq, g, t4, kk):
    """The kernel's load_v: v[p][e] = 8 symbolic bytes (token, dim) and the byte address."""
    box, chunk0, half = 2 * wg + (wq >> 1), 4 * (wq & 1) + (g >> 1), g & 1
    v, addr = {}, {}
    for p in range(2):
        for e in range(2):
            tok = 16 * kk + 8 * p + 2 * t4 + e
            a = box * 8192 + tok * 128 + ((chunk0 ^ (tok & 7)) << 4) + 8 * half
            # what the 128-byte swizzle put there: dims of the box, chunk un-XORed
            col = ((((a % 128) >> 4) ^ (tok & 7)) << 4) + (a % 16)
            v[p, e] = [(tok, box * 128 + col + i) for i in range(8)]
            addr[p, e] = a
    return v, addr


def _v_frags(v):
    """The kernel's v_frags: a[mt][reg] = (low half, high half) symbolic fp16 values."""
    a = [[None] * 4 for _ in range(4)]
    for p in range(2):
        for half in range(2):
            x0, x1 = v[p, 0][4 * half:4 * half + 4], v[p, 1][4 * half:4 * half + 4]
            for sel, mt in ((0x5140, 2 * half), (0x7362, 2 * half + 1)):
                b = _prmt(x0, x1, sel)
                a[mt][2 * p] = (b[0], b[1])      # cvt: bytes 0, 1 -> the low fp16 pair
                a[mt][2 * p + 1] = (b[2], b[3])  # bytes 2, 3 -> the high one
    return a


def _stage_dim(wg, wq, g, mt, i):
    """The output staging's dim of accumulator i of m64 tile mt (the kernel's ost index)."""
    return 256 * wg + 64 * wq + 8 * g + 2 * mt + ((i >> 1) & 1)


def test_v_fragments_are_the_a_operand_wgmma_expects():
    # m64k16 A fragment: register r of lane (g, t4) in warp wq holds row 16 wq + g + 8 (r & 1),
    # columns k = 2 t4 + 8 (r >> 1) (+1 in the high half). Row R of m64 tile mt must be the dim
    # that the staging gives the accumulators of row R, and column k the tile's token 16 kk + k
    # (P^T is written in natural token order).
    seen = set()
    for wg, wq, g, t4 in _lanes():
        for kk in range(4):
            v, _ = _load_v(wg, wq, g, t4, kk)
            a = _v_frags(v)
            for mt in range(4):
                for r in range(4):
                    h, k = r & 1, 2 * t4 + 8 * (r >> 1)
                    dim = _stage_dim(wg, wq, g, mt, 2 * h)  # accumulator i with (i >> 1) & 1 = h
                    assert a[mt][r] == ((16 * kk + k, dim), (16 * kk + k + 1, dim))
                    seen.update(a[mt][r])
    assert seen == {(t, d) for t in range(64) for d in range(512)}


def test_output_staging_is_a_bijection_onto_rows_and_dims():
    cells = set()
    for wg, wq, g, t4 in _lanes():
        for mt in range(4):
            for i in range(16):
                col = 8 * (i >> 2) + 2 * t4 + (i & 1)
                cells.add((col, _stage_dim(wg, wq, g, mt, i)))
    assert cells == {(c, d) for c in range(32) for d in range(512)}


def test_v_loads_of_a_half_warp_are_free_of_bank_conflicts():
    for wg in range(2):
        for wq in range(4):
            for kk in range(4):
                for p in range(2):
                    for e in range(2):
                        for hw in range(2):  # 8-byte loads: two phases of 16 lanes
                            banks = []
                            for lane in range(16 * hw, 16 * hw + 16):
                                _, addr = _load_v(wg, wq, lane >> 2, lane & 3, kk)
                                banks.append((addr[p, e] % 128) // 8)
                            assert len(set(banks)) == 16, (wg, wq, kk, p, e, hw)


def test_queries_land_where_the_qk_steps_read_them():
    # chunk k (dims 8 k..) of a row goes to box k >> 4 at byte 8 (k & 15): the unswizzled
    # position of dims 8 k.. in a 128-dim box (sw128 applies the same XOR the TMA tiles have)
    src = SRC.read_text()
    assert "(k >> 4) * QBOX + sw128(r, (k & 15) >> 1) + 8 * (k & 1)" in src
    for k in range(72):
        box, byte = k >> 4, 16 * ((k & 15) >> 1) + 8 * (k & 1)
        assert box * 128 + byte == 8 * k
    # step 2 j + w of warpgroup w reads box j >> 1, bytes 64 (j & 1) + 32 w: all 18 k32 steps
    steps = {((j >> 1) * 128 + 64 * (j & 1) + 32 * w) for j in range(9) for w in range(2)}
    assert steps == set(range(0, 576, 32))


def test_host_constants_match_the_source():
    hdr = HDR.read_text()
    assert int(re.search(r"stages = e4m3 \? (\d+)", hdr).group(1)) == mw._E4M3_STAGES
    assert int(re.search(r"nbox = e4m3 \? (\d+)", hdr).group(1)) * 64 * 128 == mw._E4M3_TILE
    assert re.search(r"__launch_bounds__\(NT \+ 32, 1\)\s+mla_wgmma_e4m3_m32\(", SRC.read_text())
    assert mw._SOURCES[32][1] == 288
    assert mw.wgmma_smem(32, e4m3_mma=True) <= 227 * 1024
    cfg = PAGED_VARIANTS["WE"]
    assert cfg.e4m3_mma and cfg.block_m == 32 and cfg.tag.endswith("E")
