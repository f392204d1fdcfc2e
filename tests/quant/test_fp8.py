"""e4m3 quantization: saturation, NaN, RTNE, the grid, and the round-trip bound."""

from __future__ import annotations

import pytest
import torch

from mla_spec.quant.fp8 import (
    FP8_DTYPE,
    FP8_E4M3_MAX,
    dequantize_fp8,
    fp8_e4m3_values,
    fp8_max_rel_error,
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
    assert fp8_max_rel_error(x, s) <= 2.0**-4
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
