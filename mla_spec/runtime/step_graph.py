"""Whole serving steps as one CUDA graph each, per batch-size bucket.

``"decode"`` (spec off): target DECODE, logits, greedy next ids, ``verified_id`` updated.
``"round"`` (spec v1 / v2): the draft DECODEs, TARGET_VERIFY, greedy accept, the draft extend
(v2: DRAFT_EXTEND_V2; v1: DRAFT_EXTEND at its capacity, its ragged rows laid out from the accept
lengths on the device, ``kernels.ops.ragged_extend``) and the next round's first draft. A replay
costs one host-to-device copy (the request rows and their committed lengths ``L``) and one
launch: every batch tensor (positions, lengths, KV slots through ``req_to_token``) and the
attention plan's device lengths are derived inside the graph. Host-side plan values stay the
capture's (planned at ``max_context_len``), as in ``cuda_graph``.

Sub-batch ``(offset o, rows q)`` of a step: rows at positions ``L + o .. L + o + q - 1``, KV
length ``L + o + q``; ``seq_lens`` is that KV length except in TARGET_VERIFY (``L + o``, SGLang's
convention: ``forward_batch``). Draft step ``i``: (i, 1); verify and draft extend: (0, ndt);
plain decode: (0, 1); v1's draft extend: (0, None). Padded bucket rows are scratch request row 0
with ``L = 0``.
"""

from __future__ import annotations

import contextlib
import gc
import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch

from mla_spec.forward_batch import ForwardBatch
from mla_spec.forward_mode import CaptureHiddenMode, ForwardMode
from mla_spec.kernels.ops.ragged_extend import ragged_extend_layout, ragged_extend_layout_ref
from mla_spec.kernels.ops.step_glue import refresh_rows, refresh_rows_ref

__all__ = ["StepGraphs", "gc_paused"]

logger = logging.getLogger(__name__)


@dataclass
class _StepGraph:
    graph: torch.cuda.CUDAGraph | None  # None: ``body`` runs eagerly (``use_graphs=False``)
    inputs: torch.Tensor  # [2, B] int64: request rows, committed lengths
    outputs: tuple[torch.Tensor, ...]  # [B, ...] each
    body: Callable[[], tuple]
    bucket: int


