"""e4m3 quantization: saturation, NaN, RTNE, the grid, and the round-trip bound."""

from __future__ import annotations

import pytest
import torch

from mla_spec.quant.fp8 import (
    FP8_DTYPE,
    FP8_E4M3_MAX,
    dequantize_fp8,
    fp8_e4m3_values,
    fp8_scale_for,
    quantize_fp8,
)


def test_saturates_large_finite_and_inf_never_nan():
    x = torch.tensor([500.0, -1000.0, 1e30, float("inf"), float("-inf"), 448.0, 464.0])
    q = quantize_fp8(x).float()
    assert torch.equal(q, torch.tensor([448.0, -448.0, 448.0, 448.0, -448.0, 448.0, 448.0]))
    assert torch.isnan(quantize_fp8(torch.tensor([float("nan")])).float()).all()


def test_rtne_ties_and_carry():
    # 17 lies halfway between 16 and 18 (step 2 in [16, 32)): ties to even mantissa -> 16;
    # 19 -> 20 (tie, even); 126.24 carries into the next binade -> 128.
    x = torch.tensor([17.0, 19.0, 126.24, 0.0])
    assert quantize_fp8(x).float().tolist() == [16.0, 20.0, 128.0, 0.0]


def test_scale_divides_on_write_and_multiplies_on_read():
    x = torch.randn(1000) * 30
    s = 0.37
    back = dequantize_fp8(quantize_fp8(x, s), s)
    normal = (x.abs() / s >= 2**-6)
    assert ((back - x).abs()[normal] <= x.abs()[normal] * 2.0**-4 + 1e-7).all()
    # subnormals: absolute error <= half the smallest subnormal step times the scale
    sub = ~normal
    assert ((back - x).abs()[sub] <= 2.0**-10 * s + 1e-9).all()


def test_grid_and_scale_helpers():
    grid = fp8_e4m3_values()
    assert grid.numel() == 127 and grid.max() == FP8_E4M3_MAX and grid[0] == 0
    assert fp8_e4m3_values(include_negative=True).numel() == 253
    x = torch.randn(64) * 900
    s = fp8_scale_for(x)
    assert quantize_fp8(x, s).float().abs().max() == FP8_E4M3_MAX
    assert fp8_scale_for(torch.zeros(3)) == 1.0


def test_bad_inputs():
    with pytest.raises(ValueError, match="scale"):
        quantize_fp8(torch.ones(2), 0.0)
    with pytest.raises(ValueError, match="expects"):
        dequantize_fp8(torch.ones(2))
    assert quantize_fp8(torch.ones(2, dtype=torch.bfloat16)).dtype == FP8_DTYPE


def test_scale_shape_mismatch_is_value_error():
    # regression: a tensor scale that does not broadcast to x raised a bare RuntimeError, and
    # one that broadcast *up* (e.g. [4, 1] for x [1, 3]) silently changed the output shape
    from mla_spec.quant.fp8 import dequantize_fp8, quantize_fp8

    x = torch.randn(3, 4)
    with pytest.raises(ValueError, match="does not broadcast"):
        quantize_fp8(x, torch.ones(5))
    with pytest.raises(ValueError, match="does not broadcast"):
        quantize_fp8(x[:1, :3], torch.ones(4, 1))
    x8 = quantize_fp8(x, torch.full((3, 1), 0.5))  # per-row scale is fine
    with pytest.raises(ValueError, match="does not broadcast"):
        dequantize_fp8(x8, torch.ones(2, 1))
    torch.testing.assert_close(dequantize_fp8(x8, torch.full((3, 1), 0.5)), x, rtol=2**-4,
                               atol=1e-3)


def test_rows_e4m3_scale_per_row_and_round_trip_bound():
    from mla_spec.quant.fp8 import e4m3_rows_round_trip, quantize_rows_e4m3

    g = torch.Generator().manual_seed(3)
    x = torch.randn(5, 3, 77, generator=g) * torch.tensor([1e-3, 1.0, 300.0])[None, :, None]
    x[0, 0] = 0.0  # an all-zero row: scale 0, codes 0
    x[1, 2, 5] = -2e4  # one outlier sets its row's scale
    q8, scale = quantize_rows_e4m3(x)
    assert q8.dtype == FP8_DTYPE and q8.shape == x.shape and scale.shape == x.shape[:2]
    amax = x.abs().amax(-1)
    assert torch.allclose(scale, amax / FP8_E4M3_MAX)
    assert scale[0, 0] == 0 and (q8[0, 0].float() == 0).all()
    assert q8[1, 2, 5].float() == -FP8_E4M3_MAX  # the row's largest magnitude maps to 448
    back = e4m3_rows_round_trip(x)
    bound = 2.0**-4 * x.abs() + 2.0**-10 * scale[..., None]
    assert ((back - x).abs() <= bound * (1 + 1e-6)).all()
    # a per-row scale keeps the small rows' precision where one per tensor would flush them
    per_tensor = dequantize_fp8(quantize_fp8(x, fp8_scale_for(x)), fp8_scale_for(x))
    small = (slice(2, 5), 0)
    assert (back[small] - x[small]).abs().max() < (per_tensor[small] - x[small]).abs().max()


