"""The flagged combine (``combine_flagged`` in ``csrc/mla_combine.cu``, launched by
``mla_decode_wgmma.launch_wgmma_mla`` when ``FLAG_COMBINE`` is on): ``W``'s split CTAs raise a
flag each once their rows are stored, and the combine merges each split as its flag goes up.

CPU: the parameter layouts and the flag stride against the sources, the kernels against the
source, the launcher's choice with recording stand-ins. GPU: against the reference and the
combine kernel at 64, 128 and 200 splits (one load round, a second), one and two row blocks,
requests of 0, 1 and 5000 tokens among others, the lse; the same bits at every call and with
PDL off; 40 graph replays with new queries between them (the flags must come down between
calls).
"""

from __future__ import annotations

import re

import pytest
import torch

from mla_spec.kernels import mla_decode_combine_cuda as cc
from mla_spec.kernels import mla_decode_wgmma as mw
from mla_spec.kernels import pdl
from mla_spec.kernels.cuda_driver import CSRC
from mla_spec.kernels.mla_decode import mla_decode_ref
from mla_spec.kernels.mla_decode_paged import PAGED_VARIANTS, mla_decode_paged

SM = 0.1352338
DV, DPE = 512, 64


def test_layouts_and_stride_match_the_sources():
    combine = (CSRC / "mla_combine.cu").read_text()
    assert cc._CombineParams.flags.offset == int(
        re.search(r"offsetof\(CombineParams, flags\) == (\d+)", combine).group(1))
    hdr = (CSRC / "sm90_wgmma.cuh").read_text()
    assert mw._WgParams.flags.offset == int(
        re.search(r"offsetof\(WgParams, flags\) == (\d+)", hdr).group(1))
    common = (CSRC / "sm90_common.cuh").read_text()
    assert cc.FLAG_STRIDE == int(re.search(r"SPLIT_FLAG_STRIDE = (\d+);", common).group(1))


def test_flagged_kernels_match_source():
    built = re.findall(r"^MLA_COMBINE_FLAGGED\((\d+), (\w+)\)",
                       (CSRC / "mla_combine.cu").read_text(), re.M)
    assert {int(g): name for g, name in built} == \
        {g: k.name for g, k in cc._FLAGGED_KERNELS.items()}
    assert set(cc._FLAGGED_KERNELS) == set(cc._GROUPS)
    # W raises the flags in every build (the one source), and nothing else is given them
    src = (CSRC / "mla_wgmma_sm90.cu").read_text()
    assert "split_flag_lower(" in src and "split_trigger(" in src and "split_done(" in src
    assert {mw._KERNELS[k].src.name for k in mw._FLAG_KEYS} == {"mla_wgmma_sm90.cu"}


