"""The accuracy / accept-length report of one evaluation run, and a table of several.

``EvalReport`` is what ``run_eval`` returns and what the CLI ``demo``, the tests and notebook 07
print: accuracy (share of questions whose last integer equals the label), the share of invalid
completions (no integer), SGLang's average accept length (sum over verify steps of accepted drafts
+ 1 per request, divided by the requests verified; 1.0 without speculation), output tokens,
wall-clock latency and tokens/s. ``predictions`` keeps the parsed answers so two runs can be
compared answer by answer (speculation must not change greedy outputs).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

__all__ = ["EvalReport", "format_table"]


@dataclass(frozen=True)
class EvalReport:
    """Scores of one configuration on one question set.

    Attributes
    ----------
    name : label of the configuration (e.g. ``"fp4 w / fp8 kv / tp4 / spec v2"``)
    num_questions, num_shots : the task
    accuracy : correct / num_questions
    invalid : completions with no integer / num_questions
    avg_accept_length : SGLang's ``avg_spec_accept_length`` (1.0 without speculation, None when
        the generator does not report it)
    output_tokens : generated tokens over all requests
    latency_s : wall-clock seconds of the whole batch
    predictions : parsed answer per question (None = invalid)
    completions : generated text per question (cut at the stop string)
    accept_lengths : accept length of every (request, verify step), for histograms
    extra : anything else a caller wants to carry (config, per-mode timings)
    """

    name: str
    num_questions: int
    num_shots: int
    accuracy: float
    invalid: float
    avg_accept_length: float | None
    output_tokens: int
    latency_s: float
    predictions: tuple[int | None, ...] = ()
    completions: tuple[str, ...] = ()
    accept_lengths: tuple[int, ...] = ()
    extra: dict[str, Any] = field(default_factory=dict, compare=False)

    @property
    def tokens_per_s(self) -> float:
        return self.output_tokens / self.latency_s if self.latency_s > 0 else 0.0

    @property
    def num_correct(self) -> int:
        return round(self.accuracy * self.num_questions)

    def to_dict(self, details: bool = False) -> dict[str, Any]:
        """JSON-ready dict; ``details`` keeps predictions, completions and accept lengths."""
        d = asdict(self)
        d["tokens_per_s"] = self.tokens_per_s
        if not details:
            for k in ("predictions", "completions", "accept_lengths"):
                d.pop(k)
        else:
            for k in ("predictions", "completions", "accept_lengths"):
                d[k] = list(d[k])
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> EvalReport:
        keys = {f for f in cls.__dataclass_fields__}
        kw = {k: v for k, v in d.items() if k in keys}
        for k in ("predictions", "completions", "accept_lengths"):
            kw[k] = tuple(kw.get(k, ()))
        return cls(**kw)

    def pretty(self) -> str:
        """The report as a small two-column table."""
        acc = "-" if self.avg_accept_length is None else f"{self.avg_accept_length:.3f}"
        rows = [
            ("config", self.name),
            ("questions", f"{self.num_questions} ({self.num_shots}-shot)"),
            ("accuracy", f"{self.accuracy:.4f} ({self.num_correct}/{self.num_questions})"),
            ("invalid", f"{self.invalid:.4f}"),
            ("avg accept length", acc),
            ("output tokens", str(self.output_tokens)),
            ("latency", f"{self.latency_s:.2f} s"),
            ("throughput", f"{self.tokens_per_s:.1f} tok/s"),
        ]
        w = max(len(k) for k, _ in rows)
        return "\n".join(f"{k:<{w}} | {v}" for k, v in rows)

    def __str__(self) -> str:
        return self.pretty()


def format_table(reports: Sequence[EvalReport]) -> str:
    """Several reports as one markdown table (one row per configuration)."""
    head = "| config | questions | accuracy | invalid | accept len | tokens | latency s | tok/s |"
    sep = "|---|---:|---:|---:|---:|---:|---:|---:|"
    lines = [head, sep]
    for r in reports:
        acc = "-" if r.avg_accept_length is None else f"{r.avg_accept_length:.3f}"
        lines.append(
            f"| {r.name} | {r.num_questions} | {r.accuracy:.4f} | {r.invalid:.4f} | {acc} | "
            f"{r.output_tokens} | {r.latency_s:.2f} | {r.tokens_per_s:.1f} |"
        )
    return "\n".join(lines)
