"""Where one real-size DeepSeek-V3 layer spends its time: a per-kernel table (H200).

    python benchmarks/profile_layer.py [--bs 1] [--ctx 1024] [--modes DECODE,TARGET_VERIFY]

``bench_layer.py`` says how long each piece takes inside a CUDA graph; this script says *why*.
It builds the same ``ours`` stack (NVFP4 MLP / experts, BF16 attention projections, Triton MLA
over an FP8 KV cache; TP-4 shard shapes on one GPU) and, for the attention block and the whole
layer:

- times the piece in a replayed CUDA graph (``bench_layer.Timer``, the number bench_layer
  records), with every switchable fused path on, and again with each one turned off
  (``--toggles``), so a fusion's effect on the graph time is measured, not inferred;
- profiles a few eager calls with ``torch.profiler`` (CUDA activity only) and prints each
  kernel's name, calls per forward and GPU µs per forward. The sum of kernel times against the
  graph time gives the launch gaps: ``graph µs - kernel µs``, mostly ~1 µs per kernel on H200.

Prints the tables last; writes ``profile_layer.json`` to ``$OUT`` when set. CPU: refuses (the
profile is of GPU kernels).
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

import bench_layer as bl  # noqa: E402

from mla_spec.config import ModelConfig  # noqa: E402
from mla_spec.forward_mode import ForwardMode  # noqa: E402

#: paths that can be switched at run time: (label, module, attribute, value timed): fused paths
#: turned off, candidate paths (off by default) turned on
TOGGLES = (
    ("bf16_gemv", "mla_spec.kernels.options", "BF16_GEMV", False),
    ("pdl", "mla_spec.kernels.options", "PDL", False),
    ("l2pf", "mla_spec.kernels.options", "L2_PREFETCH", False),
)


def _kernel_table(fn, iters: int) -> tuple[list[dict], float]:
    """Per-kernel GPU µs per call of ``fn`` (eager, ``iters`` calls profiled after a warm-up)."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            fn()
        torch.cuda.synchronize()
    rows = []
    for e in prof.key_averages():
        us = getattr(e, "device_time_total", None)
        if us is None:
            us = getattr(e, "cuda_time_total", 0.0)
        if us <= 0:
            continue
        rows.append(dict(kernel=e.key[:90], calls=e.count / iters, us=us / iters))
    rows.sort(key=lambda r: -r["us"])
    return rows, sum(r["us"] for r in rows)


def _set(mod: str, attr: str, value) -> object:
    m = importlib.import_module(mod)
    old = getattr(m, attr, None)
    if old is not None:
        setattr(m, attr, value)
    return old


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--bs", type=int, default=1)
    p.add_argument("--ctx", type=int, default=1024)
    p.add_argument("--modes", default="DECODE,TARGET_VERIFY")
    p.add_argument("--iters", type=int, default=5, help="profiled eager calls per piece")
    p.add_argument("--rep-ms", type=int, default=40)
    p.add_argument("--no-toggles", action="store_true", help="skip the switched-path timings")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("profile_layer profiles GPU kernels: it needs a CUDA GPU")
    t0 = time.perf_counter()
    dev, dt = torch.device("cuda"), torch.bfloat16
    cfg = ModelConfig(num_hidden_layers=1, rope_scaling=bl.YARN)
    torch.manual_seed(0)
    bargs = bl.parse_args(["--bs", str(args.bs), "--ctx", str(args.ctx)])
    notes: list[str] = []
    timer = bl.Timer(dev, args.rep_ms)
    result: dict = dict(bs=args.bs, ctx=args.ctx, pieces=[], kernels={}, notes=notes)
    lines = []
    with bl._Shims(dev, False), torch.no_grad():
        sides, env = bl._build(bargs, cfg, dev, dt, [args.bs], [args.ctx], notes)
        ours = sides[0]
        for mode_name in args.modes.split(","):
            mode = ForwardMode[mode_name]
            n = args.bs * (1 if mode.is_decode() else bl.NDT)
            x = torch.randn(n, cfg.hidden_size, dtype=dt, device=dev)
            be = ours.backends["target"]
            b = bl.make_batch(mode, args.bs, args.ctx, env["r2t"], ours.pools["target"], be, dev)
            be.plan(b)
            pieces = {"attn": lambda b=b, x=x: ours.layer.self_attn(b.positions, x, b),
                      "layer": lambda b=b, x=x: ours.layer(b.positions, x, b)}
            for part, fn in pieces.items():
                graph_us, graphed = timer(fn, f"{mode_name} {part}")
                kern, kern_us = _kernel_table(fn, args.iters)
                nk = sum(r["calls"] for r in kern)
                row = dict(mode=mode_name, part=part, variant="all fused", graph_us=graph_us,
                           graphed=graphed, kernel_us=kern_us, kernels=nk)
                result["pieces"].append(row)
                result["kernels"][f"{mode_name}/{part}"] = kern
                lines.append(f"\n## {mode_name} {part}: graph {graph_us:.1f} us, kernels "
                             f"{kern_us:.1f} us in {nk:.0f} launches (gaps "
                             f"{graph_us - kern_us:.1f} us)")
                lines.append("| kernel | calls | us | share |")
                lines.append("|---|---|---|---|")
                for r in kern:
                    lines.append(f"| {r['kernel']} | {r['calls']:.0f} | {r['us']:.1f} | "
                                 f"{100 * r['us'] / max(kern_us, 1e-9):.0f}% |")
                if args.no_toggles:
                    continue
                for label, mod, attr, value in TOGGLES:
                    old = _set(mod, attr, value)
                    if old is None or old == value:  # absent, or already the timed value
                        continue
                    try:
                        us, _ = timer(fn, f"{mode_name} {part} {label} {value}")
                        _, k_us = _kernel_table(fn, 1)
                    finally:
                        _set(mod, attr, old)
                    result["pieces"].append(dict(mode=mode_name, part=part,
                                                 variant=f"{label} {'on' if value else 'off'}",
                                                 graph_us=us,
                                                 kernel_us=k_us))
            print(f"[{time.perf_counter() - t0:6.1f} s] {mode_name} done", flush=True)
    notes += timer.notes
    summary = ["| mode | piece | variant | graph us | kernel us | vs all fused |",
               "|---|---|---|---|---|---|"]
    base = {(r["mode"], r["part"]): r["graph_us"] for r in result["pieces"]
            if r["variant"] == "all fused"}
    for r in result["pieces"]:
        ref = base[(r["mode"], r["part"])]
        summary.append(f"| {r['mode']} | {r['part']} | {r['variant']} | {r['graph_us']:.1f} | "
                       f"{r['kernel_us']:.1f} | {r['graph_us'] / ref:.2f}x |")
    text = (f"profile_layer: ours stack, bs {args.bs}, ctx {args.ctx}, "
            f"{torch.cuda.get_device_name(dev)}\n" + "\n".join(lines) + "\n\n"
            + "\n".join(summary))
    print(text)
    for nline in notes:
        print("NOTE:", nline)
    out = os.environ.get("OUT")
    if out:
        Path(out).mkdir(parents=True, exist_ok=True)
        (Path(out) / "profile_layer.json").write_text(json.dumps(result, indent=1))
        (Path(out) / "profile_layer.md").write_text(text + "\n")
    return result


if __name__ == "__main__":
    main()
