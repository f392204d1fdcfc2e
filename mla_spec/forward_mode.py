"""Forward modes of the speculative-decoding loop, with SGLang's names and predicates.

Backends, model and CUDA-graph runner branch only through the predicates (SGLang's truth table
at commit d98b81e26): ``TARGET_VERIFY`` counts as extend; ``DRAFT_EXTEND_V2`` does not unless
asked; ``SPLIT_PREFILL`` is not ``is_extend()`` but is ``is_extend_or_draft_extend_or_mixed()``.
"""

from enum import IntEnum, auto
from functools import total_ordering

__all__ = ["ForwardMode", "CaptureHiddenMode"]


class ForwardMode(IntEnum):
    """One step of the serving loop (values 1..8 in SGLang's order)."""

    EXTEND = auto()  # prefill, possibly on top of a cached prefix
    DECODE = auto()  # one new token per request
    MIXED = auto()  # chunked prefill and decode in one batch
    IDLE = auto()  # no sequences (data-parallel filler)
    TARGET_VERIFY = auto()  # the target model scores num_draft_tokens rows per request
    DRAFT_EXTEND = auto()  # v1: the draft model ingests accept_length rows per request (ragged)
    DRAFT_EXTEND_V2 = auto()  # v2: num_draft_tokens rows per request (fixed shape)
    SPLIT_PREFILL = auto()  # prefill split across PD-multiplexed steps

    def is_extend(self, include_draft_extend_v2: bool = False) -> bool:
        """EXTEND, MIXED, TARGET_VERIFY, DRAFT_EXTEND (and DRAFT_EXTEND_V2 when asked)."""
        modes = {ForwardMode.EXTEND, ForwardMode.MIXED, ForwardMode.TARGET_VERIFY,
                 ForwardMode.DRAFT_EXTEND}
        if include_draft_extend_v2:
            modes.add(ForwardMode.DRAFT_EXTEND_V2)
        return self in modes

    def is_prefill(self) -> bool:
        """Alias of :meth:`is_extend` with its defaults (SGLang keeps both names)."""
        return self.is_extend()

    def is_decode(self) -> bool:
        return self == ForwardMode.DECODE

    def is_mixed(self) -> bool:
        return self == ForwardMode.MIXED

    def is_idle(self) -> bool:
        return self == ForwardMode.IDLE

    def is_decode_or_idle(self) -> bool:
        return self in (ForwardMode.DECODE, ForwardMode.IDLE)

    def is_target_verify(self) -> bool:
        return self == ForwardMode.TARGET_VERIFY

    def is_draft_extend(self, include_v2: bool = False) -> bool:
        """DRAFT_EXTEND, and DRAFT_EXTEND_V2 too when ``include_v2``."""
        if include_v2:
            return self in (ForwardMode.DRAFT_EXTEND, ForwardMode.DRAFT_EXTEND_V2)
        return self == ForwardMode.DRAFT_EXTEND

    def is_draft_extend_v2(self) -> bool:
        return self == ForwardMode.DRAFT_EXTEND_V2

    def is_extend_or_draft_extend_or_mixed(self) -> bool:
        return self in (ForwardMode.EXTEND, ForwardMode.DRAFT_EXTEND, ForwardMode.MIXED,
                        ForwardMode.SPLIT_PREFILL)

    def is_cuda_graph(self) -> bool:
        """Modes SGLang's target graph runner captures (fixed rows per request)."""
        return self in (ForwardMode.DECODE, ForwardMode.TARGET_VERIFY, ForwardMode.IDLE)

    def is_cpu_graph(self) -> bool:
        return self == ForwardMode.DECODE

    def is_split_prefill(self) -> bool:
        return self == ForwardMode.SPLIT_PREFILL


@total_ordering
class CaptureHiddenMode(IntEnum):
    """Which hidden states a forward keeps for the draft model: none, last row, every row."""

    NULL = 0
    LAST = 1
    FULL = 2

    def need_capture(self) -> bool:
        return self != CaptureHiddenMode.NULL

    def is_full(self) -> bool:
        return self == CaptureHiddenMode.FULL

    def is_last(self) -> bool:
        return self == CaptureHiddenMode.LAST

    def __lt__(self, other: object) -> bool:
        if not isinstance(other, CaptureHiddenMode):
            return NotImplemented
        return self.value < other.value
