"""Sweep the MoE GEMV path's two launches (w13 + SiLU, then w2 + weighted sum) on the GPU.

    python benchmarks/sweep_moe_gemv.py [--ms 1,2,4] [--deadline 120]

At 1-4 tokens the fused NVFP4 MoE (256 experts, top-8, K 7168, I 512: DeepSeek-V3 at TP 4) runs
``nvfp4_moe_gemv.moe_gemv``: one program per (token-expert pair, row block, K split). The H200
measured it at 58-63 µs for 1 token against a 12.4 µs byte floor, with one tile config shared by
both launches. The w2 launch has only ``K / block_n * topk * M`` one-warp programs (448 at 1
token: ~3 warps per SM), so this sweep tunes the launches separately:

1. w13 (``block_n``, ``num_warps``, ``g`` words per step; split-K by the launcher's rule) with
   w2 at the current default;
2. w2 (``block_n2``, ``num_warps2``) with the best w13 config of stage 1.

Every variant is checked against ``fused_moe_ref`` (relative error) before it is timed, in a
replayed CUDA graph rotating over 8 input sets, beside the current default and the bf16 cuBLAS
GEMMs of the same active experts. Prints a table per M (last) and writes
``sweep_moe_gemv.json`` to ``$OUT`` when set.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)

import bench_nvfp4 as bench  # noqa: E402

from mla_spec.kernels.nvfp4_moe import fused_moe_nvfp4, fused_moe_ref  # noqa: E402

E, K, INTER, TOPK = 256, 7168, 512, 8
W13_GRID = [dict(gemv_block_n=bn, gemv_warps=w, gemv_g=g)
            for g in (2, 4) for bn, w in ((32, 1), (64, 1), (64, 2), (128, 1), (128, 2),
                                          (128, 4), (256, 2), (256, 4))]
W2_GRID = [dict(gemv_block_n2=bn, gemv_warps2=w)
           for bn, w in ((16, 1), (32, 1), (32, 2), (64, 1), (64, 2), (128, 1), (128, 2),
                         (256, 2), (256, 4))]


def graph_us(calls) -> float:
    return bench.graph_us(calls, warmup=3, rep=15)


def run_variant(kw, sets, w13, w2, ref):
    """(µs, rel err) of the gemv path with ``kw``, or (None, reason)."""
    x, t, w = sets[0]
    try:
        y = fused_moe_nvfp4(x, t, w, w13, w2, path="gemv", **kw)
        err = bench.rel_err(y, ref)
        if not err < 2e-2:
            return None, f"error {err:.1e}"
        us = graph_us([lambda x=x, t=t, w=w: fused_moe_nvfp4(x, t, w, w13, w2, path="gemv", **kw)
                       for x, t, w in sets])
        return us, err
    except Exception as exc:  # noqa: BLE001 - report and go on
        return None, f"{type(exc).__name__}: {str(exc)[:100]}"


def sweep_m(m, w13, w2, b13, b2, deadline):
    xs, ids, tws = bench.moe_inputs(m, K, E, TOPK, n_sets=8)
    sets = list(zip(xs, ids, tws))
    ref = fused_moe_ref(xs[0], ids[0], tws[0], w13, w2)
    default_us, _ = run_variant({}, sets, w13, w2, ref)
    bf16_us, active = bench.moe_bf16_us(xs, ids, b13, b2, INTER, timer=graph_us)
    res = []
    for kw in W13_GRID:
        if time.time() > deadline:
            break
        us, info = run_variant(kw, sets, w13, w2, ref)
        if us is None:
            print(f"  m={m} skip {kw}: {info}", flush=True)
            continue
        res.append((us, kw))
    best13 = min(res, key=lambda r: r[0])[1] if res else {}
    for kw2 in W2_GRID:
        if time.time() > deadline:
            break
        kw = {**best13, **kw2}
        us, info = run_variant(kw, sets, w13, w2, ref)
        if us is None:
            print(f"  m={m} skip {kw}: {info}", flush=True)
            continue
        res.append((us, kw))
    res.sort(key=lambda r: r[0])
    best_us, best = res[0] if res else (float("nan"), {})
    floor = active * 3 * INTER * K * 0.5625 / 4e6  # NVFP4 bytes + scales at 4 TB/s, µs
    row = dict(m=m, active_experts=round(active, 1), default_us=round(default_us, 2),
               best_us=round(best_us, 2), best=best, bf16_gemms_us=round(bf16_us, 2),
               x_bf16_default=round(bf16_us / default_us, 2),
               x_bf16_best=round(bf16_us / best_us, 2), floor_us=round(floor, 1),
               top5=[(round(u, 2), k) for u, k in res[:5]])
    print(row, flush=True)
    return row


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ms", default="1,2,4")
    ap.add_argument("--deadline", type=float, default=120.0, help="s per M")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("sweep_moe_gemv needs a CUDA GPU")
    print(torch.cuda.get_device_name(), "torch", torch.__version__, flush=True)
    w13, w2, b13, b2 = bench.moe_weights(E, K, INTER)
    rows = [sweep_m(int(m), w13, w2, b13, b2, time.time() + args.deadline)
            for m in args.ms.split(",")]
    c = bench.col
    print("\n" + bench.md_table([
        ("M", c("m")), ("active", c("active_experts")), ("default µs", c("default_us")),
        ("best µs", c("best_us")), ("best config", lambda r: bench.gemv_kwargs_cell(r["best"])),
        ("bf16 GEMMs µs", c("bf16_gemms_us")), ("x bf16 (default)", c("x_bf16_default")),
        ("x bf16 (best)", c("x_bf16_best")), ("byte floor µs", c("floor_us"))], rows))
    bench.save_results("sweep_moe_gemv", rows=rows)


if __name__ == "__main__":
    main()
