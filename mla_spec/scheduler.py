"""Host-side scheduling: requests, KV page bookkeeping, admission, preemption, step plans.

Token bookkeeping (one meaning everywhere). A running request has ``all_ids = prompt + output``;
its first ``kv_len = len(all_ids) - 1`` tokens ``t_0 .. t_{L-1}`` have target KV, and the last one,
``verified_id = t_L``, was sampled but has no KV yet (it is the input of the next DECODE row, or
row 0 of the next TARGET_VERIFY). A step needs KV slots for positions ``L .. L + rows - 1`` with
``rows = 1`` (DECODE) or ``num_draft_tokens`` (TARGET_VERIFY; draft decode and draft extend write
inside that window too, in the draft model's pool at the same slots).

Pages. Page 0 and request row 0 are reserved as scratch (CUDA-graph padding rows write there), so
no request ever owns them. Before each decode step :meth:`Scheduler.schedule` gives every running
request the pages its next step writes; when the pool runs dry it *preempts* the most recently
admitted request (frees its pages, puts it back at the head of the queue with its tokens kept; it
is recomputed by a prefill over ``all_ids[:-1]`` later). A request that could never fit, even alone,
is rejected at :meth:`Scheduler.add` with a message saying what would fit. Another request's pages
are never touched: a page belongs to exactly one request until that request frees it.

The output of :meth:`Scheduler.schedule` is a :class:`StepPlan`: plain lists, picklable, the same
message rank 0 sends to the other tensor-parallel ranks.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

from mla_spec.kv_cache import KVCacheFullError, PageAllocator
from mla_spec.metrics import RequestMetrics

__all__ = ["Req", "StepPlan", "Scheduler", "RequestRejectedError"]


class RequestRejectedError(ValueError):
    """A request can never be served with this KV pool / context length."""


@dataclass
class Req:
    """One generation request and its state."""

    rid: int
    prompt_ids: list[int]
    max_new_tokens: int
    stop: tuple[str, ...] = ()
    stop_token_ids: frozenset[int] = frozenset()
    output_ids: list[int] = field(default_factory=list)
    req_pool_idx: int | None = None
    pages: list[int] = field(default_factory=list)
    finished_reason: str | None = None  # "length" | "stop" | "eos" | "abort"
    error: str | None = None
    text: str = ""
    metrics: RequestMetrics = field(default_factory=RequestMetrics)

    @property
    def all_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    @property
    def kv_len(self) -> int:
        """L: tokens with target KV once prefilled (the verified token has none)."""
        return len(self.prompt_ids) + len(self.output_ids) - 1

    @property
    def finished(self) -> bool:
        return self.finished_reason is not None

    @property
    def remaining(self) -> int:
        return self.max_new_tokens - len(self.output_ids)


@dataclass
class StepPlan:
    """One step, as every rank executes it (host data only).

    ``kind``: "prefill" (EXTEND over ``fill_ids``; ``known_next_ids[b] >= 0`` for a resumed request
    whose next token is already known, -1 to sample), "decode" (DECODE, or one speculative round
    when speculation is on) or "stop". ``seq_lens``: prefill: rows per request; decode: L.
    ``slot_updates``: ``(req_pool_idx, first_page_index, page ids)`` to write into req_to_token.
    """

    kind: str
    req_pool_indices: list[int] = field(default_factory=list)
    seq_lens: list[int] = field(default_factory=list)
    fill_ids: list[list[int]] | None = None
    known_next_ids: list[int] | None = None
    slot_updates: list[tuple[int, int, list[int]]] = field(default_factory=list)

    @property
    def batch_size(self) -> int:
        return len(self.req_pool_indices)


class Scheduler:
    """Continuous batching over a paged KV pool (prefill first, then decode rounds).

    Parameters
    ----------
    num_pages, page_size : the KV pool (page 0 is reserved scratch)
    max_reqs : rows of req_to_token (row 0 is reserved scratch)
    max_context_len : columns of req_to_token
    step_rows : KV rows a decode step writes per request (1, or num_draft_tokens with spec)
    max_running : most requests decoding at once
    max_prefill_tokens : token budget of one prefill step (a longer prompt runs alone)
    """

    def __init__(self, num_pages: int, page_size: int, max_reqs: int, max_context_len: int,
                 step_rows: int = 1, max_running: int = 256, max_prefill_tokens: int = 8192):
        if num_pages < 2 or max_reqs < 2:
            raise ValueError("num_pages and max_reqs must be >= 2 (page 0 and row 0 are scratch)")
        self.page_size = page_size
        self.num_pages = num_pages
        self.max_context_len = max_context_len
        self.step_rows = step_rows
        self.max_running = min(max_running, max_reqs - 1)
        self.max_prefill_tokens = max_prefill_tokens
        self.allocator = PageAllocator(num_pages)
        self.allocator.alloc(1)  # page 0: scratch
        self._free_rows = list(range(max_reqs - 1, 0, -1))  # row 0: scratch
        self.waiting: deque[Req] = deque()
        self.running: list[Req] = []
        self._next_rid = 0
        self.num_preemptions = 0

    # ---- requests ----------------------------------------------------------------------------
    @property
    def usable_pages(self) -> int:
        return self.num_pages - 1

    def pages_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

    def check_fits(self, prompt_len: int, max_new_tokens: int) -> None:
        """Raise :class:`RequestRejectedError` if the request can never be served."""
        if prompt_len < 1:
            raise RequestRejectedError("a request needs at least one prompt token")
        if max_new_tokens < 0:
            raise RequestRejectedError(f"max_new_tokens {max_new_tokens}: must be >= 0")
        need = prompt_len + max_new_tokens + self.step_rows
        if need > self.max_context_len:
            raise RequestRejectedError(
                f"request needs {need} KV positions (prompt {prompt_len} + max_new_tokens "
                f"{max_new_tokens} + {self.step_rows} step rows) > max_context_len "
                f"{self.max_context_len}: lower max_new_tokens to at most "
                f"{self.max_context_len - prompt_len - self.step_rows} or raise max_context_len"
            )
        pages = self.pages_for(need)
        if pages > self.usable_pages:
            raise RequestRejectedError(
                f"KV cache too small: the request needs {pages} pages of {self.page_size} tokens "
                f"and the pool has {self.usable_pages} usable pages; raise num_pages to >= "
                f"{pages + 1} or lower max_new_tokens"
            )

    def add(self, prompt_ids: list[int], max_new_tokens: int, stop=(),
            stop_token_ids=()) -> Req:
        """Queue a request (rejected with :class:`RequestRejectedError` if it can never fit)."""
        self.check_fits(len(prompt_ids), max_new_tokens)
        req = Req(self._next_rid, list(prompt_ids), int(max_new_tokens), tuple(stop),
                  frozenset(stop_token_ids))
        req.metrics.prompt_tokens = len(prompt_ids)
        req.metrics.arrival_time = time.perf_counter()
        self._next_rid += 1
        self.waiting.append(req)
        return req

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    # ---- pages -------------------------------------------------------------------------------
    def _grow(self, req: Req, num_tokens: int, updates: list) -> None:
        """Give ``req`` pages for positions < num_tokens (raises KVCacheFullError)."""
        need = self.pages_for(num_tokens) - len(req.pages)
        if need <= 0:
            return
        new = self.allocator.alloc(need)
        updates.append((req.req_pool_idx, len(req.pages), new))
        req.pages.extend(new)

    def release(self, req: Req) -> None:
        """Free a request's pages and request row."""
        if req.pages:
            self.allocator.free(req.pages)
            req.pages = []
        if req.req_pool_idx is not None:
            self._free_rows.append(req.req_pool_idx)
            req.req_pool_idx = None

    def _preempt(self, req: Req) -> None:
        self.running.remove(req)
        self.release(req)
        req.metrics.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(req)

    # ---- scheduling ----------------------------------------------------------------------------
    def schedule(self) -> StepPlan | None:
        """The next step: a prefill if waiting requests fit, else a decode round (or None)."""
        plan = self._schedule_prefill()
        if plan is not None:
            return plan
        return self._schedule_decode()

    def _schedule_prefill(self) -> StepPlan | None:
        plan = StepPlan("prefill", fill_ids=[], known_next_ids=[])
        budget = self.max_prefill_tokens
        while self.waiting and len(self.running) < self.max_running and self._free_rows:
            req = self.waiting[0]
            fill = req.all_ids[:-1] if req.output_ids else list(req.prompt_ids)
            if plan.batch_size and len(fill) > budget:
                break
            # room for the prefill plus the first decode step, so admission never thrashes
            pages = self.pages_for(len(fill) + self.step_rows + 1)
            if pages > self.allocator.num_free:
                break
            self.waiting.popleft()
            req.req_pool_idx = self._free_rows.pop()
            self._grow(req, len(fill), plan.slot_updates)
            self.running.append(req)
            plan.req_pool_indices.append(req.req_pool_idx)
            plan.seq_lens.append(len(fill))
            plan.fill_ids.append(fill)
            plan.known_next_ids.append(req.output_ids[-1] if req.output_ids else -1)
            budget -= len(fill)
        if not plan.batch_size and self.waiting and not self.running:
            req = self.waiting[0]
            raise KVCacheFullError(
                f"request {req.rid} cannot be admitted into an idle engine: "
                f"{self.allocator.num_free} free pages, {len(self._free_rows)} free request rows"
            )
        return plan if plan.batch_size else None

    def _schedule_decode(self) -> StepPlan | None:
        if not self.running:
            return None
        updates: list = []
        i = 0
        while i < len(self.running):
            req = self.running[i]
            try:
                self._grow(req, req.kv_len + self.step_rows, updates)
                i += 1
            except KVCacheFullError:
                if len(self.running) == 1:
                    raise KVCacheFullError(
                        f"request {req.rid} alone needs more pages than the pool has free "
                        f"({self.allocator.num_free}); raise num_pages"
                    ) from None
                victim = self.running[-1]
                # drop updates for the victim: its pages are free again
                updates = [u for u in updates if u[0] != victim.req_pool_idx]
                self._preempt(victim)
                i = min(i, len(self.running))
        return StepPlan(
            "decode",
            req_pool_indices=[r.req_pool_idx for r in self.running],
            seq_lens=[r.kv_len for r in self.running],
            slot_updates=updates,
        )

    def finish(self, req: Req, reason: str) -> None:
        """Mark ``req`` finished and free its KV."""
        req.finished_reason = reason
        req.metrics.finish_time = time.perf_counter()
        if req in self.running:
            self.running.remove(req)
        self.release(req)
