"""Plotly figures for the NVFP4 notebook: one block's bits, format errors, GEMM speed."""

import plotly.graph_objects as go
import torch
from plotly.subplots import make_subplots

from mla_spec.quant.mxfp4 import int4_group_error_report, mxfp4_error_report
from mla_spec.quant.nvfp4 import (
    E2M1_VALUES,
    NVFP4ErrorReport,
    make_error_report,
    nvfp4_error_report,
    quantize_nvfp4,
    unpack_fp4,
)
from mla_spec.viz import read_json

__all__ = ["encode_block", "block_bits_figure", "floors_figure", "format_errors",
           "format_error_figure", "gemm_speed_figure", "weight_distribution", "RECORDED_H200",
           "RECORDED_H200_FLOORS", "RECORDED_H200_MOE"]


def encode_block(block: torch.Tensor, weight_scale_2: torch.Tensor | None = None) -> list[dict]:
    """One 16-element block, element by element: value, scaled value, code, bits, byte."""
    q = quantize_nvfp4(block.reshape(1, 16).float(), weight_scale_2)
    codes = unpack_fp4(q.weight)[0]
    scale = q.weight_scale.float().item() * q.weight_scale_2.item()
    return [dict(i=i, value=float(block[i]), scaled=float(block[i]) / scale, code=c,
                 bits=f"{c:04b}", decoded=float(E2M1_VALUES[c]) * scale,
                 byte=int(q.weight[0, i // 2]), nibble="low" if i % 2 == 0 else "high")
            for i, c in enumerate(codes.tolist())]


def block_bits_figure(rows: list[dict], title: str = "") -> go.Figure:
    """Heatmap of the 4 bits (sign, exp1, exp0, mantissa) of each element, with the bytes."""
    z = [[int(b) for b in r["bits"]] for r in rows]
    text = [[f"{b}" for b in r["bits"]] for r in rows]
    labels = [f"{r['i']:2d}: {r['value']:+.3f} -> {r['scaled']:+.2f} -> "
              f"{r['decoded']:+.3f}  byte 0x{r['byte']:02X} ({r['nibble']})" for r in rows]
    fig = go.Figure(go.Heatmap(z=z, x=["sign", "exp1", "exp0", "mant"], y=labels, text=text,
                               texttemplate="%{text}", colorscale=[[0, "#eef"], [1, "#36c"]],
                               showscale=False))
    fig.update_yaxes(autorange="reversed")
    fig.update_layout(title=title or "one NVFP4 block: value -> scaled -> E2M1 bits",
                      xaxis_title="E2M1 bit", yaxis_title="element: value -> scaled -> decoded",
                      height=520, margin=dict(l=360))
    return fig


def weight_distribution(kind: str, n: int = 256, k: int = 1024, seed: int = 0) -> torch.Tensor:
    """'gauss', 'outliers' (0.5% of weights x30) or 'student' (t, 3 dof), std about 0.02."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) * 0.02
    if kind == "outliers":
        idx = torch.randint(0, w.numel(), (w.numel() // 200,), generator=g)
        w.view(-1)[idx] *= 30.0
    elif kind == "student":
        u = torch.distributions.Chi2(3.0).sample((n, k))
        w = w / torch.sqrt(u / 3.0)
    return w


def format_errors(w: torch.Tensor) -> dict[str, NVFP4ErrorReport]:
    """Error reports of bf16, NVFP4, MXFP4 and int4 (group 128) on one weight."""
    bf = w.to(torch.bfloat16).float()
    return {"bf16": make_error_report(w.float(), bf, 0.0, 16.0),
            "nvfp4": nvfp4_error_report(w), "mxfp4": mxfp4_error_report(w),
            "int4_g128": int4_group_error_report(w, 128)}


def format_error_figure(results: dict[str, dict[str, NVFP4ErrorReport]]) -> go.Figure:
    """Grouped bars of SQNR (dB, higher is better) per distribution and format."""
    fig = go.Figure()
    formats = list(next(iter(results.values())).keys())
    for f in formats:
        fig.add_bar(name=f, x=list(results), y=[results[d][f].sqnr_db for d in results])
    fig.update_layout(barmode="group", yaxis_title="SQNR dB (higher is better)",
                      xaxis_title="weight distribution",
                      title="quantization error by weight distribution", height=380)
    return fig


def gemm_speed_figure(rows: list[dict]) -> go.Figure:
    """Per shape, µs vs M for ours, the previous default (rows with ``default_us``) and cuBLAS
    bf16 (rows from ``RECORDED_H200`` / ``RECORDED_H200_MOE`` or bench_nvfp4's table)."""
    shapes = list(dict.fromkeys(r["shape"] for r in rows))
    fig = make_subplots(rows=1, cols=len(shapes), subplot_titles=shapes)
    for j, s in enumerate(shapes, start=1):
        rs = [r for r in rows if r["shape"] == s]
        ms = [str(r["m"]) for r in rs]
        fig.add_bar(x=ms, y=[r["ours_us"] for r in rs], name="NVFP4 (ours)",
                    marker_color="#36c", showlegend=j == 1, row=1, col=j)
        if any("default_us" in r for r in rs):
            fig.add_bar(x=ms, y=[r.get("default_us") for r in rs], name="previous default",
                        marker_color="#9bd", showlegend=j == 1, row=1, col=j)
        base = [r.get("bf16_us", r.get("bf16_gemms_us")) for r in rs]
        fig.add_bar(x=ms, y=base, name="cuBLAS bf16", marker_color="#aaa",
                    showlegend=j == 1, row=1, col=j)
    fig.update_layout(barmode="group", height=380, title="µs per call (CUDA graph) vs M tokens",
                      legend=dict(orientation="h", y=-0.3))
    fig.update_yaxes(type="log")
    fig.update_yaxes(title_text="µs per call (log)", row=1, col=1)
    fig.update_xaxes(title_text="M tokens")
    return fig


def floors_figure(rows: list[dict]) -> go.Figure:
    """Per shape at 1 token: the read floor (one pass over the weight's bytes, nothing else),
    ours and cuBLAS bf16 / 3 (the 3x goal), in µs per call (rows: ``RECORDED_H200_FLOORS``
    or ``bench_nvfp4.py --floors``)."""
    shapes = [r["shape"] for r in rows]
    fig = go.Figure()
    for key, name, color in (("read_us", "read floor", "#bbb"), ("ours_us", "NVFP4 (ours)", "#36c"),
                             ("target_us", "3x goal (cuBLAS bf16 / 3)", "#e63")):
        fig.add_bar(x=shapes, y=[r[key] for r in rows], name=name, marker_color=color)
    fig.update_layout(barmode="group", height=360, yaxis_title="µs per call (graph chain)",
                      xaxis_title="weight (TP-4 shard)",
                      title="where 3x stops paying: a goal bar below the floor bar is out of reach")
    return fig


# Recorded on one H200 (``mla_spec/data/bench_nvfp4_h200.json``; each table with its commands,
# dates and notes): the GEMM per shape and M tokens (``ours_us``, ``default_us``: the pin it
# replaced, ``bf16_us``: cuBLAS), the fused MoE (bf16: cuBLAS GEMMs of the active experts), and the
# read floor at 1 token (``read_us``, ``ours_us``, ``bf16_us``, ``target_us = bf16_us / 3``).
_RECORDED = read_json(None, "bench_nvfp4_h200.json")
RECORDED_H200: list[dict] = _RECORDED["gemm"]["rows"]
RECORDED_H200_MOE: list[dict] = _RECORDED["moe"]["rows"]
RECORDED_H200_FLOORS: list[dict] = _RECORDED["floors"]["rows"]
