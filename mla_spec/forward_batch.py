"""ForwardBatch: everything one forward step hands to the model and the attention backend.

Request ``b`` of ``batch_size`` contributes ``seq_lens_q[b]`` query rows, packed request after
request into ``N = total_q`` rows (offsets ``qo_indptr``), and attends over ``kv_lens[b]`` KV
positions: its row ``i`` sits at ``kv_lens[b] - seq_lens_q[b] + i`` and sees the positions up to
its own (causal, aligned to the end of the KV). ``seq_lens`` follows SGLang per mode:

==================  =====================  ==============================  ==============
mode                rows per request       ``seq_lens``                    ``kv_lens``
==================  =====================  ==============================  ==============
EXTEND / MIXED      ``extend_seq_lens``    prefix + extend                 = seq_lens
DECODE              1                      KV length incl. the new token   = seq_lens
TARGET_VERIFY       ``num_draft_tokens``   prefix only (drafts excluded)   seq_lens + ndt
DRAFT_EXTEND (v1)   ``accept_length``      prefix + accepted rows          = seq_lens
DRAFT_EXTEND_V2     ``num_draft_tokens``   prefix + ndt                    = seq_lens
IDLE                0                      empty                           empty
==================  =====================  ==============================  ==============

``accept_length`` counts the bonus token (``1..num_draft_tokens``). The builders (``decode``,
``extend``, ...) take Python lists, validate them and derive the rest.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from functools import cached_property
from itertools import accumulate
from typing import Any

import torch

from mla_spec.forward_mode import CaptureHiddenMode, ForwardMode

__all__ = ["ForwardBatch"]


def _check_lens(name: str, values: Sequence[int], minimum: int = 0) -> list[int]:
    out = [int(v) for v in values]
    for i, v in enumerate(out):
        if v < minimum:
            raise ValueError(f"{name}[{i}] = {v}: every {name} must be >= {minimum}")
    return out


def _i32(values: Sequence[int], device) -> torch.Tensor:
    return torch.tensor(list(values), dtype=torch.int32, device=device)


@dataclass
class ForwardBatch:
    """One step's batch; tensors live on ``device``, the ``*_cpu`` lists mirror them on the host."""

    forward_mode: ForwardMode
    batch_size: int
    seq_lens: torch.Tensor  # [bs] int32, SGLang's convention (see module docstring)
    seq_lens_q: torch.Tensor  # [bs] int32, query rows per request
    qo_indptr: torch.Tensor  # [bs + 1] int32, exclusive prefix sum of seq_lens_q
    positions: torch.Tensor  # [N] int64
    seq_lens_cpu: list[int]
    seq_lens_q_cpu: list[int]
    extend_prefix_lens_cpu: list[int]
    num_draft_tokens: int | None = None
    accept_length: torch.Tensor | None = None  # [bs] int32 in 1..num_draft_tokens
    accept_length_cpu: list[int] | None = None
    req_pool_indices: torch.Tensor | None = None  # [bs] int64, rows of req_to_token
    out_cache_loc: torch.Tensor | None = None  # [N] int64, KV slot of each new row
    capture_hidden_mode: CaptureHiddenMode = CaptureHiddenMode.NULL
    # set by the model runner: this model's paged KV pool and the backend planned for the batch
    token_to_kv_pool: Any = None
    attn_backend: Any = None
    extra: dict = field(default_factory=dict)  # backend-private planning results

    @property
    def device(self) -> torch.device:
        return self.seq_lens.device

    @property
    def cu_seqlens_q(self) -> torch.Tensor:
        """SGLang's name for :attr:`qo_indptr`."""
        return self.qo_indptr

    @property
    def extend_seq_lens(self) -> torch.Tensor:
        """Rows per request (SGLang's name in extend-like modes)."""
        return self.seq_lens_q

    @cached_property
    def extend_prefix_lens(self) -> torch.Tensor:
        return _i32(self.extend_prefix_lens_cpu, self.device)

    @property
    def kv_lens_cpu(self) -> list[int]:
        """KV length each request attends over in this step (after its rows are written)."""
        return [p + q for p, q in zip(self.extend_prefix_lens_cpu, self.seq_lens_q_cpu)]

    @cached_property
    def kv_lens(self) -> torch.Tensor:
        """``[bs]`` int32 on the batch's device, built once (no host copy per layer or capture)."""
        return _i32(self.kv_lens_cpu, self.device)

    @property
    def max_seq_len_q(self) -> int:
        return max(self.seq_lens_q_cpu, default=0)

    @property
    def max_kv_len(self) -> int:
        return max(self.kv_lens_cpu, default=0)

    @property
    def total_q(self) -> int:
        """N, the number of packed query rows (SGLang's ``sum_seq_lens_q``)."""
        return sum(self.seq_lens_q_cpu)

    def to(self, device) -> ForwardBatch:
        """A copy with every tensor on ``device``."""
        tensors = {n: getattr(self, n) for n in ("seq_lens", "seq_lens_q", "qo_indptr",
                   "positions", "accept_length", "req_pool_indices", "out_cache_loc")}
        moved = {n: None if t is None else t.to(device) for n, t in tensors.items()}
        return replace(self, **moved, extra={})

    @classmethod
    def _build(cls, mode: ForwardMode, prefix_lens: list[int], q_lens: list[int],
               seq_lens: list[int], *, device=None, num_draft_tokens: int | None = None,
               accept_lengths: list[int] | None = None,
               capture_hidden_mode: CaptureHiddenMode = CaptureHiddenMode.NULL,
               req_pool_indices: Sequence[int] | None = None,
               out_cache_loc: torch.Tensor | None = None) -> ForwardBatch:
        device = torch.device(device or "cpu")
        bs = len(q_lens)
        indptr = [0, *accumulate(q_lens)]
        positions = [p + i for p, q in zip(prefix_lens, q_lens) for i in range(q)]
        if req_pool_indices is not None and len(req_pool_indices) != bs:
            raise ValueError(f"req_pool_indices has {len(req_pool_indices)} entries; batch_size "
                             f"is {bs}")
        if out_cache_loc is not None and out_cache_loc.numel() != indptr[-1]:
            raise ValueError(f"out_cache_loc has {out_cache_loc.numel()} entries; the batch has "
                             f"{indptr[-1]} query rows")
        return cls(forward_mode=mode, batch_size=bs, seq_lens=_i32(seq_lens, device),
                   seq_lens_q=_i32(q_lens, device), qo_indptr=_i32(indptr, device),
                   positions=torch.tensor(positions, dtype=torch.int64, device=device),
                   seq_lens_cpu=list(seq_lens), seq_lens_q_cpu=list(q_lens),
                   extend_prefix_lens_cpu=list(prefix_lens), num_draft_tokens=num_draft_tokens,
                   accept_length=None if accept_lengths is None else _i32(accept_lengths, device),
                   accept_length_cpu=None if accept_lengths is None else list(accept_lengths),
                   req_pool_indices=None if req_pool_indices is None else torch.tensor(
                       list(req_pool_indices), dtype=torch.int64, device=device),
                   out_cache_loc=None if out_cache_loc is None else out_cache_loc.to(device),
                   capture_hidden_mode=capture_hidden_mode)

    @classmethod
    def decode(cls, seq_lens: Sequence[int], **kw) -> ForwardBatch:
        """DECODE: one row per request; ``seq_lens`` = KV length including the new token (>= 1)."""
        seq = _check_lens("seq_lens", seq_lens, minimum=1)
        _nonempty("decode", seq)
        return cls._build(ForwardMode.DECODE, [s - 1 for s in seq], [1] * len(seq), seq, **kw)

    @classmethod
    def extend(cls, prefix_lens: Sequence[int], extend_lens: Sequence[int], *,
               mixed: bool = False, **kw) -> ForwardBatch:
        """EXTEND (or MIXED): ``extend_lens[b]`` new rows on top of ``prefix_lens[b]`` cached ones
        (0 is allowed for a request, not for the whole batch)."""
        prefix = _check_lens("prefix_lens", prefix_lens)
        ext = _check_lens("extend_lens", extend_lens)
        if len(prefix) != len(ext):
            raise ValueError(f"prefix_lens has {len(prefix)} entries and extend_lens {len(ext)}: "
                             "one per request")
        _nonempty("extend", ext)
        mode = ForwardMode.MIXED if mixed else ForwardMode.EXTEND
        return cls._build(mode, prefix, ext, [p + e for p, e in zip(prefix, ext)], **kw)

    @classmethod
    def target_verify(cls, seq_lens: Sequence[int], num_draft_tokens: int, **kw) -> ForwardBatch:
        """TARGET_VERIFY: ``num_draft_tokens`` rows per request; ``seq_lens`` the committed prefix,
        *excluding* the draft rows (backends attend over ``seq_lens + num_draft_tokens``)."""
        seq = _check_lens("seq_lens", seq_lens)
        _check_ndt(num_draft_tokens)
        _nonempty("target_verify", seq)
        kw.setdefault("capture_hidden_mode", CaptureHiddenMode.FULL)
        return cls._build(ForwardMode.TARGET_VERIFY, seq, [num_draft_tokens] * len(seq), seq,
                          num_draft_tokens=num_draft_tokens, **kw)

    @classmethod
    def draft_extend(cls, seq_lens: Sequence[int], accept_lengths: Sequence[int],
                     num_draft_tokens: int | None = None, **kw) -> ForwardBatch:
        """DRAFT_EXTEND (spec v1): ``accept_lengths[b]`` rows per request (ragged); ``seq_lens``
        the length *after* acceptance, the accepted rows included."""
        seq = _check_lens("seq_lens", seq_lens)
        acc = _check_accept(accept_lengths, len(seq), num_draft_tokens)
        for b, (s, a) in enumerate(zip(seq, acc)):
            if s < a:
                raise ValueError(f"seq_lens[{b}] = {s} < accept_lengths[{b}] = {a}: in "
                                 "DRAFT_EXTEND seq_lens already includes the accepted rows")
        kw.setdefault("capture_hidden_mode", CaptureHiddenMode.LAST)
        return cls._build(ForwardMode.DRAFT_EXTEND, [s - a for s, a in zip(seq, acc)], acc, seq,
                          num_draft_tokens=num_draft_tokens, accept_lengths=acc, **kw)

    @classmethod
    def draft_extend_capacity(cls, seq_lens: Sequence[int], num_draft_tokens: int,
                              req_pool_indices: Sequence[int], **kw) -> ForwardBatch:
        """DRAFT_EXTEND (spec v1) shaped for a CUDA graph: its capacity of ``bs * ndt`` rows, as
        ``bs`` requests of ``ndt`` rows (``seq_lens`` after acceptance) then ``bs`` padding
        requests of none on the scratch request row 0. A captured round refreshes the rows and
        lengths from the accept lengths on the device (``kernels.ops.ragged_extend``)."""
        _check_ndt(num_draft_tokens)
        seq = _check_lens("seq_lens", seq_lens, minimum=num_draft_tokens)
        bs, ndt = len(seq), num_draft_tokens
        _nonempty("draft extend", [ndt] * bs)
        kw.setdefault("capture_hidden_mode", CaptureHiddenMode.LAST)
        return cls._build(ForwardMode.DRAFT_EXTEND, [s - ndt for s in seq] + [0] * bs,
                          [ndt] * bs + [0] * bs, seq + [0] * bs, num_draft_tokens=ndt,
                          req_pool_indices=[*req_pool_indices, *([0] * bs)], **kw)

    @classmethod
    def draft_extend_v2(cls, seq_lens: Sequence[int], num_draft_tokens: int,
                        accept_lengths: Sequence[int], **kw) -> ForwardBatch:
        """DRAFT_EXTEND_V2 (spec v2): ``num_draft_tokens`` rows per request (fixed shape).
        ``seq_lens`` is the prefix the verify saw (the batch stores ``+ num_draft_tokens``).
        ``accept_lengths`` does not shape attention: it selects row ``accept_length - 1`` after."""
        prefix = _check_lens("seq_lens", seq_lens)
        _check_ndt(num_draft_tokens)
        acc = _check_accept(accept_lengths, len(prefix), num_draft_tokens)
        kw.setdefault("capture_hidden_mode", CaptureHiddenMode.FULL)
        return cls._build(ForwardMode.DRAFT_EXTEND_V2, prefix, [num_draft_tokens] * len(prefix),
                          [p + num_draft_tokens for p in prefix],
                          num_draft_tokens=num_draft_tokens, accept_lengths=acc, **kw)

    @classmethod
    def idle(cls, *, device=None) -> ForwardBatch:
        """IDLE: no requests, no rows. Backends return an empty ``[0, H, 512]``."""
        return cls._build(ForwardMode.IDLE, [], [], [], device=device)

    def select_last_rows(self) -> torch.Tensor:
        """``[bs]`` int64 index of each request's last row in the packed ``[N, ...]`` tensors
        (DRAFT_EXTEND_V2: row ``accept_length - 1``, the last accepted token)."""
        start = self.qo_indptr[:-1].to(torch.int64)
        if self.forward_mode.is_draft_extend_v2() and self.accept_length is not None:
            return start + self.accept_length.to(torch.int64) - 1
        return self.qo_indptr[1:].to(torch.int64) - 1


def _nonempty(mode: str, lens: list[int]) -> None:
    if not lens:
        raise ValueError(f"a {mode} batch needs at least one request; use ForwardBatch.idle()")
    if sum(lens) == 0:
        raise ValueError(f"a {mode} batch needs at least one query row in total")


def _check_ndt(num_draft_tokens: int) -> None:
    if not isinstance(num_draft_tokens, int) or num_draft_tokens < 1:
        raise ValueError(f"num_draft_tokens = {num_draft_tokens!r}: must be an int >= 1")


def _check_accept(values: Sequence[int], bs: int, ndt: int | None) -> list[int]:
    acc = [int(a) for a in values]
    if len(acc) != bs:
        raise ValueError(f"accept_lengths has {len(acc)} entries; the batch has {bs} requests")
    _nonempty("draft extend", acc)
    hi = ndt if ndt is not None else max(acc)
    for b, a in enumerate(acc):
        if not 1 <= a <= hi:
            raise ValueError(f"accept_lengths[{b}] = {a}: accept_length counts the bonus token "
                             f"and must be in 1..num_draft_tokens ({hi})")
    return acc
