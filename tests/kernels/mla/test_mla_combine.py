"""The CUDA split-KV combine (``mla.combine``, ``csrc/mla_combine.cu``) against its twin
``combine_splits_ref``.

On the GPU: split counts 1-3, 4, 5, 64, 127, 128, 129, 300 (one load round, a second loop),
row counts 1, 31, 33, 1000 (row blocks of 32 / G rows cut short), fp32 and bf16 partials, empty
splits whose partials are NaN, rows with no KV at all, a strided ``out`` and the lse, inside a
CUDA graph. On the CPU: the parameter layout, the kernels against the source, the refusal
messages, the fallback and an nvcc compile when nvcc is present.
"""

from __future__ import annotations

import ctypes
import re

import pytest
import torch

from mla_spec.kernels.launch.cuda_driver import CSRC, compile_cubin, nvcc_path
from mla_spec.kernels.mla import combine as cc
from mla_spec.kernels.mla import combine_splits_ref

SRC = CSRC / "mla_combine.cu"
DV = 512


def test_params_layout_matches_source():
    size = int(re.search(r"sizeof\(CombineParams\) == (\d+)", SRC.read_text()).group(1))
    assert ctypes.sizeof(cc._CombineParams) == size


def test_kernels_match_source():
    built = set(re.findall(r"^MLA_COMBINE\((true|false), (\d+), (\w+)\)", SRC.read_text(), re.M))
    assert {(bf16 == "true", int(g)) for bf16, g, _ in built} == set(cc._KERNELS)
    for bf16, g, name in built:
        assert cc._KERNELS[(bf16 == "true", int(g))].name == name
    assert re.search(r"KMAX = (\d+)", SRC.read_text()).group(1) == str(cc._KMAX)


@pytest.mark.parametrize("s,g", [(1, 2), (2, 2), (8, 2), (9, 4), (16, 4), (64, 16), (65, 32),
                                 (128, 32), (300, 32)])
def test_split_groups(s, g):
    assert cc.combine_groups(s) == g


@pytest.mark.parametrize("s,rows,cuda", [(128, 32, True), (64, 1, True), (16, 512, True),
                                         (32, 32, False), (32, 128, False), (4, 1024, False),
                                         (16, 511, False), (2, 4096, False)])
def test_cuda_preferred_where_it_measured_faster(s, rows, cuda):
    assert cc.combine_cuda_preferred(s, rows) == cuda


def test_cpu_is_refused_with_a_reason_and_falls_back():
    g = torch.Generator().manual_seed(3)
    part = torch.randn(5, 6, DV, generator=g)
    lse = torch.randn(5, 6, generator=g)
    lse[1, 2] = float("-inf")
    why = cc.combine_cuda_supported(part, lse, torch.empty(2, 3, DV, dtype=torch.bfloat16))
    assert why and "CUDA" in why
    out, ref = (torch.empty(2, 3, DV, dtype=torch.bfloat16) for _ in range(2))
    cc.combine_splits_fast(part, lse, out)
    combine_splits_ref(part, lse, ref)
    torch.testing.assert_close(out.float(), ref.float(), atol=2e-2, rtol=2e-2)
    with pytest.raises(ValueError, match="CUDA"):
        cc.combine_splits_cuda(part, lse, out)


@pytest.mark.skipif(nvcc_path() is None, reason="nvcc not installed")
def test_source_compiles(tmp_path, monkeypatch):
    monkeypatch.setenv("MLA_SPEC_CACHE", str(tmp_path))
    cubin = compile_cubin(SRC)
    assert cubin[:4] == b"\x7fELF"
    for k in cc._KERNELS.values():
        assert k.name.encode() in cubin


def _case(s, rows, dtype, seed, dev):
    g = torch.Generator(device="cpu").manual_seed(seed)
    part = torch.randn(s, rows, DV, generator=g).to(dtype)
    lse = torch.randn(s, rows, generator=g) * 4
    empty = torch.rand(s, rows, generator=g) < 0.2  # splits that saw no KV: NaN partials
    lse[empty] = float("-inf")
    part[empty] = float("nan")
    if rows > 2:
        lse[:, 1] = float("-inf")  # a row with no KV at all
        part[:, 1] = float("nan")
    return part.to(dev), lse.to(dev)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("s,rows", [(1, 31), (2, 1), (2, 1000), (3, 33), (4, 64), (5, 33),
                                    (64, 32), (127, 31), (128, 32), (129, 33), (300, 1)])
def test_matches_twin_on_gpu(dtype, s, rows):
    dev = torch.device("cuda")
    if cc.combine_cuda_supported(torch.empty(1, 1, DV, device=dev),
                                 torch.empty(1, 1, device=dev),
                                 torch.empty(1, 1, DV, device=dev, dtype=torch.bfloat16)):
        pytest.skip("the CUDA combine does not run here (nvcc / sm_90)")
    part, lse = _case(s, rows, dtype, s * 1000 + rows, dev)
    h = 1 if rows % 2 else 2
    n = rows // h
    # a strided out (a [N, H + 1, 512] buffer's first H heads) and the natural-log lse
    buf = torch.zeros(n, h + 1, DV, device=dev, dtype=torch.bfloat16)
    out, ref = buf[:, :h], torch.empty(n, h, DV, device=dev, dtype=torch.bfloat16)
    lo, lr = (torch.empty(n, h, device=dev) for _ in range(2))
    cc.combine_splits_cuda(part, lse, out, lo)
    combine_splits_ref(part, lse, ref, lr)
    torch.testing.assert_close(out.float(), ref.float(), atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(lo, lr, atol=1e-4, rtol=1e-5)
    assert torch.isfinite(out).all()
    assert (buf[:, h] == 0).all()  # nothing written past the view
    if rows > 2:
        assert (out.reshape(rows, DV)[1] == 0).all() and lo.reshape(-1)[1] == float("-inf")


@pytest.mark.gpu
def test_cuda_graph_replay_reads_new_partials():
    dev = torch.device("cuda")
    if cc.combine_cuda_supported(torch.empty(1, 1, DV, device=dev),
                                 torch.empty(1, 1, device=dev),
                                 torch.empty(1, 1, DV, device=dev, dtype=torch.bfloat16)):
        pytest.skip("the CUDA combine does not run here (nvcc / sm_90)")
    part, lse = _case(128, 32, torch.bfloat16, 7, dev)
    out = torch.empty(1, 32, DV, device=dev, dtype=torch.bfloat16)
    cc.combine_splits_cuda(part, lse, out)  # compile and load outside the capture
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        cc.combine_splits_cuda(part, lse, out)
    new_part, new_lse = _case(128, 32, torch.bfloat16, 8, dev)
    part.copy_(new_part)
    lse.copy_(new_lse)
    g.replay()
    ref = torch.empty_like(out)
    combine_splits_ref(part, lse, ref)
    torch.testing.assert_close(out.float(), ref.float(), atol=2e-2, rtol=2e-2)
