"""Serving metrics: time per forward, per step, per request, and the accept-length statistics.

:meth:`ModeTimer.section` records each forward's mode, model and rows; on a GPU with CUDA events
resolved only where the engine syncs anyway. Accept length counts accepted drafts plus the
bonus token (``1..num_draft_tokens``).
"""

import time
from collections import defaultdict
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch

from mla_spec.forward_mode import ForwardMode

__all__ = ["ForwardRecord", "ModeTimer", "StepRecord", "RequestMetrics", "EngineMetrics"]


@dataclass
class ForwardRecord:
    """One forward pass: its mode, the model that ran it, query rows, requests and seconds."""

    mode: ForwardMode
    model: str  # "target" | "draft"
    rows: int
    batch_size: int
    seconds: float = 0.0
    graph: bool = False  # replayed from a CUDA graph


class ModeTimer:
    """Collects :class:`ForwardRecord` s (GPU: CUDA events, resolved in :meth:`collect`)."""

    def __init__(self, device: torch.device | str = "cpu") -> None:
        self.device = torch.device(device)
        self._pending: list[tuple[ForwardRecord, object, object]] = []

    @contextmanager
    def section(self, mode: ForwardMode, model: str, rows: int, batch_size: int,
                graph: bool = False):
        rec = ForwardRecord(mode, model, rows, batch_size, graph=graph)
        if self.device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            yield rec
            end.record()
            self._pending.append((rec, start, end))
        else:
            t0 = time.perf_counter()
            yield rec
            rec.seconds = time.perf_counter() - t0
            self._pending.append((rec, None, None))

    def collect(self) -> list[ForwardRecord]:
        """Resolve and return the records since the last call (synchronizes on GPU)."""
        out = []
        for rec, start, end in self._pending:
            if start is not None:
                end.synchronize()
                rec.seconds = start.elapsed_time(end) / 1e3
            out.append(rec)
        self._pending = []
        return out


@dataclass
class StepRecord:
    """One engine step: prefill, decode, or one speculative round (draft, verify, draft extend)."""

    index: int
    kind: str  # "prefill" | "decode" | "spec"
    batch_size: int
    seconds: float
    new_tokens: int
    forwards: list[ForwardRecord] = field(default_factory=list)
    accept_lengths: list[int] | None = None

    def to_dict(self) -> dict:
        return {"index": self.index, "kind": self.kind, "batch_size": self.batch_size,
                "seconds": self.seconds, "new_tokens": self.new_tokens,
                "accept_lengths": self.accept_lengths,
                "forwards": [{"mode": f.mode.name, "model": f.model, "rows": f.rows,
                              "batch_size": f.batch_size, "seconds": f.seconds, "graph": f.graph}
                             for f in self.forwards]}


@dataclass
class RequestMetrics:
    """Per request: prompt/completion tokens, latencies and the accept lengths of its verifies."""

    prompt_tokens: int = 0
    completion_tokens: int = 0
    arrival_time: float = 0.0
    first_token_time: float | None = None
    finish_time: float | None = None
    accept_lengths: list[int] = field(default_factory=list)
    num_preemptions: int = 0

    @property
    def ttft(self) -> float | None:
        """Time to first token (s)."""
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time

    @property
    def e2e_latency(self) -> float | None:
        return None if self.finish_time is None else self.finish_time - self.arrival_time

    @property
    def tokens_per_s(self) -> float | None:
        lat = self.e2e_latency
        return None if not lat else self.completion_tokens / lat

    @property
    def acc_length(self) -> float:
        """SGLang's ``send_one`` figure: completion_tokens / verify count (1.0 without spec)."""
        return self.completion_tokens / len(self.accept_lengths) if self.accept_lengths else 1.0


class EngineMetrics:
    """All step records of an engine (reset with :meth:`reset`), and the summaries built on them."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.steps: list[StepRecord] = []
        self._wall = 0.0

    def add_step(self, step: StepRecord) -> None:
        self.steps.append(step)

    def add_wall_time(self, seconds: float) -> None:
        self._wall += seconds

    @property
    def wall_seconds(self) -> float:
        return self._wall or sum(s.seconds for s in self.steps)

    @property
    def accept_lengths(self) -> list[int]:
        return [a for s in self.steps if s.accept_lengths for a in s.accept_lengths]

    @property
    def avg_accept_length(self) -> float | None:
        """sum of accept lengths / sum of batch sizes over verify steps (None without spec)."""
        acc = self.accept_lengths
        return sum(acc) / len(acc) if acc else None

    @property
    def generated_tokens(self) -> int:
        return sum(s.new_tokens for s in self.steps)

    @property
    def tokens_per_s(self) -> float:
        wall = self.wall_seconds
        return self.generated_tokens / wall if wall > 0 else 0.0

    def mode_table(self) -> list[dict]:
        """Per (model, mode): forward count, rows, total and mean milliseconds, share of time."""
        agg: dict[tuple[str, str], list[float]] = defaultdict(lambda: [0, 0, 0.0])
        for f in (f for s in self.steps for f in s.forwards):
            c, r, t = agg[(f.model, f.mode.name)]
            agg[(f.model, f.mode.name)] = [c + 1, r + f.rows, t + f.seconds]
        total = sum(v[2] for v in agg.values()) or 1.0
        return [{"model": m, "mode": mode, "count": int(c), "rows": int(r), "total_ms": t * 1e3,
                 "mean_ms": t * 1e3 / c, "share": t / total}
                for (m, mode), (c, r, t) in sorted(agg.items(), key=lambda kv: -kv[1][2])]

    def accept_histogram(self, num_draft_tokens: int) -> list[int]:
        """Counts of accept length 1..num_draft_tokens."""
        hist = [0] * num_draft_tokens
        for a in self.accept_lengths:
            hist[a - 1] += 1
        return hist

    def summary(self) -> dict:
        return {"steps": len(self.steps), "generated_tokens": self.generated_tokens,
                "wall_seconds": self.wall_seconds, "tokens_per_s": self.tokens_per_s,
                "avg_accept_length": self.avg_accept_length, "modes": self.mode_table()}


def format_mode_table(rows: list[dict]) -> str:
    """The per-mode time table as aligned text."""
    head = (f"{'model':<7} {'mode':<16} {'count':>6} {'rows':>7} {'total ms':>10} "
            f"{'mean ms':>9} {'share':>6}")
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(f"{r['model']:<7} {r['mode']:<16} {r['count']:>6} {r['rows']:>7} "
                     f"{r['total_ms']:>10.1f} {r['mean_ms']:>9.2f} {r['share']:>6.1%}")
    return "\n".join(lines)
