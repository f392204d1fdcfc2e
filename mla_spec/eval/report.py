"""The accuracy / accept-length report of one evaluation run, and a table of several.

``EvalReport`` (from ``run_eval``): accuracy (last integer == label), invalid share (no integer),
SGLang's average accept length (accepted drafts + 1 per verified request; 1.0 without
speculation), output tokens, latency, tokens/s, and the parsed ``predictions`` to compare two runs
answer by answer. ``accuracy_interval`` (Wilson), ``accept_interval`` (bootstrap): 95% intervals.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

__all__ = ["EvalReport", "format_table", "wilson_interval"]

_DETAILS = ("predictions", "completions", "accept_lengths", "accept_steps")


def wilson_interval(correct: int, n: int, z: float = 1.96) -> tuple[float, float]:
    """Wilson score interval of a proportion ``correct / n`` (95% at ``z`` 1.96)."""
    if n <= 0:
        raise ValueError(f"n = {n}: a proportion needs at least one trial")
    p, z2 = correct / n, z * z
    mid = (p + z2 / (2 * n)) / (1 + z2 / n)
    half = z * np.sqrt(p * (1 - p) / n + z2 / (4 * n * n)) / (1 + z2 / n)
    return max(0.0, float(mid - half)), min(1.0, float(mid + half))


@dataclass(frozen=True)
class EvalReport:
    """Scores of one configuration (``name``, e.g. ``"fp4 w / fp8 kv / tp4 / spec v2"``) on one
    question set. ``avg_accept_length`` is SGLang's ``avg_spec_accept_length`` (None when the
    generator does not report it); ``accept_steps`` holds the verify steps of each question, so
    ``accept_lengths`` (every request's verify steps) is their concatenation."""

    name: str
    num_questions: int
    num_shots: int
    accuracy: float  # correct / num_questions
    invalid: float  # completions with no integer / num_questions
    avg_accept_length: float | None
    output_tokens: int  # over all requests
    latency_s: float  # wall clock of the whole batch
    predictions: tuple[int | None, ...] = ()  # parsed answer per question (None = invalid)
    completions: tuple[str, ...] = ()  # cut at the stop string
    accept_lengths: tuple[int, ...] = ()
    accept_steps: tuple[int, ...] = ()
    extra: dict[str, Any] = field(default_factory=dict, compare=False)  # config, mode timings

    @property
    def tokens_per_s(self) -> float:
        return self.output_tokens / self.latency_s if self.latency_s > 0 else 0.0

    @property
    def num_correct(self) -> int:
        return round(self.accuracy * self.num_questions)

    def accuracy_interval(self) -> tuple[float, float]:
        """95% Wilson interval of the accuracy."""
        return wilson_interval(self.num_correct, self.num_questions)

    def accept_interval(self, resamples: int = 2000, seed: int = 0) -> tuple[float, float] | None:
        """95% interval of the average accept length: percentile bootstrap over questions (a
        question's verify steps stay together; each step its own question without
        ``accept_steps``). None without accept lengths."""
        acc = np.asarray(self.accept_lengths, dtype=np.float64)
        if acc.size == 0:
            return None
        steps = np.asarray(self.accept_steps or [1] * acc.size)
        sums = np.bincount(np.repeat(np.arange(steps.size), steps), weights=acc,
                           minlength=steps.size)
        idx = np.random.default_rng(seed).integers(0, steps.size, (resamples, steps.size))
        means = sums[idx].sum(1) / np.maximum(steps[idx].sum(1), 1)
        lo, hi = np.percentile(means, [2.5, 97.5])
        return float(lo), float(hi)

    def to_dict(self, details: bool = False) -> dict[str, Any]:
        """JSON-ready dict; ``details`` keeps predictions, completions and accept lengths."""
        d = asdict(self)
        d["tokens_per_s"] = self.tokens_per_s
        for k in _DETAILS:
            if details:
                d[k] = list(d[k])
            else:
                d.pop(k)
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> EvalReport:
        kw = {k: v for k, v in d.items() if k in cls.__dataclass_fields__}
        for k in _DETAILS:
            kw[k] = tuple(kw.get(k, ()))
        return cls(**kw)

    def intervals_text(self) -> tuple[str, str]:
        """``(accuracy, accept length)`` as "value [low, high]" text (95%)."""
        lo, hi = self.accuracy_interval()
        ai = self.accept_interval()
        acc = "-" if self.avg_accept_length is None else f"{self.avg_accept_length:.3f}"
        if ai is not None:
            acc += f" [{ai[0]:.3f}, {ai[1]:.3f}]"
        return f"{self.accuracy:.4f} [{lo:.3f}, {hi:.3f}]", acc

    def pretty(self) -> str:
        """The report as a small two-column table."""
        accuracy, accept = self.intervals_text()
        rows = [("config", self.name),
                ("questions", f"{self.num_questions} ({self.num_shots}-shot)"),
                ("accuracy [95%]", f"{accuracy} ({self.num_correct}/{self.num_questions})"),
                ("invalid", f"{self.invalid:.4f}"), ("avg accept length", accept),
                ("output tokens", str(self.output_tokens)),
                ("latency", f"{self.latency_s:.2f} s"),
                ("throughput", f"{self.tokens_per_s:.1f} tok/s")]
        w = max(len(k) for k, _ in rows)
        return "\n".join(f"{k:<{w}} | {v}" for k, v in rows)

    def __str__(self) -> str:
        return self.pretty()


def format_table(reports: Sequence[EvalReport]) -> str:
    """Several reports as one markdown table (one row per configuration)."""
    head = ("| config | questions | accuracy [95%] | invalid | accept len [95%] | tokens | "
            "latency s | tok/s |")
    lines = [head, "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in reports:
        accuracy, acc = r.intervals_text()
        lines.append(f"| {r.name} | {r.num_questions} | {accuracy} | {r.invalid:.4f} | {acc} | "
                     f"{r.output_tokens} | {r.latency_s:.2f} | {r.tokens_per_s:.1f} |")
    return "\n".join(lines)
