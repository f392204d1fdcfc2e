"""One attention call's two kernels on the global timer: the split kernel ``W`` and the combine.

    python benchmarks/bench_call_timeline.py [--ctx 32768] [--bs 1] [--splits 128]
        [--triton-combine | --merge] [--csrc DIR]

Why: at batch 1 ctx 32k (issue 4's last open goal: >= 2.5 TB/s, 15.1 µs) a call is the split
kernel plus the combine, and ``bench_mla_breakdown.py`` times the combine alone at ~3 µs
while the split kernel's CTAs wait ~4.4 µs for it (``bench_cta_phases.py``: entry to PDL
release). This runs the stamped copy of ``W`` (``bench_cta_phases``) and a copy of the combine
kernel with ``%globaltimer`` reads around ``mla_decode_combine.combine_program`` (entry,
after the PDL wait, done) in the same replayed CUDA graph as the benchmarks, and prints for
the last call: when each kernel's programs entered, were released by the PDL wait and ended
(min / median / max over programs), all relative to the split kernel's first entry, and the
next call's split kernel's (the period is the graph's µs per call). ``--merge``: ``W`` merges
its splits inside its grid (``mla_decode_wgmma.GRID_MERGE``, ``csrc/sm90_grid_merge.cuh``) and
the merge's steps are stamped too (stores done, arrived, barrier open, loads in; docs/bench_mla.md
v17). The rows ``split last tile: ...`` break the last tile's compute into its steps (Q K
done, the warpgroups' S halves added, P^T stored after the softmax, P V done; stamped by
thread 0, so after the barriers that follow each step; v18). The global timer advances in
0.256 µs steps on the H200. ``--csrc DIR`` stamps ``W`` from a copy of the sources (a
variant tree, e.g. one that prefetches into L2 before the PDL wait) instead of this tree's.
GPU only (sm_90, nvcc).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import bench_cta_phases as cta  # noqa: E402

from mla_spec.kernels import mla_decode_combine as mc  # noqa: E402
from mla_spec.kernels import mla_decode_wgmma as mw  # noqa: E402
from mla_spec.kernels.launch.cuda_driver import CSRC, CudaKernel  # noqa: E402
from mla_spec.kernels.launch.pdl import gdc_enter  # noqa: E402


@triton.jit
def _gtime(x):
    return tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l,r", [x], dtype=tl.int64,
                                     is_pure=False, pack=1)


@triton.jit(do_not_specialize=["num_splits", "H", "stride_ls"])
def _stamped_combine(Part, PLse, Out, Lse, num_splits, H, stride_ps, stride_ls,
                     stride_o_t, stride_o_h, Stamps,
                     DV: tl.constexpr, BLOCK_D: tl.constexpr, S_BLOCK: tl.constexpr,
                     WRITE_LSE: tl.constexpr, ONE_BLOCK: tl.constexpr, USE_GDC: tl.constexpr):
    pid = tl.program_id(0) * tl.num_programs(1) + tl.program_id(1)
    t0 = _gtime(pid)
    gdc_enter(USE_GDC)
    t1 = _gtime(pid)
    mc.combine_program(Part, PLse, Out, Lse, num_splits, H, stride_ps, stride_ls, stride_o_t,
                       stride_o_h, DV, BLOCK_D, S_BLOCK, WRITE_LSE, ONE_BLOCK)
    tl.debug_barrier()
    t2 = _gtime(pid)
    tl.store(Stamps + pid * 3, t0)
    tl.store(Stamps + pid * 3 + 1, t1)
    tl.store(Stamps + pid * 3 + 2, t2)


class _StampedLaunch:
    """Stands in for ``mla_decode_combine._combine_kernel``: ``[grid](*args, **kw)`` launches
    the stamped copy with the stamp buffer after the kernel's own arguments."""

    def __init__(self, stamps: torch.Tensor):
        self.stamps = stamps

    def __getitem__(self, grid):
        return lambda *args, **kw: _stamped_combine[grid](*args, self.stamps, **kw)


def _row(name: str, t: torch.Tensor) -> str:
    t = t[~torch.isnan(t)]
    if not len(t):  # e.g. tile3 when a CTA streams fewer than four tiles
        return f"| {name} | - | - | - |"
    return f"| {name} | {t.min():.2f} | {t.median():.2f} | {t.max():.2f} |"


