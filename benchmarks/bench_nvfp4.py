"""NVFP4 W4A16 GEMM and fused MoE vs cuBLAS bf16 at DeepSeek-V3 TP4 shapes (H200).

    PYTHONUNBUFFERED=1 python benchmarks/bench_nvfp4.py [--quick | --pinned | --floors | --moe-pdl]

Default: the GPU check of what the model runs (``nvfp4_gemm`` and ``fused_moe_nvfp4`` without a
config, against their torch references), then for each shape and M in 1, 4, 16, 64: ours (the
automatic kernel and config), torch bf16 matmul on a bf16 weight of the same shape (cuBLAS), and
dequantize-then-matmul (torch dequant of the NVFP4 weight, then cuBLAS). Every time is per call
inside a replayed CUDA graph whose calls rotate over enough weight sets (>= 256 MB) that the
60 MB L2 does not help. The grouped MoE (256 experts, 8 active per token, I = 512, K = 7168)
runs ``fused_moe_nvfp4`` against the bf16 GEMMs of the active experts only (x rows pre-gathered,
no routing work: the strictest bf16 baseline). Writes ``bench_nvfp4.json`` / ``.md`` into
``$OUT`` when set. Tile sweeps: ``sweep_nvfp4.py`` (MMA), ``sweep_gemv.py`` (GEMV, MoE gemv
path), ``sweep_nvfp4_cuda.py`` (the ``mma.sync`` kernel).
``--pinned``: the automatic configs at M 1-16 and the MoE at 1-4 tokens with PDL on (as the
model runs them) and off (``pdl_on_off``), beside cuBLAS (``bench_nvfp4_pinned.*``).
``--floors`` / ``--moe-pdl``: ``bench_floors.py`` (the launch and read floors; the MoE with and
without PDL).
"""

from __future__ import annotations

import json
import os
import sys
import time

import torch
import triton

from mla_spec.kernels import options
from mla_spec.kernels.nvfp4 import fused_moe_nvfp4, fused_moe_ref, nvfp4_gemm, nvfp4_gemm_ref
from mla_spec.kernels.nvfp4.configs import variant_name
from mla_spec.kernels.nvfp4.gemm import auto_config
from mla_spec.kernels.nvfp4.gemm_cuda import cuda_auto_config
from mla_spec.kernels.nvfp4.moe import moe_align
from mla_spec.quant.nvfp4 import NVFP4Tensor, dequantize_nvfp4, quantize_nvfp4

SHAPES = {"dense_gate_up_tp4": (9216, 7168), "dense_down_tp4": (7168, 4608),
          "expert_w13_tp4": (1024, 7168), "expert_w2_tp4": (7168, 512)}
MS = [1, 4, 16, 64]
ROTATE = 256e6
DEV = "cuda"


def rel_err(y, ref) -> float:
    """max |y - ref| / max |ref|, in fp32."""
    return ((y.float() - ref.float()).abs().max() / ref.float().abs().max()).item()


def save_results(name: str, md: str | None = None, **payload) -> None:
    """When ``$OUT`` is set (the device tool brings that folder back): ``{"device": ...,
    **payload}`` to ``$OUT/<name>.json`` and ``md`` (if given) to ``$OUT/<name>.md``."""
    out = os.environ.get("OUT")
    if not out:
        return
    with open(os.path.join(out, f"{name}.json"), "w") as f:
        json.dump(dict(device=torch.cuda.get_device_name(), **payload), f, indent=1)
    if md is not None:
        with open(os.path.join(out, f"{name}.md"), "w") as f:
            f.write(md + "\n")


