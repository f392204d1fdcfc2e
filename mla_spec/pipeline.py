"""PipelineStepper: the serving pipeline one phase at a time (notebook 06's panel drives it).

An engine step is a prefill, a plain DECODE (spec off) or one speculative round, which the
stepper runs as four phases: ``draft`` (the MTP DECODEs; the verify and v2 draft-extend batches
are planned right after), ``verify`` (TARGET_VERIFY, greedy accept on the device), ``accept``
(host only: the accept lengths copied to show them) and ``draft_extend``. The forward phases are
``Engine.step``'s code (``EagleWorker.round_*``), sent to ranks 1..N-1 as plans of that kind, so
between phases every rank waits on its queue, not in a collective. A round's last phase, a prefill
and a decode go through ``Engine.step(plan)``, which commits tokens and records the step: outputs
and metrics equal ``Engine.generate``'s. The ranks live until :meth:`PipelineStepper.close`, the
stepper's collection or the interpreter's exit (``weakref.finalize``).
"""

from __future__ import annotations

import time
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace

from mla_spec.engine import Engine
from mla_spec.forward_batch import ForwardBatch
from mla_spec.metrics import ForwardRecord, StepRecord
from mla_spec.runtime import tp_worker
from mla_spec.runtime.workers import RankFailedError
from mla_spec.spec.eagle import ROUND_PHASES

__all__ = ["PipelineStepper", "PhaseRecord", "PHASES"]

#: every phase name, in the order a round runs them ("prefill" / "decode" are whole steps)
PHASES = ("prefill", "decode", "draft", "verify", "accept", "draft_extend")


@dataclass
class PhaseRecord:
    """One phase: what ran (forwards with their batches, in order), how long it took (s)."""

    index: int
    round: int  # rounds (decode steps) completed before this phase
    phase: str
    seconds: float
    forwards: list[ForwardRecord] = field(default_factory=list)
    batches: list[tuple[str, ForwardBatch]] = field(default_factory=list)  # one a forward
    planned: list[tuple[str, ForwardBatch]] = field(default_factory=list)  # run by a later phase
    rows: dict[int, int] = field(default_factory=dict)  # request id -> its request row
    step: StepRecord | None = None  # the engine's record, on the phase that commits tokens


