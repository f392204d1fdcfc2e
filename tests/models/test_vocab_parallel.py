"""Vocab-parallel embedding and lm_head: shards, the replicated fallback, and 2 gloo ranks."""

from __future__ import annotations

import torch

from mla_spec.models.vocab_parallel import ParallelLMHead, VocabParallelEmbedding, lm_head_logits
from mla_spec.runtime.launch import launch

V, D = 12, 5


def test_tp1_and_indivisible_vocab_stay_replicated():
    e = VocabParallelEmbedding(V, D)
    assert not e.sharded and e.weight.shape == (V, D) and e.tp_shard_dims == {}
    e5 = VocabParallelEmbedding(V, D, tp_rank=1, tp_size=5)  # 12 % 5: replicated
    assert not e5.sharded and e5.weight.shape == (V, D)
    h = ParallelLMHead(D, V, tp_rank=2, tp_size=3)
    assert h.sharded and h.weight.shape == (4, D) and h.vocab_start == 8
    assert h.tp_shard_dims == {"weight": 0}
    ids = torch.tensor([[0, 11, 3]])
    torch.testing.assert_close(e(ids), e.weight[ids])
    x = torch.randn(2, D)
    full = ParallelLMHead(D, V)
    torch.testing.assert_close(lm_head_logits(full, x), x @ full.weight.T)
    lin = torch.nn.Linear(D, V, bias=False)  # a plain module sharing the contract
    torch.testing.assert_close(lm_head_logits(lin, x), lin(x).float())


def _rank(rank, world, w_emb, w_head, ids, x):
    e = VocabParallelEmbedding(V, D, tp_rank=rank, tp_size=world)
    h = ParallelLMHead(D, V, tp_rank=rank, tp_size=world)
    n = V // world
    with torch.no_grad():
        e.weight.copy_(w_emb[rank * n:(rank + 1) * n])
        h.weight.copy_(w_head[rank * n:(rank + 1) * n])
        return e(ids), h.logits(x)


def test_two_ranks_equal_the_full_tables():
    g = torch.Generator().manual_seed(0)
    w_emb, w_head = torch.randn(V, D, generator=g), torch.randn(V, D, generator=g)
    ids = torch.tensor([[0, 5, 6, 11, 6]])  # ids from both shards, repeated
    x = torch.randn(3, D, generator=g)
    outs = launch(_rank, 2, backend="gloo", args=(w_emb, w_head, ids, x))
    for emb, logits in outs:
        assert torch.equal(emb, w_emb[ids])  # one non-zero term per row: exact
        torch.testing.assert_close(logits, x @ w_head.T)
    assert torch.equal(outs[0][1], outs[1][1])  # same bits on both ranks
