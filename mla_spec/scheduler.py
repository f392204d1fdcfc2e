"""Host-side scheduling: requests, KV page bookkeeping, admission, preemption, step plans.

Tokens: of a running request's ``all_ids = prompt + output`` the first ``kv_len = L`` have target
KV, the last (``verified_id``) none yet. A step writes KV at ``L .. L + rows - 1``, ``rows`` 1
(DECODE) or ``num_draft_tokens`` (TARGET_VERIFY; the draft writes there too, in its own pool).

Pages: page 0 and request row 0 are scratch (CUDA-graph padding). Each decode step first gives
every running request the pages it will write; when the pool runs dry the latest admitted request
is preempted (pages freed, tokens kept, recomputed by a prefill later). A request that could
never fit is rejected at :meth:`Scheduler.add`. A page belongs to one request until freed.
Failed steps (:meth:`Scheduler.step_failed`): a lone request is blamed (``"error"``); several
are requeued as *suspects*, each run alone until one solo step succeeds. ``schedule`` returns a
picklable :class:`StepPlan`, the message sent to all ranks.
"""

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
    finished_reason: str | None = None  # "length" | "stop" | "eos" | "abort" | "error"
    error: str | None = None
    suspect: bool = False  # was in a failed step: runs alone until a solo step succeeds
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

    ``kind``: "prefill" (EXTEND over ``fill_ids``; ``known_next_ids[b] >= 0`` when the next token
    is already known, -1 to sample), "decode" (DECODE or one speculative round) or "stop".
    ``seq_lens``: rows per request (prefill) or L (decode). ``slot_updates``: ``(req_pool_idx,
    first_page_index, page ids)`` to write into req_to_token."""

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

    ``step_rows``: KV rows a decode step writes per request (1, or num_draft_tokens with spec);
    ``max_prefill_tokens``: token budget of one prefill step (a longer prompt runs alone)."""

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

    @property
    def usable_pages(self) -> int:
        return self.num_pages - 1

    def pages_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

    def check_fits(self, prompt_len: int, max_new_tokens: int) -> None:
        """Raise :class:`RequestRejectedError` if the request can never be served."""
        if prompt_len < 1:
            raise RequestRejectedError("a request needs at least one prompt token")
        if max_new_tokens < 1:
            raise RequestRejectedError(f"max_new_tokens {max_new_tokens}: must be >= 1")
        need = prompt_len + max_new_tokens + self.step_rows
        if need > self.max_context_len:
            room = self.max_context_len - prompt_len - self.step_rows
            most = self.max_context_len - self.step_rows - 1  # the longest prompt that fits
            fix = (f"lower max_new_tokens to at most {room}, or " if room >= 1 else
                   f"shorten the prompt to at most {most} tokens, or " if most >= 1 else "")
            raise RequestRejectedError(
                f"request needs {need} KV positions (prompt {prompt_len} + max_new_tokens "
                f"{max_new_tokens} + {self.step_rows} step rows) > max_context_len "
                f"{self.max_context_len}: {fix}raise max_context_len to >= {need}")
        pages = self.pages_for(need)
        if pages > self.usable_pages:
            raise RequestRejectedError(
                f"KV cache too small: the request needs {pages} pages of {self.page_size} tokens "
                f"and the pool has {self.usable_pages} usable pages; raise num_pages to >= "
                f"{pages + 1} or lower max_new_tokens")

    def add(self, prompt_ids: list[int], max_new_tokens: int, stop=(), stop_token_ids=()) -> Req:
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

    def schedule(self) -> StepPlan | None:
        """The next step: a prefill if waiting requests fit, else a decode round (or None)."""
        plan = self._schedule_prefill()
        return plan if plan is not None else self._schedule_decode()

    def _schedule_prefill(self) -> StepPlan | None:
        plan = StepPlan("prefill", fill_ids=[], known_next_ids=[])
        budget = self.max_prefill_tokens
        plan_has_suspect = False
        while self.waiting and len(self.running) < self.max_running and self._free_rows:
            req = self.waiting[0]
            fill = req.all_ids[:-1] if req.output_ids else list(req.prompt_ids)
            if plan.batch_size and (len(fill) > budget or req.suspect or plan_has_suspect):
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
            plan_has_suspect = req.suspect
        if not plan.batch_size and self.waiting and not self.running:
            req = self.waiting[0]
            raise KVCacheFullError(
                f"request {req.rid} cannot be admitted into an idle engine: "
                f"{self.allocator.num_free} free pages, {len(self._free_rows)} free request rows")
        return plan if plan.batch_size else None

    def _schedule_decode(self) -> StepPlan | None:
        if not self.running:
            return None
        solo = next((r for r in self.running if r.suspect), None)
        reqs = [solo] if solo is not None else self.running  # a suspect decodes alone
        updates: list = []
        i = 0
        while i < len(reqs):
            req = reqs[i]
            try:
                self._grow(req, req.kv_len + self.step_rows, updates)
                i += 1
            except KVCacheFullError:
                if len(self.running) == 1:
                    raise KVCacheFullError(
                        f"request {req.rid} alone needs more pages than the pool has free "
                        f"({self.allocator.num_free}); raise num_pages") from None
                victim = next(r for r in reversed(self.running) if r is not solo)
                # drop updates for the victim: its pages are free again
                updates = [u for u in updates if u[0] != victim.req_pool_idx]
                self._preempt(victim)
                i = min(i, len(reqs))
        return StepPlan("decode", req_pool_indices=[r.req_pool_idx for r in reqs],
                        seq_lens=[r.kv_len for r in reqs], slot_updates=updates)

    def finish(self, req: Req, reason: str, error: str | None = None) -> None:
        """Mark ``req`` finished (running or still waiting) and free its KV."""
        req.finished_reason, req.error = reason, error or req.error
        req.metrics.finish_time = time.perf_counter()
        if req in self.running:
            self.running.remove(req)
        if req in self.waiting:
            self.waiting.remove(req)
        self.release(req)

    def step_failed(self, reqs: list[Req], error: str | None) -> None:
        """The step of ``reqs`` raised ``error``: blame a lone one, requeue several (None: all)."""
        if error is not None and len(reqs) == 1:
            self.finish(reqs[0], "error", error)
            return
        for req in reversed(reqs):
            self.running.remove(req)
            self.release(req)
            req.suspect = req.suspect or error is not None
            self.waiting.appendleft(req)
