"""Read-floor probes (``experiments/mla/read_floor.py``): the checksum kernel against its torch
twin on irregular shapes and splits, and the empty launch."""

from __future__ import annotations

import pytest
import torch

from experiments.mla.read_floor import empty_launch, read_checksum, read_checksum_ref


@pytest.mark.triton
@pytest.mark.parametrize("n,k,block_n,split", [
    (1, 16, 8, 1),       # one row, two weight words
    (13, 96, 4, 1),      # rows not a multiple of the tile
    (9, 224, 8, 3),      # uneven split
    (5, 64, 2, 7),       # more splits than scale words: empty splits give 0
])
def test_read_checksum_matches_twin(n, k, block_n, split, device):
    g = torch.Generator().manual_seed(n * 1000 + k)
    w = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, generator=g).to(device)
    kb = 4 * -(-(k // 16) // 4)  # scale rows rounded up to whole int32 words
    s = torch.randint(0, 256, (n, kb), dtype=torch.uint8, generator=g).to(device)
    s = s.view(torch.float8_e4m3fn)
    got = read_checksum(w, s, block_n=block_n, split=split)
    assert torch.equal(got.cpu(), read_checksum_ref(w, s, split).cpu())
    assert got.shape == (split, n)


def test_read_checksum_rejects_partial_words():
    w = torch.zeros(4, 6, dtype=torch.uint8)
    with pytest.raises(ValueError, match="whole int32 words"):
        read_checksum(w, torch.zeros(4, 4, dtype=torch.uint8))


@pytest.mark.triton
def test_empty_launch_writes_one(device):
    out = torch.zeros(1, dtype=torch.int32, device=device)
    empty_launch(out, programs=3)
    assert int(out) == 1
