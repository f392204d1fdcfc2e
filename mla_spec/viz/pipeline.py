"""Figures and tables of the serving pipeline: what each engine step ran, and how long it took.

Inputs are :class:`~mla_spec.metrics.StepRecord` lists (``engine.metrics.steps``), so the same
helpers serve notebooks 00 and 06, the CLI and the end-to-end benchmark.
"""

from collections.abc import Mapping, Sequence

import plotly.graph_objects as go

from mla_spec.metrics import StepRecord
from mla_spec.viz import read_json

__all__ = ["step_rows", "step_latency_figure", "mode_time_figure", "accept_histogram_figure",
           "read_recorded_e2e", "recorded_e2e_ratios", "tokens_per_s_figure"]


def step_rows(steps: Sequence[StepRecord]) -> list[dict]:
    """One row per step: kind, batch size, the forwards it ran (model:MODE x rows), accept
    lengths, new tokens and milliseconds."""
    return [{"step": s.index, "kind": s.kind, "bs": s.batch_size,
             "forwards": ", ".join(f"{f.model}:{f.mode.name}x{f.rows}" for f in s.forwards),
             "accept": s.accept_lengths, "new_tokens": s.new_tokens,
             "ms": round(s.seconds * 1e3, 2)} for s in steps]


def step_latency_figure(runs: Mapping[str, Sequence[StepRecord]],
                        title: str = "Latency per engine step") -> go.Figure:
    """Milliseconds of every step, one line per configuration (prefill steps marked)."""
    fig = go.Figure()
    for name, steps in runs.items():
        fig.add_trace(go.Scatter(
            x=[s.index for s in steps], y=[s.seconds * 1e3 for s in steps], mode="lines+markers",
            name=name, text=[s.kind for s in steps],
            hovertemplate="step %{x}: %{y:.2f} ms (%{text})<extra></extra>"))
    fig.update_layout(title=title, xaxis_title="engine step", yaxis_title="ms (this machine, log)",
                      yaxis_type="log", template="plotly_white", legend_orientation="h",
                      legend_y=-0.2)
    return fig


def mode_time_figure(runs: Mapping[str, Sequence[Mapping]],
                     title: str = "Time per forward mode") -> go.Figure:
    """Stacked bars: total ms per (model, mode) per configuration (``metrics.mode_table()``)."""
    keys = sorted({(r["model"], r["mode"]) for rows in runs.values() for r in rows})
    fig = go.Figure()
    for model, mode in keys:
        ys = [next((r["total_ms"] for r in rows if (r["model"], r["mode"]) == (model, mode)), 0.0)
              for rows in runs.values()]
        fig.add_trace(go.Bar(x=list(runs), y=ys, name=f"{model} {mode}"))
    fig.update_layout(barmode="stack", title=title, xaxis_title="configuration",
                      yaxis_title="total ms (this machine)", template="plotly_white")
    return fig


def accept_histogram_figure(runs: Mapping[str, Sequence[int]], num_draft_tokens: int,
                            title: str = "Accept lengths (bonus token included)") -> go.Figure:
    """Share of verifies with accept length 1..num_draft_tokens, per configuration."""
    fig = go.Figure()
    xs = list(range(1, num_draft_tokens + 1))
    for name, acc in runs.items():
        n = max(len(acc), 1)
        fig.add_trace(go.Bar(x=xs, y=[sum(a == x for a in acc) / n for x in xs], name=name))
    fig.update_layout(title=title, xaxis_title="accept length (tokens a verify)",
                      yaxis_title="share of verifies", template="plotly_white")
    return fig


def read_recorded_e2e(path=None) -> dict:
    """End-to-end tokens/s of the embedded model recorded on one H200
    (``mla_spec/data/bench_e2e_h200.json``: its ``command``, ``date``, ``setup`` and ``rows``)."""
    return read_json(path, "bench_e2e_h200.json")


def recorded_e2e_ratios(rec: dict | None = None) -> dict:
    """Spec v2 over spec off per batch size in the H200 record: ``"e2e"`` (tokens/s),
    ``"decode"`` (decode steps only), ``"gpu"`` (GPU time alone: the average accept length times
    a plain step's graph replay over a round's, ``gpu_graph_us``) and ``"other_e2e"`` (the
    end-to-end ratio of each of ``other_runs``), each ``{bs: ratio}`` (a list for the last)."""
    rec = rec or read_recorded_e2e()

    def ratio(rows, key):
        by = {(r["bs"], r["spec"]): r for r in rows}
        return {bs: by[bs, "v2"][key] / by[bs, "off"][key] for bs, s in by if s == "off"}

    acc = {r["bs"]: r["avg_accept"] for r in rec["rows"] if r["spec"] == "v2"}
    gpu = {bs: acc[bs] * g["decode_step"] / g["v2_round"]
           for bs, g in ((int(k), v) for k, v in rec.get("gpu_graph_us", {}).items()
                         if k.isdigit())}
    others = [ratio(o["rows"], "tokens_per_s") for o in rec.get("other_runs", [])]
    return {"e2e": ratio(rec["rows"], "tokens_per_s"),
            "decode": ratio(rec["rows"], "decode_tokens_per_s"), "gpu": gpu,
            "other_e2e": {bs: [o[bs] for o in others] for bs in (others[0] if others else {})}}


def tokens_per_s_figure(here: Mapping[str, float], recorded: dict | None = None,
                        here_label: str = "this machine") -> go.Figure:
    """Tokens/s per spec setting: this run (left) beside the H200 record (right, bs 1 and 32)."""
    from plotly.subplots import make_subplots
    rec = recorded or read_recorded_e2e()
    fig = make_subplots(rows=1, cols=2, subplot_titles=(
        here_label, f"H200, recorded {rec['date']}"))
    fig.add_trace(go.Bar(x=list(here), y=list(here.values()), name=here_label,
                         marker_color="#7f7f7f", text=[f"{v:.0f}" for v in here.values()]), 1, 1)
    for bs, color in ((1, "#1f77b4"), (32, "#ff7f0e")):
        rows = [r for r in rec["rows"] if r["bs"] == bs]
        fig.add_trace(go.Bar(x=[r["spec"] for r in rows], y=[r["tokens_per_s"] for r in rows],
                             name=f"H200 batch {bs}", marker_color=color,
                             text=[f"{r['tokens_per_s']:.0f}" for r in rows]), 1, 2)
    fig.update_yaxes(title_text="tokens/s", rangemode="tozero", row=1, col=1)
    fig.update_yaxes(type="log", title_text="tokens/s (log)", row=1, col=2)
    fig.update_xaxes(title_text="speculative decoding")
    fig.update_layout(title="Tokens/s of the embedded model", template="plotly_white",
                      legend_orientation="h", legend_y=-0.25, height=420)
    return fig
