"""Plotly figures for notebook 07: accuracy per configuration, accept lengths, latency per mode.

All take ``EvalReport`` objects (``mla_spec.eval``) or their ``to_dict(details=True)`` dicts, so
the same helpers draw a live CPU sweep and GPU results recorded as JSON.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import plotly.graph_objects as go

from mla_spec.eval.report import EvalReport

__all__ = [
    "accuracy_figure",
    "accept_histogram_figure",
    "mode_latency_figure",
    "step_latency_figure",
    "as_reports",
]


def as_reports(items: Sequence[EvalReport | dict[str, Any]]) -> list[EvalReport]:
    """Reports from reports or their dicts (e.g. loaded from a recorded JSON file)."""
    return [r if isinstance(r, EvalReport) else EvalReport.from_dict(r) for r in items]


def accuracy_figure(reports, bar: float = 0.935, title: str = "Accuracy per configuration"):
    """Horizontal bars of accuracy (with the average accept length as text) and the bar (SGLang's
    CI bar for DeepSeek-V3 FP4 with MTP: accuracy > 0.935)."""
    reps = as_reports(reports)
    names = [r.name for r in reps]
    text = [f"{r.accuracy:.3f}" + ("" if r.avg_accept_length is None
                                   else f" · accept {r.avg_accept_length:.2f}") for r in reps]
    fig = go.Figure(go.Bar(x=[r.accuracy for r in reps], y=names, orientation="h", text=text,
                           textposition="inside"))
    fig.add_vline(x=bar, line_dash="dash", annotation_text=f"bar {bar}")
    fig.update_layout(title=title, xaxis_title="accuracy", xaxis_range=[0, 1.02],
                      height=120 + 28 * len(reps), yaxis_autorange="reversed")
    return fig


def accept_histogram_figure(reports, num_draft_tokens: int = 4,
                            title: str = "Accept length per verify step"):
    """Share of (request, verify step) pairs accepting 1..num_draft_tokens tokens, per report."""
    fig = go.Figure()
    xs = list(range(1, num_draft_tokens + 1))
    for r in as_reports(reports):
        if not r.accept_lengths:
            continue
        n = len(r.accept_lengths)
        ys = [sum(a == x for a in r.accept_lengths) / n for x in xs]
        fig.add_bar(x=xs, y=ys, name=f"{r.name} (avg {r.avg_accept_length:.2f})")
    fig.add_vline(x=2.04, line_dash="dash", annotation_text="SGLang CI bar 2.04 (average)")
    fig.update_layout(title=title, xaxis_title="accepted tokens (bonus included)",
                      yaxis_title="share of verify steps", barmode="group")
    return fig


def mode_latency_figure(reports, title: str = "Time per forward mode"):
    """Stacked bars: total milliseconds per (model, mode) of each report (``extra['modes']``)."""
    reps = as_reports(reports)
    keys: list[str] = []
    for r in reps:
        for m in r.extra.get("modes", []):
            k = f"{m['model']} {m['mode']}"
            if k not in keys:
                keys.append(k)
    fig = go.Figure()
    for k in keys:
        ys = []
        for r in reps:
            ms = {f"{m['model']} {m['mode']}": m["total_ms"] for m in r.extra.get("modes", [])}
            ys.append(ms.get(k, 0.0))
        fig.add_bar(x=[r.name for r in reps], y=ys, name=k)
    fig.update_layout(title=title, barmode="stack", yaxis_title="ms (all forwards of the run)")
    return fig


def step_latency_figure(reports, title: str = "Latency per engine step"):
    """Box plot of per-step milliseconds by step kind (prefill / decode / spec) per report."""
    fig = go.Figure()
    for r in as_reports(reports):
        steps = [s for s in r.extra.get("steps", []) if s["kind"] != "prefill"]
        if not steps:
            continue
        fig.add_box(y=[s["ms"] for s in steps], name=r.name, boxmean=True)
    fig.update_layout(title=title, yaxis_title="ms per decode / spec step", showlegend=False)
    return fig
