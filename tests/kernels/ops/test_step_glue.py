"""The step graph's glue kernels (``mla_spec.kernels.ops.step_glue``) against their torch twins:
random request rows and lengths (0, 1, odd batch sizes, a length at the row's end), every mix of
int32 / int64 outputs, and accept chains with matches, misses and full acceptance."""

import pytest
import torch

from mla_spec.kernels.ops.step_glue import (
    greedy_accept,
    greedy_accept_update,
    greedy_accept_update_ref,
    refresh_rows,
    refresh_rows_ref,
)


def _refresh_case(bs, q, offset, width, n_lens, n_rows, device, seed):
    g = torch.Generator().manual_seed(seed)
    r2t = torch.randint(0, 1 << 20, (9, width), generator=g, dtype=torch.int32)
    rows = torch.randint(0, 9, (bs,), generator=g)
    lens = torch.randint(0, width - offset - q + 1, (bs,), generator=g)
    if bs > 1:
        lens[0], lens[1] = 0, width - offset - q  # empty prefix; the row's last slot
    dtypes = [torch.int32, torch.int64, torch.int32]

    def outs():  # destinations filled with garbage (never zeros), fresh per side
        pos = torch.full((bs * q,), -7, dtype=torch.int64)
        loc = torch.full((bs * q,), -7, dtype=torch.int64)
        lo = tuple((torch.full((bs,), -5, dtype=dtypes[i]).to(device), d)
                   for i, d in zip(range(n_lens), (offset + q, offset, 3)))
        ro = tuple(torch.full((bs,), -3, dtype=dtypes[2 - i]).to(device) for i in range(n_rows))
        return pos.to(device), loc.to(device), lo, ro

    return [t.to(device) for t in (rows, lens, r2t)], outs


@pytest.mark.triton
@pytest.mark.parametrize("bs,q,offset,n_lens,n_rows", [
    (1, 1, 0, 1, 1), (3, 4, 0, 3, 2), (5, 1, 2, 2, 1), (37, 3, 1, 3, 3), (2, 5, 0, 0, 0),
    (0, 2, 0, 1, 1)])
def test_refresh_rows_matches_twin(bs, q, offset, n_lens, n_rows, device):
    (rows, lens, r2t), outs = _refresh_case(bs, q, offset, 40, n_lens, n_rows, device, bs + q)
    want, got = outs(), outs()
    refresh_rows_ref(rows, lens, r2t, offset, q, *want)
    refresh_rows(rows, lens, r2t, offset, q, *got)
    for a, b in zip(want[:2], got[:2]):
        assert torch.equal(a, b)
    for (a, _), (b, _) in zip(want[2], got[2]):
        assert torch.equal(a, b)
    for a, b in zip(want[3], got[3]):
        assert torch.equal(a, b)
    if bs:
        assert int(want[0][q - 1]) == int(lens[0]) + offset + q - 1  # positions as documented
        assert int(want[1][0]) == int(r2t[rows[0], lens[0] + offset])


def test_refresh_rows_refuses_bad_shapes():
    rows, lens = torch.tensor([1, 2]), torch.tensor([3, 4])
    r2t = torch.arange(80, dtype=torch.int32).view(2, 40)
    pos, loc = torch.empty(6, dtype=torch.int64), torch.empty(6, dtype=torch.int64)
    with pytest.raises(ValueError, match="bs \\* q = 4"):
        refresh_rows(rows, lens, r2t, 0, 2, pos, loc)
    with pytest.raises(ValueError, match="at most 3"):
        refresh_rows(rows, lens, r2t, 0, 3, pos, loc, row_outs=(lens,) * 4)
    with pytest.raises(IndexError):  # the twin raises on a slot past the row
        refresh_rows_ref(rows, torch.tensor([3, 39]), r2t, 0, 3, pos, loc)


def _accept_case(bs, ndt, device, seed):
    g = torch.Generator().manual_seed(seed)
    predict = torch.randint(0, 50, (bs, ndt), generator=g)
    drafts = predict[:, : ndt - 1].clone()
    cut = torch.randint(0, ndt, (bs,), generator=g)  # first mismatch (ndt - 1: all accepted)
    for b in range(bs):
        if cut[b] < ndt - 1:
            drafts[b, cut[b]] += 1 + int(torch.randint(0, 9, (1,), generator=g))
            drafts[b, cut[b] + 1:] = torch.randint(0, 50, (ndt - 2 - int(cut[b]),), generator=g)
    rows = torch.randperm(max(bs, 1) + 3, generator=g)[:bs]
    return [t.to(device) for t in (predict, drafts, rows)], cut


@pytest.mark.triton
@pytest.mark.parametrize("bs,ndt", [(1, 2), (1, 4), (7, 4), (33, 5), (130, 3), (0, 4)])
def test_greedy_accept_update_matches_twin(bs, ndt, device):
    (predict, drafts, rows), cut = _accept_case(bs, ndt, device, bs * 10 + ndt)
    vid_want = torch.full((140,), -9, dtype=torch.int64, device=device)
    vid_got = vid_want.clone()
    want = greedy_accept_update_ref(predict, drafts, rows, vid_want)
    got = greedy_accept_update(predict, drafts, rows, vid_got)
    assert torch.equal(want.accept.cpu(), (cut + 1).clamp(max=ndt)) if bs else True
    for a, b in zip(want, got):
        assert a.dtype == b.dtype and torch.equal(a, b)
    assert torch.equal(vid_want, vid_got)
    assert torch.equal(greedy_accept(predict, drafts), want.accept)


def test_greedy_accept_chains():
    predict = torch.tensor([[1, 2, 3, 4], [1, 9, 3, 4], [5, 6, 7, 8], [0, 0, 0, 0]])
    drafts = torch.tensor([[1, 2, 3], [1, 2, 3], [5, 6, 0], [1, 0, 0]])
    assert greedy_accept(predict, drafts).tolist() == [4, 2, 3, 1]
    with pytest.raises(ValueError, match="drafts \\[bs, ndt - 1\\]"):
        greedy_accept_update(predict, drafts[:, :2], torch.arange(4), torch.zeros(4))
