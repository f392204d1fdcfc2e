"""Figures and tables of the serving pipeline: what each engine step ran, and how long it took.

Inputs are :class:`~mla_spec.metrics.StepRecord` lists (``engine.metrics.steps``), so the same
helpers serve notebooks 00 and 06, the CLI and the end-to-end benchmark.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import plotly.graph_objects as go

from mla_spec.metrics import StepRecord

__all__ = ["step_rows", "step_latency_figure", "mode_time_figure", "accept_histogram_figure"]


def step_rows(steps: Sequence[StepRecord]) -> list[dict]:
    """One row per step: kind, batch size, the forwards it ran (model:MODE x rows), accept
    lengths, new tokens and milliseconds."""
    out = []
    for s in steps:
        out.append({
            "step": s.index,
            "kind": s.kind,
            "bs": s.batch_size,
            "forwards": ", ".join(f"{f.model}:{f.mode.name}x{f.rows}" for f in s.forwards),
            "accept": s.accept_lengths,
            "new_tokens": s.new_tokens,
            "ms": round(s.seconds * 1e3, 2),
        })
    return out


def step_latency_figure(runs: Mapping[str, Sequence[StepRecord]],
                        title: str = "Latency per engine step") -> go.Figure:
    """Milliseconds of every step, one line per configuration (prefill steps marked)."""
    fig = go.Figure()
    for name, steps in runs.items():
        fig.add_trace(go.Scatter(
            x=[s.index for s in steps], y=[s.seconds * 1e3 for s in steps], mode="lines+markers",
            name=name, text=[s.kind for s in steps],
            hovertemplate="step %{x}: %{y:.2f} ms (%{text})<extra></extra>"))
    fig.update_layout(title=title, xaxis_title="step", yaxis_title="ms", template="plotly_white")
    return fig


def mode_time_figure(runs: Mapping[str, Sequence[Mapping]],
                     title: str = "Time per forward mode") -> go.Figure:
    """Stacked bars: total ms per (model, mode) per configuration (``metrics.mode_table()``)."""
    keys = sorted({(r["model"], r["mode"]) for rows in runs.values() for r in rows})
    fig = go.Figure()
    for model, mode in keys:
        ys = []
        for rows in runs.values():
            hit = [r["total_ms"] for r in rows if (r["model"], r["mode"]) == (model, mode)]
            ys.append(hit[0] if hit else 0.0)
        fig.add_trace(go.Bar(x=list(runs), y=ys, name=f"{model} {mode}"))
    fig.update_layout(barmode="stack", title=title, yaxis_title="ms", template="plotly_white")
    return fig


def accept_histogram_figure(runs: Mapping[str, Sequence[int]], num_draft_tokens: int,
                            title: str = "Accept lengths (bonus token included)") -> go.Figure:
    """Share of verifies with accept length 1..num_draft_tokens, per configuration."""
    fig = go.Figure()
    xs = list(range(1, num_draft_tokens + 1))
    for name, acc in runs.items():
        n = max(len(acc), 1)
        fig.add_trace(go.Bar(x=xs, y=[sum(a == x for a in acc) / n for x in xs], name=name))
    fig.update_layout(title=title, xaxis_title="accept length", yaxis_title="share",
                      template="plotly_white")
    return fig
