"""BF16 GEMV (``mla_spec.kernels.ops.bf16_gemv``) against cuBLAS / einsum at the attention shapes.

    python benchmarks/bench_bf16_gemv.py [--ms 1,2] [--deadline 100]

DeepSeek-V3's BF16 attention weights per rank (TP 4 and TP 1) at 1-2 tokens: the joint
``q_a``/``kv_a`` projection, ``q_b``, ``o_proj``, and the absorbed ``W_UK`` / ``W_UV`` products
(views of ``kv_b``, as ``models.mla`` runs them); also the MTP layer's ``eh_proj``. Each call is
timed in one replayed CUDA graph whose calls rotate over weight copies of >= 200 MB (past the
60 MB L2); every candidate tile is checked against the twin first. Prints, per shape and token
count, cuBLAS, our default (with PDL, as the model runs it, and without) and our best tile
(suggested ``PINNED`` rows), and a table last;
writes ``bench_bf16_gemv.json`` to ``$OUT``.
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

from mla_spec.kernels.ops.bf16_gemv import BgemvConfig, bgemv, bgemv_config  # noqa: E402

K_CANDIDATES = [BgemvConfig(*c) for c in (
    (4, 1024, 4), (8, 1024, 8), (4, 2048, 8), (2, 2048, 4), (8, 512, 4), (4, 512, 2),
    (16, 512, 4), (8, 1024, 4), (2, 1024, 2), (1, 2048, 4), (2, 4096, 8), (4, 512, 4))]
N_CANDIDATES = [BgemvConfig(*c) for c in (
    (64, 32, 4), (128, 16, 4), (64, 64, 8), (128, 32, 8), (256, 16, 8), (512, 8, 8),
    (128, 64, 8), (256, 32, 8), (512, 16, 8), (128, 128, 8), (32, 128, 4))]
# name, heads (B), N, K, kind: "linear" (w [N, K]) | "uk" (w = W_UK^T, N-contiguous) | "uv"
SHAPES = [
    ("qkv_a TP4/TP1", 1, 2112, 7168, "linear"),
    ("q_b TP4", 1, 6144, 1536, "linear"),
    ("o_proj TP4", 1, 7168, 4096, "linear"),
    ("W_UK TP4 (32 heads)", 32, 512, 128, "uk"),
    ("W_UV TP4 (32 heads)", 32, 128, 512, "uv"),
    ("q_b TP1", 1, 24576, 1536, "linear"),
    ("o_proj TP1", 1, 7168, 16384, "linear"),
    ("W_UK TP1 (128 heads)", 128, 512, 128, "uk"),
    ("W_UV TP1 (128 heads)", 128, 128, 512, "uv"),
    ("eh_proj (MTP)", 1, 7168, 14336, "linear"),
]


def _operands(heads, n, k, kind, m, sets):
    """Rotations of (x [B, M, K], w [B, N, K], out view, cuBLAS callable)."""
    dt, dev = torch.bfloat16, "cuda"
    ops = []
    for _ in range(sets):
        if kind == "linear":
            w = torch.randn(n, k, dtype=dt, device=dev) * 0.02
            x = torch.randn(m, k, dtype=dt, device=dev)
            ops.append((x[None], w[None], None,
                        lambda x=x, w=w: torch.nn.functional.linear(x, w)))
        else:
            kv_b = torch.randn(heads, 256, 512, dtype=dt, device=dev) * 0.02
            if kind == "uk":
                w_uk = kv_b[:, :128]  # [H, 128 (k), 512 (n)]
                q = torch.randn(m, heads, 192, dtype=dt, device=dev)[..., :128]
                out = torch.empty(m, heads, 512, dtype=dt, device=dev)
                ops.append((q.transpose(0, 1), w_uk.transpose(1, 2), out.transpose(0, 1),
                            lambda q=q, w=w_uk: torch.einsum("nhd,hdc->nhc", q, w)))
            else:
                w_uv = kv_b[:, 128:]  # [H, 128 (n), 512 (k)]
                o = torch.randn(m, heads, 512, dtype=dt, device=dev)
                out = torch.empty(m, heads, 128, dtype=dt, device=dev)
                ops.append((o.transpose(0, 1), w_uv, out.transpose(0, 1),
                            lambda o=o, w=w_uv: torch.einsum("nhc,hvc->nhv", o, w)))
    return ops


def bench_shape(name, heads, n, k, kind, m, deadline) -> dict:
    wbytes = heads * n * k * 2
    sets = max(2, -(-200_000_000 // wbytes))
    ops = _operands(heads, n, k, kind, m, sets)
    x0, w0, _, cublas0 = ops[0]
    ref = cublas0().reshape(-1).float()
    cublas_us = bench.graph_us([c for *_, c in ops])
    default = bgemv_config(heads, m, n, k, kind != "uk")
    cands = [default] + [c for c in (N_CANDIDATES if kind == "uk" else K_CANDIDATES)
                         if c != default]
    best, default_us, nopdl_us = None, None, None
    for cfg in cands:
        if time.perf_counter() > deadline and best is not None:
            break
        try:
            got = bgemv(x0, w0, cfg=cfg)
            got = got.transpose(0, 1) if kind != "linear" else got[0]
            err = bench.rel_err(got.reshape(-1), ref)
            if err > 2e-2:
                print(f"  {name} M {m} {cfg}: rel err {err:.1e}, skipped", flush=True)
                continue
            calls = [lambda x=x, w=w, o=o, c=cfg: bgemv(x, w, o, cfg=c, static_w=True)
                     for x, w, o, _ in ops]
            if cfg == default:  # as the model runs it (PDL on) and without PDL
                us, nopdl_us = bench.pdl_on_off(calls)
            else:
                us = bench.graph_us(calls)
        except Exception as e:  # a tile Triton refuses
            print(f"  {name} M {m} {cfg}: {type(e).__name__}: {str(e)[:100]}", flush=True)
            continue
        if cfg == default:
            default_us = us
        if best is None or us < best[0]:
            best = (us, cfg)
    row = dict(shape=name, heads=heads, n=n, k=k, kind=kind, m=m, mb=wbytes / 1e6,
               cublas_us=cublas_us, default_us=default_us, default_nopdl_us=nopdl_us,
               best_us=best[0] if best else None,
               best=best[1].__dict__ if best else None, default=default.__dict__)
    print(f"{name} M {m}: cuBLAS {cublas_us:.2f} us, default {default_us} us (no PDL "
          f"{nopdl_us}), best "
          f"{best[0] if best else None} {best[1] if best else ''}", flush=True)
    return row


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ms", default="1,2")
    p.add_argument("--deadline", type=float, default=100.0, help="seconds for the whole sweep")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit("bench_bf16_gemv needs a CUDA GPU")
    print(torch.cuda.get_device_name(), "torch", torch.__version__, "triton", triton.__version__)
    t0 = time.perf_counter()
    rows = []
    ms = [int(v) for v in args.ms.split(",")]
    for name, heads, n, k, kind in SHAPES:
        for m in ms:
            left = len(SHAPES) * len(ms) - len(rows)
            budget = (t0 + args.deadline - time.perf_counter()) / max(left, 1)
            rows.append(bench_shape(name, heads, n, k, kind, m, time.perf_counter() + budget))
            torch.cuda.empty_cache()
    print("\nsuggested PINNED rows (B, M, N, K, contiguous axis) -> BgemvConfig, where ours beat "
          "cuBLAS by >= 3%:")
    for r in rows:
        if r["best"] and r["best_us"] < 0.97 * r["cublas_us"]:
            b = r["best"]
            axis = "n" if r["kind"] == "uk" else "k"
            print(f"    ({r['heads']}, {r['m']}, {r['n']}, {r['k']}, {axis!r}): "
                  f"BgemvConfig({b['block_n']}, "
                  f"{b['block_k']}, {b['num_warps']}),  # {r['shape']}: {r['best_us']:.2f} vs "
                  f"{r['cublas_us']:.2f} us")
    def us(key):  # 2 decimals, nan when not measured
        return lambda r: f"{r[key] or float('nan'):.2f}"

    def per_best(num):  # num / best time, nan without a best tile
        return lambda r: f"{num(r) / r['best_us'] if r['best_us'] else float('nan'):.2f}"

    print("\n" + bench.md_table([
        ("shape", bench.col("shape")), ("M", bench.col("m")), ("MB", lambda r: f"{r['mb']:.1f}"),
        ("cuBLAS µs", us("cublas_us")), ("ours default µs", us("default_us")),
        ("default no PDL µs", us("default_nopdl_us")), ("ours best µs", us("best_us")),
        ("best tile", lambda r: "{block_n}x{block_k}w{num_warps}".format(**r["best"])
         if r["best"] else "-"),
        ("TB/s best", per_best(lambda r: r["mb"])),
        ("x cuBLAS", per_best(lambda r: r["cublas_us"]))], rows))
    bench.save_results("bench_bf16_gemv", rows=rows)


if __name__ == "__main__":
    main()
