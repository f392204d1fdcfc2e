"""Plotly figures for the MLA-backend and FP8-cache notebooks (03, 04).

Every function returns a ``plotly.graph_objects.Figure`` and takes plain data (tables computed
by ``mla_spec`` functions), so the notebooks only call and show.
"""

from collections.abc import Mapping, Sequence

import plotly.graph_objects as go
import torch

from mla_spec.viz import read_json

__all__ = ["dispatch_table", "agreement_heatmap", "latency_bars", "fp8_grid_figure",
           "error_histogram", "bytes_per_token_bars", "read_bench_table"]


def dispatch_table(device="cpu"):
    """``{backend: {"device": "ok" | reason, mode name: "ok" | reason}}`` from the registry (no
    backend is built); mode support is the backend's own, whatever the device."""
    from mla_spec.attention import BACKENDS, get_backend_class
    from mla_spec.attention.synthetic import ALL_MODES
    dev = torch.device(device)
    table = {}
    for name in BACKENDS:
        cls = get_backend_class(name)
        row = {"device": cls.device_reason(dev) or "ok"}
        row.update({m.name: "ok" if m.is_idle() else cls.mode_reason(m) or "ok"
                    for m in ALL_MODES})
        row["kv dtypes"] = ", ".join(str(d).replace("torch.", "") for d in cls.kv_dtypes)
        table[name] = row
    return table


def agreement_heatmap(errors: Mapping[str, Mapping[str, float]], title="max rel. error vs oracle"):
    """Heatmap of ``errors[backend][mode]`` (NaN = not supported)."""
    backends = list(errors)
    modes = list(next(iter(errors.values())))
    z = [[errors[b].get(m, float("nan")) for m in modes] for b in backends]
    text = [["-" if v != v else f"{v:.1e}" for v in row] for row in z]
    fig = go.Figure(go.Heatmap(z=z, x=modes, y=backends, text=text, texttemplate="%{text}",
                               colorscale="Blues", colorbar_title="rel. error"))
    fig.update_layout(title=title, xaxis_title="forward mode", yaxis_title="backend",
                      height=280 + 30 * len(backends))
    return fig


def latency_bars(labels: Sequence[str], series: Mapping[str, Sequence[float]],
                 unit="µs", title="latency", xaxis_title="shape"):
    """Grouped bars on a log axis (values span decades): one group per label, one bar per
    series (e.g. ours / FlashInfer)."""
    fig = go.Figure([go.Bar(name=k, x=list(labels), y=list(v)) for k, v in series.items()])
    fig.update_layout(barmode="group", title=title, yaxis_title=f"{unit} per call (log)",
                      yaxis_type="log", xaxis_title=xaxis_title)
    return fig


def fp8_grid_figure(values: torch.Tensor):
    """The non-negative e4m3 grid on a log axis (spacing doubles every binade)."""
    v = values[values > 0].tolist()
    fig = go.Figure(go.Scatter(x=v, y=[0] * len(v), mode="markers", marker=dict(size=5)))
    fig.update_layout(title=f"e4m3fn: {len(v)} positive values, max {max(v):g}",
                      xaxis_type="log", xaxis_title="value (log)", yaxis_visible=False,
                      height=240)
    return fig


def error_histogram(errors: Mapping[str, torch.Tensor], title="relative error", nbins=60,
                    xaxis_title="relative error"):
    """Overlaid histograms of error samples over log-spaced bins (one trace per name; exact
    zeros are counted in the legend: a log axis has no place for them)."""
    logs = {k: e.flatten().double() for k, e in errors.items()}
    logs = {k: (e[e > 0].log10(), int((e == 0).sum())) for k, e in logs.items()}
    lo = min(float(v.min()) for v, _ in logs.values() if v.numel())
    hi = max(float(v.max()) for v, _ in logs.values() if v.numel())
    width = (hi - lo) / nbins or 1.0
    fig = go.Figure()
    for k, (v, zeros) in logs.items():
        counts = torch.histc(v, bins=nbins, min=lo, max=lo + nbins * width)
        fig.add_trace(go.Bar(x=[lo + (i + 0.5) * width for i in range(nbins)],
                             y=counts.tolist(), width=width, opacity=0.6,
                             name=f"{k} ({zeros} exact)" if zeros else k))
    ticks = list(range(int(lo // 1), int(-(-hi // 1)) + 1))
    fig.update_layout(barmode="overlay", bargap=0, title=title, yaxis_title="count",
                      xaxis=dict(title=f"{xaxis_title} (log)", tickvals=ticks,
                                 ticktext=[f"1e{t}" for t in ticks]))
    return fig


def bytes_per_token_bars(per_dtype: Mapping[str, int], title="KV bytes per token"):
    fig = go.Figure(go.Bar(x=list(per_dtype), y=list(per_dtype.values()),
                           text=[f"{v:,} B" for v in per_dtype.values()]))
    fig.update_layout(title=title, xaxis_title="KV cache dtype", yaxis_title="bytes per token")
    return fig


def read_bench_table(path=None) -> list[dict]:
    """Rows of the recorded H200 MLA timing table (keys: ``docs/bench_mla.md``'s header cells,
    "ours µs", "FI µs", ...; its ``source`` names each column's table); ``path`` None reads
    ``mla_spec/data/bench_mla_h200.json``."""
    return read_json(path, "bench_mla_h200.json")["rows"]
