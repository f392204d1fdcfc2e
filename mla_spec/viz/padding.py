"""Figures for draft-extend padding: ragged vs padded layouts, causal KV windows, the benchmark.

Used by ``notebooks/02_draft_extend_padding.ipynb``. Everything takes plain lists (seq_lens_q,
kv_lens, max_q) so the figures can be driven by widgets; the kernels themselves live in
:mod:`mla_spec.kernels.draft_extend_pad`.

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
    fig.update_layout(height=220 + 16 * sum(seq_lens_q), margin=dict(t=50, b=40),
                      title="causal KV window per real row (blue seen, red lost)")
    return fig


def lost_context(seq_lens_q: list[int], max_q: int, align: str) -> int:
    """KV positions lost over all real rows (``sum (max_q - L) * L`` for start, 0 for end)."""
    return 0 if align == "end" else sum((max_q - n) * n for n in seq_lens_q)


# Measured on one H200 (2026-11-29), `python benchmarks/bench_pad.py`, bf16, D 576 / Dv 512,
# per call in a replayed CUDA graph of 20 calls (us). Filled from docs/bench_pad.md.
# Columns: op, H, bs, max_q, MB moved, ours, sglang-style, torch, copy_.
RECORDED_BENCH: list[tuple] = [
    ("pad", 16, 1, 2, 0.04, 1.83, 1.92, 14.80, 1.76),
    ("pad", 16, 1, 4, 0.07, 2.27, 2.32, 18.81, 1.85),
    ("pad", 16, 1, 8, 0.11, 2.29, 2.37, 18.93, 1.85),
    ("pad", 16, 64, 2, 3.47, 3.38, 3.57, 21.12, 2.91),
    ("pad", 16, 64, 4, 6.05, 4.11, 4.39, 25.36, 3.57),
    ("pad", 16, 64, 8, 11.61, 5.40, 5.89, 30.62, 6.21),
    ("pad", 16, 512, 2, 27.98, 9.44, 10.19, 46.60, 12.26),
    ("pad", 16, 512, 4, 47.22, 15.09, 15.82, 62.82, 19.34),
    ("pad", 16, 512, 8, 84.05, 25.12, 26.64, 88.97, 21.86),
    ("pad", 32, 1, 2, 0.15, 2.34, 2.37, 19.01, 1.87),
    ("pad", 32, 1, 4, 0.29, 2.42, 2.42, 18.44, 1.93),
    ("pad", 32, 1, 8, 0.07, 2.28, 2.36, 18.39, 1.80),
    ("pad", 32, 64, 2, 6.64, 4.12, 4.24, 23.89, 3.66),
    ("pad", 32, 64, 4, 12.39, 5.53, 5.88, 29.60, 5.10),
    ("pad", 32, 64, 8, 22.27, 8.12, 8.53, 38.15, 7.42),
    ("pad", 32, 512, 2, 58.02, 17.02, 18.03, 70.55, 15.77),
    ("pad", 32, 512, 4, 99.53, 27.18, 29.86, 100.65, 25.51),
    ("pad", 32, 512, 8, 172.60, 45.02, 51.04, 153.25, 42.61),
    ("pad", 128, 1, 2, 0.29, 2.48, 2.46, 18.99, 1.93),
    ("pad", 128, 1, 4, 1.18, 2.66, 2.63, 19.29, 2.17),
    ("pad", 128, 1, 8, 2.06, 2.87, 2.85, 19.33, 2.50),
    ("pad", 128, 64, 2, 29.79, 10.25, 10.41, 40.27, 9.17),
    ("pad", 128, 64, 4, 48.37, 15.03, 15.40, 55.23, 13.61),
    ("pad", 128, 64, 8, 85.23, 24.47, 25.97, 83.66, 22.09),
    ("pad", 128, 512, 2, 217.94, 57.43, 64.16, 182.74, 53.07),
    ("pad", 128, 512, 4, 373.06, 96.31, 109.95, 292.24, 89.27),
    ("pad", 128, 512, 8, 688.32, 175.03, 202.93, 515.36, 163.58),
    ("unpad", 16, 1, 2, 0.03, 2.38, 2.29, 17.50, 1.77),
    ("unpad", 16, 1, 4, 0.07, 2.41, 2.33, 18.07, 1.81),
    ("unpad", 16, 1, 8, 0.10, 2.44, 2.34, 18.68, 1.85),
    ("unpad", 16, 64, 2, 3.08, 3.24, 3.44, 19.19, 2.80),
    ("unpad", 16, 64, 4, 5.37, 3.87, 4.19, 21.12, 3.38),
    ("unpad", 16, 64, 8, 10.32, 5.08, 5.51, 24.04, 4.65),
    ("unpad", 16, 512, 2, 24.87, 8.72, 9.25, 32.23, 8.02),
    ("unpad", 16, 512, 4, 41.98, 13.40, 14.13, 38.09, 11.91),
    ("unpad", 16, 512, 8, 74.71, 21.48, 23.71, 45.72, 19.58),
    ("unpad", 32, 1, 2, 0.13, 2.43, 2.34, 18.44, 1.84),
    ("unpad", 32, 1, 4, 0.26, 2.44, 2.37, 18.51, 1.94),
    ("unpad", 32, 1, 8, 0.07, 2.41, 2.33, 16.99, 1.82),
    ("unpad", 32, 64, 2, 5.90, 4.01, 4.15, 19.93, 3.50),
    ("unpad", 32, 64, 4, 11.01, 5.20, 5.47, 22.70, 4.77),
    ("unpad", 32, 64, 8, 19.79, 7.64, 7.82, 26.38, 6.82),
    ("unpad", 32, 512, 2, 51.58, 15.61, 16.27, 40.75, 14.33),
    ("unpad", 32, 512, 4, 88.47, 24.86, 26.60, 49.87, 22.92),
    ("unpad", 32, 512, 8, 153.42, 40.97, 45.55, 65.98, 38.05),
    ("unpad", 128, 1, 2, 0.26, 2.47, 2.47, 17.92, 1.99),
    ("unpad", 128, 1, 4, 1.05, 2.66, 2.60, 19.34, 2.13),
    ("unpad", 128, 1, 8, 1.84, 2.81, 2.85, 21.09, 2.43),
    ("unpad", 128, 64, 2, 26.48, 9.27, 9.63, 25.25, 8.39),
    ("unpad", 128, 64, 4, 42.99, 13.71, 13.94, 30.88, 12.17),
    ("unpad", 128, 64, 8, 75.76, 22.03, 23.11, 41.16, 19.93),
    ("unpad", 128, 512, 2, 193.72, 51.00, 56.86, 76.60, 47.80),
    ("unpad", 128, 512, 4, 331.61, 85.16, 97.45, 112.84, 79.91),
    ("unpad", 128, 512, 8, 611.84, 154.26, 178.50, 184.79, 145.09),
]


def bench_figure(rows: list[dict] | None = None) -> go.Figure:
    """GB/s of ours, the SGLang-style kernel, torch and copy_ per shape (graph replay)."""
    if rows is None:
        rows = [dict(zip(("op", "H", "bs", "max_q", "MB", "ours_graph_us", "sglang_graph_us",
                          "torch_graph_us", "copy__graph_us"), r)) for r in RECORDED_BENCH]
    fig = make_subplots(rows=1, cols=2, subplot_titles=("pad (D 576)", "unpad (Dv 512)"),
                        shared_yaxes=True)
    names = (("ours", "ours_graph_us"), ("sglang-style", "sglang_graph_us"),
             ("torch", "torch_graph_us"), ("copy_", "copy__graph_us"))
    for col, op in ((1, "pad"), (2, "unpad")):
        sel = [r for r in rows if r["op"] == op]
        x = [f"H{r['H']} bs{r['bs']} q{r['max_q']}" for r in sel]
        for k, (name, key) in enumerate(names):
            gbps = [r["MB"] * 1e3 / r[key] for r in sel]
            fig.add_trace(go.Bar(x=x, y=gbps, name=name, legendgroup=name, showlegend=col == 1,
                                 marker_color=("#1f77b4", "#ff7f0e", "#2ca02c", "#7f7f7f")[k]),
                          1, col)
    fig.update_yaxes(title_text="GB/s (read + write), CUDA graph", row=1, col=1)
    fig.update_layout(barmode="group", height=420, margin=dict(t=50, b=120))
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
