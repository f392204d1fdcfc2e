"""Plotly figures for the NVFP4 notebook: one block's bits, format errors, GEMM speed."""

from __future__ import annotations

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

__all__ = ["encode_block", "block_bits_figure", "format_errors", "format_error_figure",
           "gemm_speed_figure", "weight_distribution", "RECORDED_H200"]


def encode_block(block: torch.Tensor, weight_scale_2: torch.Tensor | None = None) -> list[dict]:
    """One 16-element block, element by element: value, scaled value, code, bits, byte."""
    q = quantize_nvfp4(block.reshape(1, 16).float(), weight_scale_2)
    codes = unpack_fp4(q.weight)[0]
    scale = q.weight_scale.float().item() * q.weight_scale_2.item()
    rows = []
    for i in range(16):
        c = int(codes[i])
        rows.append(dict(i=i, value=float(block[i]), scaled=float(block[i]) / scale, code=c,
                         bits=f"{c:04b}", decoded=float(E2M1_VALUES[c]) * scale,
                         byte=int(q.weight[0, i // 2]), nibble="low" if i % 2 == 0 else "high"))
    return rows


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
                      title="quantization error by weight distribution", height=380)
    return fig


def gemm_speed_figure(rows: list[dict]) -> go.Figure:
    """Per shape, µs vs M for ours and cuBLAS bf16 (rows from bench_nvfp4's table)."""
    shapes = list(dict.fromkeys(r["shape"] for r in rows))
    fig = make_subplots(rows=1, cols=len(shapes), subplot_titles=shapes)
    for j, s in enumerate(shapes, start=1):
        rs = [r for r in rows if r["shape"] == s]
        ms = [str(r["m"]) for r in rs]
        fig.add_bar(x=ms, y=[r["ours_us"] for r in rs], name="NVFP4 (ours)",
                    marker_color="#36c", showlegend=j == 1, row=1, col=j)
        base = [r.get("bf16_us", r.get("bf16_gemms_us")) for r in rs]
        fig.add_bar(x=ms, y=base, name="cuBLAS bf16", marker_color="#aaa",
                    showlegend=j == 1, row=1, col=j)
    fig.update_layout(barmode="group", height=360, title="µs per call (CUDA graph) vs M tokens")
    fig.update_yaxes(title_text="µs", row=1, col=1)
    return fig


# Measured by benchmarks/bench_nvfp4.py on an H200 (2026-11-29, portable decoder, see
# docs/bench_nvfp4.md): µs per call inside a CUDA graph, weights rotated past L2.
RECORDED_H200 = [
    dict(shape='dense_gate_up_tp4', m=1, ours_us=78.79, bf16_us=43.56,
         dq_mm_us=963.3, speedup_vs_bf16=0.55, speedup_vs_dq_mm=12.2),
    dict(shape='dense_gate_up_tp4', m=4, ours_us=91.46, bf16_us=43.39,
         dq_mm_us=962.5, speedup_vs_bf16=0.47, speedup_vs_dq_mm=10.5),
    dict(shape='dense_gate_up_tp4', m=16, ours_us=97.66, bf16_us=44.46,
         dq_mm_us=962.8, speedup_vs_bf16=0.46, speedup_vs_dq_mm=9.9),
    dict(shape='dense_gate_up_tp4', m=64, ours_us=140.38, bf16_us=39.17,
         dq_mm_us=958.5, speedup_vs_bf16=0.28, speedup_vs_dq_mm=6.8),
    dict(shape='dense_down_tp4', m=1, ours_us=34.59, bf16_us=23.45,
         dq_mm_us=502.9, speedup_vs_bf16=0.68, speedup_vs_dq_mm=14.5),
    dict(shape='dense_down_tp4', m=4, ours_us=38.87, bf16_us=23.51,
         dq_mm_us=502.5, speedup_vs_bf16=0.6, speedup_vs_dq_mm=12.9),
    dict(shape='dense_down_tp4', m=16, ours_us=40.99, bf16_us=21.38,
         dq_mm_us=498.8, speedup_vs_bf16=0.52, speedup_vs_dq_mm=12.2),
    dict(shape='dense_down_tp4', m=64, ours_us=67.87, bf16_us=21.51,
         dq_mm_us=499.0, speedup_vs_bf16=0.32, speedup_vs_dq_mm=7.4),
    dict(shape='expert_w13_tp4', m=1, ours_us=14.57, bf16_us=9.41,
         dq_mm_us=124.4, speedup_vs_bf16=0.65, speedup_vs_dq_mm=8.5),
    dict(shape='expert_w13_tp4', m=4, ours_us=16.14, bf16_us=9.43,
         dq_mm_us=124.1, speedup_vs_bf16=0.58, speedup_vs_dq_mm=7.7),
    dict(shape='expert_w13_tp4', m=16, ours_us=16.94, bf16_us=8.8,
         dq_mm_us=124.5, speedup_vs_bf16=0.52, speedup_vs_dq_mm=7.3),
    dict(shape='expert_w13_tp4', m=64, ours_us=22.47, bf16_us=10.16,
         dq_mm_us=125.9, speedup_vs_bf16=0.45, speedup_vs_dq_mm=5.6),
    dict(shape='expert_w2_tp4', m=1, ours_us=8.22, bf16_us=4.79,
         dq_mm_us=62.9, speedup_vs_bf16=0.58, speedup_vs_dq_mm=7.6),
    dict(shape='expert_w2_tp4', m=4, ours_us=8.17, bf16_us=4.78,
         dq_mm_us=62.5, speedup_vs_bf16=0.58, speedup_vs_dq_mm=7.7),
    dict(shape='expert_w2_tp4', m=16, ours_us=8.55, bf16_us=4.82,
         dq_mm_us=62.7, speedup_vs_bf16=0.56, speedup_vs_dq_mm=7.3),
    dict(shape='expert_w2_tp4', m=64, ours_us=12.34, bf16_us=5.13,
         dq_mm_us=63.8, speedup_vs_bf16=0.42, speedup_vs_dq_mm=5.2),
]
