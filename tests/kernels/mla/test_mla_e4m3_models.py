"""CPU models of the index arithmetic of ``csrc/mla_wgmma_e4m3pp_sm90.cu`` (variants ``WE2`` and
``WE8``), whose shared parts live in ``csrc/sm90_e4m3.cuh``.

The kernel feeds ``wgmma`` its V^T operand from registers that each thread builds from the
e4m3 tile's bytes: a 16-byte load per token, one ``prmt`` per token pair and two dims,
``cvt.f16x2.e4m3x2`` (``WE2``), or ldmatrix .trans and one ``prmt`` a register (``WE8``).
These tests replay that arithmetic lane by lane, with symbolic bytes ``(token, dim)``, and
check it against what ``wgmma`` expects of an m64k16 A fragment, that the output staging puts
every accumulator at the dim its fragment row stands for, and that the loads of a phase (8
lanes of 16 bytes) hit distinct banks in the 128-byte-swizzled stage. The GPU twin tests are in
``test_mla_sm90_wgmma.py``.
"""

from __future__ import annotations

import itertools
import re

import pytest

from mla_spec.kernels.launch.cuda_driver import CSRC
from mla_spec.kernels.mla import PAGED_VARIANTS
from mla_spec.kernels.mla import sm90_wgmma as mw

SRC_PP, SHARED, HDR = (CSRC / n for n in ("mla_wgmma_e4m3pp_sm90.cu", "sm90_e4m3.cuh",
                                          "sm90_wgmma.cuh"))
# per kernel: (words a thread loads per token, its first dim, box, 16-byte chunk, byte in it,
# accumulator rows -> dim)
KERNELS = {
    "WE2": dict(nw=4, box=lambda wg, wq, g: wq, chunk=lambda wg, wq, g: g, byte=lambda g: 0,
                dim=lambda wg, wq, g, mt, h: 128 * wq + 16 * g + 2 * mt + h, tiles=8),
}


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


def _load_v(k, wg, wq, g, t4, kk):
    """The kernels' load_v: v[p][e] = 4 nw symbolic bytes (token, dim), and the byte address."""
    kd = KERNELS[k]
    box, chunk0, byte = kd["box"](wg, wq, g), kd["chunk"](wg, wq, g), kd["byte"](g)
    v, addr = {}, {}
    for p in range(2):
        for e in range(2):
            tok = 16 * kk + 8 * p + 2 * t4 + e
            a = box * 8192 + tok * 128 + ((chunk0 ^ (tok & 7)) << 4) + byte
            # what the 128-byte swizzle put there: dims of the box, chunk un-XORed
            col = ((((a % 128) >> 4) ^ (tok & 7)) << 4) + (a % 16)
            v[p, e] = [(tok, box * 128 + col + i) for i in range(4 * kd["nw"])]
            addr[p, e] = a
    return v, addr


def _v_frags(k, v):
    """The kernels' v_frags: a[mt][reg] = (low half, high half) symbolic fp16 values."""
    nw = KERNELS[k]["nw"]
    a = [[None] * 4 for _ in range(2 * nw)]
    for p in range(2):
        for wd in range(nw):
            x0, x1 = v[p, 0][4 * wd:4 * wd + 4], v[p, 1][4 * wd:4 * wd + 4]
            for sel, mt in ((0x5140, 2 * wd), (0x7362, 2 * wd + 1)):
                b = _prmt(x0, x1, sel)
                a[mt][2 * p] = (b[0], b[1])      # cvt: bytes 0, 1 -> the low fp16 pair
                a[mt][2 * p + 1] = (b[2], b[3])  # bytes 2, 3 -> the high one
    return a


def _groups(k):
    """The threads that share the output dims: each warpgroup has all of them."""
    return [0]


def _threads(groups=(0,)):
    """(wg, wq, g, t4) of every consumer thread of the warpgroups ``groups``."""
    return itertools.product(groups, range(4), range(8), range(4))


@pytest.mark.parametrize("k", list(KERNELS))
def test_v_fragments_are_the_a_operand_wgmma_expects(k):
    # m64k16 A fragment: register r of lane (g, t4) in warp wq holds row 16 wq + g + 8 (r & 1),
    # columns k = 2 t4 + 8 (r >> 1) (+1 in the high half). Row R of m64 tile mt must be the dim
    # that the staging gives the accumulators of row R, and column k the tile's token 16 kk + k
    # (P^T is written in natural token order).
    kd = KERNELS[k]
    seen = set()
    for wg, wq, g, t4 in _threads(_groups(k)):
        for kk in range(4):
            a = _v_frags(k, _load_v(k, wg, wq, g, t4, kk)[0])
            for mt in range(kd["tiles"]):
                for r in range(4):
                    h, col = r & 1, 2 * t4 + 8 * (r >> 1)
                    dim = kd["dim"](wg, wq, g, mt, h)
                    assert a[mt][r] == ((16 * kk + col, dim), (16 * kk + col + 1, dim))
                    seen.update(a[mt][r])
    assert seen == {(t, d) for t in range(64) for d in range(512)}


