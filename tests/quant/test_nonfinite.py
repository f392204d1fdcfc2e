"""Non-finite input to the quantizers: a clear error naming the position, never NaN spread to
finite values; NVFP4 global scales must be positive and finite."""

from __future__ import annotations

import math

import pytest
import torch

from mla_spec.quant.fp8 import (
    e4m3_rows_round_trip,
    fp8_scale_for,
    quantize_fp8,
    quantize_rows_e4m3,
    require_finite,
)
from mla_spec.quant.nvfp4 import (
    check_nvfp4_scales,
    dequantize_nvfp4,
    global_scale,
    quantize_nvfp4,
)

BAD = [float("inf"), float("-inf"), float("nan")]


def _random(shape, seed, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g) * scale


def _pick(shape, seed):
    g = torch.Generator().manual_seed(seed + 1000)
    return tuple(int(torch.randint(0, n, (1,), generator=g)) for n in shape)


# ---- NVFP4 ---------------------------------------------------------------------------------
@pytest.mark.parametrize("bad", BAD)
@pytest.mark.parametrize("shape,seed", [((1, 16), 0), ((3, 48), 1), ((2, 5, 32), 2)])
def test_nvfp4_rejects_non_finite_weight_naming_the_index(bad, shape, seed):
    w = _random(shape, seed, 0.02)
    pos = _pick(shape, seed)
    w[pos] = bad
    with pytest.raises(ValueError, match=rf"at index \[{', '.join(map(str, pos))}\].*finite"):
        quantize_nvfp4(w)
    with pytest.raises(ValueError, match="layers.3.mlp.up_proj"):
        quantize_nvfp4(w, name="layers.3.mlp.up_proj")


def test_nvfp4_rejects_fp64_values_that_overflow_fp32():
    w = _random((2, 16), 3).double()
    w[1, 9] = 1e300  # finite in fp64, inf once in fp32 (what the quantizer computes in)
    with pytest.raises(ValueError, match=r"index \[1, 9\]"):
        quantize_nvfp4(w)


@pytest.mark.parametrize("ws2", [0.0, -0.01, float("nan"), float("inf"), float("-inf")])
def test_nvfp4_rejects_bad_global_scale(ws2):
    w = _random((3, 32), 4, 0.02)
    with pytest.raises(ValueError, match="weight_scale_2.*positive and finite"):
        quantize_nvfp4(w, weight_scale_2=torch.tensor(ws2))
    experts = _random((2, 3, 32), 5, 0.02)
    with pytest.raises(ValueError, match=r"weight_scale_2.*index \[1\]"):
        quantize_nvfp4(experts, weight_scale_2=torch.tensor([0.01, ws2]))


@pytest.mark.parametrize("amax", [-1.0, float("nan"), float("inf")])
def test_nvfp4_rejects_bad_amax(amax):
    with pytest.raises(ValueError, match="amax"):
        quantize_nvfp4(_random((1, 16), 6), input_amax=amax)
    with pytest.raises(ValueError, match="amax"):
        global_scale(amax)


@pytest.mark.parametrize("shape,seed", [((1, 16), 7), ((5, 48), 8), ((3, 4, 64), 9)])
def test_nvfp4_finite_input_never_dequantizes_to_nan(shape, seed):
    w = _random(shape, seed, 0.02)
    w[_pick(shape, seed)] = 3e38  # finite, near the fp32 limit: saturates, no NaN
    q = quantize_nvfp4(w)
    ws2 = q.weight_scale_2
    if ws2.dim() == 0 and w.dim() > 2:  # dequantize_nvfp4 takes one scalar per 2-D tensor
        ws2 = ws2.expand(w.shape[0]).contiguous()
    assert torch.isfinite(dequantize_nvfp4(q.weight, q.weight_scale, ws2)).all()


