"""NVFP4 format: E2M1 rounding (ModelOpt's tie rule), byte-exact packing, scales, error bounds,
MXFP4 / int4-group comparisons."""

from __future__ import annotations

import pytest
import torch

from mla_spec.quant.mxfp4 import int4_group_error_report, mxfp4_error_report, quantize_mxfp4
from mla_spec.quant.nvfp4 import (
    E2M1_VALUES,
    NVFP4Tensor,
    cast_to_e2m1,
    dequantize_nvfp4,
    global_scale,
    input_scale_from_amax,
    nvfp4_error_report,
    pack_fp4,
    quantize_nvfp4,
    unpack_fp4,
)


def test_e2m1_table_and_ties():
    assert E2M1_VALUES[:8].tolist() == [0, 0.5, 1, 1.5, 2, 3, 4, 6]
    assert (E2M1_VALUES[8:] == -E2M1_VALUES[:8]).all()
    x = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 7.0, 100.0,
                      0.26, 0.74, 2.49, 2.51, 4.99, 5.01])
    # ties: 0.25->0, 0.75->1, 1.25->1, 1.75->2, 2.5->3, 3.5->3, 5->4; >6 saturates to 6
    assert cast_to_e2m1(x).tolist() == [0, 2, 2, 4, 5, 5, 6, 7, 7, 1, 1, 4, 5, 6, 7]
    neg = cast_to_e2m1(torch.tensor([-0.1, -0.0, 0.0, -6.0, -2.5, -0.75]))
    assert neg.tolist() == [8, 0, 0, 15, 13, 10]  # -0.1 -> -0 (code 8), an exact -0.0 -> 0


def test_pack_byte_exact_hand_cases():
    codes = torch.tensor([[1, 2, 8, 0, 0, 8, 15, 7]], dtype=torch.uint8)
    packed = pack_fp4(codes)
    assert packed.tolist() == [[0x21, 0x08, 0x80, 0x7F]]  # even element in the low nibble
    assert torch.equal(unpack_fp4(packed), codes)
    all_bytes = torch.arange(256, dtype=torch.uint8).reshape(2, 128)
    assert torch.equal(pack_fp4(unpack_fp4(all_bytes)), all_bytes)
    vals = E2M1_VALUES[unpack_fp4(torch.tensor([0x80], dtype=torch.uint8)).long()]
    assert vals.tolist() == [0.0, 0.0] and torch.signbit(vals[1])  # -0 decodes to -0.0


def test_quantize_hand_computed_block():
    # amax 6 -> weight_scale_2 = 6/2688, block scale = 448 exactly: scaled values = w.
    w = torch.tensor([[6.0, -3.0, 0.5, 0.75, -0.1, 2.5, 1.25, -6.0,
                       0.0, 4.0, -1.5, 3.5, 5.0, 0.25, -0.0, 1.75]])
    q = quantize_nvfp4(w)
    assert q.weight_scale_2.item() == pytest.approx(6.0 / 2688.0)
    assert q.weight_scale.float().tolist() == [[448.0]]
    codes = [7, 13, 1, 2, 8, 5, 2, 15, 0, 6, 11, 5, 6, 0, 0, 4]
    expect = [codes[i] | (codes[i + 1] << 4) for i in range(0, 16, 2)]
    assert q.weight.tolist() == [expect]
    dq = q.dequantize()
    assert torch.allclose(dq, E2M1_VALUES[torch.tensor(codes)][None] * (448 * 6 / 2688))


