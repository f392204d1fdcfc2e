"""Figures for draft-extend padding: ragged vs padded layouts, causal KV windows, the benchmark.

Used by ``notebooks/02_draft_extend_padding.ipynb``. Everything takes plain lists (seq_lens_q,
kv_lens, max_q) so the figures can be driven by widgets; the kernels themselves live in
:mod:`mla_spec.kernels.pad`.

Causal rule of a fixed-q_len kernel: row ``i`` of a ``max_q`` block with KV length ``K`` sees KV
positions ``< K - max_q + i + 1``. A ragged request of ``L`` rows wants row ``j`` to see
``< K - L + j + 1``. ``align="end"`` gives exactly that; ``align="start"`` gives row ``j`` only
``< K - max_q + j + 1``: ``max_q - L`` positions of context lost.
"""

from __future__ import annotations

import plotly.graph_objects as go
from plotly.subplots import make_subplots

__all__ = [
    "RECORDED_BENCH",
    "padded_layout",
    "window_matrix",
    "layout_figure",
    "window_figure",
    "bench_figure",
    "padding_explorer",
]

# Window cell states: not visible, visible (correct), context the row should see but does not.
HIDDEN, SEEN, LOST = 0, 1, 2


def padded_layout(seq_lens_q: list[int], max_q: int, align: str = "end") -> list[list[int]]:
    """``[bs][max_q]`` grid: the packed row index each padded slot holds, or -1 for padding."""
    grid, start = [], 0
    for length in seq_lens_q:
        first = max_q - length if align == "end" else 0
        grid.append([start + s - first if first <= s < first + length else -1
                     for s in range(max_q)])
        start += length
    return grid


def window_matrix(seq_lens_q: list[int], kv_lens: list[int], max_q: int,
                  align: str) -> tuple[list[list[int]], list[str]]:
    """Per real row (packed order), the state of every KV position under ``align``.

    Returns ``(matrix [total_q][max(kv_lens)], row labels)`` with cells HIDDEN / SEEN / LOST
    (LOST = inside the row's exact ragged window but masked by the padded layout).
    """
    width = max(kv_lens, default=0)
    rows, labels = [], []
    for b, (length, kv) in enumerate(zip(seq_lens_q, kv_lens)):
        for j in range(length):
            exact = kv - length + j + 1
            i = max_q - length + j if align == "end" else j
            seen = kv - max_q + i + 1
            rows.append([SEEN if p < min(seen, exact) else LOST if p < exact else HIDDEN
                         for p in range(width)])
            labels.append(f"r{b}.{j}")
    return rows, labels


def layout_figure(seq_lens_q: list[int], max_q: int, align: str = "end") -> go.Figure:
    """Heatmaps: the packed ragged rows (left) and the padded ``[bs, max_q]`` block (right)."""
    total = sum(seq_lens_q)
    owner = [b for b, n in enumerate(seq_lens_q) for _ in range(n)]
    grid = padded_layout(seq_lens_q, max_q, align)
    padded_owner = [[owner[r] if r >= 0 else None for r in row] for row in grid]
    text = [[f"q{r}" if r >= 0 else "pad" for r in row] for row in grid]
    fig = make_subplots(rows=1, cols=2, column_widths=[0.25, 0.75], subplot_titles=(
        f"ragged q [total_q={total}, H, D]", f"padded [bs={len(seq_lens_q)}, max_q={max_q}, H, D]"
        f" (align={align})"))
    fig.add_trace(go.Heatmap(z=[[o] for o in owner], text=[[f"q{r}"] for r in range(total)],
                             texttemplate="%{text}", colorscale="Turbo", showscale=False,
                             zmin=0, zmax=max(len(seq_lens_q) - 1, 1)), 1, 1)
    fig.add_trace(go.Heatmap(z=padded_owner, text=text, texttemplate="%{text}",
                             colorscale="Turbo", showscale=False, zmin=0,
                             zmax=max(len(seq_lens_q) - 1, 1)), 1, 2)
    fig.update_yaxes(autorange="reversed", title_text="packed row", row=1, col=1)
    fig.update_yaxes(autorange="reversed", title_text="request b", row=1, col=2)
    fig.update_xaxes(showticklabels=False, row=1, col=1)
    fig.update_xaxes(title_text="row s of the block", row=1, col=2)
    fig.update_layout(height=260 + 18 * len(seq_lens_q), margin=dict(t=50, b=40))
    return fig


