"""MoE router at decode sizes: router logits and top-k, ours against torch / cuBLAS (H200).

    python benchmarks/bench_router.py [--tokens 1,2,4]

DeepSeek-V3's router per MoE layer: ``logits = x.float() @ gate.weight^T`` (fp32 weight
``[256, 7168]``, 7.3 MB), sigmoid grouped top-8 (``mla_spec.kernels.ops.router``) and, on the
fused NVFP4 path, the shared-expert column and int32 ids. Timed per call in one replayed CUDA
graph whose calls rotate over 12 weight copies (88 MB, past the 60 MB L2):

- ``logits``: torch (a cast kernel + cuBLAS fp32 GEMV) vs ``gate_logits`` at every candidate
  ``GateConfig`` (checked against the twin first); the best one is printed as the suggested
  ``GATE_CONFIGS`` row;
- ``route``: ``fused_route`` alone at 1, 2, 4, 8 warps (``ROUTE_WARPS``);
- ``router``: the torch chain (torch logits, ``fused_route``, two ``torch.cat`` for the shared
  column, an int64 -> int32 copy) vs the model's (``gate_logits``, ``fused_route`` writing the
  shared column and int32 ids).

Prints a table last (µs, GB/s of the weight, ratio); writes ``bench_router.json`` to ``$OUT``.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import triton

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)

import bench_nvfp4 as bench  # noqa: E402

from mla_spec.kernels.ops.router import (  # noqa: E402
    GateConfig,
    fused_route,
    gate_config,
    gate_logits,
    gate_logits_ref,
)

E, HID, SETS = 256, 7168, 12
ROUTE = dict(top_k=8, n_group=8, topk_group=4, norm_topk_prob=True, routed_scaling_factor=2.5)
CANDIDATES = [GateConfig(be, bk, w) for be, bk, w in (
    (1, 8192, 8), (1, 8192, 16), (1, 4096, 4), (1, 4096, 8), (1, 2048, 4), (2, 4096, 8),
    (2, 2048, 4), (2, 2048, 8), (4, 2048, 8), (4, 1024, 4), (8, 1024, 8), (2, 1024, 4))]


def _old_router(x, w, bias, sid, scol):
    logits = gate_logits_ref(x, w)
    tw, ids = fused_route(logits, bias, **ROUTE)
    n = ids.shape[0]
    ids = torch.cat((ids, sid.expand(n, 1)), 1)
    tw = torch.cat((tw, scol.expand(n, 1)), 1)
    return tw, ids.to(torch.int32)


def _new_router(x, w, bias):
    return fused_route(gate_logits(x, w), bias, shared_id=E, ids_dtype=torch.int32, **ROUTE)


def bench_tokens(n: int) -> tuple[list[dict], GateConfig]:
    ws = [torch.randn(E, HID, device="cuda") * 0.02 for _ in range(SETS)]
    x = torch.randn(n, HID, device="cuda", dtype=torch.bfloat16)
    bias = torch.randn(E, device="cuda") * 0.01
    ref = gate_logits_ref(x, ws[0])
    rows = []
    mb = E * HID * 4 / 1e6
    torch_us = bench.graph_us([lambda w=w: gate_logits_ref(x, w) for w in ws])
    rows.append(dict(n=n, what="logits", impl="torch (cast + cuBLAS fp32)", us=torch_us))
    best = None
    for cfg in CANDIDATES:
        try:
            err = bench.rel_err(gate_logits(x, ws[0], cfg), ref)
            if err > 1e-5:
                print(f"n {n} {cfg}: rel err {err:.1e}, skipped", flush=True)
                continue
            us = bench.graph_us([lambda w=w, c=cfg: gate_logits(x, w, c) for w in ws])
        except Exception as e:  # a tile Triton refuses (registers, shared memory)
            print(f"n {n} {cfg}: {type(e).__name__}: {str(e)[:100]}", flush=True)
            continue
        print(f"n {n} {cfg}: {us:.2f} us ({mb / us * 1e3:.0f} GB/s)", flush=True)
        if best is None or us < best[0]:
            best = (us, cfg)
    default = gate_config(n, E, HID)
    def_us = bench.graph_us([lambda w=w: gate_logits(x, w) for w in ws])
    rows.append(dict(n=n, what="logits", impl=f"ours default {default}", us=def_us))
    if best is not None:
        rows.append(dict(n=n, what="logits", impl=f"ours best {best[1]}", us=best[0]))
    import mla_spec.kernels.ops.router as mr

    logits = gate_logits_ref(x, ws[0])
    default_warps = mr.ROUTE_WARPS
    for warps in (1, 2, 4, 8):
        mr.ROUTE_WARPS = warps
        us = bench.graph_us([lambda: fused_route(logits, bias, shared_id=E,
                                                 ids_dtype=torch.int32, **ROUTE)] * 8)
        rows.append(dict(n=n, what="route", impl=f"fused_route, {warps} warps"
                         + (" (default)" if warps == default_warps else ""), us=us))
    mr.ROUTE_WARPS = default_warps
    sid = torch.full((1, 1), E, dtype=torch.int64, device="cuda")
    scol = torch.ones((1, 1), device="cuda")
    a, b = _old_router(x, ws[0], bias, sid, scol), _new_router(x, ws[0], bias)
    same = torch.equal(a[1], b[1]) and bench.rel_err(b[0], a[0]) < 1e-5
    old_us = bench.graph_us([lambda w=w: _old_router(x, w, bias, sid, scol) for w in ws])
    new_us = bench.graph_us([lambda w=w: _new_router(x, w, bias) for w in ws])
    rows.append(dict(n=n, what="router", impl="old: torch logits + route + 2 cat + cast",
                     us=old_us))
    rows.append(dict(n=n, what="router", impl=f"new: gate_logits + route (same: {same})",
                     us=new_us))
    for r in rows:
        ref_us = {"logits": torch_us, "router": old_us}.get(r["what"], r["us"])
        r["ratio"] = ref_us / r["us"]
        r["gbps"] = mb / r["us"] * 1e3
    return rows, (best[1] if best else default)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", default="1,2,4")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit("bench_router needs a CUDA GPU")
    print(torch.cuda.get_device_name(), "torch", torch.__version__, "triton", triton.__version__)
    rows, best = [], {}
    for n in (int(t) for t in args.tokens.split(",")):
        r, cfg = bench_tokens(n)
        rows += r
        best[n] = cfg
    print("\nsuggested GATE_CONFIGS = {" + ", ".join(
        f"{n}: GateConfig({c.block_e}, {c.block_k}, {c.num_warps})" for n, c in best.items())
        + "}")
    print("\n" + bench.md_table([
        ("tokens", bench.col("n")), ("piece", bench.col("what")),
        ("implementation", bench.col("impl")), ("µs (graph)", lambda r: f"{r['us']:.2f}"),
        ("weight GB/s", lambda r: f"{r['gbps']:.0f}"),
        ("x torch/old", lambda r: f"{r['ratio']:.2f}")], rows))
    bench.save_results("bench_router", rows=rows)


if __name__ == "__main__":
    main()
