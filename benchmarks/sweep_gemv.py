"""Sweep the NVFP4 GEMV (fp32 and packed-fp16 "h2" math) against the pinned kernel and cuBLAS.

    python benchmarks/sweep_gemv.py [--ms 1,4,8,16] [--deadline 40] [--moe]

For each DeepSeek-V3 TP-4 shape of ``bench_nvfp4.SHAPES`` and token count M: the pinned default
(``nvfp4_gemm`` without a config: what the model runs), cuBLAS bf16 on
bf16 weights, and GEMV tiles (``block_n``, ``num_warps``, ``g`` words per step, split-K by
target CTAs per SM) with the fp32 math and with the packed-fp16 math of
``nvfp4.gemv_packed``. Each variant is checked against ``nvfp4_gemm_ref`` on real quantized
weights (relative max error; the packed math must stay under 4e-3), then timed per call in a
replayed CUDA graph rotating over >= 256 MB of weights (the L2 is 60 MB).

``--moe``: also the fused MoE gemv path (256 experts, top-8) at 1-4 tokens: its default tiles
(``MoeGemvConfig()``), then other w13 tiles and other tiles of the w2 launch that sums the
top-k experts in one program. ``--no-wide`` / ``--no-narrow`` restrict the dense grid to g 2-4
or g 16-64; ``--packed-only``, ``--stages 1,2`` and ``--prefetch`` (the packed loop with
register double buffering, ``pf``) shape the rest.

Prints one row per (shape, M) and a markdown table last; writes ``sweep_gemv.json`` to ``$OUT``.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch
import triton

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)

import bench_nvfp4 as bench  # noqa: E402

from mla_spec.kernels.nvfp4 import (  # noqa: E402
    GemvConfig,
    MoeGemvConfig,
    fused_moe_nvfp4,
    fused_moe_ref,
    nvfp4_gemm,
    nvfp4_gemm_ref,
)
from mla_spec.kernels.nvfp4.configs import variant_name  # noqa: E402
from mla_spec.kernels.nvfp4.gemv import split_k_for  # noqa: E402
from mla_spec.quant.nvfp4 import quantize_nvfp4  # noqa: E402

# block_n, warps. Small g (2-4 words per row and step) spreads a warp's lanes over 32+ rows, each
# reading 16-32 B per row; large g (16-64) puts the lanes along K, each warp streaming 256-512
# contiguous bytes of one row (the first sweep measured only g 2-4: ~1.3 TB/s at best).
TILES = [(128, 1), (256, 2), (64, 1), (256, 4), (512, 4), (128, 2)]
GROUPS = (4, 2)
WIDE_TILES = [(16, 4), (8, 2), (32, 4), (16, 8), (4, 1), (32, 8), (64, 8)]
WIDE_GROUPS = (64, 32, 16)
CTAS_PER_SM = (4, 8, 2)  # most promising first: the deadline cuts the tail
PACKED_TOL = 4e-3


def graph_us(calls) -> float:
    return bench.graph_us(calls, warmup=3, rep=15)


def split_for(n, k, m, bn, target):
    return split_k_for(triton.cdiv(n, bn) * triton.cdiv(m, 8), k // 64, 2, target)


def configs(n, k, m, wide=True, narrow=True, packed_only=False, stages=(1,), prefetch=False):
    out = []
    grids = ([(WIDE_GROUPS, WIDE_TILES)] if wide else []) + ([(GROUPS, TILES)] if narrow else [])
    maths = [(True, True), (True, False)] if prefetch else [(True, False)]
    if not packed_only:
        maths.append((False, False))
    for target in CTAS_PER_SM:
        for groups, tiles in grids:
            for g in groups:
                for bn, w in tiles:
                    for st in stages:
                        for packed, pf in maths:
                            split = min(split_for(n, k, m, bn, target), triton.cdiv(k // 16, g))
                            out.append(GemvConfig(bn, g, split, w, st, packed=packed,
                                                  prefetch=pf))
    return list(dict.fromkeys(out))


ONE_STEP_TILES = [(16, 4), (8, 2), (16, 8), (8, 4), (32, 8), (4, 2), (4, 1)]


def one_step_configs(n, k):
    """Packed GEMVs whose program reads its whole K slice in one step: the layouts of the read
    floor (``bench_nvfp4.py --floors``: 16 rows, 2 K splits, 4 warps read one expert's w13 in
    2.39 µs)."""
    kb = k // 16
    out = []
    for split in (1, 2, 4, 7, 8):
        g = triton.next_power_of_2(triton.cdiv(kb, split))
        if g > 256 or (split > 1 and triton.cdiv(kb, g) < split):
            continue
        for bn, w in ONE_STEP_TILES:
            out.append(GemvConfig(bn, g, split, w, 1, packed=True, prefetch=True))
    return out


def sweep_shape(name, n, k, ms, deadline_s, grid, one_step=False):
    """Per M: pinned, cuBLAS and the GEMV variants of ``configs`` (``grid``: its options), or
    with ``one_step`` those of ``one_step_configs``."""
    q = quantize_nvfp4(torch.randn(n, k, device="cuda") * 0.02)
    args_q = (q.weight, q.weight_scale, q.weight_scale_2)
    sets, wbf = bench.weight_sets(n, k)
    rows = []
    for m in ms:
        end = time.time() + deadline_s
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        ref = nvfp4_gemm_ref(x, *args_q, torch.float32)
        pinned = graph_us([lambda a=a, x=x: nvfp4_gemm(x, *a) for a in sets])
        cublas = graph_us([lambda w=w, x=x: torch.matmul(x, w.t()) for w in wbf])
        best = {False: (float("inf"), ""), True: (float("inf"), "")}
        errs = {False: 0.0, True: 0.0}
        for cfg in one_step_configs(n, k) if one_step else configs(n, k, m, **grid):
            if time.time() > end:
                break
            try:
                err = bench.rel_err(nvfp4_gemm(x, *args_q, torch.float32, cfg), ref)
                if not err < (PACKED_TOL if cfg.packed else 1e-4):
                    print(f"  {name} m={m} {variant_name(cfg)}: error {err:.1e}", flush=True)
                    continue
                us = graph_us([lambda a=a, c=cfg, x=x: nvfp4_gemm(x, *a, config=c) for a in sets])
            except Exception as exc:  # noqa: BLE001 - a tile that does not compile / fit
                print(f"  skip {variant_name(cfg)}: {type(exc).__name__}: {str(exc)[:120]}")
                continue
            errs[cfg.packed] = max(errs[cfg.packed], err)
            if us < best[cfg.packed][0]:
                best[cfg.packed] = (us, variant_name(cfg))
        h2, f32 = best[True], best[False]
        win = min(pinned, h2[0], f32[0])
        gbs = n * k * 0.5625 / (win * 1e-6) / 1e9
        rows.append(dict(shape=name, n=n, k=k, m=m, pinned_us=round(pinned, 2),
                         gemv_f32_us=round(f32[0], 2), gemv_f32=f32[1],
                         gemv_h2_us=round(h2[0], 2), gemv_h2=h2[1], cublas_us=round(cublas, 2),
                         x_cublas_best=round(cublas / win, 2), best_GBps=round(gbs),
                         h2_max_err=float(f"{errs[True]:.1e}"),
                         f32_max_err=float(f"{errs[False]:.1e}")))
        print(rows[-1], flush=True)
    del sets, wbf
    torch.cuda.empty_cache()
    return rows


# the default first, then w13 tiles (lanes along K: g 16-64 words), then w2-launch tiles
MOE_VARIANTS = [MoeGemvConfig()] + [
    MoeGemvConfig(block_n=bn, num_warps=w, groups=g)
    for g in (16, 32, 64) for bn, w in ((16, 4), (8, 2), (32, 4))] + [
    MoeGemvConfig(block_n2=bn2, num_warps2=w2, groups2=g2)
    for g2 in (16, 32) for bn2, w2 in ((4, 1), (8, 1), (8, 2), (16, 2), (16, 4), (32, 4))]


def moe_cell(cfg: MoeGemvConfig) -> str:
    """The fields of ``cfg`` that differ from the default, as ``name=value`` words."""
    base = MoeGemvConfig()
    return " ".join(f"{f}={getattr(cfg, f)}" for f in base.__dataclass_fields__
                    if getattr(cfg, f) != getattr(base, f)) or "default"


def sweep_moe(ms, deadline_s):
    """The MoE gemv path (bf16 activations) at ``MOE_VARIANTS``, checked against the torch
    reference, beside the bf16 GEMMs of the active experts."""
    e, k, inter, topk = 256, 7168, 512, 8
    w13, w2, b13, b2 = bench.moe_weights(e, k, inter)
    rows = []
    for m in ms:
        end = time.time() + deadline_s
        xs, ids, tws = bench.moe_inputs(m, k, e, topk, n_sets=8)
        ref = fused_moe_ref(xs[0], ids[0], tws[0], w13, w2)
        bf16, active = bench.moe_bf16_us(xs, ids, b13, b2, inter, timer=graph_us)
        res = []
        for cfg in MOE_VARIANTS:
            if time.time() > end:
                break
            try:
                y = fused_moe_nvfp4(xs[0], ids[0], tws[0], w13, w2, path="gemv", gemv_config=cfg)
                err = bench.rel_err(y, ref)
                us = graph_us([lambda x=x, t=t, w=w, c=cfg: fused_moe_nvfp4(
                    x, t, w, w13, w2, path="gemv", gemv_config=c)
                    for x, t, w in zip(xs, ids, tws)])
            except Exception as exc:  # noqa: BLE001 - report and go on
                print(f"  moe skip {moe_cell(cfg)}: {type(exc).__name__}: {str(exc)[:100]}")
                continue
            if err < 2e-2:
                res.append((us, err, cfg))
        dflt = next((r for r in res if r[2] == MoeGemvConfig()), (float("nan"), 0.0, None))
        res.sort(key=lambda r: r[0])
        best = res[0] if res else (float("nan"), 0.0, MoeGemvConfig())
        row = dict(m=m, active=round(active, 1), pinned_us=round(dflt[0], 2),
                   best_us=round(best[0], 2), best=moe_cell(best[2]),
                   best_err=float(f"{best[1]:.1e}"), bf16_gemms_us=round(bf16, 2),
                   x_bf16_pinned=round(bf16 / dflt[0], 2), x_bf16_best=round(bf16 / best[0], 2),
                   top5=[(round(u, 2), moe_cell(c)) for u, _, c in res[:5]])
        print(row, flush=True)
        rows.append(row)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ms", default="1,4,8,16")
    ap.add_argument("--deadline", type=float, default=40.0, help="s per (shape, M)")
    ap.add_argument("--moe", action="store_true")
    ap.add_argument("--moe-ms", default="1,2,4", help="token counts of --moe")
    ap.add_argument("--shapes", default=",".join(bench.SHAPES))
    ap.add_argument("--no-narrow", action="store_true", help="only the wide-g tiles")
    ap.add_argument("--no-wide", action="store_true", help="only the narrow-g tiles")
    ap.add_argument("--packed-only", action="store_true", help="no fp32-math GEMV variants")
    ap.add_argument("--stages", default="1", help="num_stages values, e.g. 1,2")
    ap.add_argument("--prefetch", action="store_true", help="also the 'pf' packed loop")
    ap.add_argument("--one-step", action="store_true",
                    help="only packed GEMVs that read their whole K slice in one step")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("sweep_gemv needs a CUDA GPU")
    print(torch.cuda.get_device_name(), "torch", torch.__version__, "triton",
          triton.__version__, flush=True)
    ms = [int(m) for m in args.ms.split(",")]
    moe = sweep_moe([int(m) for m in args.moe_ms.split(",")], args.deadline) if args.moe else []
    rows = []
    for name in filter(None, args.shapes.split(",")):
        grid = dict(wide=not args.no_wide, narrow=not args.no_narrow,
                    packed_only=args.packed_only, prefetch=args.prefetch,
                    stages=tuple(int(v) for v in args.stages.split(",")))
        rows += sweep_shape(name, *bench.SHAPES[name], ms, args.deadline, grid, args.one_step)
    c = bench.col
    print("\n" + bench.md_table([
        ("shape", c("shape")), ("M", c("m")), ("pinned µs", c("pinned_us")),
        ("best GEMV fp32", lambda r: f"{r['gemv_f32_us']} (`{r['gemv_f32']}`)"),
        ("best GEMV h2", lambda r: f"{r['gemv_h2_us']} (`{r['gemv_h2']}`)"),
        ("cuBLAS bf16 µs", c("cublas_us")), ("x cuBLAS (best)", c("x_cublas_best")),
        ("GB/s", c("best_GBps")), ("h2 err", c("h2_max_err"))], rows))
    if moe:
        print("\n" + bench.md_table([
            ("MoE M", c("m")), ("active", c("active")), ("default µs", c("pinned_us")),
            ("best µs", c("best_us")), ("best variant", c("best")),
            ("bf16 GEMMs µs", c("bf16_gemms_us")), ("x bf16 (pinned)", c("x_bf16_pinned")),
            ("x bf16 (best)", c("x_bf16_best")), ("err", c("best_err"))], moe))
    bench.save_results("sweep_gemv", rows=rows, moe=moe)


if __name__ == "__main__":
    main()