def window_figure(seq_lens_q: list[int], kv_lens: list[int], max_q: int) -> go.Figure:
    """Every real row's causal KV window under both alignments; red = lost context."""
    fig = make_subplots(rows=1, cols=2, shared_yaxes=True, subplot_titles=(
        "align='end' (exact)", "align='start' (SGLang layout)"))
    scale = [[0, "#f2f2f2"], [0.33, "#f2f2f2"], [0.34, "#3b7dd8"], [0.66, "#3b7dd8"],
             [0.67, "#d62728"], [1, "#d62728"]]
    for col, align in ((1, "end"), (2, "start")):
        z, labels = window_matrix(seq_lens_q, kv_lens, max_q, align)
        fig.add_trace(go.Heatmap(z=z, y=labels, colorscale=scale, zmin=0, zmax=2,
                                 showscale=False, xgap=1, ygap=1), 1, col)
        fig.update_xaxes(title_text="KV position", row=1, col=col)
    fig.update_yaxes(autorange="reversed")
    fig.update_yaxes(title_text="real row (r request.row)", row=1, col=1)
    fig.update_layout(height=220 + 16 * sum(seq_lens_q), margin=dict(t=50, b=40),
                      title="causal KV window per real row (blue seen, red lost)")
    return fig


def lost_context(seq_lens_q: list[int], max_q: int, align: str) -> int:
    """KV positions lost over all real rows (``sum (max_q - L) * L`` for start, 0 for end)."""
    return 0 if align == "end" else sum((max_q - n) * n for n in seq_lens_q)


