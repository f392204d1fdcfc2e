"""CUDA graphs for the fixed-shape forwards of the serving loop, per batch-size bucket.

Target DECODE / TARGET_VERIFY and draft DECODE / DRAFT_EXTEND_V2. Each graph owns a static
ForwardBatch; :meth:`CudaGraphRunner.replay` copies the step's planned batch into it and pads the
bucket with scratch requests (row 0, page 0). Host-side plan values stay the capture's (planned
at ``max_context_len``). Only a model that never syncs with the host over a backend that reads
its plan from device memory is captured; else :attr:`CudaGraphRunner.disabled_reason` says why.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, fields

import torch

from mla_spec.forward_batch import ForwardBatch
from mla_spec.forward_mode import ForwardMode
from mla_spec.runtime.step_graph import StepGraphs, gc_paused

__all__ = ["CudaGraphRunner", "attach_graphs"]

logger = logging.getLogger(__name__)

_BATCH_TENSORS = ("seq_lens", "seq_lens_q", "positions", "out_cache_loc", "req_pool_indices",
                  "accept_length")


@dataclass
class _Graph:
    graph: torch.cuda.CUDAGraph
    batch: ForwardBatch  # static batch (bucket shape)
    input_ids: torch.Tensor  # [B * q]
    target_hidden: torch.Tensor | None  # [B * q, D]
    out: torch.Tensor  # [B * q, D]
    bs: int
    q: int


class CudaGraphRunner:
    """Captured graphs keyed by (model, mode, bucket batch size); see the module docstring."""

    def __init__(self, runner, num_draft_tokens: int | None,
                 batch_sizes=(1, 2, 4, 8, 16, 32, 64)) -> None:
        self.runner = runner
        self.ndt = num_draft_tokens
        max_bs = runner.req_to_token.shape[0] - 1
        self.batch_sizes = sorted({b for b in batch_sizes if 1 <= b <= max_bs})
        self.graphs: dict[tuple[str, ForwardMode, int], _Graph] = {}
        self.disabled_reason: str | None = None
        self.hidden_size: int | None = None
        self._pool = None

    @classmethod
    def capture(cls, runner, worker, batch_sizes=None) -> CudaGraphRunner:
        """Capture every graph the worker's configuration uses (or record why none)."""
        spec = worker.spec
        g = cls(runner, spec.num_draft_tokens if spec.enabled else None,
                batch_sizes or (1, 2, 4, 8, 16, 32, 64))
        g.disabled_reason = g._why_not()
        if g.disabled_reason is None:
            try:
                g._capture_all(spec.enabled and spec.version == "v2")
            except Exception as e:  # noqa: BLE001 - fall back to eager with the reason
                g.graphs.clear()
                g.disabled_reason = f"capture failed: {type(e).__name__}: {e}"
        if g.disabled_reason is not None:
            logger.warning("CUDA graphs off: %s", g.disabled_reason)
        return g

    def _why_not(self) -> str | None:
        if self.runner.device.type != "cuda":
            return f"device is {self.runner.device}, CUDA graphs need a GPU"
        for which, b in self.runner.backends.items():
            if b is not None and not getattr(b, "graph_safe", False):
                return (f"the {which} attention backend {b.name!r} is not graph-safe "
                        "(its class does not set graph_safe = True)")
        return None

    def _targets(self, with_v2: bool) -> list[tuple[str, ForwardMode, int]]:
        out = [("target", ForwardMode.DECODE, 1)]
        if self.ndt is not None:
            out += [("target", ForwardMode.TARGET_VERIFY, self.ndt),
                    ("draft", ForwardMode.DECODE, 1)]
            if with_v2:
                out.append(("draft", ForwardMode.DRAFT_EXTEND_V2, self.ndt))
        return out

    def _static_batch(self, mode: ForwardMode, bs: int, q: int) -> ForwardBatch:
        ctx = self.runner.req_to_token.shape[1]
        dev = self.runner.device
        kw = dict(req_pool_indices=[0] * bs, device=dev)
        if mode.is_decode():
            b = ForwardBatch.decode([ctx] * bs, **kw)
        elif mode.is_target_verify():
            b = ForwardBatch.target_verify([ctx - q] * bs, q, **kw)
        else:
            b = ForwardBatch.draft_extend_v2([ctx - q] * bs, q, [1] * bs, **kw)
        b.out_cache_loc = torch.zeros(bs * q, dtype=torch.int64, device=dev)
        return b

    def _capture_all(self, with_v2: bool) -> None:
        run = self.runner
        self._pool = torch.cuda.graph_pool_handle()
        for which, mode, q in self._targets(with_v2):
            if which == "draft" and run.draft is None:
                continue
            for bs in reversed(self.batch_sizes):
                sb = self._static_batch(mode, bs, q)
                run.prepare(which, sb)
                n = bs * q
                ids = torch.zeros(n, dtype=torch.int64, device=run.device)
                th = None
                if which == "draft":
                    th = torch.zeros(n, self._hidden_size(), dtype=self._dtype(),
                                     device=run.device)
                self._warmup(which, sb, ids, th)
                graph = torch.cuda.CUDAGraph()
                # relaxed: a lazy module load or a pool allocation must not invalidate the
                # capture; no GC inside it (a finalizer freeing CUDA objects would)
                with gc_paused(), torch.cuda.graph(graph, pool=self._pool,
                                                    capture_error_mode="relaxed"):
                    out = run.forward_eager(which, sb, ids, th)
                self.graphs[(which, mode, bs)] = _Graph(graph, sb, ids, th, out, bs, q)

    def _warmup(self, which, sb, ids, th) -> None:
        """Two eager runs on a side stream; the first under sync-debug "error" (fails fast)."""
        run = self.runner
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            prev = torch.cuda.get_sync_debug_mode()
            torch.cuda.set_sync_debug_mode("error")
            try:
                run.forward_eager(which, sb, ids, th)
            except RuntimeError as e:
                raise RuntimeError(f"the {which} forward synchronizes with the host "
                                   f"({e}); it cannot be captured") from e
            finally:
                torch.cuda.set_sync_debug_mode(prev)
            run.forward_eager(which, sb, ids, th)
        torch.cuda.current_stream().wait_stream(stream)

    def _hidden_size(self) -> int:
        cfg = self.runner.config
        return int(getattr(cfg, "hidden_size", None) or self.runner.target.hidden_size)

    def _dtype(self) -> torch.dtype:
        return getattr(self.runner.target, "dtype", torch.float32)

    def _bucket(self, bs: int) -> int | None:
        for b in self.batch_sizes:
            if b >= bs:
                return b
        return None

    def can_run(self, which: str, batch: ForwardBatch) -> bool:
        if not self.graphs:
            return False
        b = self._bucket(batch.batch_size)
        return b is not None and (which, batch.forward_mode, b) in self.graphs

    def replay(self, which: str, batch: ForwardBatch, input_ids: torch.Tensor,
               target_hidden: torch.Tensor | None = None) -> torch.Tensor:
        """Copy ``batch``'s tensors into the bucket's static batch, replay, return ``[N, D]``."""
        g = self.graphs[(which, batch.forward_mode, self._bucket(batch.batch_size))]
        bs, n = batch.batch_size, batch.total_q
        sb = g.batch
        self._copy_batch(batch, sb, bs, n, g.q)
        self._copy_plan(batch, sb, bs, g.q)
        g.input_ids[:n].copy_(input_ids)
        g.input_ids[n:].zero_()
        if g.target_hidden is not None:
            g.target_hidden[:n].copy_(target_hidden)
            g.target_hidden[n:].zero_()
        g.graph.replay()
        return g.out[:n]

    @staticmethod
    def _pad_value(name: str, mode: ForwardMode, q: int) -> int:
        if name in ("seq_lens",):
            return 0 if mode.is_target_verify() else q
        return {"seq_lens_q": q, "accept_length": 1}.get(name, 0)

    def _copy_batch(self, batch, sb, bs, n, q) -> None:
        for name in _BATCH_TENSORS:
            src, dst = getattr(batch, name), getattr(sb, name)
            if src is None or dst is None:
                continue
            rows = n if name in ("positions", "out_cache_loc") else bs
            dst[:rows].copy_(src)
            if name == "positions":  # padded requests: positions 0..q-1
                pad = dst[rows:].view(-1, q)
                pad.copy_(torch.arange(q, device=dst.device).expand_as(pad))
            else:
                dst[rows:].fill_(self._pad_value(name, batch.forward_mode, q))

    def _copy_plan(self, batch, sb, bs, q) -> None:
        backend = sb.attn_backend
        if backend is None:
            return
        src, dst = batch.extra.get(backend.name), sb.extra.get(backend.name)
        if src is None:
            src = backend.plan(batch)
        for f in fields(dst):
            s, d = getattr(src, f.name), getattr(dst, f.name)
            if not isinstance(d, torch.Tensor) or f.name == "qo_indptr":
                continue
            d[:bs].copy_(s)
            d[bs:].fill_(q if f.name in ("kv_lens", "seq_lens_q") else 0)


def attach_graphs(runner, worker, batch_sizes=None, step_graphs: bool = True) -> None:
    """Capture the fixed-shape forwards of ``runner`` / ``worker`` per batch-size bucket and
    attach them (``runner.graphs``; ``run`` replays them from then on), then the whole decode
    steps and v2 rounds (``runner.step_graphs``, ``mla_spec.runtime.step_graph``)."""
    runner.graphs = g = CudaGraphRunner.capture(runner, worker, batch_sizes)
    if g.disabled_reason is None and step_graphs:
        runner.step_graphs = StepGraphs.capture(runner, worker, g.batch_sizes, g._pool)
    logger.info("rank %d: %d CUDA graphs (%s), %d step graphs", runner.tp_rank, len(g.graphs),
                g.disabled_reason or "captured",
                len(runner.step_graphs.graphs) if runner.step_graphs else 0)
