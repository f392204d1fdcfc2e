"""Floors under the speed goals, and the MoE's launches (H200).

    PYTHONUNBUFFERED=1 python benchmarks/bench_floors.py [--moe-pdl]
    (also: python benchmarks/bench_nvfp4.py --floors | --moe-pdl)

Default: what *any* kernel on this launch path (Triton, CUDA graph, PDL) needs, beside ours and
cuBLAS bf16 in the same run, per call in a replayed graph rotating inputs past the L2:
- per NVFP4 shape at 1 token: an empty PDL kernel, and the read floor
  (``experiments/mla/read_floor.read_checksum``: the weight's bytes and block scales read once, best
  of 36 layouts): the best ratio to cuBLAS any GEMV of these bytes could reach;
- the same read of one request's bf16 MLA KV at batch 1 (ctx 1k / 4k / 32k);
- the MoE gemv path's two launches, each one's GPU time (``torch.profiler``) and bytes.
Writes ``bench_nvfp4_floors.{json,md}`` into ``$OUT``. ``--moe-pdl``: the fused MoE at 1-4 tokens
with PDL on, on but not for the w2 loop launch (``nvfp4.moe_gemv.W2_LOOP_PDL_MIN_M``), and off
(``bench_nvfp4_moe_pdl.*``).
"""

from __future__ import annotations

import sys

import torch
import triton
from bench_nvfp4 import (
    DEV,
    NK,
    ROTATE,
    SHAPES,
    col,
    graph_us,
    md_table,
    moe_inputs,
    moe_weights,
    pdl_on_off,
    save_results,
    weight_sets,
)

from mla_spec.kernels.nvfp4 import fused_moe_nvfp4, nvfp4_gemm

FLOOR_LAYOUTS = [(bn, sp, w) for bn in (2, 4, 8, 16) for sp in (1, 2, 4) for w in (1, 2, 4)]


def bench_floors():
    """Launch and read floors per shape at 1 token, with ours (PDL) and cuBLAS in the same run."""
    from experiments.mla.read_floor import empty_launch, read_checksum

    flag = torch.zeros(1, dtype=torch.int32, device=DEV)
    empty_on, empty_off = pdl_on_off([lambda: empty_launch(flag)] * 64)
    rows = []
    for name, (n, k) in SHAPES.items():
        sets, wbf = weight_sets(n, k)
        x = torch.randn(1, k, device=DEV, dtype=torch.bfloat16)
        best = (float("inf"), None)
        for bn, sp, w in FLOOR_LAYOUTS:
            us = graph_us([lambda a=a, c=(bn, sp, w): read_checksum(a[0], a[1], *c)
                           for a in sets])
            best = min(best, (us, (bn, sp, w)), key=lambda t: t[0])
        ours = graph_us([lambda a=a, x=x: nvfp4_gemm(x, *a) for a in sets])
        bf16 = graph_us([lambda w=w, x=x: torch.matmul(x, w.t()) for w in wbf])
        rows.append(dict(shape=name, n=n, k=k, empty_pdl_us=round(empty_on, 2),
                         empty_us=round(empty_off, 2), read_us=round(best[0], 2),
                         read_layout="bn{} s{} w{}".format(*best[1]), ours_us=round(ours, 2),
                         bf16_us=round(bf16, 2), target_us=round(bf16 / 3, 2),
                         floor_x_bf16=round(bf16 / best[0], 2), ours_x_bf16=round(bf16 / ours, 2),
                         read_GBps=round(n * k * 0.5625 / (best[0] * 1e-6) / 1e9)))
        print(rows[-1], flush=True)
        del sets, wbf
    return rows