class PipelineStepper:
    """An :class:`~mla_spec.engine.Engine` (``engine_kw``; ``model_path`` default: the embedded
    model) with ``prompts`` queued, stepped phase by phase. :attr:`next_phase` names what
    :meth:`step` runs next; asking for it schedules the next step (and gives its KV pages)."""

    def __init__(self, prompts: Sequence[str | Sequence[int]], model_path=None, *,
                 max_new_tokens: int = 24, stop: Sequence[str] | None = None, **engine_kw):
        from mla_spec.data import EMBEDDED_MODEL
        self.attention_backend = engine_kw.get("attention_backend", "auto")
        if model_path is None and engine_kw.get("runner") is None:
            model_path = EMBEDDED_MODEL
        self.engine = Engine(model_path, **engine_kw)
        self._finalizer = weakref.finalize(self, self.engine.shutdown)
        try:
            self.requests = [self.engine.add_request(p, max_new_tokens, stop) for p in prompts]
        except BaseException:
            self.close()
            raise
        self.records: list[PhaseRecord] = []
        self.rounds = 0
        # this round, per request id: drafts d_1..d_ns, the verify's argmax, the accept length
        self.drafts: dict[int, list[int]] = {}
        self.predict: dict[int, list[int]] = {}
        self.accept: dict[int, int] = {}
        self.listeners: list[Callable[[PhaseRecord], None]] = []  # called after each phase
        self._plan, self._rows, self._phases, self._out = None, {}, [], None
        self._round_forwards: list[ForwardRecord] = []
        self._prepared: list[tuple[str, ForwardBatch]] = []  # (model, batch) not run yet
        self._round_seconds = 0.0

    @property
    def closed(self) -> bool:
        return not self._finalizer.alive

    @property
    def next_phase(self) -> str | None:
        """``prefill`` / ``decode`` / ``draft`` / ``verify`` / ``accept`` / ``draft_extend``, or
        None when every request is finished (or the stepper is closed)."""
        if not self._phases:
            sched = self.engine.scheduler
            plan = None if self.closed or not sched.has_work else sched.schedule()
            if plan is None:
                return None
            by_row = {r.req_pool_idx: r.rid for r in sched.running}
            self._plan, self._rows = plan, {by_row[i]: i for i in plan.req_pool_indices}
            self._phases = (["prefill"] if plan.kind == "prefill" else
                            ["draft", "verify", "accept", "draft_extend"]
                            if self.engine.spec.enabled else ["decode"])
        return self._phases[0]

    def step(self) -> PhaseRecord | None:
        """Run the next phase; returns its record (None when there is nothing left)."""
        phase = self.next_phase
        if phase is None:
            return None
        eng, plan = self.engine, self._plan
        eng.runner.prepared = batches = []
        t0 = time.perf_counter()
        forwards, rec = [], None
        try:
            if phase == "accept":
                self.accept = dict(zip(self._rows, self._out.accept.tolist()))
            elif phase in ROUND_PHASES[:2]:  # draft, verify
                updates = plan.slot_updates if phase == "draft" else []
                self._out = self._run_phase(replace(plan, kind=phase, slot_updates=updates))
                forwards = eng.runner.timer.collect()
                if phase == "draft":
                    self.drafts = dict(zip(self._rows, eng.worker.round.drafts.tolist()))
                    self.predict, self.accept = {}, {}
                else:
                    self.predict = dict(zip(self._rows, self._out.predict.tolist()))
            else:  # prefill, decode or draft_extend: an engine step, which commits the tokens
                last = replace(plan, kind="draft_extend", slot_updates=[])
                rec = eng.step(last if phase == "draft_extend" else plan)
                forwards = list(rec.forwards)
        finally:
            eng.runner.prepared = None
        seconds = time.perf_counter() - t0
        self._phases.pop(0)
        if rec is not None:  # the step's record holds the whole round
            rec.forwards[:0] = self._round_forwards
            rec.seconds += self._round_seconds
            self._round_forwards, self._round_seconds = [], 0.0
        else:
            self._round_forwards += forwards
            self._round_seconds += seconds
        self._prepared += batches
        ran = [self._prepared.pop(next(i for i, (w, b) in enumerate(self._prepared)
                                       if (w, b.forward_mode) == (f.model, f.mode)))
               for f in forwards]
        out = PhaseRecord(len(self.records), self.rounds, phase, seconds, forwards, ran,
                          list(self._prepared), dict(self._rows), rec)
        if phase in ("decode", "draft_extend"):
            self.rounds += 1
        self.records.append(out)
        for fn in self.listeners:
            fn(out)
        return out

    def _run_phase(self, plan):
        eng = self.engine
        if eng.tp_size > 1 and eng.workers is None:
            raise RankFailedError("the tensor-parallel ranks are shut down: build a new stepper")
        tp_worker.broadcast_plan(eng._queues, plan)
        try:
            return eng.worker.execute(plan)
        except BaseException:
            self.close()  # the other ranks are mid-phase
            raise

    def run_round(self) -> list[PhaseRecord]:
        """The rest of the current step (or one whole step): its phases' records."""
        out = [self.step()] if self.next_phase else []
        while self._phases:
            out.append(self.step())
        return out

    def run_to_end(self) -> list[PhaseRecord]:
        """Every phase until every request is finished."""
        return list(iter(self.step, None))

    def close(self) -> None:
        """Stop the tensor-parallel ranks (safe to call twice)."""
        self._phases = []
        self._finalizer()

    def __enter__(self) -> PipelineStepper:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
