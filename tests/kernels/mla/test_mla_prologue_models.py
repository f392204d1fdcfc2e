"""CPU models of the wgmma kernels' start (``csrc/sm90_wgmma.cuh``): ``div_small`` and the
queries' way into shared memory (``QueryLoad``, ``store_queries_e4m3``).

Why: a CTA's start runs once, from a cold instruction cache, in front of its first KV tile, so it
is written without int divisions and with one query row a thread; these models check that the
shortcuts still compute what the long form did, for every row-block size the kernels use. The
GPU twins (``test_mla_sm90_wgmma.py``) check the results.
"""

from __future__ import annotations

import re

import numpy as np
import pytest

from mla_spec.kernels.launch.cuda_driver import CSRC

HDR = CSRC / "sm90_wgmma.cuh"
COMMON = CSRC / "sm90_common.cuh"
NT = 256


def _div_small(x: np.ndarray, d: int, rcp_rel_err: float) -> np.ndarray:
    """div_small with d's reciprocal off by ``rcp_rel_err`` (MUFU.RCP is within ~2^-22)."""
    f32 = np.float32
    rd = f32(f32(1.0) / f32(d)) * f32(1.0 + rcp_rel_err)
    q = np.trunc(x.astype(f32) * rd).astype(np.int64)
    q -= (q * d > x).astype(np.int64)
    q += ((q + 1) * d <= x).astype(np.int64)
    return q


@pytest.mark.parametrize("d", [1, 2, 3, 7, 16, 32, 33, 127, 128, 1000, 4095])
@pytest.mark.parametrize("err", [-2.0**-21, 0.0, 2.0**-21])
def test_div_small_is_exact_below_2_pow_21(d, err):
    rng = np.random.default_rng(d)
    x = np.concatenate([np.arange(0, 4 * d + 3), d * np.arange(1, 2000) - 1,
                        d * np.arange(1, 2000), rng.integers(0, 2**21, 5000)])
    x = x[x < 2**21]
    np.testing.assert_array_equal(_div_small(x, d, err), x // d)


def test_div_small_source_is_the_modelled_one():
    src = COMMON.read_text()
    assert "__float2int_rz(__int2float_rn(x) * __fdividef(1.f, __int2float_rn(d)))" in src
    assert "q -= q * d > x;" in src and "q += (q + 1) * d <= x;" in src
    hdr = HDR.read_text()
    body = hdr[hdr.index("struct QueryLoad"):hdr.index("// an accumulator zeroed")]
    assert " / p.H" not in body and " % p.H" not in body


def _tpr(bm: int) -> int:
    return min(NT // bm, 8)


@pytest.mark.parametrize("bm", [32, 64])
def test_query_chunks_are_each_loaded_and_stored_once(bm):
    src = HDR.read_text()
    assert re.search(r"TPR = NT / BM < 8 \? NT / BM : 8, QIT = 72 / TPR", src)
    tpr = _tpr(bm)
    qit = 72 // tpr
    seen = {}
    for tid in range(NT):
        if tid >= bm * tpr:
            continue
        r = tid // tpr
        for j in range(qit):
            k = tid % tpr + tpr * j
            pe = j >= 64 // tpr
            assert pe == (k >= 64)  # the compile-time choice of q_pe is the chunk's
            assert (r, k) not in seen
            # where store() puts it: box k >> 3, row r, 16-byte chunk k & 7 (swizzled)
            seen[(r, k)] = ((k >> 3) * bm * 128 + r * 128 + (((k & 7) ^ (r & 7)) << 4))
    assert set(seen) == {(r, k) for r in range(bm) for k in range(72)}
    assert len(set(seen.values())) == bm * 72


def test_query_stores_of_a_warp_are_free_of_bank_conflicts():
    # a warp stores 4 rows x 8 chunks (BM 32) per j: 512 bytes, 4 wavefronts, each bank 4 times
    for j in range(9):
        banks = []
        for lane in range(32):
            r, k = lane // 8, lane % 8 + 8 * j
            addr = (k >> 3) * 32 * 128 + r * 128 + (((k & 7) ^ (r & 7)) << 4)
            banks += [(addr // 4 + w) % 32 for w in range(4)]
        assert np.bincount(banks, minlength=32).tolist() == [4] * 32


def test_a_rows_e4m3_amax_lanes_are_adjacent():
    # store_queries_e4m3 reduces a row's amax over shuffles xor 1, 2, 4: row tid / 8's lanes
    src = (CSRC / "sm90_e4m3.cuh").read_text()
    assert "for (int o = 1; o < QL::TPR; o *= 2)" in src
    tpr = _tpr(32)
    for tid in range(0, 32 * tpr, tpr):
        group = {tid ^ o for o in range(tpr)}
        assert {t // tpr for t in group} == {tid // tpr} and len(group) == tpr
