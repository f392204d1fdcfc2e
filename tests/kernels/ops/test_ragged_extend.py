"""Spec v1's capacity layout (``mla_spec.kernels.ops.ragged_extend``) against its torch twin and
against the layout the host builds eagerly (``ForwardBatch.draft_extend``): random accept lengths
(all 1, all ndt, mixed), odd batch sizes, a length at the row's end, every mix of outputs."""

import pytest
import torch

from mla_spec.forward_batch import ForwardBatch
from mla_spec.kernels.ops.ragged_extend import ragged_extend_layout, ragged_extend_layout_ref


def _case(bs, ndt, kind, device, seed, n_lens=2, n_rows=2, width=48):
    g = torch.Generator().manual_seed(seed)
    acc = {"one": torch.ones(bs, dtype=torch.int64), "full": torch.full((bs,), ndt),
           "mixed": torch.randint(1, ndt + 1, (bs,), generator=g)}[kind]
    rows = torch.randperm(39, generator=g)[:bs] + 1  # request rows, never the scratch row 0
    lens = torch.randint(0, width - ndt + 1, (bs,), generator=g)
    if bs > 1:
        lens[1] = width - ndt  # the row's last slots
    r2t = torch.randint(0, 1 << 20, (40, width), generator=g, dtype=torch.int32)
    ins = [t.to(device) for t in (acc, rows, lens, r2t)]

    def outs():  # garbage-filled destinations, fresh per side
        c, r = bs * ndt, 2 * bs
        full = lambda n, dt, v: torch.full((n,), v, dtype=dt, device=device)  # noqa: E731
        return (full(c, torch.int64, -7), full(c, torch.int64, -7), full(r + 1, torch.int32, -5),
                full(r, torch.int32, -5),
                tuple(full(r, dt, -3) for dt in (torch.int32, torch.int64, torch.int32)[:n_lens]),
                tuple(full(r, dt, -3) for dt in (torch.int64, torch.int64, torch.int32)[:n_rows]))

    return ins, outs


@pytest.mark.triton
@pytest.mark.parametrize("bs,ndt,kind,n_lens,n_rows", [
    (1, 4, "one", 1, 1), (1, 4, "full", 2, 2), (3, 4, "mixed", 3, 3), (7, 2, "mixed", 0, 0),
    (37, 4, "mixed", 2, 1), (5, 3, "full", 1, 2), (4, 1, "one", 1, 1)])
def test_layout_matches_twin(bs, ndt, kind, n_lens, n_rows, device):
    (acc, rows, lens, r2t), outs = _case(bs, ndt, kind, device, bs * 31 + ndt, n_lens, n_rows)
    want, got = outs(), outs()
    src_w, last_w = ragged_extend_layout_ref(acc, rows, lens, r2t, ndt, *want)
    src_g, last_g = ragged_extend_layout(acc, rows, lens, r2t, ndt, *got)
    assert torch.equal(src_w, src_g) and torch.equal(last_w, last_g)
    for a, b in zip(want[:4], got[:4]):
        assert torch.equal(a, b)
    for a, b in zip(want[4] + want[5], got[4] + got[5]):
        assert torch.equal(a, b)


@pytest.mark.parametrize("kind", ["one", "full", "mixed"])
def test_real_rows_equal_the_host_layout(kind):
    """The first sum(accept) rows and the first bs requests are ForwardBatch.draft_extend's;
    padding requests hold <= ndt rows each on the scratch row, up to the capacity."""
    bs, ndt = 6, 4
    (acc, rows, lens, r2t), outs = _case(bs, ndt, kind, "cpu", 5)
    pos, loc, indptr, qlen, lo, ro = outs()
    src, last = ragged_extend_layout_ref(acc, rows, lens, r2t, ndt, pos, loc, indptr, qlen, lo, ro)
    a = acc.tolist()
    host = ForwardBatch.draft_extend([int(L) + x for L, x in zip(lens, a)], a, ndt,
                                     req_pool_indices=rows.tolist())
    n = sum(a)
    assert torch.equal(pos[:n], host.positions) and torch.equal(indptr[:bs + 1].long(),
                                                                host.qo_indptr.long())
    assert torch.equal(lo[0][:bs].long(), host.seq_lens.long()) and torch.equal(ro[0][:bs], rows)
    assert torch.equal(last, host.select_last_rows())
    assert torch.equal(src[:n], torch.tensor([b * ndt + j for b, x in enumerate(a)
                                              for j in range(x)]))
    assert torch.equal(loc[:n], r2t[rows.repeat_interleave(acc), pos[:n]].long())
    pad = qlen[bs:]
    assert int(pad.sum()) == bs * ndt - n and int(pad.max()) <= ndt and int(indptr[-1]) == bs * ndt
    assert (ro[0][bs:] == 0).all() and (pos[n:] < ndt).all() and (src[n:] == 0).all()


def test_bad_shapes_are_refused():
    (acc, rows, lens, r2t), outs = _case(3, 4, "mixed", "cpu", 1)
    pos, loc, indptr, qlen, lo, ro = outs()
    with pytest.raises(ValueError, match="capacity bs \\* ndt = 12"):
        ragged_extend_layout(acc, rows, lens, r2t, 4, pos[:5], loc, indptr, qlen)
    with pytest.raises(ValueError, match="2 \\* bs = 6 requests"):
        ragged_extend_layout(acc, rows, lens, r2t, 4, pos, loc, indptr[:4], qlen)