def graph_us(calls, warmup=5, rep=25) -> float:
    """Median µs per call of ``calls`` (zero-arg callables) replayed in one CUDA graph."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for c in calls:
            c()
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for c in calls:
            c()
    return triton.testing.do_bench(g.replay, warmup=warmup, rep=rep) * 1e3 / len(calls)


def rand_nvfp4(n, k, count):
    """``count`` random NVFP4 weights (speed does not depend on the values)."""
    out = []
    for _ in range(count):
        w = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, device=DEV)
        s = (torch.rand(n, k // 16, device=DEV) + 0.5).to(torch.float8_e4m3fn)
        out.append((w, s, torch.tensor(1e-3, device=DEV)))
    return out


def stack_nvfp4(qs):
    """One ``[E, ...]`` NVFP4Tensor (MoE expert weights) from E quantized weights."""
    return NVFP4Tensor(*(torch.stack([getattr(q, f) for q in qs])
                         for f in ("weight", "weight_scale", "weight_scale_2")))


def moe_weights(e, k, inter):
    """Random NVFP4 expert weights ``w13 [e, 2I, K]``, ``w2 [e, K, I]`` and bf16 ones of the same
    shapes (``b13``, ``b2``) for the cuBLAS baseline."""
    u8 = lambda *s: torch.randint(0, 256, s, dtype=torch.uint8, device=DEV)
    sc = lambda *s: (torch.rand(*s, device=DEV) + 0.5).to(torch.float8_e4m3fn)
    w13 = NVFP4Tensor(u8(e, 2 * inter, k // 2), sc(e, 2 * inter, k // 16),
                      torch.full((e,), 1e-3, device=DEV))
    w2 = NVFP4Tensor(u8(e, k, inter // 2), sc(e, k, inter // 16), torch.full((e,), 1e-3,
                                                                            device=DEV))
    b13 = torch.randn(e, 2 * inter, k, device=DEV, dtype=torch.bfloat16) * 0.01
    b2 = torch.randn(e, k, inter, device=DEV, dtype=torch.bfloat16) * 0.01
    return w13, w2, b13, b2


def moe_inputs(m, k, e, topk, n_sets):
    """``n_sets`` rotations of (x ``[m, K]`` bf16, topk_ids ``[m, topk]``, weights)."""
    xs = [torch.randn(m, k, device=DEV, dtype=torch.bfloat16) for _ in range(n_sets)]
    ids = [torch.rand(m, e, device=DEV).topk(topk).indices for _ in range(n_sets)]
    tws = [torch.rand(m, topk, device=DEV) for _ in range(n_sets)]
    return xs, ids, tws


def moe_bf16_us(xs, ids, b13, b2, inter, timer=graph_us):
    """The bf16 baseline of a MoE layer: µs per input set of cuBLAS GEMMs of the active experts
    only (x rows pre-gathered, no routing work), and the mean number of active experts."""
    calls = []
    for i in range(len(xs)):
        for ex in torch.unique(ids[i]).tolist():
            tok = (ids[i] == ex).any(1).nonzero().flatten()
            xe = xs[i][tok].contiguous()
            act = torch.randn(len(tok), inter, device=DEV, dtype=torch.bfloat16)
            calls.append(lambda xe=xe, ex=ex: torch.matmul(xe, b13[ex].t()))
            calls.append(lambda a=act, ex=ex: torch.matmul(a, b2[ex].t()))
    us = timer(calls) * len(calls) / len(xs)
    return us, sum(len(torch.unique(t)) for t in ids) / len(xs)


def check_correctness() -> bool:
    """The automatic GEMM and MoE paths against their torch references on real quantized
    weights (the packed GEMV at 1-2 tokens, the ``mma.sync`` kernel at 2-16, the MMA kernel
    above; the MoE's gemv and sorted paths); True when every relative error is in bounds."""
    torch.manual_seed(0)
    ok = True
    for n, k in ((1024, 7168), (7168, 512), (96, 272)):
        q = quantize_nvfp4(torch.randn(n, k, device=DEV) * 0.02)
        args = (q.weight, q.weight_scale, q.weight_scale_2)
        for m in (1, 2, 4, 16, 64, 200):
            x = torch.randn(m, k, device=DEV, dtype=torch.bfloat16)
            ref = nvfp4_gemm_ref(x, *args, torch.float32)
            err = rel_err(nvfp4_gemm(x, *args, out_dtype=torch.float32), ref)
            ok &= err < 8e-3  # the packed GEMV's fp16 block sums at 1-2 tokens: ~1e-3
            print(f"check gemm {n}x{k} m={m}: rel err {err:.2e} {'ok' if err < 8e-3 else 'FAIL'}")
    e, k, inter = 16, 7168, 512
    w13 = stack_nvfp4([quantize_nvfp4(torch.randn(2 * inter, k, device=DEV) * 0.02)
                       for _ in range(e)])
    w2 = stack_nvfp4([quantize_nvfp4(torch.randn(k, inter, device=DEV) * 0.02) for _ in range(e)])
    for m in (1, 5, 64):
        x = torch.randn(m, k, device=DEV, dtype=torch.bfloat16)
        ids = torch.rand(m, e, device=DEV).topk(8).indices
        tw = torch.rand(m, 8, device=DEV)
        err = rel_err(fused_moe_nvfp4(x, ids, tw, w13, w2), fused_moe_ref(x, ids, tw, w13, w2))
        ok &= err < 2e-2
        print(f"check moe m={m}: rel err {err:.2e} {'ok' if err < 2e-2 else 'FAIL'}")
    return ok


def auto_name(x, sets) -> str:
    """The variant ``nvfp4_gemm`` runs without a config for ``x`` on the weights ``sets[0]``."""
    cfg = cuda_auto_config(x, *sets[0], x.dtype) or auto_config(x.shape[0], sets[0][0].shape[0],
                                                                  x.shape[1])
    return variant_name(cfg)


def weight_sets(n, k):
    """NVFP4 and bf16 ``[n, k]`` weight sets, each rotation >= ``ROTATE`` bytes (past the L2)."""
    nq = max(2, int(ROTATE // (n * k * 0.5625)) + 1)
    nb = max(2, int(ROTATE // (n * k * 2)) + 1)
    return rand_nvfp4(n, k, nq), [torch.randn(n, k, device=DEV, dtype=torch.bfloat16)
                                  for _ in range(nb)]


def bench_dense(ok=True, quick=False):
    """Per shape and M: ours (the automatic config), cuBLAS bf16 and dequantize-then-matmul.
    ``ok``: the result of ``check_correctness`` (recorded with the rows)."""
    rows = []
    for name, (n, k) in SHAPES.items():
        sets, wbf = weight_sets(n, k)
        for m in MS[:2] if quick else MS:
            x = torch.randn(m, k, device=DEV, dtype=torch.bfloat16)
            t0 = time.time()
            ours = graph_us([lambda a=a, x=x: nvfp4_gemm(x, *a) for a in sets])
            bf16 = graph_us([lambda w=w, x=x: torch.matmul(x, w.t()) for w in wbf])
            dq = graph_us([lambda a=a, x=x: torch.matmul(x, dequantize_nvfp4(
                *a, dtype=torch.bfloat16).t()) for a in sets[:len(wbf)]])
            gbs = n * k * 0.5625 / (ours * 1e-6) / 1e9
            rows.append(dict(shape=name, n=n, k=k, m=m, ours_us=round(ours, 2),
                             bf16_us=round(bf16, 2), dq_mm_us=round(dq, 1),
                             speedup_vs_bf16=round(bf16 / ours, 2),
                             speedup_vs_dq_mm=round(dq / ours, 1), ours_GBps=round(gbs),
                             config=auto_name(x, sets), checked=ok))
            print(rows[-1], f"({time.time() - t0:.0f} s)")
        del sets, wbf
    return rows


def bench_moe(ok=True, quick=False):
    """The fused MoE (automatic path) against the bf16 GEMMs of the active experts."""
    e, k, inter, topk = 256, 7168, 512, 8
    w13, w2, b13, b2 = moe_weights(e, k, inter)
    rows = []
    for m in MS[:2] if quick else MS:
        xs, ids, tws = moe_inputs(m, k, e, topk, n_sets=8)
        ours = graph_us([lambda x=x, t=t, w=w: fused_moe_nvfp4(x, t, w, w13, w2)
                         for x, t, w in zip(xs, ids, tws)])
        align = graph_us([lambda t=t: moe_align(t, e, 16) for t in ids])
        bf16, active = moe_bf16_us(xs, ids, b13, b2, inter)
        rows.append(dict(shape="moe_256e_top8_tp4", m=m, active_experts=round(active, 1),
                         ours_us=round(ours, 2), align_us=round(align, 2),
                         bf16_gemms_us=round(bf16, 2), speedup_vs_bf16=round(bf16 / ours, 2),
                         ours_GBps=round(active * 3 * inter * k * 0.5625 / ours / 1e3),
                         checked=ok))
        print(rows[-1])
    return rows


def pdl_on_off(calls) -> tuple[float, float]:
    """Graph µs per call of ``calls`` with PDL on (as the model runs) and off (switch restored)."""
    keep = options.PDL
    try:
        options.PDL = True
        on = graph_us(calls)
        options.PDL = False
        return on, graph_us(calls)
    finally:
        options.PDL = keep


def bench_pinned(ms=(1, 2, 4, 8, 16), moe_ms=(1, 2, 4)):
    """What the model runs (``nvfp4_gemm``'s automatic config, the MoE's automatic path), with
    and without PDL, against cuBLAS bf16 in the same run. No tuning: seconds per row."""
    rows = []
    for name, (n, k) in SHAPES.items():
        sets, wbf = weight_sets(n, k)
        for m in ms:
            x = torch.randn(m, k, device=DEV, dtype=torch.bfloat16)
            on, off = pdl_on_off([lambda a=a, x=x: nvfp4_gemm(x, *a) for a in sets])
            bf16 = graph_us([lambda w=w, x=x: torch.matmul(x, w.t()) for w in wbf])
            rows.append(dict(shape=name, n=n, k=k, m=m, pdl_us=round(on, 2),
                             nopdl_us=round(off, 2), bf16_us=round(bf16, 2),
                             x_bf16_pdl=round(bf16 / on, 2), x_bf16_nopdl=round(bf16 / off, 2),
                             pdl_GBps=round(n * k * 0.5625 / (on * 1e-6) / 1e9)))
            print(rows[-1], flush=True)
        del sets, wbf
    e, k, inter, topk = 256, 7168, 512, 8
    w13, w2, b13, b2 = moe_weights(e, k, inter)
    for m in moe_ms:
        xs, ids, tws = moe_inputs(m, k, e, topk, n_sets=8)
        on, off = pdl_on_off([lambda x=x, t=t, w=w: fused_moe_nvfp4(x, t, w, w13, w2)
                              for x, t, w in zip(xs, ids, tws)])
        bf16, active = moe_bf16_us(xs, ids, b13, b2, inter)
        rows.append(dict(shape="moe_256e_top8_tp4", n=2 * inter, k=k, m=m, pdl_us=round(on, 2),
                         nopdl_us=round(off, 2), bf16_us=round(bf16, 2),
                         x_bf16_pdl=round(bf16 / on, 2), x_bf16_nopdl=round(bf16 / off, 2),
                         pdl_GBps=round(active * 3 * inter * k * 0.5625 / on / 1e3)))
        print(rows[-1], flush=True)
    return rows


def md_table(columns, rows) -> str:
    """A markdown table: ``columns`` is a list of (header, row -> cell) pairs."""
    lines = ["| " + " | ".join(h for h, _ in columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(str(f(r)) for _, f in columns) + " |" for r in rows]
    return "\n".join(lines)


def col(key):
    """A cell taken straight from the row's ``key``."""
    return lambda r: r[key]


def pinned_markdown(rows) -> str:
    return md_table([("shape", col("shape")), ("M", col("m")), ("ours µs (PDL)", col("pdl_us")),
                     ("no PDL µs", col("nopdl_us")), ("cuBLAS bf16 µs", col("bf16_us")),
                     ("x bf16", col("x_bf16_pdl")), ("x bf16 (no PDL)", col("x_bf16_nopdl")),
                     ("GB/s", col("pdl_GBps"))], rows)


NK = ("N x K", lambda r: f"{r['n']} x {r['k']}")


NK = ("N x K", lambda r: f"{r['n']} x {r['k']}")


def to_markdown(dense, moe) -> str:
    return md_table([("shape", col("shape")), NK, ("M", col("m")), ("ours µs", col("ours_us")),
                     ("cuBLAS bf16 µs", col("bf16_us")), ("dequant+mm µs", col("dq_mm_us")),
                     ("x bf16", col("speedup_vs_bf16")), ("x dq+mm", col("speedup_vs_dq_mm")),
                     ("ours GB/s", col("ours_GBps")), ("config", col("config"))], dense) + \
        "\n\n" + md_table([("MoE", col("shape")), ("M", col("m")),
                            ("active experts", col("active_experts")), ("ours µs", col("ours_us")),
                            ("align µs", col("align_us")), ("bf16 GEMMs µs", col("bf16_gemms_us")),
                            ("x bf16", col("speedup_vs_bf16")), ("ours GB/s", col("ours_GBps"))],
                           moe)


def main() -> None:
    if not torch.cuda.is_available():
        sys.exit("bench_nvfp4 needs a CUDA GPU")
    quick = "--quick" in sys.argv
    print(torch.cuda.get_device_name(), "torch", torch.__version__, "triton", triton.__version__)
    if "--floors" in sys.argv or "--moe-pdl" in sys.argv:  # the floor probes' own script
        import bench_floors

        bench_floors.main(["--moe-pdl"] if "--moe-pdl" in sys.argv else [])
        return
    if "--pinned" in sys.argv:
        rows = bench_pinned()
        md = pinned_markdown(rows)
        print(md)
        save_results("bench_nvfp4_pinned", md, torch=torch.__version__,
                     triton=triton.__version__, rows=rows)
        return
    t0 = time.time()
    ok = check_correctness()
    print(f"checks {'passed' if ok else 'FAILED'} in {time.time() - t0:.0f} s")
    dense = bench_dense(ok, quick)
    moe = bench_moe(ok, quick)
    md = to_markdown(dense, moe)
    print(md)
    save_results("bench_nvfp4", md, torch=torch.__version__, triton=triton.__version__,
                 checks=ok, dense=dense, moe=moe)


if __name__ == "__main__":
    main()