def test_check_nvfp4_scales():
    ws = _random((3, 4), 10).abs().to(torch.float8_e4m3fn)
    check_nvfp4_scales(ws, torch.tensor(0.01), torch.tensor([0.5]), name="ok")  # no error
    zero_block = ws.clone()
    zero_block[1, 2] = 0.0
    check_nvfp4_scales(zero_block)  # a zero block scale only zeroes its block
    neg = ws.float()
    neg[2, 1] = -neg[2, 1] - 1
    with pytest.raises(ValueError, match=r"lin.weight_scale: .* at index \[2, 1\].*>= 0"):
        check_nvfp4_scales(neg.to(torch.float8_e4m3fn), name="lin")
    nan = ws.clone().view(torch.uint8)
    nan[0, 3] = 0x7F  # the e4m3fn NaN code
    with pytest.raises(ValueError, match=r"weight_scale: 1 of 12 .*nan at index \[0, 3\]"):
        check_nvfp4_scales(nan.view(torch.float8_e4m3fn))
    for bad in (0.0, -1.0, float("nan")):
        with pytest.raises(ValueError, match="input_scale"):
            check_nvfp4_scales(input_scale=torch.tensor([bad]))


# ---- FP8 e4m3 ------------------------------------------------------------------------------
@pytest.mark.parametrize("bad", BAD)
@pytest.mark.parametrize("shape,seed", [((1, 1), 0), ((3, 7), 1), ((2, 3, 576), 2)])
def test_rows_e4m3_rejects_non_finite_naming_the_index(bad, shape, seed):
    x = _random(shape, seed)
    pos = _pick(shape, seed)
    x[pos] = bad
    with pytest.raises(ValueError, match=rf"quantize_rows_e4m3.*index \[{', '.join(map(str, pos))}"
                                         rf"\].*finite"):
        quantize_rows_e4m3(x)
    with pytest.raises(ValueError, match="quantize_rows_e4m3"):
        e4m3_rows_round_trip(x.bfloat16())


@pytest.mark.parametrize("shape,seed", [((0, 5), 3), ((1, 1), 4), ((4, 0), 5), ((3, 577), 6)])
def test_rows_e4m3_finite_input_never_nan(shape, seed):
    x = _random(shape, seed)
    if x.numel():
        x[_pick(shape, seed)] = 3e38
    q8, scale = quantize_rows_e4m3(x)
    assert not q8.float().isnan().any() and torch.isfinite(scale).all()
    assert torch.isfinite(e4m3_rows_round_trip(x)).all()


@pytest.mark.parametrize("bad", BAD)
def test_fp8_scale_for_rejects_non_finite(bad):
    x = _random((4, 9), 7)
    x[2, 5] = bad
    with pytest.raises(ValueError, match=r"fp8_scale_for.*index \[2, 5\]"):
        fp8_scale_for(x)
    with pytest.raises(ValueError, match="margin"):
        fp8_scale_for(_random((3,), 8), margin=float("nan"))


def test_fp8_scale_for_finite_unchanged():
    x = _random((5, 11), 9)
    assert fp8_scale_for(x) == float(x.abs().max()) / 448.0
    assert fp8_scale_for(x, margin=2.0) == float(x.abs().max()) / 448.0 * 2.0
    assert fp8_scale_for(torch.empty(0)) == 1.0


def test_quantize_fp8_saturates_inf_and_keeps_nan_local():
    """The documented per-element policy of the hot-path quantizer: no check, no spreading."""
    x = _random((2, 9), 10)
    x[0, 3], x[1, 4], x[1, 5] = float("inf"), float("-inf"), float("nan")
    q = quantize_fp8(x, 0.5).float()
    assert q[0, 3] == 448 and q[1, 4] == -448 and math.isnan(q[1, 5])
    finite = torch.isfinite(x)
    assert not q[finite].isnan().any()


def test_require_finite_passes_integers_and_finite():
    require_finite(torch.arange(5), "ints")
    require_finite(_random((3, 3), 11).bfloat16(), "bf16")
    with pytest.raises(ValueError, match=r"t: 2 of 6 values are NaN or inf \(first inf at index "
                                         r"\[0, 1\]"):
        require_finite(torch.tensor([[1.0, float("inf"), 2.0], [float("nan"), 3.0, 4.0]]), "t")
