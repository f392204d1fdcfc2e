"""Sweep of the NVFP4 MMA kernel's tiles against cuBLAS bf16 on one H200 (one device call).

    PYTHONUNBUFFERED=1 python benchmarks/sweep_nvfp4.py [--no-precompile]

GPU checks of the MMA kernel (``nvfp4_gemm`` with an ``NVFP4MmaConfig``) and the sorted MoE path
against their torch references at irregular shapes first (a failing variant is not timed), then
for every shape and M = 16, 64, 128, 512 (``SWEEP_MMA_MS``) the kernel's heuristic config and
~6 tiles, cuBLAS bf16 and what ``nvfp4_gemm`` runs by default, each per call in a CUDA graph
with the weights rotated past the L2; prints per row the best tile and the ``PINNED_CONFIGS``
lines to paste. Then the sorted MoE path (256 experts, top-8, K 7168, I 512) at M = 32, 128
(``SWEEP_MOE_MS``) over a few ``sorted_config`` tiles. Past ``SWEEP_DEADLINE_S`` (default 100 s)
only the heuristic configs are timed and the MoE rows are skipped. The GEMV tiles (1-2 tokens)
are ``sweep_gemv.py``'s. Writes ``$OUT/sweep_nvfp4_mma.{json,md}`` when ``$OUT`` is set.
"""

from __future__ import annotations

import os
import sys
import time
from dataclasses import replace

import bench_nvfp4 as bench  # the sibling script (this directory is sys.path[0])
import torch
import triton

from mla_spec.kernels.nvfp4 import (
    NVFP4MmaConfig,
    fused_moe_nvfp4,
    fused_moe_ref,
    nvfp4_gemm,
    nvfp4_gemm_ref,
)
from mla_spec.kernels.nvfp4.configs import parse_variant, variant_name
from mla_spec.kernels.nvfp4.gemm import default_mma_config, mma_block_m
from mla_spec.quant.nvfp4 import quantize_nvfp4

SHAPES = bench.SHAPES
DEV = "cuda"
DEADLINE = [time.time() + float(os.environ.get("SWEEP_DEADLINE_S", "100"))]
MMA_MS = [int(m) for m in os.environ.get("SWEEP_MMA_MS", "16,64,128,512").split(",")]
TILES = [(0, 128, 128, 4, 4), (0, 128, 256, 4, 3), (0, 256, 128, 8, 3),
         (0, 64, 128, 4, 4), (64, 128, 128, 4, 3), (0, 128, 64, 4, 4)]  # bm bn bk w st
CHECK_SHAPES = [(1024, 7168), (200, 528)]
CHECK_MS = [9, 70, 300]
MOE_MS = [int(m) for m in os.environ.get("SWEEP_MOE_MS", "32,128").split(",")]
MOE_TILES = [(64, 128, 4, 3), (128, 128, 4, 3), (64, 256, 4, 3), (32, 128, 4, 4)]  # bn bk w st


def graph_us(calls) -> float:
    """Median µs per call of ``calls`` replayed in one CUDA graph (shorter runs than bench)."""
    return bench.graph_us(calls, warmup=3, rep=15)


def check_mma() -> dict:
    """The MMA kernel and the sorted MoE path vs their torch references (relative max error)."""
    torch.manual_seed(0)
    ok = {"mma": True, "moe_sorted": True}
    for n, k in CHECK_SHAPES:
        q = quantize_nvfp4(torch.randn(n, k, device=DEV) * 0.02)
        a = (q.weight, q.weight_scale, q.weight_scale_2)
        for m in CHECK_MS:
            x = torch.randn(m, k, device=DEV, dtype=torch.bfloat16)
            ref = nvfp4_gemm_ref(x, *a, torch.float32)
            for cfg in (default_mma_config(m, n, k, block_n=64),
                        NVFP4MmaConfig(block_n=128, block_k=64, split_k=3)):
                try:
                    err = bench.rel_err(nvfp4_gemm(x, *a, torch.float32, cfg), ref)
                except Exception as exc:  # noqa: BLE001 - report, mark the kernel bad
                    print(f"{variant_name(cfg)}: {type(exc).__name__}: {exc}"[:400])
                    err = float("inf")
                ok["mma"] &= err < 1e-3
                print(f"check {variant_name(cfg)} {n}x{k} m={m}: {err:.1e}")
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
        try:
            err = bench.rel_err(fused_moe_nvfp4(x, ids, tw, w13, w2, path="sorted"),
                                fused_moe_ref(x, ids, tw, w13, w2))
        except Exception as exc:  # noqa: BLE001
            print(f"moe sorted: {type(exc).__name__}: {exc}"[:400])
            err = float("inf")
        ok["moe_sorted"] &= err < 2e-2
        print(f"check moe sorted m={m}: {err:.1e}")
    print("checks:", ok)
    return ok