def _stamp_words(raw: torch.Tensor, word0: int, t0: float) -> torch.Tensor:
    """The four stamp words from ``word0`` of every CTA, µs after ``t0`` (NaN: not stamped)."""
    w = raw[:, word0:word0 + 4].double()
    w[w == 0] = float("nan")
    return (w - t0) / 1e3


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ctx", type=int, default=32768)
    ap.add_argument("--bs", type=int, default=1)
    ap.add_argument("--splits", type=int, default=128)
    ap.add_argument("--merge", action="store_true",
                    help="W merges its splits inside its grid (mla_decode_wgmma.GRID_MERGE), "
                         "stamping the merge's steps")
    ap.add_argument("--triton-combine", action="store_true",
                    help="merge with the Triton combine and stamp it too (default: the CUDA "
                         "combine, not stamped)")
    ap.add_argument("--csrc", help="stamp W from this copy of the csrc folder (default: this "
                                   "tree's)")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
        print("bench_call_timeline: needs an sm_90 GPU (the wgmma kernels)")
        return
    dev = torch.device("cuda")
    stamps = torch.zeros(1 << 16, 3, dtype=torch.int64, device=dev)
    real = mc._combine_kernel
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "W_stamped.cu"
        path.write_text(cta.stamped_source("W", Path(args.csrc).resolve() if args.csrc else CSRC))
        kernel = CudaKernel(str(path), cta.SPECS["W"]["name"], arch="sm_90a")
        keep = mw.COMBINE_CUDA, mw.GRID_MERGE
        try:
            mc._combine_kernel = _StampedLaunch(stamps)
            mw.COMBINE_CUDA = not args.triton_combine
            mw.GRID_MERGE = args.merge
            merged = mw.grid_merges(mw.WgmmaKind().key(torch.bfloat16), args.splits,
                                    args.splits * args.bs, 32, dev)
            us, us_st, rel, _, raw = cta.phases("W", kernel, args.ctx, args.bs, args.splits, dev,
                                            raw=True)
        finally:
            mc._combine_kernel, (mw.COMBINE_CUDA, mw.GRID_MERGE) = real, keep
    cs = stamps.cpu()
    cs = cs[cs[:, 0] != 0].double()
    t0 = float(raw[:, 0].min())
    c = (cs - t0) / 1e3
    names = cta.SPECS["W"]["phases"]
    comb = "Triton combine (stamped)" if args.triton_combine else "CUDA combine"
    if merged:
        comb = "the merge inside its grid (split merged)"
    src = f" from {args.csrc}" if args.csrc else ""
    print(f"\nW{src} + {comb}, H 32 q 1 bf16, bs {args.bs}, ctx {args.ctx}, {args.splits} splits: "
          f"{us_st:.2f} µs per call in a graph, W stamped ({us:.2f} unstamped); µs after the "
          "split kernel's first entry, the last call of the graph")
    print("| event | min | median | max |\n|---|---|---|---|")
    for ev in ("entry", "begun", "prod0", "tile0", "tile1", "tile2", "tile3", "loopend", "end",
               "merged"):
        print(_row(f"split {ev}", rel[:, names.index(ev)]))
    lt = _stamp_words(raw, cta.LT_WORD0, t0)
    for i, ev in enumerate(cta.LAST_TILE_STEPS):
        print(_row(f"split last tile: {ev}", lt[:, i]))
    gm = _stamp_words(raw, cta.GM_WORD0, t0)
    # the last CTA to arrive does not stamp "arrived": its word is an earlier replay's
    gm[:, 1][gm[:, 1] < gm[:, 0]] = float("nan")
    for i, ev in enumerate(("stores done", "arrived (not last)", "barrier open", "loads in")):
        if not torch.isnan(gm[:, i]).all():
            print(_row(f"merge: {ev}", gm[:, i]))
    if len(c):
        for i, ev in enumerate(("entry", "released (PDL wait)", "done")):
            print(_row(f"combine {ev}", c[:, i]))
    print(f"| next call's split entry (one period on) | {us_st:.2f} | | |")


if __name__ == "__main__":
    main()
