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

__all__ = ["encode_block", "block_bits_figure", "floors_figure", "format_errors",
           "format_error_figure", "gemm_speed_figure", "weight_distribution", "RECORDED_H200",
           "RECORDED_H200_FLOORS", "RECORDED_H200_MOE"]


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


# `python3 benchmarks/bench_nvfp4.py --floors` on an H200 (2026-11-30; torch 2.11, triton 3.6):
# per call in a replayed CUDA graph with PDL, weights rotated past the L2, at 1 token. read_us:
# the fastest of 36 layouts of ``read_checksum`` (``experiments/mla/read_floor.py``: the weight's
# NVFP4 bytes and block scales read once, XOR per row); ours_us: ``nvfp4_gemm``'s pinned config;
# bf16_us: cuBLAS in the same run; target_us = bf16_us / 3.
RECORDED_H200_FLOORS = [
    dict(shape="dense_gate_up_tp4", read_us=11.25, ours_us=14.71, bf16_us=43.75, target_us=14.58),
    # ours_us: the mma.sync kernel with two row tiles per warp (2026-11-30; 10.09 with one)
    dict(shape="dense_down_tp4", read_us=6.44, ours_us=9.5, bf16_us=23.54, target_us=7.85),
    dict(shape="expert_w13_tp4", read_us=2.39, ours_us=4.87, bf16_us=9.37, target_us=3.12),
    # ours_us: the mma.sync kernel (2026-11-30, sweep_nvfp4_cuda.py; 2.95 with the Triton one)
    dict(shape="expert_w2_tp4", read_us=2.05, ours_us=2.31, bf16_us=4.79, target_us=1.60),
]


# M = 1 rows: `benchmarks/sweep_gemv.py` on an H200 (2026-11-29): the packed, wide,
# double-buffered GEMV pinned; default_us = the mmab pin it replaced, same day.
# Other rows: `benchmarks/sweep_nvfp4.py --mma-only` on an H200 (2026-11-29; torch 2.11,
# triton 3.6, PTX decoders; docs/bench_nvfp4.md): µs per call inside a CUDA graph, weights rotated
# past L2. ours_us: the pinned config (kernels.nvfp4.configs.PINNED_CONFIGS, the
# standard-orientation "mmab" kernel everywhere); default_us: the GEMV / swap-AB MMA pins it
# replaced; bf16_us: cuBLAS bf16 in the same run.
# Rows pinned 'cuda ...': `benchmarks/sweep_nvfp4_cuda.py` (2026-11-30): the hand-written
# mma.sync kernel (kernels.nvfp4.configs.PINNED_CUDA); default_us = the Triton config it
# replaced, bf16_us = cuBLAS, both in the same run.
RECORDED_H200 = [
    dict(shape='dense_gate_up_tp4', m=1, ours_us=15.23, default_us=29.59,
         bf16_us=43.97, speedup_vs_bf16=2.89, pinned='gemv bn8 s1 w2 st1 g64 h2 pf'),
    dict(shape='dense_gate_up_tp4', m=4, ours_us=19.24, default_us=28.79,
         bf16_us=43.75, speedup_vs_bf16=2.27, pinned='cuda w8 st4 s1'),
    dict(shape='dense_gate_up_tp4', m=16, ours_us=29.35, default_us=88.88,
         bf16_us=43.97, speedup_vs_bf16=1.5, pinned='mmab bm16 bn128 bk256 w4 st3 s4'),
    dict(shape='dense_gate_up_tp4', m=64, ours_us=51.93, default_us=317.73,
         bf16_us=39.49, speedup_vs_bf16=0.76, pinned='mmab bm64 bn128 bk128 w4 st3 s4'),
    dict(shape='dense_down_tp4', m=1, ours_us=9.5, default_us=10.03,
         bf16_us=23.5, speedup_vs_bf16=2.47, pinned='cuda w8 st4 s1 r2'),
    dict(shape='dense_down_tp4', m=4, ours_us=9.73, default_us=16.04,
         bf16_us=23.49, speedup_vs_bf16=2.41, pinned='cuda w8 st4 s1 r2'),
    dict(shape='dense_down_tp4', m=16, ours_us=13.52, default_us=15.41,
         bf16_us=21.49, speedup_vs_bf16=1.59, pinned='cuda w8 st4 s1 r2 xl'),
    dict(shape='dense_down_tp4', m=64, ours_us=26.54, default_us=140.0,
         bf16_us=21.69, speedup_vs_bf16=0.82, pinned='mmab bm64 bn64 bk128 w4 st4 s4'),
    dict(shape='expert_w13_tp4', m=1, ours_us=5.91, default_us=9.01,
         bf16_us=9.4, speedup_vs_bf16=1.59, pinned='gemv bn4 s4 w1 st1 g64 h2 pf'),
    dict(shape='expert_w13_tp4', m=4, ours_us=6.53, default_us=7.76,
         bf16_us=9.46, speedup_vs_bf16=1.45, pinned='cuda w4 st4 s16 xl'),
    dict(shape='expert_w13_tp4', m=16, ours_us=9.09, default_us=28.77,
         bf16_us=9.53, speedup_vs_bf16=1.05, pinned='mmab bm16 bn64 bk128 w4 st4 s8'),
    dict(shape='expert_w13_tp4', m=64, ours_us=11.02, default_us=159.36,
         bf16_us=10.11, speedup_vs_bf16=0.92, pinned='mmab bm64 bn64 bk128 w4 st4 s8'),
    dict(shape='expert_w2_tp4', m=1, ours_us=2.31, default_us=2.96,
         bf16_us=4.79, speedup_vs_bf16=2.07, pinned='cuda w4 st4 s1 xl'),
    dict(shape='expert_w2_tp4', m=4, ours_us=2.41, default_us=4.01,
         bf16_us=4.79, speedup_vs_bf16=1.99, pinned='cuda w4 st4 s1 xl'),
    dict(shape='expert_w2_tp4', m=16, ours_us=3.38, default_us=3.86,
         bf16_us=4.83, speedup_vs_bf16=1.43, pinned='cuda w4 st4 s1 xl'),
    dict(shape='expert_w2_tp4', m=64, ours_us=5.38, default_us=38.26,
         bf16_us=5.13, speedup_vs_bf16=0.95, pinned='mmab bm64 bn64 bk128 w4 st4 s1'),
]

