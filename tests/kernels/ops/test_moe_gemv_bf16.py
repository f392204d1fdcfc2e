"""BF16 MoE GEMV (``mla_spec.kernels.ops.moe_gemv_bf16``) against its torch twin and the grouped
GEMM path, on random routing (repeated experts, one token, odd sizes)."""

import pytest
import torch

from mla_spec.kernels.ops.moe_gemv_bf16 import moe_gemv_bf16, moe_gemv_bf16_ref
from mla_spec.models.moe_grouped import grouped_experts_forward


def _case(n, k, kdim, inter, e, device, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, kdim, generator=g).bfloat16()
    w13 = (torch.randn(e, 2 * inter, kdim, generator=g) / kdim ** 0.5).bfloat16()
    w2 = (torch.randn(e, kdim, inter, generator=g) / inter ** 0.5).bfloat16()
    ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(n)]) if n else \
        torch.empty(0, k, dtype=torch.int64)
    if n > 1:
        ids[1] = ids[0]  # two tokens on the same experts
    w = torch.rand(n, k, generator=g) + 0.1
    return [t.to(device) for t in (x, w, ids, w13, w2)]


@pytest.mark.triton
@pytest.mark.parametrize("n,k,kdim,inter,e", [(1, 2, 256, 128, 8), (3, 2, 40, 24, 5),
                                              (4, 3, 304, 72, 7), (1, 1, 16, 16, 1)])
def test_kernel_matches_twin_and_grouped(n, k, kdim, inter, e, device):
    x, w, ids, w13, w2 = _case(n, k, kdim, inter, e, device, seed=n * 7 + kdim)
    ref = moe_gemv_bf16_ref(x, w, ids, w13, w2)
    got = moe_gemv_bf16(x, w, ids, w13, w2)
    assert got.shape == x.shape and got.dtype == x.dtype and ref.float().abs().max() > 0.1
    torch.testing.assert_close(got.float(), ref.float(), rtol=3e-2, atol=8e-2)
    grouped = grouped_experts_forward(x.cpu(), w.cpu(), ids.cpu(), w13.cpu(), w2.cpu())
    torch.testing.assert_close(got.float().cpu(), grouped.float(), rtol=3e-2, atol=8e-2)


def test_no_tokens_and_bad_shapes():
    x, w, ids, w13, w2 = _case(0, 2, 16, 8, 3, "cpu", 0)
    assert moe_gemv_bf16(x, w, ids, w13, w2).shape == (0, 16)
    x, w, ids, w13, w2 = _case(2, 2, 16, 8, 3, "cpu", 1)
    with pytest.raises(ValueError, match=r"w13 \[E, 2I, K\]"):
        moe_gemv_bf16(x, w, ids, w13[:, :15], w2)