def test_launch_takes_the_flagged_combine_only_where_on_and_taken(monkeypatch):
    # with recording stand-ins for the kernels: flags reach the split kernel and the flagged
    # combine runs only with FLAG_COMBINE, W, bf16 partials and a split count the CUDA combine
    # would merge; the combine kernel (or none) otherwise
    seen = []
    monkeypatch.setattr(mw, "_KERNELS", {k: (lambda *a, **kw: seen.append(("split", a[3].flags)))
                                         for k in mw._KERNELS})
    monkeypatch.setattr(mw, "_tensor_map", lambda *a, **k: bytes(128))
    monkeypatch.setattr(mw, "grid_merges", lambda *a, **k: False)
    monkeypatch.setattr(mw, "combine_cuda_supported", lambda *a, **k: None)
    monkeypatch.setattr(mw, "combine_splits_fast", lambda *a, **k: seen.append(("fast", None)))
    monkeypatch.setattr(mw, "combine_splits", lambda *a, **k: seen.append(("triton", None)))
    monkeypatch.setattr(mw, "combine_splits_flagged",
                        lambda part, lse_p, out, lse, f: seen.append(("flagged", f)))

    def call(name, splits, h=32, q_len=1):
        m_blocks = -(-q_len * h // PAGED_VARIANTS[name].block_m)
        qn = torch.randn(2 * q_len, h, DV).bfloat16()
        qp = torch.randn(2 * q_len, h, DPE).bfloat16()
        kv = torch.zeros(128, DV + DPE, dtype=torch.bfloat16)
        out = torch.empty(2 * q_len, h, DV, dtype=torch.bfloat16)
        r2t, rpi = torch.zeros(2, 128, dtype=torch.int32), torch.arange(2, dtype=torch.int32)
        kl = torch.full((2,), 100, dtype=torch.int32)
        seen.clear()
        mw.launch_wgmma_mla(qn, qp, kv, r2t, rpi, kl, out, None, 1.0, 1.0, q_len=q_len,
                            m_blocks=m_blocks, num_splits=splits, kind=PAGED_VARIANTS[name])
        return list(seen)

    assert [k for k, _ in call("W", 128)] == ["split", "fast"]  # FLAG_COMBINE off by default
    monkeypatch.setattr(mw, "FLAG_COMBINE", True)
    (_, ptr), (kind, flags) = call("W", 128, q_len=2)
    assert kind == "flagged" and ptr == flags.flags.data_ptr()
    assert (flags.n_rows, flags.block_rows, flags.m_blocks) == (64, 32, 2)
    assert flags.flags.numel() >= 2 * 2 * 128 * cc.FLAG_STRIDE
    assert [k for k, _ in call("W", 8)] == ["split", "fast"]  # the Triton combine's shapes
    assert [k for k, _ in call("W16", 128)] == ["split", "fast"]  # fp32 partials
    assert call("W", 1) == [("split", None)]  # one split: no combine
    monkeypatch.setattr(mw, "COMBINE_CUDA", False)
    assert [k for k, _ in call("W", 128)] == ["split", "triton"]


def _case(lens, h, q_len, seed):
    g = torch.Generator().manual_seed(seed)
    page, bs = 64, len(lens)
    pages = [-(-max(n, 1) // page) for n in lens]
    perm = torch.randperm(sum(pages) + 1, generator=g)
    kv = torch.randn((sum(pages) + 1) * page, DV + DPE, generator=g).to(torch.bfloat16)
    r2t = torch.zeros(bs, max(lens) + page, dtype=torch.int32)
    used = 0
    for i, n in enumerate(lens):
        pos = torch.arange(n)
        r2t[i, :n] = (perm[used + pos // page] * page + pos % page).int()
        used += pages[i]
    qn = torch.randn(bs * q_len, h, DV, generator=g).to(torch.bfloat16)
    qp = torch.randn(bs * q_len, h, DPE, generator=g).to(torch.bfloat16)
    return [t.cuda() for t in (qn, qp, kv, r2t, torch.arange(bs, dtype=torch.int32),
                               torch.tensor(lens, dtype=torch.int32))]


def _call(case, q_len, splits, lens, flagged, monkeypatch):
    monkeypatch.setattr(mw, "FLAG_COMBINE", flagged)
    qn, qp, kv, r2t, rpi, kl = case
    return mla_decode_paged(qn, qp, kv, r2t, rpi, kl, SM, page_size=64, q_len=q_len,
                            num_splits=splits, config=PAGED_VARIANTS["W"], max_kv=max(lens),
                            return_lse=True)


@pytest.mark.gpu
@pytest.mark.parametrize("lens,q_len", [([32768], 1), ([5000, 0, 1, 777], 1), ([9000, 3], 2)])
@pytest.mark.parametrize("splits", [64, 128, 200])
def test_flagged_combine_matches_the_reference_and_the_combine_kernel(lens, q_len, splits,
                                                                      monkeypatch):
    case = _case(lens, 32, q_len, seed=splits + len(lens))
    qn, qp, kv, r2t, rpi, kl = case
    ref, lse_ref = mla_decode_ref(qn, qp, kv, r2t, rpi, kl, SM, q_len=q_len, return_lse=True)
    base, lse_base = _call(case, q_len, splits, lens, False, monkeypatch)
    runs = [_call(case, q_len, splits, lens, True, monkeypatch) for _ in range(3)]
    monkeypatch.setattr(pdl, "PDL", False)
    runs.append(_call(case, q_len, splits, lens, True, monkeypatch))
    torch.cuda.synchronize()
    out, lse = runs[0]
    assert torch.isfinite(out).all()
    err = (out.float() - ref.float()).abs().max() / ref.float().abs().max()
    assert err.item() < 1e-2
    torch.testing.assert_close(lse, lse_ref.float(), atol=2e-2, rtol=1e-3)
    # the combine kernel's result up to the order of the fp32 sums (one bf16 rounding apart)
    torch.testing.assert_close(out.float(), base.float(), atol=1e-2, rtol=8e-3)
    torch.testing.assert_close(lse, lse_base, atol=1e-4, rtol=1e-5)
    for o, s in runs[1:]:  # split order, whatever order the flags go up in; PDL or not
        assert torch.equal(o, out) and torch.equal(s, lse)


@pytest.mark.gpu
def test_flagged_combine_replays_in_a_graph(monkeypatch):
    lens, q_len, splits = [20000, 4000], 1, 128
    case = _case(lens, 32, q_len, seed=3)
    qn = case[0]
    monkeypatch.setattr(mw, "FLAG_COMBINE", True)
    out = torch.empty_like(qn)
    _, qp, kv, r2t, rpi, kl = case

    def step():
        mla_decode_paged(qn, qp, kv, r2t, rpi, kl, SM, page_size=64, q_len=q_len,
                         num_splits=splits, config=PAGED_VARIANTS["W"], max_kv=max(lens),
                         out=out)

    step()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(3):  # back to back: each call's flags come down before its combine reads
            step()
    g = torch.Generator(device="cuda").manual_seed(9)
    for i in range(40):
        qn.copy_(torch.randn(qn.shape, generator=g, device="cuda").to(qn.dtype))
        graph.replay()
        if i % 8 == 7:
            got = out.clone()
            step()
            torch.cuda.synchronize()
            assert torch.equal(got, out), i