def mma_variants(m, n, k) -> list[NVFP4MmaConfig]:
    """The heuristic config first, then the tile grid (split K by the heuristic's rule)."""
    cfgs = [default_mma_config(m, n, k)] + [
        default_mma_config(m, n, k, block_m=bm, block_n=bn, block_k=bk, num_warps=w,
                           num_stages=st) for bm, bn, bk, w, st in TILES
        if bm <= triton.next_power_of_2(max(m, 16))]
    cfgs = list(dict.fromkeys(cfgs))
    return cfgs[:1] if time.time() > DEADLINE[0] else cfgs


def moe_variants() -> list[NVFP4MmaConfig]:
    return [NVFP4MmaConfig(0, bn, bk, 1, w, st) for bn, bk, w, st in MOE_TILES]


def _compile_job(job) -> str:
    """Worker: run one dense (N, K, M, variant) or MoE (config) call once, so its kernels land
    in Triton's disk cache."""
    try:
        if job[0] == "moe":
            # 8 experts, 2 tokens: P = 16 and 2 rows per expert give the timed MoE's
            # specialization (P % 16 == 0, K, I) and token tile (16): the same kernels
            e, k, inter = 8, 7168, 512
            w13, w2, _, _ = bench.moe_weights(e, k, inter)
            xs, ids, tws = bench.moe_inputs(2, k, e, 8, n_sets=1)
            fused_moe_nvfp4(xs[0], ids[0], tws[0], w13, w2, path="sorted", sorted_config=job[1])
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
    jobs, seen = [], set()
    todo = [(n, k, m, c) for n, k in SHAPES.values() for m in MMA_MS
            for c in mma_variants(m, n, k)]
    for n, k, m, cfg in todo:
        key = (replace(cfg, split_k=1), cfg.split_k > 1, mma_block_m(m, cfg),
               k % cfg.block_k == 0)
        if key not in seen:
            seen.add(key)
            jobs.append(("gemm", n, k, m, variant_name(cfg)))
    jobs = [("moe", c) for c in moe_variants()] + jobs
    workers = min(8, max(1, (os.cpu_count() or 2) // 2))
    with ProcessPoolExecutor(workers, mp_context=mp.get_context("spawn")) as ex:
        bad = [r for r in ex.map(_compile_job, jobs) if r]
    print(f"precompiled {len(jobs)} calls with {workers} workers in {time.time() - t0:.0f} s"
          + (f"; failed: {bad}" if bad else ""))


def bench_mma() -> list[dict]:
    rows = []
    for name, (n, k) in SHAPES.items():
        t0 = time.time()
        sets, wbf = bench.weight_sets(n, k)
        for m in MMA_MS:
            x = torch.randn(m, k, device=DEV, dtype=torch.bfloat16)
            bf16 = graph_us([lambda w=w, x=x: torch.matmul(x, w.t()) for w in wbf])
            res = []
            for cfg in mma_variants(m, n, k):
                try:
                    us = graph_us([lambda a=a, c=cfg, x=x: nvfp4_gemm(x, *a, config=c)
                                   for a in sets])
                except Exception as exc:  # noqa: BLE001 - does not compile / fit
                    print(f"  skip {variant_name(cfg)}: {type(exc).__name__}: {str(exc)[:120]}")
                    continue
                res.append((us, variant_name(cfg)))
            best = min(res) if res else (float("inf"), "none")
            auto = graph_us([lambda a=a, x=x: nvfp4_gemm(x, *a) for a in sets])
            rows.append(dict(shape=name, n=n, k=k, m=m, best_us=round(best[0], 2), pin=best[1],
                             auto_us=round(auto, 2), bf16_us=round(bf16, 2),
                             bf16_over_best=round(bf16 / best[0], 3)))
            print(rows[-1], f"({time.time() - t0:.0f} s)")
        del sets, wbf
    return rows


def bench_moe_sorted() -> list[dict]:
    """The sorted MoE path over ``MOE_TILES``, the gemv path and the bf16 GEMMs."""
    if time.time() > DEADLINE[0]:
        print("moe: past the deadline, skipped")
        return []
    e, k, inter, topk = 256, 7168, 512, 8
    w13, w2, b13, b2 = bench.moe_weights(e, k, inter)
    rows = []
    for m in MOE_MS:
        xs, ids, tws = bench.moe_inputs(m, k, e, topk, n_sets=2)
        res = []
        for cfg in moe_variants() if time.time() < DEADLINE[0] else moe_variants()[:1]:
            try:
                us = graph_us([lambda x=x, t=t, w=w, c=cfg: fused_moe_nvfp4(
                    x, t, w, w13, w2, path="sorted", sorted_config=c)
                    for x, t, w in zip(xs, ids, tws)])
            except Exception as exc:  # noqa: BLE001
                print(f"  skip moe {cfg}: {type(exc).__name__}: {str(exc)[:120]}")
                continue
            res.append((us, f"bn{cfg.block_n} bk{cfg.block_k} w{cfg.num_warps} "
                            f"st{cfg.num_stages}"))
        gemv_us = None
        if m <= 16:
            gemv_us = graph_us([lambda x=x, t=t, w=w: fused_moe_nvfp4(
                x, t, w, w13, w2, path="gemv") for x, t, w in zip(xs, ids, tws)])
        bf16, active = bench.moe_bf16_us(xs, ids, b13, b2, inter, timer=graph_us)
        best = min(res) if res else (float("inf"), "none")
        hbm_us = active * 3 * inter * k * 0.5625 / 4.0e6  # active experts' bytes at 4 TB/s
        rows.append(dict(shape="moe_256e_top8_tp4", m=m, active_experts=round(active, 1),
                         best_us=round(best[0], 2), best=best[1],
                         gemv_us=gemv_us and round(gemv_us, 2), bf16_us=round(bf16, 2),
                         hbm_floor_us=round(hbm_us, 1), bf16_over_best=round(bf16 / best[0], 3)))
        print(rows[-1])
    return rows


def mma_markdown(rows, moe) -> str:
    lines = ["| shape | M | best µs | default µs | cuBLAS bf16 µs | bf16 / best | best variant |",
             "|" + "---|" * 7]
    lines += [f"| {r['shape']} | {r['m']} | {r['best_us']} | {r['auto_us']} | {r['bf16_us']} | "
              f"{r['bf16_over_best']} | {r['pin']} |" for r in rows]
    lines += ["", "PINNED_CONFIGS entries (mla_spec/data/nvfp4_pinned_h200.json):", "```"]
    lines += [f"    ({r['n']}, {r['k']}, {r['m']}): \"{r['pin']}\",  # {r['best_us']} (cuBLAS "
              f"{r['bf16_us']})" for r in rows]
    lines += ["```", "", "| MoE | M | active experts | sorted µs | gemv path µs | bf16 GEMMs µs | "
              "NVFP4 bytes at 4 TB/s µs | bf16 / sorted | best tiles |", "|" + "---|" * 9]
    lines += [f"| {r['shape']} | {r['m']} | {r['active_experts']} | {r['best_us']} | "
              f"{r.get('gemv_us') or '-'} | {r['bf16_us']} | {r['hbm_floor_us']} | "
              f"{r['bf16_over_best']} | {r['best']} |" for r in moe]
    return "\n".join(lines)


def main() -> None:
    if not torch.cuda.is_available():
        sys.exit("sweep_nvfp4 needs a CUDA GPU")
    print(torch.cuda.get_device_name(), "torch", torch.__version__, "triton", triton.__version__)
    t0 = time.time()
    DEADLINE[0] = t0 + float(os.environ.get("SWEEP_DEADLINE_S", "100"))
    if "--no-precompile" not in sys.argv:
        precompile()
    ok = check_mma()
    if not all(ok.values()):
        sys.exit(f"checks failed: {ok}")
    rows = bench_mma()
    moe = bench_moe_sorted()
    md = mma_markdown(rows, moe)
    print(md)
    print(f"total {time.time() - t0:.0f} s")
    bench.save_results("sweep_nvfp4_mma", md, torch=torch.__version__, triton=triton.__version__,
                       checks=ok, rows=rows, moe=moe)


if __name__ == "__main__":
    main()
