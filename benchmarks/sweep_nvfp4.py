"""Sweep of every NVFP4 W4A16 kernel variant against cuBLAS bf16 on one H200 (one device call).

    PYTHONUNBUFFERED=1 python benchmarks/sweep_nvfp4.py [--quick]

1. Correctness on the GPU, each variant against the torch twin at a couple of shapes: the
   GEMV (``nvfp4_gemv``, PTX and portable decoders, split-K on/off), the MMA kernel with the
   PTX decoder, the MoE GEMV path and the sorted MoE path. A variant that fails is not timed.
2. Timing: per call inside a replayed CUDA graph whose calls rotate over >= 256 MB of weight
   sets (L2 is 60 MB), for the issue's shapes and M = 1, 4, 16, 64: GEMV configs
   (block_n, warps, stages, split), MMA configs, cuBLAS bf16 (``x @ W.t()``). The grouped MoE
   (256 experts, top-8, K 7168, I 512) runs the gemv and sorted paths against the bf16 GEMMs of
   the active experts only. The table (best variant per row) is printed last and written to
   ``$OUT/sweep_nvfp4.{json,md}`` when set.
"""

from __future__ import annotations

import json
import os
import sys
import time

import bench_nvfp4 as bench  # the sibling script (this directory is sys.path[0])
import torch
import triton

import mla_spec.kernels.nvfp4_gemv as gemv_mod
from mla_spec.kernels.nvfp4_gemm import NVFP4GemmConfig, nvfp4_gemm, nvfp4_gemm_ref
from mla_spec.kernels.nvfp4_gemv import GemvConfig, default_gemv_config
from mla_spec.kernels.nvfp4_moe import fused_moe_nvfp4, fused_moe_ref
from mla_spec.quant.nvfp4 import quantize_nvfp4

SHAPES = {"dense_gate_up_tp4": (9216, 7168), "dense_down_tp4": (7168, 4608),
          "expert_w13_tp4": (1024, 7168), "expert_w2_tp4": (7168, 512)}
MS = [1, 4, 16, 64]
ROTATE = 256e6
DEV = "cuda"
# past the deadline only default configs are timed (one device call)
DEADLINE = [time.time() + float(os.environ.get("SWEEP_DEADLINE_S", "150"))]
GEMV_TILES = [(128, 1, 1), (256, 2, 1), (512, 4, 1), (256, 2, 3)]  # bn, warps, st
MMA_TILES = [(64, 256, 4, 4), (128, 128, 3, 8)]  # bn, bk, stages, warps


def graph_us(calls) -> float:
    """Median µs per call of ``calls`` replayed in one CUDA graph (shorter runs than bench)."""
    return bench.graph_us(calls, warmup=3, rep=15)


def rel_err(y, ref) -> float:
    return ((y.float() - ref.float()).abs().max() / ref.float().abs().max()).item()


def check() -> dict:
    """Which variants are right on this GPU (rel. max error vs the twin)."""
    torch.manual_seed(0)
    ok = dict(gemv_fast=True, gemv_pure=True, mma_fast=True, moe_gemv=True, moe_sorted=True)
    for n, k in ((1024, 7168), (7168, 512), (96, 272)):
        q = quantize_nvfp4(torch.randn(n, k, device=DEV) * 0.02)
        a = (q.weight, q.weight_scale, q.weight_scale_2)
        for m in (1, 4, 9):
            x = torch.randn(m, k, device=DEV, dtype=torch.bfloat16)
            ref = nvfp4_gemm_ref(x, *a, torch.float32)
            for fast in (True, False):
                for split in (1, 4):
                    cfg = GemvConfig(128, 2, split, 1, 1, fast)
                    try:
                        err = rel_err(nvfp4_gemm(x, *a, torch.float32, cfg), ref)
                    except Exception as exc:  # noqa: BLE001 - report, mark the variant bad
                        print(f"gemv fast={fast}: {type(exc).__name__}: {exc}"[:300])
                        err = float("inf")
                    key = "gemv_fast" if fast else "gemv_pure"
                    ok[key] &= err < 1e-4
                    print(f"check gemv {n}x{k} m={m} fast={fast} split={split}: {err:.1e}")
            if k % 256 == 0:
                try:
                    cfg = NVFP4GemmConfig(block_n=32, split_k=2, fast_dequant=True)
                    err = rel_err(nvfp4_gemm(x, *a, torch.float32, cfg), ref)
                except Exception as exc:  # noqa: BLE001
                    print(f"mma fast: {type(exc).__name__}: {exc}"[:300])
                    err = float("inf")
                ok["mma_fast"] &= err < 1e-3
                print(f"check mma-fast {n}x{k} m={m}: {err:.1e}")
    e, k, inter = 16, 7168, 512
    w13 = bench.stack_nvfp4([quantize_nvfp4(torch.randn(2 * inter, k, device=DEV) * 0.02)
                             for _ in range(e)])
    w2 = bench.stack_nvfp4([quantize_nvfp4(torch.randn(k, inter, device=DEV) * 0.02)
                            for _ in range(e)])
    for m in (1, 5, 20):
        x = torch.randn(m, k, device=DEV, dtype=torch.bfloat16)
        ids = torch.rand(m, e, device=DEV).topk(8).indices
        ids[0, 0] = -1
        tw = torch.rand(m, 8, device=DEV)
        ref = fused_moe_ref(x, ids, tw, w13, w2)
        for path in ("gemv", "sorted"):
            try:
                err = rel_err(fused_moe_nvfp4(x, ids, tw, w13, w2, path=path), ref)
            except Exception as exc:  # noqa: BLE001
                print(f"moe {path}: {type(exc).__name__}: {exc}"[:300])
                err = float("inf")
            ok[f"moe_{path}"] &= err < 2e-2
            print(f"check moe {path} m={m}: {err:.1e}")
    print("checks:", ok)
    return ok