# Measured on one H200 (2026-11-29), `python benchmarks/bench_pad.py`, bf16,
# D 576 / Dv 512, per call in a replayed CUDA graph of 20 calls (us); docs/bench_pad.md.
# "ours" = the one-round-trip "small" variant, the default for bs <= 1024 since that run.
# Columns: op, H, bs, max_q, MB moved, ours, sglang-style, torch, copy_.
RECORDED_BENCH: list[tuple] = [
    ("pad", 16, 1, 2, 0.04, 1.92, 1.90, 14.76, 1.73),
    ("pad", 16, 1, 4, 0.07, 1.95, 2.28, 18.61, 1.81),
    ("pad", 16, 1, 8, 0.11, 1.98, 2.34, 18.75, 1.83),
    ("pad", 16, 8, 2, 0.44, 2.12, 2.48, 19.58, 1.93),
    ("pad", 16, 8, 4, 0.63, 2.16, 2.54, 19.48, 1.97),
    ("pad", 16, 8, 8, 1.14, 2.25, 2.68, 19.77, 2.10),
    ("pad", 16, 64, 2, 3.47, 2.97, 3.49, 21.11, 2.88),
    ("pad", 16, 64, 4, 6.05, 3.62, 4.34, 25.10, 3.48),
    ("pad", 16, 64, 8, 11.61, 4.86, 5.81, 30.45, 6.10),
    ("pad", 16, 512, 2, 27.98, 9.91, 10.12, 46.14, 12.03),
    ("pad", 16, 512, 4, 47.22, 14.78, 15.73, 62.02, 18.95),
    ("pad", 16, 512, 8, 84.05, 23.58, 26.61, 87.23, 21.70),
    ("pad", 32, 1, 2, 0.15, 2.00, 2.36, 18.76, 1.84),
    ("pad", 32, 1, 4, 0.29, 2.10, 2.41, 18.32, 1.89),
    ("pad", 32, 1, 8, 0.07, 1.99, 2.33, 18.20, 1.77),
    ("pad", 32, 8, 2, 0.88, 2.21, 2.55, 19.54, 2.06),
    ("pad", 32, 8, 4, 1.33, 2.30, 2.64, 19.73, 2.16),
    ("pad", 32, 8, 8, 3.17, 2.85, 3.32, 19.64, 2.80),
    ("pad", 32, 64, 2, 6.64, 3.75, 4.19, 23.59, 3.60),
    ("pad", 32, 64, 4, 12.39, 5.03, 5.83, 29.25, 5.03),
    ("pad", 32, 64, 8, 22.27, 7.65, 8.51, 37.90, 7.32),
    ("pad", 32, 512, 2, 58.02, 17.09, 18.02, 68.95, 15.68),
    ("pad", 32, 512, 4, 99.53, 27.14, 29.92, 97.65, 25.38),
    ("pad", 32, 512, 8, 172.60, 44.54, 51.26, 149.16, 42.33),
    ("pad", 128, 1, 2, 0.29, 2.07, 2.39, 18.60, 1.87),
    ("pad", 128, 1, 4, 1.18, 2.26, 2.58, 18.55, 2.13),
    ("pad", 128, 1, 8, 2.06, 2.52, 2.82, 19.69, 2.47),
    ("pad", 128, 8, 2, 3.24, 2.89, 3.27, 19.54, 2.80),
    ("pad", 128, 8, 4, 7.37, 3.86, 4.28, 23.12, 3.79),
    ("pad", 128, 8, 8, 9.44, 4.35, 4.88, 24.77, 4.34),
    ("pad", 128, 64, 2, 29.79, 9.37, 10.43, 39.84, 9.08),
    ("pad", 128, 64, 4, 48.37, 13.92, 15.43, 54.42, 13.51),
    ("pad", 128, 64, 8, 85.23, 22.73, 25.94, 82.24, 21.94),
    ("pad", 128, 512, 2, 217.94, 55.10, 64.42, 179.15, 52.76),
    ("pad", 128, 512, 4, 373.06, 92.24, 110.72, 285.93, 88.79),
    ("pad", 128, 512, 8, 688.32, 167.43, 204.92, 504.84, 161.68),
    ("unpad", 16, 1, 2, 0.03, 2.00, 2.23, 16.36, 1.72),
    ("unpad", 16, 1, 4, 0.07, 2.06, 2.27, 17.30, 1.76),
    ("unpad", 16, 1, 8, 0.10, 2.10, 2.29, 17.79, 1.81),
    ("unpad", 16, 8, 2, 0.39, 2.22, 2.46, 23.17, 1.91),
    ("unpad", 16, 8, 4, 0.56, 2.30, 2.49, 17.50, 1.96),
    ("unpad", 16, 8, 8, 1.02, 2.38, 2.64, 17.13, 2.10),
    ("unpad", 16, 64, 2, 3.08, 3.10, 3.40, 18.50, 2.76),
    ("unpad", 16, 64, 4, 5.37, 3.74, 4.16, 21.08, 3.34),
    ("unpad", 16, 64, 8, 10.32, 4.90, 5.46, 23.85, 4.54),
    ("unpad", 16, 512, 2, 24.87, 8.41, 9.18, 31.87, 7.93),
    ("unpad", 16, 512, 4, 41.98, 12.83, 14.08, 36.78, 11.82),
    ("unpad", 16, 512, 8, 74.71, 20.87, 23.64, 44.37, 19.44),
    ("unpad", 32, 1, 2, 0.13, 2.09, 2.31, 17.60, 1.81),
    ("unpad", 32, 1, 4, 0.26, 2.17, 2.37, 19.19, 1.90),
    ("unpad", 32, 1, 8, 0.07, 2.09, 2.28, 17.66, 1.75),
    ("unpad", 32, 8, 2, 0.79, 2.35, 2.56, 24.28, 2.00),
    ("unpad", 32, 8, 4, 1.18, 2.40, 2.60, 17.02, 2.14),
    ("unpad", 32, 8, 8, 2.82, 2.99, 3.24, 17.36, 2.67),
    ("unpad", 32, 64, 2, 5.90, 3.85, 4.11, 19.71, 3.47),
    ("unpad", 32, 64, 4, 11.01, 5.03, 5.43, 22.48, 4.72),
    ("unpad", 32, 64, 8, 19.79, 7.21, 7.75, 25.74, 6.73),
    ("unpad", 32, 512, 2, 51.58, 15.23, 16.22, 39.73, 14.12),
    ("unpad", 32, 512, 4, 88.47, 24.13, 26.72, 48.45, 22.72),
    ("unpad", 32, 512, 8, 153.42, 39.39, 45.61, 64.27, 37.79),
    ("unpad", 128, 1, 2, 0.26, 2.18, 2.40, 17.01, 1.90),
    ("unpad", 128, 1, 4, 1.05, 2.40, 2.54, 19.05, 2.05),
    ("unpad", 128, 1, 8, 1.84, 2.63, 2.77, 21.64, 2.38),
    ("unpad", 128, 8, 2, 2.88, 3.02, 3.21, 23.93, 2.67),
    ("unpad", 128, 8, 4, 6.55, 3.93, 4.10, 18.60, 3.62),
    ("unpad", 128, 8, 8, 8.39, 4.33, 4.62, 19.01, 4.03),
    ("unpad", 128, 64, 2, 26.48, 8.79, 9.61, 24.64, 8.35),
    ("unpad", 128, 64, 4, 42.99, 12.72, 13.88, 30.43, 12.09),
    ("unpad", 128, 64, 8, 75.76, 20.53, 23.21, 40.52, 19.71),
    ("unpad", 128, 512, 2, 193.72, 48.48, 57.00, 75.54, 47.29),
    ("unpad", 128, 512, 4, 331.61, 81.26, 97.82, 110.72, 79.19),
    ("unpad", 128, 512, 8, 611.84, 147.00, 179.68, 183.03, 143.65),
]


