"""Plotly figures for the MLA-backend and FP8-cache notebooks (03, 04).

Every function returns a ``plotly.graph_objects.Figure`` and takes plain data (tables computed
by ``mla_spec`` functions), so the notebooks only call and show.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import plotly.graph_objects as go
import torch

__all__ = [
    "dispatch_table",
    "agreement_heatmap",
    "latency_bars",
    "fp8_grid_figure",
    "error_histogram",
    "bytes_per_token_bars",
    "read_bench_table",
]


def dispatch_table(device="cpu"):
    """``{backend: {"device": "ok" | reason, mode name: "ok" | reason}}`` from the registry.

    Mode support is the backend's own (``mode_reason``), independent of the device; the
    ``device`` column says whether it can run here. No backend is built.
    """
    from mla_spec.attention import BACKENDS, get_backend_class
    from mla_spec.attention.synthetic import ALL_MODES

    dev = torch.device(device)
    table = {}
    for name in BACKENDS:
        cls = get_backend_class(name)
        row = {"device": cls.device_reason(dev) or "ok"}
        for mode in ALL_MODES:
            why = None if mode.is_idle() else cls.mode_reason(mode)
            row[mode.name] = why or "ok"
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
                               colorscale="Blues"))
    fig.update_layout(title=title, height=260 + 30 * len(backends))
    return fig


def latency_bars(labels: Sequence[str], series: Mapping[str, Sequence[float]],
                 unit="µs", title="latency"):
    """Grouped bars: one group per label, one bar per series (e.g. ours / FlashInfer)."""
    fig = go.Figure([go.Bar(name=k, x=list(labels), y=list(v)) for k, v in series.items()])
    fig.update_layout(barmode="group", title=title, yaxis_title=unit)
    return fig


def fp8_grid_figure(values: torch.Tensor):
    """The non-negative e4m3 grid on a log axis (spacing doubles every binade)."""
    v = values[values > 0].tolist()
    fig = go.Figure(go.Scatter(x=v, y=[0] * len(v), mode="markers", marker=dict(size=5)))
    fig.update_layout(title=f"e4m3fn: {len(v)} positive values, max {max(v):g}",
                      xaxis_type="log", yaxis_visible=False, height=220)
    return fig


def error_histogram(errors: Mapping[str, torch.Tensor], title="relative error", nbins=60):
    """Overlaid histograms of error samples (one trace per name)."""
    fig = go.Figure([go.Histogram(x=e.flatten().float().tolist(), name=k, nbinsx=nbins,
                                  opacity=0.6) for k, e in errors.items()])
    fig.update_layout(barmode="overlay", title=title)
    return fig


def bytes_per_token_bars(per_dtype: Mapping[str, int], title="KV bytes per token"):
    fig = go.Figure(go.Bar(x=list(per_dtype), y=list(per_dtype.values()),
                           text=[f"{v:,} B" for v in per_dtype.values()]))
    fig.update_layout(title=title, yaxis_title="bytes")
    return fig


def read_bench_table(path=None) -> list[dict]:
    """Rows of the recorded H200 MLA timing table (keys = the header cells of
    ``docs/bench_mla.md``'s tables: "ours µs", "FI µs", "ours graph µs", ...; the file's
    ``source`` field says which table each column comes from).

    ``path`` None reads the copy shipped in the package (``mla_spec/data/bench_mla_h200.json``),
    so the notebooks work from an installed package too.
    """
    import json
    from pathlib import Path

    if path is None:
        path = Path(__file__).resolve().parents[1] / "data" / "bench_mla_h200.json"
    return json.loads(Path(path).read_text())["rows"]
