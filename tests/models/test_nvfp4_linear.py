"""NVFP4Linear: checkpoint buffer names, the forward on CPU (the model's NVFP4 path), the
dequantized-weight cache invalidated by a reload, and clear errors on bad shapes."""

from __future__ import annotations

import pytest
import torch

from mla_spec.models.linear import NVFP4Linear, nvfp4_linear
from mla_spec.quant.nvfp4 import quantize_nvfp4


def test_linear_module_names_forward_and_cache():
    torch.manual_seed(1)
    w = torch.randn(24, 48)
    lin = NVFP4Linear.from_float(w, input_amax=3.0)
    sd = lin.state_dict()
    assert {k: (tuple(v.shape), v.dtype) for k, v in sd.items()} == {
        "weight": ((24, 24), torch.uint8), "weight_scale": ((24, 3), torch.float8_e4m3fn),
        "weight_scale_2": ((), torch.float32), "input_scale": ((), torch.float32)}
    x = torch.randn(2, 3, 48, dtype=torch.bfloat16)
    y = lin(x)
    assert y.shape == (2, 3, 24) and y.dtype == torch.bfloat16
    # on CPU: the weight dequantized to the activation dtype, then F.linear (the model's path)
    ref = torch.nn.functional.linear(x, quantize_nvfp4(w).dequantize().to(torch.bfloat16))
    assert torch.equal(y, ref)
    # reload other weights: the cached dequantized weight must be invalidated
    other = NVFP4Linear.from_float(torch.randn(24, 48))
    sd2 = dict(other.state_dict())
    sd2["weight_scale_2"] = sd2["weight_scale_2"].reshape(1)  # checkpoints may store [1]
    lin.load_state_dict(sd2)
    assert torch.equal(lin(x), other(x))
    with pytest.raises(ValueError, match="multiple of the group size 16"):
        NVFP4Linear(20, 4)
    with pytest.raises(ValueError, match=r"\[..., 48\]"):
        lin(torch.randn(2, 32))


def test_nvfp4_linear_is_the_model_path_with_bias():
    """Irregular sizes (K = 80, N = 7, one row and zero rows): equal to the dense reference."""
    g = torch.Generator().manual_seed(3)
    w, b = torch.randn(7, 80, generator=g), torch.randn(7, generator=g)
    lin = NVFP4Linear.from_float(w, bias=b)
    for rows in (0, 1, 5):
        x = torch.randn(rows, 80, generator=g)
        ref = torch.nn.functional.linear(x, quantize_nvfp4(w).dequantize(), b)
        torch.testing.assert_close(lin(x), ref)
        assert torch.equal(lin(x), nvfp4_linear(x, lin) + lin.bias)
