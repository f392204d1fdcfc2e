"""CPU models of ``csrc/mla_wgmma_rows_sm90.cu`` (``WR``): the index arithmetic that decides
where each value of P, O and the zeroed V tail goes, lane by lane, checked against the layouts
the ``wgmma`` operands and the output staging expect. The GPU twin tests
(``test_mla_sm90_mma.py``, ``test_mla_sm90_wgmma.py``) run the kernel itself; these fail
on the CPU as soon as one of the formulas below and its copy in the ``.cu`` file stop agreeing
(keep the two in step).
"""

from __future__ import annotations

import itertools
import re

from mla_spec.kernels.launch.cuda_driver import CSRC

SRC = (CSRC / "mla_wgmma_rows_sm90.cu").read_text()
BLK = 64 * 128  # one [64 tok, 64 dims] block of a stage, 128 B per row


def sw128(r: int, c: int) -> int:
    """Byte offset of 16-byte chunk c of row r in a 128-byte-swizzled block (sm90_wgmma.cuh)."""
    return r * 128 + ((c ^ (r & 7)) << 4)


def s_frag(wq: int, lane: int, i: int) -> tuple[int, int]:
    """(row, token) of value i of an m64n64 accumulator held by lane of warp wq."""
    g, t4 = lane >> 2, lane & 3
    j, h, c = i >> 2, (i >> 1) & 1, i & 1
    return 16 * wq + g + 8 * h, 8 * j + 2 * t4 + c


def test_p_registers_are_the_a_fragments_of_each_k16_step():
    """pa[i] = pack(s[2 i], s[2 i + 1]); pa[4 kb + q] must be register q of the m64k16 A
    fragment of step kb: rows g / g + 8, k 2 t4.. (q 0 / 1) and 8 + 2 t4.. (q 2 / 3)."""
    assert "pa[i] = pack_h2<F16>(s[2 * i], s[2 * i + 1]);" in SRC
    for wq, lane, kb, q in itertools.product(range(4), range(32), range(4), range(4)):
        g, t4 = lane >> 2, lane & 3
        i = 4 * kb + q
        got = [s_frag(wq, lane, 2 * i + e) for e in (0, 1)]
        row = 16 * wq + g + 8 * (q & 1)
        k = 16 * kb + 8 * (q >> 1) + 2 * t4
        assert got == [(row, k), (row, k + 1)]


def test_stmatrix_puts_p_where_the_k_major_a_operand_reads_it():
    """stmatrix x4 of pa[4 kb..4 kb + 3]: lane l gives the address of row l % 8 of block l / 8
    (row 16 wq + 8 ((l / 8) & 1) + l % 8, chunk 2 kb + (l / 8) / 2). Every P value must land at
    sw128(row, token / 8) + 2 (token % 8), the swizzled [64 rows][64 tokens] layout warpgroup 1's
    A descriptor reads."""
    assert re.search(r"stsm_x4\(p_base \+ sw128\(16 \* wq \+ 8 \* \(mi & 1\) \+ \(lane & 7\), "
                     r"2 \* kb \+ \(mi >> 1\)\)", SRC)
    placed = {}
    for wq, kb in itertools.product(range(4), range(4)):
        addr = {}
        for lane in range(32):
            mi = lane >> 3
            addr[(mi, lane & 7)] = sw128(16 * wq + 8 * (mi & 1) + (lane & 7), 2 * kb + (mi >> 1))
        for lane, m in itertools.product(range(32), range(4)):  # block m = register m
            r, col = lane >> 2, 2 * (lane & 3)
            for e in (0, 1):
                value = s_frag(wq, lane, 2 * (4 * kb + m) + e)
                placed[addr[(m, r)] + 2 * (col + e)] = value
    assert len(placed) == 64 * 64
    for off, (row, tok) in placed.items():
        assert off == sw128(row, tok >> 3) + 2 * (tok & 7)


def test_output_staging_and_rescale_rows():
    """O value i of block nb is row r0 + 8 ((i >> 1) & 1), dim 256 wg + 64 nb + 8 (i >> 2) +
    2 t4 + (i & 1): the staging index and the rescale factor's row must say the same."""
    assert "o[nb][i] *= (i >> 1) & 1 ? a1 : a0" in SRC  # rescale(a0, a1): rows r0, r0 + 8
    assert "rescale(alpha[0], alpha[1]);" in SRC and "rescale(a0, a1);" in SRC
    assert re.search(r"ost\[\(r0 \+ 8 \* \(\(i >> 1\) & 1\)\) \* OSTRIDE \+ 256 \* wg \+ "
                     r"64 \* nb \+ 8 \* \(i >> 2\) \+ 2 \* t4 \+\s+\(i & 1\)\] = o\[nb\]\[i\];",
                     SRC)
    seen = set()
    for wg, wq, lane, nb, i in itertools.product(range(2), range(4), range(32), range(4),
                                                 range(32)):
        g, t4 = lane >> 2, lane & 3
        row = 16 * wq + g + 8 * ((i >> 1) & 1)
        dim = 256 * wg + 64 * nb + 8 * (i >> 2) + 2 * t4 + (i & 1)
        seen.add((row, dim))
    assert seen == {(r, d) for r in range(64) for d in range(512)}


def test_zero_v_half_covers_exactly_its_dims_of_the_tail_rows():
    """Warpgroup wg zeroes V dims [256 wg, 256 wg + 256) of rows [nvalid, 64): c over
    [0, (64 - nvalid) 32) in steps of 128 from its thread index."""
    assert re.search(r"\(4 \* wg \+ \(\(c >> 3\) & 3\)\) \* BLK \+\s+"
                     r"\(nvalid \+ \(c >> 5\)\) \* 128 \+ \(c & 7\) \* 16\)", SRC)
    for wg, nvalid in itertools.product(range(2), (0, 1, 17, 63)):
        got = set()
        for wt in range(128):
            for c in range(wt, (64 - nvalid) * 32, 128):
                got.add((4 * wg + ((c >> 3) & 3)) * BLK + (nvalid + (c >> 5)) * 128 + (c & 7) * 16)
        want = {blk * BLK + row * 128 + ch * 16 for blk in range(4 * wg, 4 * wg + 4)
                for row in range(nvalid, 64) for ch in range(8)}
        assert got == want