# Fused MoE, 256 experts, top-8, K 7168, I 512 (TP4), random routing; bf16 = cuBLAS GEMMs of the
# active experts only (rows pre-gathered). M <= 4: gemv path (one program per token-expert pair;
# benchmarks/sweep_moe_gemv.py, per-M tiles; default_us = the single tile it replaced), above:
# the sorted path with the "mmab" grouped kernel (2026-11-29).
RECORDED_H200_MOE = [
    # 1-4 tokens: 2026-11-30 (`sweep_gemv.py --moe --moe-w2-loop`): the w2 launch summing each
    # token's top-k experts in one program; default_us = the per-slot w2 launch (packed, wide,
    # double-buffered tiles), same run
    dict(shape='moe_256e_top8_tp4', m=1, ours_us=32.32, default_us=34.25, bf16_gemms_us=108.91,
         speedup_vs_bf16=3.37, active_experts=8.0, path='gemv'),
    dict(shape='moe_256e_top8_tp4', m=2, ours_us=44.45, default_us=56.17, bf16_gemms_us=218.7,
         speedup_vs_bf16=4.92, active_experts=15.9, path='gemv'),
    dict(shape='moe_256e_top8_tp4', m=4, ours_us=77.17, default_us=98.8, bf16_gemms_us=419.62,
         speedup_vs_bf16=5.44, active_experts=30.5, path='gemv'),
    dict(shape='moe_256e_top8_tp4', m=16, ours_us=416.85, bf16_gemms_us=1369.79,
         speedup_vs_bf16=3.29, active_experts=100.5, path='sorted'),
    dict(shape='moe_256e_top8_tp4', m=32, ours_us=604.8, bf16_gemms_us=2234.1,
         speedup_vs_bf16=3.69, active_experts=163.0, path='sorted'),
    dict(shape='moe_256e_top8_tp4', m=64, ours_us=787.02, bf16_gemms_us=3046.18,
         speedup_vs_bf16=3.87, active_experts=223.5, path='sorted'),
    dict(shape='moe_256e_top8_tp4', m=128, ours_us=886.48, bf16_gemms_us=3471.1,
         speedup_vs_bf16=3.92, active_experts=253.0, path='sorted'),
]
