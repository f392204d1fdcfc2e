"""The split-KV combine alone: fp32 vs bf16 partials, program shapes, per call in a CUDA graph.

    python benchmarks/sweep_combine.py [--shapes 16x512,4x1024,2x4096,64x128]

Why: the wgmma kernels' split partials are fp32 or bf16 (``mla_decode_wgmma.PART_BF16``),
and bf16 partials, half the bytes, measured *slower* in several places (512 rows at batch 1 ctx
4k: ~22 µs to combine; bs 32 ctx 4k at 32 rows: +4.6 µs; docs/bench_mla.md v11 / v12). This times
``mla_decode_combine._combine_kernel`` on its own for each ``SxROWS`` shape (S splits of ROWS
rows of 512 dims), both partial dtypes, the program shape ``combine_splits`` picks and a grid of
others (columns per program, warps), each per call in one replayed graph that rotates partial
sets past the L2, PDL on, checked against ``combine_splits_ref`` first. Prints the bytes each
call moves and the rate, then a table last. GPU only.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import triton

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench_mla import graph_time  # noqa: E402

from mla_spec.kernels import mla_decode_combine as mc  # noqa: E402
from mla_spec.kernels.launch.pdl import pdl_kwargs  # noqa: E402

DV = 512
BLOCKS = (128, 256, 512)
WARPS = (2, 4, 8)


def launch(part, plse, out, block_d: int, warps: int) -> None:
    """``combine_splits`` with the program shape given (no LSE output)."""
    s, rows, dv = part.shape
    s_block = max(2, triton.next_power_of_2(s)) if s <= 128 else 64
    mc._combine_kernel[(rows, triton.cdiv(dv, block_d))](
        part, plse, out, plse, s, out.shape[1], part.stride(0), plse.stride(0), out.stride(0),
        out.stride(1), DV=dv, BLOCK_D=block_d, S_BLOCK=s_block, WRITE_LSE=False,
        ONE_BLOCK=s <= s_block, num_warps=warps, **pdl_kwargs(part))


def shape_rows(s: int, rows: int, dev) -> list[dict]:
    h = min(rows, 128)
    out = torch.empty(rows // h, h, DV, dtype=torch.bfloat16, device=dev)
    res = []
    for dt in (torch.float32, torch.bfloat16):
        nbytes = s * rows * DV * (4 if dt == torch.float32 else 2)
        sets = max(2, min(16, -(-200_000_000 // nbytes)))
        parts = [(torch.randn(s, rows, DV, device=dev).to(dt),
                  torch.randn(s, rows, device=dev) * 4) for _ in range(sets)]
        parts[0][1][0, :] = float("-inf")  # an empty split among them
        want = torch.empty_like(out)
        mc.combine_splits_ref(*parts[0], want)
        moved = nbytes + s * rows * 4 + rows * DV * 2
        configs = [("default", None, None)] + [(f"d{b} w{w}", b, w) for b in BLOCKS
                                                for w in WARPS if b <= DV]
        for name, b, w in configs:
            def call(p, b=b, w=w):
                if b is None:
                    return lambda: mc.combine_splits(p[0], p[1], out)
                return lambda: launch(p[0], p[1], out, b, w)

            call(parts[0])()
            torch.cuda.synchronize()
            err = float((out.float() - want.float()).abs().max() / want.float().abs().max())
            if err > 1e-2:
                print(f"  {s}x{rows} {dt} {name}: error {err:.3g}, skipped", flush=True)
                continue
            us = graph_time([call(p) for p in parts])
            res.append({"shape": f"{s}x{rows}", "partials": str(dt).split(".")[-1],
                        "config": name, "us": us, "GBps": moved / us / 1e3})
        del parts
        torch.cuda.empty_cache()
    return res


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shapes", default="16x512,4x1024,2x4096,64x128",
                    help="SPLITSxROWS,... (rows of 512 dims)")
    ap.add_argument("--all", action="store_true", help="every config in the table, not the best")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("sweep_combine: needs a CUDA GPU")
        return
    dev = torch.device("cuda")
    rows, every = [], []
    for item in args.shapes.split(","):
        s, r = (int(v) for v in item.split("x"))
        got = shape_rows(s, r, dev)
        every += got
        for dt in ("float32", "bfloat16"):
            mine = [g for g in got if g["partials"] == dt]
            if mine:
                best = min(mine, key=lambda g: g["us"])
                dflt = next(g for g in mine if g["config"] == "default")
                print(f"{item} {dt}: default {dflt['us']:.2f} µs, best {best['config']} "
                      f"{best['us']:.2f} µs ({best['GBps']:.0f} GB/s)", flush=True)
                rows += [dflt, best]
    print("\n| shape (splits x rows) | partials | config | µs | GB/s |\n|---|---|---|---|---|")
    for g in (every if args.all else rows):
        print(f"| {g['shape']} | {g['partials']} | {g['config']} | {g['us']:.2f} | "
              f"{g['GBps']:.0f} |")


if __name__ == "__main__":
    main()