@contextlib.contextmanager
def gc_paused():
    """Python's cyclic GC off for the block (back on afterwards, if it was on): a finalizer
    freeing CUDA objects must not run inside a capture."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


class StepGraphs:
    """Captured whole steps keyed by (kind, bucket); see the module docstring."""

    def __init__(self, runner, worker, batch_sizes) -> None:
        self.runner, self.worker = runner, worker
        self.batch_sizes = sorted(batch_sizes)
        self.graphs: dict[tuple[str, int], _StepGraph] = {}

    @classmethod
    def capture(cls, runner, worker, batch_sizes, pool=None,
                use_graphs: bool = True) -> StepGraphs | None:
        """Capture the decode step (spec off) or the round (spec v1 / v2); None (logged) when a
        capture fails: the engine then runs the per-forward graphs. ``use_graphs=False`` keeps the
        step bodies uncaptured (any device: the same code path, run eagerly at each replay)."""
        kinds = ["round"] if worker.spec.enabled else ["decode"]
        g = cls(runner, worker, batch_sizes)
        runner.capturing = True
        try:
            for kind in kinds:
                for bs in reversed(g.batch_sizes):
                    g.graphs[(kind, bs)] = g._capture(kind, bs, pool, use_graphs)
        except Exception as e:  # noqa: BLE001 - per-forward graphs remain
            logger.warning("step graphs off: %s: %s", type(e).__name__, e)
            return None
        finally:
            runner.capturing = False
        return g

    def _sub_batches(self, kind: str, bs: int) -> list[tuple[ForwardBatch, int, int | None]]:
        """The step's static batches with their (offset, rows), planned at max_context_len;
        rows None: spec v1's draft extend at capacity, laid out after the verify."""
        run, ctx, dev = self.runner, self.runner.req_to_token.shape[1], self.runner.device
        kw = dict(req_pool_indices=[0] * bs, device=dev)
        if kind == "decode":
            return [(run.prepare("target", self._slots(ForwardBatch.decode([ctx] * bs, **kw))),
                     0, 1)]
        ndt = self.worker.spec.num_draft_tokens
        out = [(run.prepare("draft", self._slots(ForwardBatch.decode(
            [ctx] * bs, capture_hidden_mode=CaptureHiddenMode.LAST, **kw))), i, 1)
            for i in range(self.worker.spec.num_steps - 1)]  # as EagleWorker.draft_batches
        out.append((run.prepare("target", self._slots(ForwardBatch.target_verify(
            [ctx - ndt] * bs, ndt, **kw))), 0, ndt))
        if self.worker.spec.version == "v1":
            out.append((run.prepare("draft", self._slots(ForwardBatch.draft_extend_capacity(
                [ctx] * bs, ndt, **kw))), 0, None))
        else:
            out.append((run.prepare("draft", self._slots(ForwardBatch.draft_extend_v2(
                [ctx - ndt] * bs, ndt, [1] * bs, **kw))), 0, ndt))
        return out

    @staticmethod
    def _slots(b: ForwardBatch) -> ForwardBatch:  # the static batch's KV slots, refreshed
        b.out_cache_loc = torch.zeros(b.total_q, dtype=torch.int64, device=b.device)
        return b

    def _refresh(self, subs, rows: torch.Tensor, lens: torch.Tensor) -> None:
        """Device work: every sub-batch's tensors from the request rows and lengths, one
        ``refresh_rows`` launch a sub-batch (positions, KV slots, lengths, request rows of the
        batch and of its attention plan; the twin on CPU)."""
        r2t = self.runner.req_to_token
        fill = refresh_rows if rows.is_cuda else refresh_rows_ref
        for b, o, q in subs:
            if q is None:  # laid out after the verify: _ragged_layout
                continue
            kv = o + q  # KV length - L
            lens_out = [(b.seq_lens, o if b.forward_mode.is_target_verify() else kv)]
            rows_out = [b.req_pool_indices]
            if "kv_lens" in b.__dict__:  # ForwardBatch.kv_lens, built once
                lens_out.append((b.kv_lens, kv))
            plan = self._attn_plan(b)
            if plan is not None:
                lens_out.append((plan.kv_lens, kv))
                rows_out.append(plan.req_pool_indices)
            fill(rows, lens, r2t, o, q, b.positions, b.out_cache_loc, tuple(lens_out),
                 tuple(rows_out))

    @staticmethod
    def _attn_plan(b: ForwardBatch):
        """The batch's ``AttnPlan`` (its device tensors are refreshed too), or None."""
        plan = b.extra.get(b.attn_backend.name) if b.attn_backend is not None else None
        return plan if hasattr(plan, "kv_lens") else None

    def _ragged_layout(self, b: ForwardBatch, rows, lens, accept, ndt: int):
        """Spec v1's draft extend at capacity from the device accept lengths (one launch;
        ``kernels.ops.ragged_extend``) -> (verify row of each row, last row of each request)."""
        plan = self._attn_plan(b)
        lens_out = [b.seq_lens] + ([b.kv_lens] if "kv_lens" in b.__dict__ else [])
        rows_out = [b.req_pool_indices]
        if plan is not None:  # written twice where the plan shares the batch's tensor
            lens_out.append(plan.kv_lens)
            rows_out.append(plan.req_pool_indices)
        fill = ragged_extend_layout if rows.is_cuda else ragged_extend_layout_ref
        src, last = fill(accept, rows, lens, self.runner.req_to_token, ndt, b.positions,
                         b.out_cache_loc, b.qo_indptr, b.seq_lens_q, tuple(lens_out),
                         tuple(rows_out))
        if plan is not None:  # the plan's copies where they are not the batch's own tensors
            for mine, theirs in ((plan.qo_indptr, b.qo_indptr), (plan.seq_lens_q, b.seq_lens_q)):
                if mine is not theirs:
                    mine.copy_(theirs)
        return src, last

    def build(self, kind: str, bs: int):
        """(inputs ``[2, bs]`` int64: request rows and committed lengths, ``body``): ``body()``
        runs the whole step on the static batches from ``inputs`` (device work only) and returns
        its outputs; ``_capture`` records it in a graph, a CPU test calls it directly."""
        run, worker, dev = self.runner, self.worker, self.runner.device
        subs = self._sub_batches(kind, bs)
        inputs = torch.zeros(2, bs, dtype=torch.int64, device=dev)
        rows, lens = inputs[0], inputs[1]
        if kind == "round":
            cfg = run.config
            worker.ensure_draft_state(int(getattr(cfg, "hidden_size", None)
                                          or run.target.hidden_size),
                                      getattr(run.target, "dtype", torch.float32))

        def body():
            self._refresh(subs, rows, lens)
            if kind == "decode":
                return (worker.decode_body(subs[0][0], rows),)
            batches = [b for b, _, _ in subs]
            eb, ndt = batches[-1], worker.spec.num_draft_tokens
            layout = None if subs[-1][2] is not None else (
                lambda accept: self._ragged_layout(eb, rows, lens, accept, ndt))
            return worker.round_body(batches[:-2], batches[-2], eb, rows, layout)

        return inputs, body

    def _capture(self, kind: str, bs: int, pool, use_graphs: bool = True) -> _StepGraph:
        inputs, body = self.build(kind, bs)
        if not use_graphs:
            return _StepGraph(None, inputs, (), body, bs)
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):
                body()
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with gc_paused(), torch.cuda.graph(graph, pool=pool, capture_error_mode="relaxed"):
            outputs = body()
        return _StepGraph(graph, inputs, tuple(outputs), body, bs)

    def _bucket(self, bs: int) -> int | None:
        return next((b for b in self.batch_sizes if b >= bs), None)

    def can_run(self, kind: str, bs: int) -> bool:
        b = self._bucket(bs)
        return b is not None and (kind, b) in self.graphs

    def replay(self, kind: str, plan) -> tuple[torch.Tensor, ...]:
        """Copy the plan's request rows and lengths in, replay, return the outputs' live rows."""
        bs = plan.batch_size
        g = self.graphs[(kind, self._bucket(bs))]
        pad = [0] * (g.bucket - bs)
        g.inputs.copy_(torch.tensor([list(plan.req_pool_indices) + pad,
                                     list(plan.seq_lens) + pad], dtype=torch.int64))
        decode = kind == "decode"
        rows = bs * (1 if decode else self.worker.spec.num_draft_tokens)
        mode = ForwardMode.DECODE if decode else ForwardMode.TARGET_VERIFY
        with self.runner.timer.section(mode, "target" if decode else "round", rows, bs,
                                       graph=g.graph is not None):
            if g.graph is None:
                outputs = g.body()
            else:
                g.graph.replay()
                outputs = g.outputs
        return tuple(o[:bs] for o in outputs)
