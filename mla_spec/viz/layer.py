"""Plotly figures for the recorded real-size DeepSeek-V3 layer benchmark (notebook 07).

``benchmarks/bench_layer.py`` times one layer at TP-4 shard shapes on one H200 for ``ours``
(NVFP4 W4A16 + Triton MLA, FP8 KV) and ``base`` (BF16 cuBLAS / grouped GEMM + FlashInfer MLA,
BF16 KV) and projects tokens/s per user from the batch-1 times; the 2026-11-30 run is shipped as
``mla_spec/data/bench_layer_h200.json``, the dict every figure takes (``load_layer_results()``):

- ``rows``: per (layer, mode, part, bs, ctx) ``ours_us`` / ``base_us`` (median µs, CUDA graph);
  ``part``: ``layer`` / ``mtp`` (whole layer), ``attn``, ``attn_kernel``, ``moe``, ``dense``,
  ``norms``, ``lm_head``; ``ctx`` None for the pieces that do not depend on the context.
- ``projection``: ``{side: {"lines": {name: {"accept_length", "tok_s", "tok_s_range",
  "step_ms", "collectives_pct", "b200_scaled_tok_s"}}}}`` (names ``no_mtp``, ``mtp_accept_<a>``);
  ``projection_model["sglang_ci_bars_tok_s"]``: SGLang's CI bars (4 B200s: 75 / 150 tok/s).
"""

from pathlib import Path
from typing import Any

import plotly.graph_objects as go

from mla_spec.viz import read_json

__all__ = ["load_layer_results", "layer_rows", "piece_times", "pieces_figure",
           "layer_vs_batch_figure", "projection_figure", "load_collectives", "collectives_figure"]

SIDES = ("ours", "base")
PIECES = ("attn", "attn_kernel", "moe", "dense", "norms", "lm_head")


def _load(path: str | Path | None, shipped: str, keys: tuple[str, ...], what: str) -> dict:
    d = read_json(path, shipped)
    for key in keys:
        if key not in d:
            raise ValueError(f"{path or shipped}: not a {what} result (no {key!r}); expected the "
                             f"format of mla_spec/data/{shipped}")
    return d


def load_layer_results(path: str | Path | None = None) -> dict[str, Any]:
    """The recorded bench_layer results; ``path`` None reads the copy shipped in the package."""
    return _load(path, "bench_layer_h200.json", ("rows", "projection"), "bench_layer")


def layer_rows(res: dict, *, part: str | None = None, mode: str | None = None,
               bs: int | None = None, ctx: int | None | str = "any",
               layer: str | None = None) -> list[dict]:
    """Rows of ``res`` matching every given filter (``ctx="any"`` leaves ctx unfiltered)."""
    return [r for r in res["rows"]
            if (part is None or r["part"] == part) and (mode is None or r["mode"] == mode)
            and (bs is None or r["bs"] == bs) and (ctx == "any" or r["ctx"] == ctx)
            and (layer is None or r["layer"] == layer)]


def piece_times(res: dict, *, mode: str = "DECODE", bs: int = 1,
                ctx: int = 1024) -> dict[str, dict[str, float]]:
    """``{piece: {"ours": us, "base": us}}`` for one (mode, bs); context-dependent pieces at
    ``ctx``. The whole layer is included as ``layer``."""
    out: dict[str, dict[str, float]] = {}
    for piece in ("layer",) + PIECES:
        c = ctx if piece in ("layer", "attn", "attn_kernel") else None
        rows = layer_rows(res, part=piece, mode=mode, bs=bs, ctx=c)
        if len(rows) != 1:
            raise ValueError(f"expected one row for {piece} {mode} bs {bs} ctx {c}, "
                             f"found {len(rows)}")
        out[piece] = {s: rows[0][f"{s}_us"] for s in SIDES}
    return out


def pieces_figure(res: dict, *, mode: str = "DECODE", bs: int = 1, ctx: int = 1024,
                  title: str | None = None) -> go.Figure:
    """Grouped bars: ours vs base per piece of one layer (µs), ratio base/ours as text."""
    t = piece_times(res, mode=mode, bs=bs, ctx=ctx)
    names = list(t)
    fig = go.Figure()
    for s in SIDES:
        text = [f"{t[n]['base'] / t[n]['ours']:.2f}x" if s == "ours" else "" for n in names]
        fig.add_bar(x=names, y=[t[n][s] for n in names], name=s, text=text,
                    textposition="outside")
    fig.update_layout(
        barmode="group", yaxis_title="µs (median, CUDA graph)",
        title=title or f"H200, one layer at TP-4 shapes: {mode} bs {bs} ctx {ctx} "
                       "(text: base / ours, > 1 = ours faster)")
    return fig