@pytest.mark.parametrize("k", list(KERNELS))
def test_output_staging_is_a_bijection_onto_rows_and_dims(k):
    kd = KERNELS[k]
    cells = set()
    for wg, wq, g, t4 in _threads(_groups(k)):
        for mt in range(kd["tiles"]):
            for i in range(16):
                col = 8 * (i >> 2) + 2 * t4 + (i & 1)
                cells.add((col, kd["dim"](wg, wq, g, mt, (i >> 1) & 1)))
    assert cells == {(c, d) for c in range(32) for d in range(512)}
    src = SRC_PP.read_text()
    # WE2 writes each thread's rows straight from its accumulators: o_quad(o, c, q) is dims
    # 4q .. 4q + 3 of the 16 at d0 = 128 wq + 16 g of S^T column c's row (store_row16)
    for _, wq, g, t4 in _threads():
        for c in range(8):
            i0 = 4 * (c >> 1) + (c & 1)
            row = 8 * (c >> 1) + 2 * t4 + (c & 1)  # frag_col(c, t4)
            for q in range(4):
                d0 = 128 * wq + 16 * g + 4 * q
                quad = [(2 * q, i0), (2 * q, i0 + 2), (2 * q + 1, i0), (2 * q + 1, i0 + 2)]
                for j, (mt, i) in enumerate(quad):
                    assert 8 * (i >> 2) + 2 * t4 + (i & 1) == row
                    assert kd["dim"](0, wq, g, mt, (i >> 1) & 1) == d0 + j
    assert ("make_float4(o[2 * q][i0] * k, o[2 * q][i0 + 2] * k, o[2 * q + 1][i0] * k," in src
            and "const int i0 = 4 * (c >> 1) + (c & 1);" in src
            and "store_row16(p, w, split, b, frag_col(c, t4), 128 * wq + 16 * g, v);" in src)