def kv_floors(ctxs=(1024, 4096, 32768)):
    """The same read floor for one request's bf16 MLA KV (``[ctx, 576]``, 1152 B per token) at
    batch 1: the bound under issue 4's batch-1 attention goals (one launch; attention at batch
    1 needs a second one, the split combine, unless fused)."""
    from experiments.mla.read_floor import read_checksum

    rows = []
    for ctx in ctxs:
        nset = max(2, int(ROTATE // (ctx * 1152)) + 1)
        sets = [(torch.randint(0, 256, (ctx, 1152), dtype=torch.uint8, device=DEV),
                 torch.zeros(ctx, 4, dtype=torch.uint8, device=DEV)) for _ in range(nset)]
        best = (float("inf"), None)
        for bn in (8, 16, 32, 64):
            for w in (4, 8):
                if ctx // bn > 4096:
                    continue
                us = graph_us([lambda a=a, c=(bn, 1, w): read_checksum(a[0], a[1], *c)
                               for a in sets])
                best = min(best, (us, (bn, w)), key=lambda t: t[0])
        rows.append(dict(ctx=ctx, MB=round(ctx * 1152 / 1e6, 2), read_us=round(best[0], 2),
                         layout="{} tokens w{}".format(*best[1]),
                         TBps=round(ctx * 1152 / (best[0] * 1e-6) / 1e12, 2)))
        print(rows[-1], flush=True)
        del sets
    return rows


def moe_launches(ms=(1, 2, 4), iters=20):
    """GPU µs of each of the MoE gemv path's two launches (w13 + SiLU, then w2: the per-slot
    launch or, by default, ``nvfp4_moe_w2``'s loop), from
    ``torch.profiler`` over eager calls (no PDL overlap), with the NVFP4 bytes each reads."""
    from torch.profiler import ProfilerActivity, profile

    e, k, inter, topk = 256, 7168, 512, 8
    w13, w2, _, _ = moe_weights(e, k, inter)
    rows = []
    for m in ms:
        xs, ids, tws = moe_inputs(m, k, e, topk, n_sets=8)
        for i in range(8):
            fused_moe_nvfp4(xs[i], ids[i], tws[i], w13, w2)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for i in range(iters):
                fused_moe_nvfp4(xs[i % 8], ids[i % 8], tws[i % 8], w13, w2)
            torch.cuda.synchronize()
        durs = [ev.device_time_total if hasattr(ev, "device_time_total") else ev.cuda_time_total
                for ev in prof.events()
                if ev.name in ("_moe_gemv_kernel", "_moe_w2_loop_kernel")]  # w13, then w2
        active = sum(len(torch.unique(t)) for t in ids) / len(ids)
        per = [sum(durs[j::2]) / max(len(durs[j::2]), 1) for j in (0, 1)]
        mb = [active * 2 * inter * k * 0.5625 / 1e6, active * k * inter * 0.5625 / 1e6]
        rows.append(dict(m=m, active=round(active, 1), w13_us=round(per[0], 2),
                         w2_us=round(per[1], 2), w13_MB=round(mb[0], 1), w2_MB=round(mb[1], 1),
                         w13_TBps=round(mb[0] / per[0], 2) if per[0] else 0,  # MB/µs = TB/s
                         w2_TBps=round(mb[1] / per[1], 2) if per[1] else 0))
        print(rows[-1], flush=True)
    return rows


def moe_pdl_ab(ms=(1, 2, 4)):
    """The fused MoE per call in a graph chain with PDL on for every launch (the w2 loop's
    ``W2_LOOP_PDL_MIN_M`` rule off), with PDL on but the w2 loop launch without it, and with
    PDL off."""
    from mla_spec.kernels import options
    from mla_spec.kernels.nvfp4 import moe_gemv

    e, k, inter, topk = 256, 7168, 512, 8
    w13, w2, _, _ = moe_weights(e, k, inter)
    rows = []
    keep = options.PDL, moe_gemv.W2_LOOP_PDL_MIN_M
    try:
        for m in ms:
            xs, ids, tws = moe_inputs(m, k, e, topk, n_sets=8)
            calls = [lambda x=x, t=t, w=w: fused_moe_nvfp4(x, t, w, w13, w2)
                     for x, t, w in zip(xs, ids, tws)]
            row = dict(m=m)
            for name, on, w2_on in (("pdl_us", True, True), ("w2_nopdl_us", True, False),
                                    ("nopdl_us", False, True)):
                options.PDL, moe_gemv.W2_LOOP_PDL_MIN_M = on, 1 if w2_on else 1 << 30
                row[name] = round(graph_us(calls), 2)
            rows.append(row)
            print(row, flush=True)
    finally:
        options.PDL, moe_gemv.W2_LOOP_PDL_MIN_M = keep
    return rows


def floors_markdown(rows) -> str:
    return md_table([("shape", col("shape")), NK, ("empty kernel µs (PDL / no)",
                     lambda r: f"{r['empty_pdl_us']} / {r['empty_us']}"),
                     ("read floor µs", col("read_us")), ("layout", col("read_layout")),
                     ("read GB/s", col("read_GBps")), ("ours µs", col("ours_us")),
                     ("cuBLAS bf16 µs", col("bf16_us")), ("3x target µs", col("target_us")),
                     ("floor x bf16", col("floor_x_bf16")), ("ours x bf16", col("ours_x_bf16"))],
                    rows)


def main(argv=None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if not torch.cuda.is_available():
        sys.exit("bench_floors needs a CUDA GPU")
    print(torch.cuda.get_device_name(), "torch", torch.__version__, "triton", triton.__version__)
    if "--moe-pdl" in argv:
        rows = moe_pdl_ab()
        md = md_table([("MoE tokens", col("m")), ("PDL µs", col("pdl_us")),
                       ("PDL, w2 loop without µs", col("w2_nopdl_us")),
                       ("no PDL µs", col("nopdl_us"))], rows)
        print(md)
        save_results("bench_nvfp4_moe_pdl", md, rows=rows)
        return
    launches = moe_launches()
    rows, kv = bench_floors(), kv_floors()
    md = floors_markdown(rows) + "\n\n" + md_table(
        [("bf16 KV ctx", col("ctx")), ("MB", col("MB")), ("read floor µs", col("read_us")),
         ("layout", col("layout")), ("TB/s", col("TBps"))], kv) + "\n\n" + md_table(
        [("MoE tokens", col("m")), ("active experts", col("active")),
         ("w13 launch µs", col("w13_us")), ("MB", col("w13_MB")), ("TB/s", col("w13_TBps")),
         ("w2 launch µs", col("w2_us")), ("MB", col("w2_MB")), ("TB/s", col("w2_TBps"))],
        launches)
    print(md)
    save_results("bench_nvfp4_floors", md, torch=torch.__version__, triton=triton.__version__,
                 rows=rows, kv=kv, moe_launches=launches)

if __name__ == "__main__":
    main()
