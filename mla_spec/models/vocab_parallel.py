"""Vocab-parallel embedding and lm_head: each TP rank holds ``vocab / tp_size`` rows.

``VocabParallelEmbedding`` zeroes the rows of ids it does not own and all-reduces (exact);
``ParallelLMHead`` all-gathers ``[N, V]`` fp32 logits. A vocabulary ``tp_size`` does not divide
stays replicated (``sharded`` False).
"""

import math

import torch
import torch.nn.functional as F
from torch import nn

from mla_spec.distributed import tp_all_gather, tp_all_reduce
from mla_spec.models.batch_invariant import per_row

__all__ = ["VocabParallelEmbedding", "ParallelLMHead", "lm_head_logits"]


def _shard(vocab: int, tp_rank: int, tp_size: int) -> tuple[bool, int, int]:
    if not 0 <= tp_rank < tp_size:
        raise ValueError(f"tp_rank {tp_rank} must be in [0, tp_size {tp_size})")
    sharded = tp_size > 1 and vocab % tp_size == 0
    local = vocab // tp_size if sharded else vocab
    return sharded, local, (tp_rank * local if sharded else 0)


class VocabParallelEmbedding(nn.Module):
    """``ids [...]`` int -> ``[..., dim]``; ``weight [vocab / tp_size, dim]`` on each rank."""

    def __init__(self, num_embeddings: int, embedding_dim: int, *, tp_rank: int = 0,
                 tp_size: int = 1, dtype=torch.float32, device=None) -> None:
        super().__init__()
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.tp_size = tp_size
        self.sharded, local, self.vocab_start = _shard(num_embeddings, tp_rank, tp_size)
        self.weight = nn.Parameter(torch.empty(local, embedding_dim, dtype=dtype, device=device))
        nn.init.normal_(self.weight)  # nn.Embedding's default init
        self.tp_shard_dims = {"weight": 0} if self.sharded else {}

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if not self.sharded:
            return F.embedding(ids, self.weight)
        local = ids - self.vocab_start
        mine = (local >= 0) & (local < self.weight.shape[0])
        out = F.embedding(torch.where(mine, local, torch.zeros_like(local)), self.weight)
        out = out * mine.unsqueeze(-1).to(out.dtype)
        return tp_all_reduce(out, self.tp_size)

    def extra_repr(self) -> str:
        return (f"{self.num_embeddings}, {self.embedding_dim}"
                + (f", rows {self.vocab_start}..{self.vocab_start + self.weight.shape[0]}"
                   if self.sharded else ""))


class ParallelLMHead(nn.Module):
    """``weight [vocab / tp_size, hidden]``; :meth:`logits` gathers the full vocabulary."""

    def __init__(self, hidden_size: int, vocab_size: int, *, tp_rank: int = 0, tp_size: int = 1,
                 dtype=torch.float32, device=None) -> None:
        super().__init__()
        self.vocab_size, self.tp_size = vocab_size, tp_size
        self.sharded, local, self.vocab_start = _shard(vocab_size, tp_rank, tp_size)
        self.weight = nn.Parameter(torch.empty(local, hidden_size, dtype=dtype, device=device))
        nn.init.kaiming_uniform_(self.weight, a=math.sqrt(5))  # nn.Linear's default init
        self.tp_shard_dims = {"weight": 0} if self.sharded else {}

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """``[..., hidden]`` -> fp32 ``[..., vocab]`` (matmul in the weight dtype), the same bits
        on every rank."""
        part = _rows_logits(hidden, self.weight)
        if not self.sharded:
            return part
        with torch.no_grad():  # sampling / evaluation only: training runs at TP 1
            return tp_all_gather(part, self.tp_size)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[1]} -> {self.vocab_size}" + (
            f" (rows {self.vocab_start}..{self.vocab_start + self.weight.shape[0]})"
            if self.sharded else "")


def lm_head_logits(lm_head: nn.Module, hidden: torch.Tensor) -> torch.Tensor:
    """fp32 logits through a ``ParallelLMHead`` or any module with a ``weight [vocab, hidden]``
    (e.g. a plain ``nn.Linear`` a benchmark shares with the MTP layer)."""
    if isinstance(lm_head, ParallelLMHead):
        return lm_head.logits(hidden)
    return _rows_logits(hidden, lm_head.weight)


def _rows_logits(hidden: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """fp32 ``hidden @ w^T`` in ``w``'s dtype (a row at a time inside ``batch_invariant()``)."""
    return per_row(lambda h: F.linear(h.to(w.dtype), w), hidden).float()