@pytest.mark.parametrize("m,n,d,seed", [(1, 1, 16, 0), (3, 37, 48, 1), (8, 200, 96, 2)])
def test_query_e4m3_error_stays_within_its_bound(m, n, d, seed):
    from mla_spec.quant.fp8 import e4m3_rows_round_trip, fp8_query_attention_error_bound

    g = torch.Generator().manual_seed(seed)
    q = torch.randn(m, d, generator=g, dtype=torch.float64) * 2
    kv = torch.randn(n, d, generator=g, dtype=torch.float64)
    dv, sm = d - d // 8, d**-0.5

    def attend(qq):
        p = torch.softmax(qq @ kv.T * sm, -1)
        return p @ kv[:, :dv]

    err = float((attend(e4m3_rows_round_trip(q).double()) - attend(q)).abs().max())
    bound = fp8_query_attention_error_bound(q, kv, dv, sm)
    assert err <= bound  # a worst case: the rounding errors add up with one sign
    assert fp8_query_attention_error_bound(q[:0], kv, dv, sm) == 0.0


@pytest.mark.parametrize("m,n,logit,seed", [(1, 1, 1.0, 0), (3, 37, 4.0, 1), (8, 700, 12.0, 2),
                                             (2, 5000, 30.0, 3)])
def test_probability_e4m3_error_stays_within_its_bound(m, n, logit, seed):
    # WE8's P V: the weights (relative to the row max) rounded to e4m3 after a scale of 256,
    # the sum they are divided by taken before rounding, as the kernel does
    from mla_spec.quant.fp8 import fp8_probability_attention_error_bound, round_probabilities_e4m3

    g = torch.Generator().manual_seed(seed)
    s = torch.randn(m, n, generator=g, dtype=torch.float64) * logit
    s[0, : n // 2] -= 40.0  # weights far below 2^-14 (the subnormal floor) in row 0
    v = torch.randn(n, 48, generator=g, dtype=torch.float64) * 3
    p = torch.exp2(s - s.amax(-1, keepdim=True))
    ref = p @ v / p.sum(-1, keepdim=True)
    got = round_probabilities_e4m3(p).double() @ v / p.sum(-1, keepdim=True)
    err = float((got - ref).abs().max())
    assert err <= fp8_probability_attention_error_bound(n, float(v.abs().max()))
    if n >= 700:  # unbiased rounding: the norm error is a fraction of the worst case
        assert float((got - ref).norm() / ref.norm()) < 2.0**-4 / 3**0.5
    assert fp8_probability_attention_error_bound(0, 5.0) == 2.0**-4 * 5.0


def test_probability_rounding_is_the_kernels():
    from mla_spec.kernels.launch.cuda_driver import CSRC
    from mla_spec.quant.fp8 import P8_SCALE, round_probabilities_e4m3

    src = (CSRC / "sm90_e4m3.cuh").read_text()
    assert f"constexpr float P8_SCALE = {int(P8_SCALE)}.f;" in src
    assert "__NV_SATFINITE" in src  # cvt.rn.satfinite: RTNE, as torch's cast
    p = torch.tensor([1.0, 0.5, 2.0**-14, 2.0**-20, 0.0, 0.3])
    q = round_probabilities_e4m3(p)
    assert q[0] == 1.0 and q[1] == 0.5 and q[2] == 2.0**-14 and q[4] == 0.0
    assert q[3] == 0.0  # 2^-12 after the scale: under half of e4m3's smallest subnormal 2^-9
    assert abs(float(q[5]) - 0.3) <= 2.0**-4 * 0.3


def test_query_e4m3_costs_about_what_the_cache_rounding_costs():
    # DeepSeek's dims and softmax scale: rounding the queries to e4m3 per row moves an output
    # about as much as rounding the cache to e4m3 does (which an FP8 cache already pays)
    from mla_spec.quant.fp8 import e4m3_rows_round_trip

    g = torch.Generator().manual_seed(0)
    q = torch.randn(16, 576, generator=g, dtype=torch.float64)
    kv = torch.randn(512, 576, generator=g, dtype=torch.float64)
    kv8 = dequantize_fp8(quantize_fp8(kv)).double()

    def attend(qq, kk):
        return torch.softmax(qq @ kk.T * 192**-0.5, -1) @ kk[:, :512]

    ref = attend(q, kv)
    q8 = e4m3_rows_round_trip(q).double()
    err_q, err_kv, err_both = (float((attend(a, b) - ref).norm() / ref.norm())
                               for a, b in ((q8, kv), (q, kv8), (q8, kv8)))
    # independent errors add in quadrature: both together ~ sqrt(2) x either alone
    assert err_q < 1.5 * err_kv and err_both < 2.0 * err_kv, (err_q, err_kv, err_both)