def layer_vs_batch_figure(res: dict, *, ctx: int = 1024, layer: str = "target",
                          title: str | None = None) -> go.Figure:
    """Whole-layer time vs batch size per (side, mode) at one context (log-log)."""
    part = "layer" if layer == "target" else "mtp"
    rows = layer_rows(res, part=part, ctx=ctx, layer=layer)
    modes = sorted({r["mode"] for r in rows})
    fig = go.Figure()
    for s in SIDES:
        for m in modes:
            rs = sorted((r for r in rows if r["mode"] == m), key=lambda r: r["bs"])
            fig.add_scatter(x=[r["bs"] for r in rs], y=[r[f"{s}_us"] for r in rs],
                            mode="lines+markers", name=f"{s} {m}",
                            line_dash="solid" if s == "ours" else "dash")
    fig.update_layout(xaxis_type="log", yaxis_type="log", xaxis_title="batch size",
                      yaxis_title="µs per layer",
                      title=title or f"H200: {layer} layer time vs batch (ctx {ctx})")
    return fig


def projection_figure(res: dict, title: str | None = None) -> go.Figure:
    """Projected tokens/s per user (bs 1) per side and line, with SGLang's CI bars as markers."""
    bars = res.get("projection_model", {}).get("sglang_ci_bars_tok_s",
                                               {"no_mtp": 75.0, "mtp": 150.0})
    fig = go.Figure()
    names: list[str] = []
    for s in SIDES:
        lines = res["projection"][s]["lines"]
        names = list(lines)
        lo = [lines[n]["tok_s"] - lines[n]["tok_s_range"][0] for n in names]
        hi = [lines[n]["tok_s_range"][1] - lines[n]["tok_s"] for n in names]
        fig.add_bar(x=names, y=[lines[n]["tok_s"] for n in names], name=f"{s} (H200 projection)",
                    text=[f"{lines[n]['tok_s']:.1f}" for n in names], textposition="outside",
                    error_y=dict(type="data", symmetric=False, array=hi, arrayminus=lo))
    fig.add_scatter(x=names, y=[bars["no_mtp"] if n == "no_mtp" else bars["mtp"] for n in names],
                    mode="markers", marker_symbol="line-ew-open", marker_size=40,
                    marker_line_width=3, name="SGLang CI bar (4x B200, end to end)")
    fig.update_layout(barmode="group", yaxis_title="tokens/s per user (projected)",
                      title=title or "Projection from the bs-1 layer times vs SGLang's CI bars "
                                     "(error bars: collective latency 5-10 µs)")
    return fig


def load_collectives(path: str | Path | None = None) -> dict[str, Any]:
    """``benchmarks/bench_allreduce.py``'s table; ``path`` None reads the 4x H200 run shipped
    in the package (``mla_spec/data/allreduce_h200x4.json``: NCCL, inside CUDA graphs and
    eagerly, with the projection's old estimate beside each size)."""
    return _load(path, "allreduce_h200x4.json", ("allreduce", "allgather", "meta"),
                 "bench_allreduce")


def collectives_figure(d: dict, title: str | None = None) -> go.Figure:
    """All-reduce time vs message size (rows of ``[rows, hidden]`` bf16): measured in a CUDA
    graph, eagerly, and the estimate the projection used before the measurement (log-log)."""
    rows = d["allreduce"]
    x = [r["rows"] for r in rows]
    fig = go.Figure()
    for key, name, dash in (("graph_us", "in a CUDA graph", None), ("eager_us", "eager", None),
                            ("estimate_us", "old estimate (8 µs + 450 GB/s)", "dash")):
        fig.add_scatter(x=x, y=[r.get(key) for r in rows], name=name, mode="lines+markers",
                        line=dict(dash=dash))
    m = d["meta"]
    fig.update_layout(title=title or f"NCCL all-reduce of [rows, {m.get('hidden', 7168)}] bf16 "
                      f"over {m['world']} x {m.get('device', 'GPU')}",
                      xaxis=dict(title="rows (bs x q_len)", type="log"),
                      yaxis=dict(title="µs per all-reduce", type="log"), height=380)
    return fig
