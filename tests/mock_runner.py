"""A mock target + MTP draft with exact integer logits, for testing the serving loop on CPU.

They write one "KV row" ``(token, position)`` per new token at ``batch.out_cache_loc`` and read
earlier rows back through ``req_to_token``, so a wrong slot or stale page changes their output.
Target: hidden ``[next, s_p, 0, 0]`` with ``s_p = sum_{q<=p} (tok_q + 1)(pos_q + 1) mod 9973``,
``next = (31 s_p + 7 tok_p + 3) mod vocab``, one-hot logits. Draft: continues the sum and
predicts what the target will, off by one where ``(s' + its KV window's tokens) % 3 == 0``, so
accept lengths vary and v1 / v2 agree only if both keep the draft's cache right.

A test helper, not package code: tests import it as ``mock_runner`` (pytest puts ``tests/``, the
directory of ``tests/conftest.py``, on ``sys.path``).
"""

from __future__ import annotations

import torch

from mla_spec.config import SpecConfig
from mla_spec.kv_cache import ReqToTokenPool
from mla_spec.model_runner import ModelRunner

__all__ = ["MockKVPool", "MockTarget", "MockDraft", "WordTokenizer", "build_mock_runner"]

_MOD = 9973


class MockKVPool:
    """``buf [num_slots, 2]`` int64 rows ``(token, position)``; pages like the real pool."""

    def __init__(self, num_pages: int, page_size: int, device=None) -> None:
        self.num_pages, self.page_size = num_pages, page_size
        self.device = torch.device(device or "cpu")
        self.buf = torch.full((num_pages * page_size, 2), -1, dtype=torch.int64,
                              device=self.device)


def _window_rows(batch, req_to_token: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Slots ``[N, ctx]`` of every row's causal window and its mask (no host sync)."""
    rows = torch.repeat_interleave(batch.req_pool_indices, batch.seq_lens_q.to(torch.int64),
                                   output_size=n)
    ctx = req_to_token.shape[1]
    cols = torch.arange(ctx, device=req_to_token.device)
    slots = req_to_token[rows][:, :ctx].to(torch.int64)
    mask = cols[None, :] <= batch.positions[:, None]
    return slots, mask


class MockTarget:
    """Deterministic target model (see the module docstring)."""

    def __init__(self, vocab_size: int, req_to_token: torch.Tensor, hidden_size: int = 4) -> None:
        self.vocab_size, self.req_to_token, self.hidden_size = vocab_size, req_to_token, hidden_size
        self.calls = 0

    def __call__(self, input_ids, positions, batch) -> torch.Tensor:
        self.calls += 1
        pool = batch.token_to_kv_pool
        pool.buf[batch.out_cache_loc] = torch.stack([input_ids, positions], dim=1)
        slots, mask = _window_rows(batch, self.req_to_token, input_ids.shape[0])
        kv = pool.buf[slots.clamp(min=0)]  # [N, ctx, 2]
        terms = (kv[..., 0] + 1) * (kv[..., 1] + 1) * mask
        s = terms.sum(dim=1) % _MOD
        nxt = (31 * s + 7 * input_ids + 3) % self.vocab_size
        h = torch.zeros(input_ids.shape[0], self.hidden_size, dtype=torch.float32,
                        device=input_ids.device)
        h[:, 0], h[:, 1] = nxt.float(), s.float()
        return h

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        idx = hidden[:, 0].round().to(torch.int64)
        logits = torch.zeros(hidden.shape[0], self.vocab_size, device=hidden.device)
        return logits.scatter_(1, idx[:, None], 10.0)


class MockDraft(MockTarget):
    """Deterministic MTP draft: right most of the time, wrong where its own KV says so."""

    def __call__(self, input_ids, positions, target_hidden, batch) -> torch.Tensor:
        self.calls += 1
        pool = batch.token_to_kv_pool
        pool.buf[batch.out_cache_loc] = torch.stack([input_ids, positions], dim=1)
        slots, mask = _window_rows(batch, self.req_to_token, input_ids.shape[0])
        kv_sum = (pool.buf[slots.clamp(min=0)][..., 0] * mask).sum(dim=1)
        s = (target_hidden[:, 1].round().to(torch.int64) + (input_ids + 1) * (positions + 2))
        s = s % _MOD
        pred = (31 * s + 7 * input_ids + 3) % self.vocab_size
        pred = torch.where((s + kv_sum) % 3 == 0, (pred + 1) % self.vocab_size, pred)
        h = torch.zeros(input_ids.shape[0], self.hidden_size, dtype=torch.float32,
                        device=input_ids.device)
        h[:, 0], h[:, 1] = pred.float(), s.float()
        return h


def build_mock_runner(*, vocab_size: int = 97, num_pages: int = 64, page_size: int = 4,
                      max_reqs: int = 16, max_context_len: int = 128, device=None,
                      spec: SpecConfig | None = None) -> ModelRunner:
    """A :class:`ModelRunner` over the mock target and draft (no attention backend needed)."""
    device = torch.device(device or "cpu")
    req_pool = ReqToTokenPool(max_reqs, max_context_len, device)
    target = MockTarget(vocab_size, req_pool.req_to_token)
    draft = MockDraft(vocab_size, req_pool.req_to_token)
    return ModelRunner(target, draft, target_pool=MockKVPool(num_pages, page_size, device),
                       draft_pool=MockKVPool(num_pages, page_size, device),
                       req_to_token_pool=req_pool, backend=None, draft_backend=None,
                       page_size=page_size, device=device)


def mock_greedy_reference(prompt: list[int], max_new_tokens: int, vocab_size: int = 97
                          ) -> list[int]:
    """The mock target's greedy continuation computed directly (no cache, no engine)."""
    toks = list(prompt)
    out = []
    for _ in range(max_new_tokens):
        s = sum((t + 1) * (q + 1) for q, t in enumerate(toks)) % _MOD
        nxt = (31 * s + 7 * toks[-1] + 3) % vocab_size
        out.append(nxt)
        toks.append(nxt)
    return out


class WordTokenizer:
    """A stand-in tokenizer for tests with the mock model: token id i <-> the word "w{i}"."""

    class _Encoding:
        def __init__(self, ids):
            self.ids = ids

    def encode(self, text):
        return self._Encoding([int(w[1:]) for w in text.split()])

    def decode(self, ids, skip_special_tokens=True):
        return " ".join(f"w{i}" for i in ids)