def _heavy(n, k):
    w = torch.randn(n, k) * 0.02
    idx = torch.randint(0, w.numel(), (w.numel() // 200,))
    w.view(-1)[idx] *= 30.0  # outliers, as in real LLM weights
    return w


@pytest.mark.parametrize("kind", ["gauss", "heavy", "student"])
def test_roundtrip_error_bounds(kind):
    n, k = 48, 272
    w = {"gauss": lambda: torch.randn(n, k), "heavy": lambda: _heavy(n, k),
         "student": lambda: torch.distributions.StudentT(2.0).sample((n, k))}[kind]()
    q = quantize_nvfp4(w.to(torch.bfloat16))
    dq = q.dequantize()
    w32 = w.to(torch.bfloat16).float()
    eff = (q.weight_scale.float() * q.weight_scale_2).repeat_interleave(16, dim=1)
    # nearest E2M1 level: error <= half the widest gap (1 unit at 4..6) + what was clipped
    bound = eff * 1.0 + (w32.abs() - 6 * eff).clamp(min=0) + 1e-6
    assert ((w32 - dq).abs() <= bound).all()
    rep = nvfp4_error_report(w32, q)
    assert rep.rel_error < {"gauss": 0.11, "heavy": 0.13, "student": 0.13}[kind]
    assert 0.0 <= rep.clipped_block_share <= 1.0 and rep.bits_per_weight == 4.5


def test_nvfp4_beats_mxfp4_and_int4_on_heavy_tails():
    w = _heavy(64, 512)
    nv, mx, i4 = nvfp4_error_report(w), mxfp4_error_report(w), int4_group_error_report(w)
    assert nv.rel_error < mx.rel_error and nv.rel_error < i4.rel_error
    q = quantize_mxfp4(w)
    assert q.scale_e8m0.dtype == torch.uint8 and q.codes.shape == w.shape


def test_scales_and_zero_block():
    w = torch.randn(4, 32)
    w[1, :16] = 0.0
    q = quantize_nvfp4(w)
    assert q.weight_scale.dtype == torch.float8_e4m3fn and q.weight_scale.shape == (4, 2)
    assert q.weight_scale[1, 0].float().item() == 1.0  # zero block -> scale 1.0
    assert (q.dequantize()[1, :16] == 0).all()
    assert q.weight_scale.float().max().item() == 448.0
    assert quantize_nvfp4(torch.zeros(2, 16)).dequantize().abs().max().item() == 0.0
    assert input_scale_from_amax(2688.0).item() == 1.0
    assert global_scale(torch.tensor(5376.0)).item() == 2.0
    assert quantize_nvfp4(w, input_amax=26.88).input_scale.item() == pytest.approx(0.01)


def test_validation_errors():
    w = torch.zeros(4, 8, dtype=torch.uint8)
    s = torch.ones(4, 1).to(torch.float8_e4m3fn)
    one = torch.tensor(1.0)
    NVFP4Tensor(w, s, one)
    with pytest.raises(ValueError, match="multiple of the group size 16"):
        NVFP4Tensor(torch.zeros(4, 4, dtype=torch.uint8), s, one)
    with pytest.raises(ValueError, match=r"weight_scale must have shape \(4, 1\)"):
        NVFP4Tensor(w, torch.ones(4, 2).to(torch.float8_e4m3fn), one)
    with pytest.raises(ValueError, match="weight must be uint8"):
        NVFP4Tensor(w.to(torch.int8), s, one)
    with pytest.raises(ValueError, match="weight_scale must be float8_e4m3fn"):
        NVFP4Tensor(w, torch.ones(4, 1), one)
    with pytest.raises(ValueError, match="weight_scale_2 must be float32"):
        NVFP4Tensor(w, s, one.double())
    with pytest.raises(ValueError, match="K % 16"):
        quantize_nvfp4(torch.randn(3, 24))


def test_stacked_dequant_with_gate_up_scales():
    g, u = torch.randn(2, 4, 32), torch.randn(2, 4, 32) * 10
    qs = [quantize_nvfp4(t[e]) for e in range(2) for t in (g, u)]
    w = torch.stack([torch.cat([qs[2 * e].weight, qs[2 * e + 1].weight]) for e in range(2)])
    s = torch.stack([torch.cat([qs[2 * e].weight_scale, qs[2 * e + 1].weight_scale])
                     for e in range(2)])
    s2 = torch.stack([torch.stack([qs[2 * e].weight_scale_2, qs[2 * e + 1].weight_scale_2])
                      for e in range(2)])
    dq = dequantize_nvfp4(w, s, s2)
    assert torch.equal(dq[1, 4:], qs[3].dequantize()) and torch.equal(dq[0, :4], qs[0].dequantize())


def test_per_expert_global_scale_quantizes_each_expert_with_its_own():
    # regression: a [E] weight_scale_2 was broadcast against the K/16 axis (a RuntimeError, or
    # silently wrong block scales when E == K/16)
    from mla_spec.quant.nvfp4 import dequantize_nvfp4, quantize_nvfp4

    g = torch.Generator().manual_seed(0)
    w = torch.randn(2, 8, 32, generator=g) * torch.tensor([1.0, 50.0])[:, None, None]  # E == K/16
    ws2 = torch.stack([quantize_nvfp4(w[e]).weight_scale_2 for e in range(2)]).reshape(2)
    q = quantize_nvfp4(w, weight_scale_2=ws2)
    for e in range(2):
        qe = quantize_nvfp4(w[e])
        assert torch.equal(q.weight[e], qe.weight)
        assert torch.equal(q.weight_scale[e].view(torch.uint8), qe.weight_scale.view(torch.uint8))
    back = dequantize_nvfp4(q.weight, q.weight_scale, q.weight_scale_2)
    assert ((back - w).norm() / w.norm()) < 0.15
    with pytest.raises(ValueError, match="weight_scale_2 must have shape"):
        quantize_nvfp4(w, weight_scale_2=torch.ones(3))