def gemv_configs(m, n, k, fast):
    base = default_gemv_config(m, n, k)
    out = []
    for bn, warps, st in GEMV_TILES:
        tiles = triton.cdiv(n, bn) * triton.cdiv(m, 8)
        for target in (2, 4):
            split = 1
            while tiles * split < target * 132 and (k // 32) >= 4 * split:
                split *= 2
            out.append(GemvConfig(bn, 2, split, warps, st, fast))
    return [base] + list(dict.fromkeys(out))


def time_variants(m, n, k, sets, ok):
    """(µs, name) of every variant valid for this M, rotated over ``sets``."""
    x = torch.randn(m, k, device=DEV, dtype=torch.bfloat16)
    res = []
    cfgs = []
    if m <= 16 and (ok["gemv_fast"] or ok["gemv_pure"]):
        cfgs += gemv_configs(m, n, k, ok["gemv_fast"])
    if m >= 4:
        cfgs += [NVFP4GemmConfig(bn, bk, s, w, st, ok["mma_fast"]) for bn, bk, st, w in MMA_TILES
                 for s in (1, 4) if triton.cdiv(n, bn) * s <= 4 * 132]
    if time.time() > DEADLINE[0]:
        cfgs = cfgs[:1]
    for cfg in cfgs:
        try:
            us = graph_us([lambda a=a, c=cfg: nvfp4_gemm(x, *a, config=c) for a in sets])
        except Exception as exc:  # noqa: BLE001 - a config that does not compile / fit
            print(f"  skip {cfg}: {type(exc).__name__}: {str(exc)[:120]}")
            continue
        kind = "gemv" if isinstance(cfg, GemvConfig) else "mma"
        name = (f"{kind} bn{cfg.block_n} s{cfg.split_k} w{cfg.num_warps} st{cfg.num_stages}"
                + ("" if isinstance(cfg, GemvConfig) else f" bk{cfg.block_k}"))
        res.append((us, name))
    return sorted(res)


def bench_dense(ok, quick):
    rows = []
    for name, (n, k) in SHAPES.items():
        sets = bench.rand_nvfp4(n, k, max(2, int(ROTATE // (n * k * 0.5625)) + 1))
        wbf = [torch.randn(n, k, device=DEV, dtype=torch.bfloat16)
               for _ in range(max(2, int(ROTATE // (n * k * 2)) + 1))]
        for m in MS[:2] if quick else MS:
            t0 = time.time()
            x = torch.randn(m, k, device=DEV, dtype=torch.bfloat16)
            bf16 = graph_us([lambda w=w, x=x: torch.matmul(x, w.t()) for w in wbf])
            res = time_variants(m, n, k, sets, ok)
            dflt = graph_us([lambda a=a, x=x: nvfp4_gemm(x, *a) for a in sets])
            us, best = res[0] if res else (dflt, "default")
            rows.append(dict(shape=name, n=n, k=k, m=m, ours_us=round(us, 2), best=best,
                             default_us=round(dflt, 2), bf16_us=round(bf16, 2),
                             speedup_vs_bf16=round(bf16 / us, 2),
                             ours_GBps=round(n * k * 0.5625 / us / 1e3),
                             top3="; ".join(f"{u:.2f} {s}" for u, s in res[:3])))
            print(rows[-1], f"({time.time() - t0:.0f} s)")
        del sets, wbf
    return rows


def bench_moe(ok, quick):
    e, k, inter, topk = 256, 7168, 512, 8
    w13, w2, b13, b2 = bench.moe_weights(e, k, inter)
    rows = []
    for m in MS[:2] if quick else MS:
        xs, ids, tws = bench.moe_inputs(m, k, e, topk, n_sets=8)
        variants = []
        if ok["moe_gemv"] and m <= 16:
            variants += [dict(path="gemv", gemv_block_n=bn, gemv_warps=w)
                         for bn, w in ((128, 1), (256, 2), (256, 1))]
        if ok["moe_sorted"] and m >= 4:
            variants += [dict(path="sorted", block_n=bn, fast_dequant=ok["mma_fast"])
                         for bn in (32, 64)]
        res = []
        for kw in variants if time.time() < DEADLINE[0] else variants[:1]:
            try:
                us = graph_us([lambda x=x, t=t, w=w, kw=kw: fused_moe_nvfp4(x, t, w, w13, w2, **kw)
                               for x, t, w in zip(xs, ids, tws)])
            except Exception as exc:  # noqa: BLE001
                print(f"  skip moe {kw}: {type(exc).__name__}: {str(exc)[:120]}")
                continue
            res.append((us, " ".join(f"{a}={b}" for a, b in kw.items())))
        res.sort()
        bf16, active = bench.moe_bf16_us(xs, ids, b13, b2, inter, timer=graph_us)
        us, best = res[0] if res else (float("nan"), "none")
        rows.append(dict(shape="moe_256e_top8_tp4", m=m, active_experts=round(active, 1),
                         ours_us=round(us, 2), best=best, bf16_gemms_us=round(bf16, 2),
                         speedup_vs_bf16=round(bf16 / us, 2),
                         ours_GBps=round(active * 3 * inter * k * 0.5625 / us / 1e3),
                         top3="; ".join(f"{u:.2f} {s}" for u, s in res[:3])))
        print(rows[-1])
    return rows


def to_markdown(dense, moe) -> str:
    lines = ["| shape | N x K | M | ours µs | default µs | cuBLAS bf16 µs | x bf16 | ours GB/s | "
             "best variant |", "|" + "---|" * 9]
    for r in dense:
        lines.append(f"| {r['shape']} | {r['n']} x {r['k']} | {r['m']} | {r['ours_us']} | "
                     f"{r['default_us']} | {r['bf16_us']} | {r['speedup_vs_bf16']} | "
                     f"{r['ours_GBps']} | {r['best']} |")
    lines += ["", "| MoE | M | active experts | ours µs | bf16 GEMMs µs | x bf16 | ours GB/s | "
              "best variant |", "|" + "---|" * 8]
    for r in moe:
        lines.append(f"| {r['shape']} | {r['m']} | {r['active_experts']} | {r['ours_us']} | "
                     f"{r['bf16_gemms_us']} | {r['speedup_vs_bf16']} | {r['ours_GBps']} | "
                     f"{r['best']} |")
    return "\n".join(lines)


def main() -> None:
    if not torch.cuda.is_available():
        sys.exit("sweep_nvfp4 needs a CUDA GPU")
    quick = "--quick" in sys.argv
    print(torch.cuda.get_device_name(), "torch", torch.__version__, "triton", triton.__version__)
    t0 = time.time()
    DEADLINE[0] = t0 + float(os.environ.get("SWEEP_DEADLINE_S", "150"))
    ok = check()
    gemv_mod.GEMV_FAST = ok["gemv_fast"]
    print(f"checks took {time.time() - t0:.0f} s")
    dense = bench_dense(ok, quick)
    moe = bench_moe(ok, quick)
    md = to_markdown(dense, moe)
    for r in dense + moe:
        print(r["shape"], r["m"], "top3:", r["top3"])
    print(md)
    out = os.environ.get("OUT")
    if out:
        with open(os.path.join(out, "sweep_nvfp4.json"), "w") as f:
            json.dump(dict(device=torch.cuda.get_device_name(), torch=torch.__version__,
                           triton=triton.__version__, checks=ok, dense=dense, moe=moe), f,
                      indent=1)
        with open(os.path.join(out, "sweep_nvfp4.md"), "w") as f:
            f.write(md + "\n")


if __name__ == "__main__":
    main()
