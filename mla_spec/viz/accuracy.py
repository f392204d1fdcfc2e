"""Plotly figures for notebook 07: accuracy and accept length per configuration with their 95%
intervals, accept-length histograms, the draft-extend padding regression, latency per mode.

All take ``EvalReport`` objects (``mla_spec.eval``) or their ``to_dict(details=True)`` dicts, so
the same helpers draw a live CPU run and results recorded as JSON.
"""

from collections.abc import Sequence
from typing import Any

import plotly.graph_objects as go
from plotly.subplots import make_subplots

from mla_spec.eval.report import EvalReport

__all__ = ["accuracy_figure", "accept_length_figure", "accept_histogram_figure", "padding_figure",
           "mode_latency_figure", "step_latency_figure", "as_reports"]


def as_reports(items: Sequence[EvalReport | dict[str, Any]]) -> list[EvalReport]:
    """Reports from reports or their dicts (e.g. loaded from a recorded JSON file)."""
    return [r if isinstance(r, EvalReport) else EvalReport.from_dict(r) for r in items]


def _bars(reps: list[EvalReport], metric: str, labels=None, vertical: bool = False, **kw) -> go.Bar:
    """Bars of ``metric`` ("accuracy" | "accept") with 95% error bars, one per report."""
    if metric == "accuracy":
        vals, ivs = [r.accuracy for r in reps], [r.accuracy_interval() for r in reps]
    else:
        vals, ivs = [r.avg_accept_length for r in reps], [r.accept_interval() for r in reps]
    err = dict(type="data", symmetric=False, array=[hi - v for v, (_, hi) in zip(vals, ivs)],
               arrayminus=[v - lo for v, (lo, _) in zip(vals, ivs)])
    names = labels or [r.name for r in reps]
    text = [f"{v:.3f}" for v in vals]
    if vertical:
        return go.Bar(x=names, y=vals, error_y=err, text=text, textposition="inside", **kw)
    return go.Bar(x=vals, y=names, orientation="h", error_x=err, text=text,
                  textposition="inside", **kw)


def accuracy_figure(reports, floor: float = 0.88,
                    title: str = "Accuracy per configuration (95% Wilson intervals)"):
    """Accuracy per configuration with its 95% Wilson interval, on an axis zoomed to the
    intervals; the dashed line is the model's accuracy floor (its band starts at 0.88)."""
    reps = as_reports(reports)
    low = min([floor, *(r.accuracy_interval()[0] for r in reps)])
    fig = go.Figure(_bars(reps, "accuracy"))
    fig.add_vline(x=floor, line_dash="dash", annotation_text=f"floor {floor}")
    fig.update_layout(title=title, xaxis_title="accuracy (share of questions answered right)",
                      yaxis_title="configuration", xaxis_range=[low - 0.01, 1.0],
                      height=140 + 30 * len(reps), yaxis_autorange="reversed")
    return fig


def accept_length_figure(reports, title: str = "Average accept length (95% bootstrap intervals)"):
    """Average accept length of the speculative configurations with its 95% interval (bootstrap
    over questions), on an axis zoomed to the intervals (SGLang CI's bar, 2.04, lies below)."""
    reps = [r for r in as_reports(reports) if r.accept_lengths]
    ivs = [r.accept_interval() for r in reps]
    lo, hi = min(i[0] for i in ivs), max(i[1] for i in ivs)
    fig = go.Figure(_bars(reps, "accept"))
    fig.update_layout(title=title, xaxis_range=[lo - (hi - lo) / 2, hi + (hi - lo) / 4],
                      xaxis_title="accepted tokens per verify step, bonus included "
                                  "(SGLang CI's bar: 2.04)",
                      yaxis_title="configuration", height=140 + 30 * len(reps),
                      yaxis_autorange="reversed")
    return fig


def padding_figure(end, start, title: str = "v1 draft extend padded to max_q rows: "
                   "align end (ours) vs start (SGLang's)"):
    """Accept length and accuracy side by side for the two pad alignments of spec v1's
    fixed-q_len draft extend (95% intervals)."""
    end, start = as_reports([end, start])
    fig = make_subplots(rows=1, cols=2, subplot_titles=("average accept length", "accuracy"))
    for col, metric in ((1, "accept"), (2, "accuracy")):
        fig.add_trace(_bars([end, start], metric, ["align end (ours)", "align start (SGLang)"],
                            vertical=True, showlegend=False), row=1, col=col)
    fig.update_xaxes(title_text="pad alignment")
    for col, ytitle, ivs in ((1, "accepted tokens per verify step", (end.accept_interval(),
                                                                      start.accept_interval())),
                             (2, "accuracy", (end.accuracy_interval(), start.accuracy_interval()))):
        lo, hi = min(i[0] for i in ivs), max(i[1] for i in ivs)  # zoomed to the intervals
        fig.update_yaxes(title_text=ytitle, range=[lo - (hi - lo), hi + (hi - lo) / 2],
                         row=1, col=col)
    fig.update_layout(title=title, height=420)
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
    ms = [{f"{m['model']} {m['mode']}": m["total_ms"] for m in r.extra.get("modes", [])}
          for r in reps]
    fig = go.Figure()
    for k in dict.fromkeys(k for per in ms for k in per):  # first-seen order
        fig.add_bar(x=[r.name for r in reps], y=[per.get(k, 0.0) for per in ms], name=k)
    fig.update_layout(title=title, barmode="stack", xaxis_title="configuration",
                      yaxis_title="ms (all forwards of the run)")
    return fig


def step_latency_figure(reports, title: str = "Latency per engine step"):
    """Box plot of per-step milliseconds by step kind (prefill / decode / spec) per report."""
    fig = go.Figure()
    for r in as_reports(reports):
        steps = [s for s in r.extra.get("steps", []) if s["kind"] != "prefill"]
        if not steps:
            continue
        fig.add_box(y=[s["ms"] for s in steps], name=r.name, boxmean=True)
    fig.update_layout(title=title, xaxis_title="configuration",
                      yaxis_title="ms per decode / spec step", showlegend=False)
    return fig
