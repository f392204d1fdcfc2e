"""Sweep of every NVFP4 W4A16 kernel variant against cuBLAS bf16 on one H200 (one device call).

    PYTHONUNBUFFERED=1 python benchmarks/sweep_nvfp4.py [--quick]
    PYTHONUNBUFFERED=1 python benchmarks/sweep_nvfp4.py --mma-only   # ~100 s, the MMA kernels

``--mma-only``: GPU checks of the two MMA kernels, then for every shape and M = 16, 64, 128,
512 the swap-AB kernel's tiles ("mma", incl. the older bk128 4-warp ones), the standard-
orientation kernel's tiles ("mmab") and cuBLAS bf16; prints per row the best of each kernel,
what ``nvfp4_gemm`` runs by default, and the ``PINNED_CONFIGS`` lines to paste; then the
sorted MoE path at M = 32, 128 with both kernels. Past ``SWEEP_DEADLINE_S`` (default 100 s
here) only the heuristic configs are timed and the MoE rows are skipped.

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

import os
import sys
import time
from dataclasses import replace

import bench_nvfp4 as bench  # the sibling script (this directory is sys.path[0])
import torch
import triton

import mla_spec.kernels.nvfp4_gemv as gemv_mod
from mla_spec.kernels.nvfp4_configs import parse_variant, variant_name
from mla_spec.kernels.nvfp4_gemm import (
    NVFP4GemmConfig,
    NVFP4MmaConfig,
    block_m_for,
    default_gemm_config,
    default_mma_config,
    mma_block_m,
    nvfp4_gemm,
    nvfp4_gemm_ref,
)
from mla_spec.kernels.nvfp4_gemv import GemvConfig, default_gemv_config
from mla_spec.kernels.nvfp4_moe import fused_moe_nvfp4, fused_moe_ref
from mla_spec.quant.nvfp4 import quantize_nvfp4

SHAPES = {"dense_gate_up_tp4": (9216, 7168), "dense_down_tp4": (7168, 4608),
          "expert_w13_tp4": (1024, 7168), "expert_w2_tp4": (7168, 512)}
MS = [1, 4, 16, 64]
DEV = "cuda"
# past the deadline only default configs are timed (one device call)
DEADLINE = [time.time() + float(os.environ.get("SWEEP_DEADLINE_S", "150"))]
GEMV_TILES = [(128, 1, 1), (256, 2, 1), (512, 4, 1), (256, 2, 3)]  # bn, warps, st
MMA_TILES = [(64, 256, 4, 4), (128, 128, 3, 8)]  # bn, bk, stages, warps


def graph_us(calls) -> float:
    """Median µs per call of ``calls`` replayed in one CUDA graph (shorter runs than bench)."""
    return bench.graph_us(calls, warmup=3, rep=15)


rel_err = bench.rel_err


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
        res.append((us, variant_name(cfg)))
    return sorted(res)


def bench_dense(ok, quick):
    rows = []
    for name, (n, k) in SHAPES.items():
        sets, wbf = bench.weight_sets(n, k)
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
            variants += [dict(path="sorted", sorted_kernel="mma", block_n=bn,
                              fast_dequant=ok["mma_fast"]) for bn in (32, 64)]
            variants.append(dict(path="sorted", fast_dequant=ok["mma_fast"]))  # mmab
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
    c = bench.col
    return bench.md_table([("shape", c("shape")), bench.NK, ("M", c("m")),
                           ("ours µs", c("ours_us")), ("default µs", c("default_us")),
                           ("cuBLAS bf16 µs", c("bf16_us")), ("x bf16", c("speedup_vs_bf16")),
                           ("ours GB/s", c("ours_GBps")), ("best variant", c("best"))], dense) + \
        "\n\n" + bench.md_table([("MoE", c("shape")), ("M", c("m")),
                                  ("active experts", c("active_experts")),
                                  ("ours µs", c("ours_us")), ("bf16 GEMMs µs", c("bf16_gemms_us")),
                                  ("x bf16", c("speedup_vs_bf16")), ("ours GB/s", c("ours_GBps")),
                                  ("best variant", c("best"))], moe)


MMA_MS = [int(m) for m in os.environ.get("SWEEP_MMA_MS", "16,64,128,512").split(",")]
OLD_TILES = [(64, 4, 3), (64, 4, 4), (128, 4, 3), (128, 4, 4)]  # swap-AB bk128: bn, warps, st
NEW_TILES = [(0, 128, 128, 4, 4), (0, 128, 256, 4, 3), (0, 256, 128, 8, 3),
             (0, 64, 128, 4, 4), (64, 128, 128, 4, 3), (0, 128, 64, 4, 4)]  # bm bn bk w st


CHECK_SHAPES = [(1024, 7168), (200, 528)]
CHECK_MS = [9, 70, 300]


def check_configs(m, n, k) -> dict:
    return {"mma_fast": NVFP4GemmConfig(block_n=64, block_k=128, split_k=2),
            "mmab_fast": default_mma_config(m, n, k, block_n=64),
            "mmab_pure": NVFP4MmaConfig(block_n=128, block_k=64, split_k=3, fast_dequant=False)}


def check_mma() -> dict:
    """Both MMA kernels (PTX and portable decoders) vs the twin at irregular shapes."""
    torch.manual_seed(0)
    ok = {"mma_fast": True, "mmab_fast": True, "mmab_pure": True, "moe_mma": True,
          "moe_mmab": True}
    for n, k in CHECK_SHAPES:
        q = quantize_nvfp4(torch.randn(n, k, device=DEV) * 0.02)
        a = (q.weight, q.weight_scale, q.weight_scale_2)
        for m in CHECK_MS:
            x = torch.randn(m, k, device=DEV, dtype=torch.bfloat16)
            ref = nvfp4_gemm_ref(x, *a, torch.float32)
            for key, cfg in check_configs(m, n, k).items():
                try:
                    err = rel_err(nvfp4_gemm(x, *a, torch.float32, cfg), ref)
                except Exception as exc:  # noqa: BLE001 - report, mark the variant bad
                    print(f"{key}: {type(exc).__name__}: {exc}"[:400])
                    err = float("inf")
                ok[key] &= err < 1e-3
                print(f"check {key} {n}x{k} m={m}: {err:.1e}")
    e, k, inter = 16, 7168, 512
    w13 = bench.stack_nvfp4([quantize_nvfp4(torch.randn(2 * inter, k, device=DEV) * 0.02)
                             for _ in range(e)])
    w2 = bench.stack_nvfp4([quantize_nvfp4(torch.randn(k, inter, device=DEV) * 0.02)
                            for _ in range(e)])
    for m in (5, 40):
        x = torch.randn(m, k, device=DEV, dtype=torch.bfloat16)
        ids = torch.rand(m, e, device=DEV).topk(8).indices
        ids[0, 0] = -1
        tw = torch.rand(m, 8, device=DEV)
        ref = fused_moe_ref(x, ids, tw, w13, w2)
        for kern in ("mma", "mmab"):
            try:
                err = rel_err(fused_moe_nvfp4(x, ids, tw, w13, w2, path="sorted",
                                              sorted_kernel=kern), ref)
            except Exception as exc:  # noqa: BLE001
                print(f"moe {kern}: {type(exc).__name__}: {exc}"[:400])
                err = float("inf")
            ok[f"moe_{kern}"] &= err < 2e-2
            print(f"check moe sorted {kern} m={m}: {err:.1e}")
    print("checks:", ok)
    return ok


def mma_variants(m, n, k, ok):
    """(kernel, config) candidates at M tokens: the heuristic first, then the tile grid."""
    fast_old = ok["mma_fast"]
    fast_new = ok["mmab_fast"]
    if not (fast_new or ok["mmab_pure"]):
        new = []
    else:
        new = [default_mma_config(m, n, k, block_m=bm, block_n=bn, block_k=bk, num_warps=w,
                                  num_stages=st) for bm, bn, bk, w, st in NEW_TILES
               if bm <= triton.next_power_of_2(max(m, 16))]
        new = [replace(c, fast_dequant=fast_new)
               for c in dict.fromkeys([default_mma_config(m, n, k)] + new)]
    old = [default_gemm_config(m, n, k)]
    for bn, w, st in OLD_TILES:
        tiles = triton.cdiv(n, bn) * triton.cdiv(m, min(64, triton.next_power_of_2(m)))
        split = 1
        while tiles * split * w < 8 * 132 and split < 8 and k // 128 >= 8 * split:
            split *= 2
        old.append(NVFP4GemmConfig(bn, 128, split, w, st, fast_old))
    old = list(dict.fromkeys(old))
    if time.time() > DEADLINE[0]:
        return old[:1], new[:1]
    return old, new


def _compile_job(job) -> str:
    """Worker: run one dense (N, K, M, variant) or MoE (M, kwargs) call once, so its kernels
    land in Triton's disk cache."""
    try:
        if job[0] == "moe":
            kw = job[1]
            # 8 experts, 2 tokens: P = 16 and 2 rows per expert give the timed MoE's
            # specialization (P % 16 == 0, K, I) and token tile (16): the same kernels
            e, k, inter = 8, 7168, 512
            w13, w2, _, _ = bench.moe_weights(e, k, inter)
            xs, ids, tws = bench.moe_inputs(2, k, e, 8, n_sets=1)
            fused_moe_nvfp4(xs[0], ids[0], tws[0], w13, w2, path="sorted", **kw)
        else:
            _, n, k, m, name = job
            w = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, device=DEV)
            s = torch.ones(n, k // 16, device=DEV).to(torch.float8_e4m3fn)
            x = torch.randn(m, k, device=DEV, dtype=torch.bfloat16)
            nvfp4_gemm(x, w, s, torch.tensor(1e-3, device=DEV), config=parse_variant(name))
        torch.cuda.synchronize()
    except Exception as exc:  # noqa: BLE001 - the checks / timing loop report it
        return f"{job[1:]}: {type(exc).__name__}"
    return ""


def precompile() -> None:
    """Compile the checks' and every timed variant in parallel worker processes (Triton's
    disk cache is shared), so the main process does not pay ~1 s of compile per variant."""
    import multiprocessing as mp
    from concurrent.futures import ProcessPoolExecutor
    t0 = time.time()
    ok = dict.fromkeys(("mma_fast", "mmab_fast", "mmab_pure", "moe_mma", "moe_mmab"), True)
    jobs, seen = [], set()
    todo = [(n, k, m, c) for n, k in SHAPES.values() for m in MMA_MS
            for c in sum(mma_variants(m, n, k, ok), [])]
    todo += [(n, k, m, c) for n, k in CHECK_SHAPES for m in CHECK_MS
             for c in check_configs(m, n, k).values()]
    for n, k, m, cfg in todo:
        bm = mma_block_m(m, cfg) if isinstance(cfg, NVFP4MmaConfig) else block_m_for(m)
        key = (replace(cfg, split_k=1), cfg.split_k > 1, bm, k % cfg.block_k == 0)
        if key not in seen:
            seen.add(key)
            jobs.append(("gemm", n, k, m, variant_name(cfg)))
    jobs = [("moe", kw) for _, kw in moe_variants(ok)] + jobs
    workers = min(8, max(1, (os.cpu_count() or 2) // 2))
    with ProcessPoolExecutor(workers, mp_context=mp.get_context("spawn")) as ex:
        bad = [r for r in ex.map(_compile_job, jobs) if r]
    print(f"precompiled {len(jobs)} calls with {workers} workers in {time.time() - t0:.0f} s"
          + (f"; failed: {bad}" if bad else ""))


def bench_mma(ok) -> list[dict]:
    rows = []
    for name, (n, k) in SHAPES.items():
        t0 = time.time()
        sets, wbf = bench.weight_sets(n, k)
        for m in MMA_MS:
            x = torch.randn(m, k, device=DEV, dtype=torch.bfloat16)
            bf16 = graph_us([lambda w=w, x=x: torch.matmul(x, w.t()) for w in wbf])
            best = {}
            old, new = mma_variants(m, n, k, ok)
            for kind, cfgs in (("mma", old), ("mmab", new)):
                res = []
                for cfg in cfgs:
                    try:
                        us = graph_us([lambda a=a, c=cfg, x=x: nvfp4_gemm(x, *a, config=c)
                                       for a in sets])
                    except Exception as exc:  # noqa: BLE001 - does not compile / fit
                        print(f"  skip {variant_name(cfg)}: {type(exc).__name__}: "
                              f"{str(exc)[:120]}")
                        continue
                    res.append((us, variant_name(cfg)))
                best[kind] = min(res) if res else (float("inf"), "none")
            try:
                auto = graph_us([lambda a=a, x=x: nvfp4_gemm(x, *a) for a in sets])
            except Exception as exc:  # noqa: BLE001 - report; the variants still count
                print(f"  default failed: {type(exc).__name__}: {str(exc)[:200]}")
                auto = float("inf")
            win = min(best.values())
            rows.append(dict(shape=name, n=n, k=k, m=m, old_us=round(best["mma"][0], 2),
                             old_best=best["mma"][1], new_us=round(best["mmab"][0], 2),
                             new_best=best["mmab"][1], auto_us=round(auto, 2),
                             bf16_us=round(bf16, 2), bf16_over_best=round(bf16 / win[0], 3),
                             new_over_old=round(best["mma"][0] / best["mmab"][0], 2),
                             pin=win[1]))
            print(rows[-1], f"({time.time() - t0:.0f} s)")
        del sets, wbf
    return rows


MOE_MS = [int(m) for m in os.environ.get("SWEEP_MOE_MS", "32,128").split(",")]
MOE_MMAB = [(64, 128, 4, 3), (128, 128, 4, 3), (64, 256, 4, 3), (32, 128, 4, 4)]  # bn bk w st


def moe_variants(ok) -> list[tuple[str, dict]]:
    out = [("mma bn32", dict(sorted_kernel="mma", block_n=32, fast_dequant=ok["mma_fast"]))]
    out = out if ok["moe_mma"] else []
    return out + [(f"mmab bn{bn} bk{bk} w{w} st{st}", dict(mmab_config=NVFP4MmaConfig(
        0, bn, bk, 1, w, st, ok["mmab_fast"]))) for bn, bk, w, st in MOE_MMAB if ok["moe_mmab"]]


def bench_moe_mma(ok) -> list[dict]:
    """Sorted MoE path (256 experts, top-8, K 7168, I 512): swap-AB vs standard kernel."""
    if time.time() > DEADLINE[0]:
        print("moe: past the deadline, skipped")
        return []
    e, k, inter, topk = 256, 7168, 512, 8
    w13, w2, b13, b2 = bench.moe_weights(e, k, inter)
    rows = []
    for m in MOE_MS:
        xs, ids, tws = bench.moe_inputs(m, k, e, topk, n_sets=2)
        variants = moe_variants(ok)
        if time.time() > DEADLINE[0]:
            variants = variants[:2]
        best = {}
        for name, kw in variants:
            try:
                us = graph_us([lambda x=x, t=t, w=w, kw=kw: fused_moe_nvfp4(
                    x, t, w, w13, w2, path="sorted", **kw) for x, t, w in zip(xs, ids, tws)])
            except Exception as exc:  # noqa: BLE001
                print(f"  skip moe {name}: {type(exc).__name__}: {str(exc)[:120]}")
                continue
            kind = name.split()[0]
            best[kind] = min(best.get(kind, (float("inf"), "none")), (us, name))
        gemv_us = None
        if m <= 16:  # the per-pair GEMV path ("auto" takes it up to MOE_GEMV_MAX_M tokens)
            gemv_us = graph_us([lambda x=x, t=t, w=w: fused_moe_nvfp4(
                x, t, w, w13, w2, path="gemv") for x, t, w in zip(xs, ids, tws)])
        bf16, active = bench.moe_bf16_us(xs, ids, b13, b2, inter, timer=graph_us)
        old, new = best.get("mma", (float("inf"), "none")), best.get("mmab", (float("inf"),
                                                                             "none"))
        hbm_us = active * 3 * inter * k * 0.5625 / 4.0e6  # active experts' bytes at 4 TB/s
        rows.append(dict(shape="moe_256e_top8_tp4", m=m, active_experts=round(active, 1),
                         old_us=round(old[0], 2), old_best=old[1], new_us=round(new[0], 2),
                         new_best=new[1], gemv_us=gemv_us and round(gemv_us, 2),
                         bf16_us=round(bf16, 2), hbm_floor_us=round(hbm_us, 1),
                         bf16_over_best=round(bf16 / min(old[0], new[0]), 3)))
        print(rows[-1])
    return rows


def mma_markdown(rows, moe) -> str:
    lines = ["| shape | M | best mma (swap AB) µs | best mmab (standard) µs | default µs | "
             "cuBLAS bf16 µs | bf16 / best | best variant |", "|" + "---|" * 8]
    lines += [f"| {r['shape']} | {r['m']} | {r['old_us']} | {r['new_us']} | {r['auto_us']} | "
              f"{r['bf16_us']} | {r['bf16_over_best']} | {r['pin']} |" for r in rows]
    lines += ["", "PINNED_CONFIGS lines (the faster kernel per (N, K, M bucket)):", "```"]
    for r in rows:
        us = min(r["old_us"], r["new_us"])
        lines.append(f"    ({r['n']}, {r['k']}, {r['m']}): \"{r['pin']}\",  # {us} (cuBLAS "
                     f"{r['bf16_us']}); {r['old_best']}: {r['old_us']}")
    lines += ["```", "", "| MoE | M | active experts | sorted mma (swap AB) µs | sorted mmab µs | "
              "gemv path µs | bf16 GEMMs µs | NVFP4 bytes at 4 TB/s µs | bf16 / best sorted | "
              "best mmab |", "|" + "---|" * 10]
    lines += [f"| {r['shape']} | {r['m']} | {r['active_experts']} | {r['old_us']} | "
              f"{r['new_us']} | {r.get('gemv_us') or '-'} | {r['bf16_us']} | {r['hbm_floor_us']} "
              f"| {r['bf16_over_best']} | {r['new_best']} |" for r in moe]
    return "\n".join(lines)


def main_mma() -> None:
    t0 = time.time()
    DEADLINE[0] = t0 + float(os.environ.get("SWEEP_DEADLINE_S", "100"))
    if "--no-precompile" not in sys.argv:
        precompile()
    ok = check_mma()
    rows = bench_mma(ok)
    moe = bench_moe_mma(ok)
    md = mma_markdown(rows, moe)
    print(md)
    print(f"total {time.time() - t0:.0f} s")
    bench.save_results("sweep_nvfp4_mma", md, torch=torch.__version__, triton=triton.__version__,
                       checks=ok, rows=rows, moe=moe)


def main() -> None:
    if not torch.cuda.is_available():
        sys.exit("sweep_nvfp4 needs a CUDA GPU")
    print(torch.cuda.get_device_name(), "torch", torch.__version__, "triton", triton.__version__)
    if "--mma-only" in sys.argv:
        return main_mma()
    quick = "--quick" in sys.argv
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
    bench.save_results("sweep_nvfp4", md, torch=torch.__version__, triton=triton.__version__,
                       checks=ok, dense=dense, moe=moe)


if __name__ == "__main__":
    main()
