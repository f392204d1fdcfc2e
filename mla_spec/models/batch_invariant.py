"""Batch invariance: a row's result that does not depend on how many rows share the call.

A GEMM or GEMV kernel picks its tiles and split-K by the number of rows ``M``, and a verify step
has 4x the rows of a decode step, so the same token can round differently in the two (the
greedy choice then flips where two logits are within a rounding). Inside ``batch_invariant()``
the model's row-mixing ops (every linear, the MoE block, the per-head absorbed projections, the
LM head) run one row at a time: each row then meets the same kernels, whatever the batch.
Row-wise ops (norms, RoPE, the KV store) are invariant as they are; attention is made so by its
backend (the triton backend's ``deterministic`` option: one kernel, one KV split). The engine
enters it for ``Engine(deterministic=True)``; ranks each hold the flag of their own process.
"""

import contextlib
from collections.abc import Callable

import torch

__all__ = ["batch_invariant", "per_row"]

_ACTIVE = [False]


@contextlib.contextmanager
def batch_invariant(enabled: bool = True):
    """Row-at-a-time row-mixing ops inside the block (nothing changes with ``enabled=False``)."""
    prev, _ACTIVE[0] = _ACTIVE[0], bool(enabled)
    try:
        yield
    finally:
        _ACTIVE[0] = prev


def per_row(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    """``fn(x)`` for ``x [N, ...]``, one row at a time inside :func:`batch_invariant`."""
    if not _ACTIVE[0] or x.dim() < 2 or x.shape[0] <= 1:
        return fn(x)
    return torch.cat([fn(x[i:i + 1]) for i in range(x.shape[0])])
