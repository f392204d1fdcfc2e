"""Figures for draft-extend padding: ragged vs padded layouts, causal KV windows, the benchmark.

Notebook 02's; all take plain lists (seq_lens_q, kv_lens, max_q), so widgets can drive them.
Row ``i`` of a fixed ``max_q`` block with KV length ``K`` sees positions ``< K - max_q + i + 1``;
a ragged request of ``L`` rows wants row ``j`` to see ``< K - L + j + 1``: ``align="end"`` gives
exactly that, ``align="start"`` only ``< K - max_q + j + 1`` (``max_q - L`` positions lost).
"""

import plotly.graph_objects as go
from plotly.subplots import make_subplots

from mla_spec.viz import read_json

__all__ = ["RECORDED_BENCH", "padded_layout", "window_matrix", "layout_figure", "window_figure",
           "bench_figure", "padding_explorer"]

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
    """``(matrix [total_q][max(kv_lens)], row labels)``: per real row, each KV position HIDDEN,
    SEEN or LOST (in the exact ragged window but masked by the padded layout) under ``align``."""
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


# One H200 (``mla_spec/data/bench_pad_h200.json``: its ``command``, ``date`` and ``setup``): rows
# (op, H, bs, max_q, MB moved, then µs per call in a CUDA graph: ours, sglang-style, torch, copy_).
_BENCH = read_json(None, "bench_pad_h200.json")
RECORDED_BENCH: list[tuple] = [tuple(r) for r in _BENCH["rows"]]


def bench_figure(rows: list[dict] | None = None) -> go.Figure:
    """GB/s against the bytes a call moves (both log), one point per shape: ours, the
    SGLang-style kernel, torch and ``copy_`` (the ceiling), per call in a CUDA graph."""
    if rows is None:
        rows = [dict(zip(_BENCH["columns"], r)) for r in RECORDED_BENCH]
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