@pytest.mark.parametrize("k", list(KERNELS))
def test_v_loads_of_a_phase_are_free_of_bank_conflicts(k):
    lanes = 16 if KERNELS[k]["nw"] == 2 else 8  # lanes served per shared-memory wavefront
    for wg in _groups(k):
        for wq in range(4):
            for kk in range(4):
                for p in range(2):
                    for e in range(2):
                        for ph in range(32 // lanes):
                            banks = []  # each lane covers nw consecutive 4-byte banks
                            for lane in range(lanes * ph, lanes * (ph + 1)):
                                _, addr = _load_v(k, wg, wq, lane >> 2, lane & 3, kk)
                                first = (addr[p, e] % 128) // 4
                                banks += range(first, first + KERNELS[k]["nw"])
                            assert len(set(banks)) == len(banks) == 32, (k, wg, wq, kk, p, e)


def test_queries_land_where_the_qk_steps_read_them():
    # chunk k (dims 8 k..) of a row goes to box k >> 4 at byte 8 (k & 15): the unswizzled
    # position of dims 8 k.. in a 128-dim box (sw128 applies the same XOR the TMA tiles have)
    src = SHARED.read_text()
    assert "(k >> 4) * QBOX + sw128(r, (k & 15) >> 1) + 8 * (k & 1)" in src
    for k in range(72):
        box, byte = k >> 4, 16 * ((k & 15) >> 1) + 8 * (k & 1)
        assert box * 128 + byte == 8 * k
    # qk_e4m3: step st = STRIDE j reads box st >> 2, bytes 32 (st & 3) past the descriptors;
    # WE2 takes all 18 with STRIDE 1
    dims = {(st >> 2) * 128 + 32 * (st & 3) for st in range(18)}
    assert dims == set(range(0, 576, 32))
    assert "qk_e4m3<18, 1>(s, sw128_desc(kv_base, 16, 1024), q_desc)" in SRC_PP.read_text()


def test_host_constants_match_the_source():
    hdr = HDR.read_text()
    assert int(re.search(r"stages = e4m3 \? (\d+)", hdr).group(1)) == mw._E4M3_STAGES
    assert int(re.search(r"nbox = e4m3 \? (\d+)", hdr).group(1)) * 64 * 128 == mw._E4M3_TILE
    assert "WGMMA_ENTRY(mla_wgmma_e4m3pp_m32, NT + 128, mla_wgmma_e4m3pp<false, false>)" in \
        SRC_PP.read_text()
    kind = mw.WgmmaKind.of(PAGED_VARIANTS["WE2"])
    assert kind.threads == 384 and mw.wgmma_smem(kind) <= 227 * 1024
    cfg = PAGED_VARIANTS["WE2"]
    assert cfg.e4m3_mma and not cfg.e4m3_pv and cfg.block_m == 32 and cfg.tag.endswith("E")


# ---- WE8: WE2 with P V as e4m3 MMAs (the same source, ``PV8``) ----

def _ldsm_x4_t(addrs, smem):
    """``ldmatrix .x4 .trans .b16``: lane l gives addrs[l] (row l % 8 of block l / 8, 16 bytes);
    lane (g, t4) gets, per block j, 16-bit pair g of rows 2 t4 (bytes 0, 1) and 2 t4 + 1."""
    out = []
    for lane in range(32):
        g, t4 = lane >> 2, lane & 3
        regs = []
        for j in range(4):
            rows = [smem[addrs[8 * j + 2 * t4 + e] + 2 * g + b] for e in range(2) for b in range(2)]
            regs.append(rows)
        out.append(regs)
    return out


def _we8_tile_bytes(wq):
    """Symbolic tile bytes of box wq: address -> (token, dim), 128-byte swizzle as TMA lands it."""
    smem = {}
    for tok in range(64):
        for ch in range(8):
            for b in range(16):
                smem[wq * 8192 + tok * 128 + ((ch ^ (tok & 7)) << 4) + b] = \
                    (tok, wq * 128 + 16 * ch + b)
    return smem


def _we8_pos_token(k):
    """The token of column k (0..31) of a k32 step in WE8's order (v8_frag's header)."""
    h, a, b = k >> 4, (k >> 2) & 3, k & 3
    return 16 * h + 2 * a + (b >> 1) + 8 * (b & 1)


def test_we8_v_fragments_are_the_a_operand_wgmma_expects():
    # m64k32 8-bit A fragment (CUTLASS's ALayout_64x32): register r of lane (g, t4) in warp wq
    # holds row 16 wq + g + 8 (r & 1), columns k = 4 t4 + 16 (r >> 1) + byte. Row R of m64 tile
    # mt must be dim 128 wq + 16 mt + 2 g (+1 for g + 8), column k of step ks the token
    # 32 ks + _we8_pos_token(k), the byte store_p8 puts that token's P at.
    sels = {0: (0, 1, 0x6240), 1: (0, 1, 0x7351), 2: (2, 3, 0x6240), 3: (2, 3, 0x7351)}
    seen = set()
    for wq in range(4):
        smem = _we8_tile_bytes(wq)
        for ks in range(2):
            for mt in range(8):
                addrs = []
                for lane in range(32):  # the kernel's vrow + ks * 4096 + ((mt ^ (lane & 7)) << 4)
                    addrs.append(wq * 8192 + (lane >> 3) * 1024 + (lane & 7) * 128 + ks * 4096
                                 + ((mt ^ (lane & 7)) << 4))
                d = _ldsm_x4_t(addrs, smem)
                for lane in range(32):
                    g, t4 = lane >> 2, lane & 3
                    for r, (x, y, sel) in sels.items():
                        a = _prmt(d[lane][x], d[lane][y], sel)
                        for byte in range(4):
                            k = 4 * t4 + 16 * (r >> 1) + byte
                            dim = 128 * wq + 16 * mt + 2 * g + (r & 1)
                            assert a[byte] == (32 * ks + _we8_pos_token(k), dim)
                            seen.add(a[byte])
    assert seen == {(t, d) for t in range(64) for d in range(512)}
    src = SHARED.read_text()
    for x, y, sel in sels.values():
        assert f"prmt(d[{x}], d[{y}], 0x{sel:x})" in src


def test_we8_p_lands_in_the_token_order_of_the_v_fragments():
    # store_p8: S^T column c's tokens 16 wq + g (+8) go to bytes 16 wq + 2 g (+1) of the row;
    # column k of step ks (P^T descriptor + 2 ks: bytes 32 ks..) must hold token
    # 32 ks + _we8_pos_token(k)
    where = {}
    for wq in range(4):
        for g in range(8):
            for hf in range(2):
                where[16 * wq + g + 8 * hf] = 16 * wq + 2 * g + hf
    assert sorted(where.values()) == list(range(64))
    for ks in range(2):
        for k in range(32):
            assert where[32 * ks + _we8_pos_token(k)] == 32 * ks + k
    src = SHARED.read_text()
    assert "p_base + sw128(frag_col(c, t4), wq) + 2 * g" in src
    assert "s[frag_at(c, 0)] * P8_SCALE, s[frag_at(c, 1)] * P8_SCALE" in src
    # a warp's 32 two-byte stores of one column index: rows 2 t4 + e (chunk wq swizzled by the
    # row) x bytes 2 g: 4 distinct chunks' banks, never two words of one bank
    for wq in range(4):
        for c in range(8):
            words = {}
            for g in range(8):
                for t4 in range(4):
                    row = 8 * (c >> 1) + 2 * t4 + (c & 1)
                    addr = row * 128 + ((wq ^ (row & 7)) << 4) + 2 * g
                    words.setdefault((addr // 4) % 32, set()).add(addr // 4)
            assert all(len(w) == 1 for w in words.values())


def test_we8_v_loads_are_free_of_bank_conflicts():
    # one ldmatrix block (8 lanes' 16-byte rows) a wavefront: 8 distinct 16-byte bank groups
    for wq in range(4):
        for ks in range(2):
            for mt in range(8):
                for j in range(4):
                    groups = {((wq * 8192 + j * 1024 + r * 128 + ks * 4096 + ((mt ^ r) << 4))
                               % 128) // 16 for r in range(8)}
                    assert len(groups) == 8


def test_we8_output_dims_and_stores():
    # o[mt] row g (+8) is dim 128 wq + 16 mt + 2 g (+1); o_quad(o, c, q) gives (mt 2q, h 0),
    # (2q, 1), (2q + 1, 0), (2q + 1, 1), so v[2 k + h] is dim d0 + 16 k + h with d0 = 128 wq + 2 g
    # (store_row16<16>); every (row, dim) once per warpgroup
    cells = set()
    for wq, g, t4 in itertools.product(range(4), range(8), range(4)):
        for c in range(8):
            row = 8 * (c >> 1) + 2 * t4 + (c & 1)
            for q in range(4):
                for j in range(4):
                    mt, h = 2 * q + (j >> 1), j & 1
                    k = 4 * q + j  # index into v
                    assert 16 * mt + h == 16 * (k >> 1) + (k & 1)
                    cells.add((row, 128 * wq + 16 * mt + 2 * g + h))
    assert cells == {(r, d) for r in range(32) for d in range(512)}
    src = SRC_PP.read_text()
    assert "store_row16<16>(p, w, split, b, frag_col(c, t4), 128 * wq + 2 * g, v);" in src
    hdr = HDR.read_text()  # pair k (v[2 k], v[2 k + 1]) at d0 + PAIRS k: bf16 and fp32 stores
    assert "for (int k = 0; k < 8; ++k) h[k] = pack_bf16(v[2 * k], v[2 * k + 1]);" in hdr
    assert "*reinterpret_cast<uint32_t*>(dst + PAIRS * k) = h[k];" in hdr
    assert ("*reinterpret_cast<float2*>(dst + PAIRS * 2 * q) = make_float2(v[4 * q], "
            "v[4 * q + 1]);") in hdr


def test_we8_zeroes_exactly_the_v_tail():
    # zero_v_tail8(stage, nvalid, wt) over 128 threads: rows [nvalid, 64) of boxes 0-3, all 128
    # bytes; nothing of box 4 (the rope dims, Q K only) nor of a valid row
    for nvalid in (1, 17, 63):
        hit = []
        for wt in range(128):
            for c in range(wt, (64 - nvalid) * 32, 128):
                base = ((c >> 3) & 3) * 8192 + (nvalid + (c >> 5)) * 128 + (c & 7) * 16
                hit += range(base, base + 16)
        want = [box * 8192 + tok * 128 + b for box in range(4) for tok in range(nvalid, 64)
                for b in range(128)]
        assert sorted(hit) == sorted(want)


def test_we8_is_built_and_named():
    cfg = PAGED_VARIANTS["WE8"]
    assert cfg.e4m3_mma and cfg.e4m3_pv and cfg.tag.endswith("E8")
    assert "WGMMA_ENTRY(mla_wgmma_e4m3pp8_m32, NT + 128, mla_wgmma_e4m3pp<true, false>)" in \
        SRC_PP.read_text()
    assert mw._KERNELS[(mw.WgmmaKind.of(cfg), True)].name == "mla_wgmma_e4m3pp8_m32"
    with pytest.raises(ValueError, match="e4m3_pv is an option of the e4m3_mma"):
        type(cfg)(32, 64, 8, 2, cuda=True, wgmma=True, e4m3_pv=True)