def bench_figure(rows: list[dict] | None = None) -> go.Figure:
    """GB/s against the bytes a call moves (both log), one point per shape: ours, the
    SGLang-style kernel, torch and ``copy_`` (the ceiling), per call in a CUDA graph."""
    if rows is None:
        rows = [dict(zip(("op", "H", "bs", "max_q", "MB", "ours_graph_us", "sglang_graph_us",
                          "torch_graph_us", "copy__graph_us"), r)) for r in RECORDED_BENCH]
    fig = make_subplots(rows=1, cols=2, subplot_titles=("pad (D 576)", "unpad (Dv 512)"),
                        shared_yaxes=True)
    # drawn last to first (ours on top); the legend keeps this order
    names = (("ours", "ours_graph_us", "#1f77b4", "diamond"),
             ("sglang-style", "sglang_graph_us", "#ff7f0e", "circle"),
             ("torch", "torch_graph_us", "#2ca02c", "circle"),
             ("copy_ (ceiling)", "copy__graph_us", "#7f7f7f", "circle-open"))
    for col, op in ((1, "pad"), (2, "unpad")):
        sel = sorted((r for r in rows if r["op"] == op), key=lambda r: r["MB"])
        text = [f"H{r['H']} bs{r['bs']} max_q {r['max_q']}" for r in sel]
        for k, (name, key, color, symbol) in reversed(list(enumerate(names))):
            fig.add_trace(go.Scatter(
                x=[r["MB"] for r in sel], y=[r["MB"] * 1e3 / r[key] for r in sel], text=text,
                mode="markers", name=name, legendgroup=name, showlegend=col == 1,
                legendrank=k, marker=dict(color=color, size=8, symbol=symbol),
                hovertemplate=f"{name}: %{{text}}, %{{x:.2f}} MB, %{{y:.0f}} GB/s<extra></extra>"),
                1, col)
        fig.update_xaxes(type="log", title_text="MB moved a call (read + write, log)", row=1,
                         col=col)
    fig.update_yaxes(type="log", title_text="GB/s in a CUDA graph (log)", row=1, col=1)
    fig.update_yaxes(type="log", row=1, col=2)
    fig.update_layout(height=420, title="pad / unpad bandwidth, one point per shape (H200)",
                      legend=dict(orientation="h", y=-0.25))
    return fig


def padding_explorer(num_draft_tokens: int = 4):
    """ipywidgets: batch size, accept lengths, max_q and align drive the layout + window figures."""
    import ipywidgets as widgets

    bs = widgets.IntSlider(value=4, min=1, max=8, description="batch size")
    max_q = widgets.IntSlider(value=num_draft_tokens, min=1, max=8, description="max_q")
    accepts = widgets.Text(value="1, 4, 2, 3", description="accept lens")
    align = widgets.ToggleButtons(options=["end", "start"], description="align")
    out = widgets.Output()

    def redraw(_=None):
        lens = [int(x) for x in accepts.value.replace(" ", "").split(",") if x.isdigit()]
        lens = [min(max(x, 1), max_q.value) for x in (lens + [1] * bs.value)[: bs.value]]
        kv = [max_q.value + 3 + 2 * b for b in range(len(lens))]
        out.clear_output(wait=True)
        with out:
            layout_figure(lens, max_q.value, align.value).show()
            window_figure(lens, kv, max_q.value).show()

    for w in (bs, max_q, accepts, align):
        w.observe(redraw, names="value")
    redraw()
    return widgets.VBox([widgets.HBox([bs, max_q]), widgets.HBox([accepts, align]), out])
