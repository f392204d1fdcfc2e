"""The wgmma kernels of another source tree against this one, in the same run, interleaved.

    python benchmarks/ab_csrc.py --base DIR[,DIR2,...] [--shapes bf16:32x1:32768,...] [--reps 3]
    python benchmarks/ab_csrc.py --base-combine triton   # this tree, the Triton combine as base
    python benchmarks/ab_csrc.py --merge   # W merging inside its grid vs the combine kernel
    python benchmarks/ab_csrc.py --early   # the first KV tile before the PDL wait vs after

Why: a change to a header the wgmma kernels share (``csrc/sm90_wgmma.cuh``: a CTA's start, the
query loads, the stores) moves every variant a little, often less than two calls on two
machines differ (v12: ~1-3% between calls). This builds each kernel of
``mla_decode_wgmma._KERNELS`` / ``_CLUSTER_KERNELS`` and of the CUDA combine
(``mla_decode_combine_cuda._KERNELS``) a second time from ``DIR`` (a copy of
``mla_spec/kernels/csrc`` as it was, e.g. ``git archive HEAD mla_spec/kernels/csrc``; several
comma-separated trees are each timed against this one in the same rotation), and per
shape (``kv:HxQ:ctx[:bs]``, at the default variant and split count: ``paged_choice``) times the
default call with the base kernels and with this tree's, per call in a replayed CUDA graph
rotating KV copies past the L2, ``--reps`` times alternately, FlashInfer in the same run as the
peer. Each tree's output is checked against the reference first (the e4m3 kernels against their
twin: queries rounded per row). ``--base-combine triton`` makes the base merge its splits with
the Triton combine (``mla_decode_wgmma.COMBINE_CUDA`` off; with or without ``--base``);
``--merge`` makes this tree's calls merge their splits inside the split grid where they can
(``mla_decode_wgmma.GRID_MERGE`` on) and the base's in a combine kernel; ``--early`` makes
this tree's calls load their first KV tile before the PDL wait (``mla_decode_wgmma.EARLY_KV``:
the graph's calls meet its contract) and the base's after it (without ``--base``, the base
is this tree; ``DIR:early`` makes one base's calls load early too; ``DIR:nocheck`` times a
floor variant whose output is not attention, e.g. a kernel with its math compiled out, without
the check against the reference; options combine: ``DIR:early:nocheck``).
GPU only (sm_90, nvcc); a table last.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench_mla import DV, PAGE, SM_SCALE, fi_wrapper, graph_time  # noqa: E402
from bench_mla_breakdown import default_setup, parse_shapes  # noqa: E402
from bench_nvfp4 import md_table  # noqa: E402

from mla_spec.kernels import mla_decode_combine_cuda as mcc  # noqa: E402
from mla_spec.kernels import mla_decode_wgmma as mw  # noqa: E402
from mla_spec.kernels.launch.cuda_driver import CudaKernel  # noqa: E402
from mla_spec.kernels.mla_decode import mla_decode_ref  # noqa: E402
from mla_spec.kernels.mla_decode_paged import mla_decode_paged  # noqa: E402
from mla_spec.quant.fp8 import FP8_DTYPE, e4m3_rows_round_trip  # noqa: E402

DEFAULT_SHAPES = ("bf16:32x1:32768,bf16:32x1:4096:32,fp8:32x1:4096:32,fp8:32x1:32768,"
                  "bf16:128x1:4096:32,bf16:32x1:1024:128")


def base_name(i: int) -> str:
    """The kernel set name of the i-th ``--base`` tree: "base", "base2", ..."""
    return "base" + (str(i + 1) if i else "")


def kernel_sets(bases: list[Path | None], base_cuda_combine: bool = True,
                new_merge: bool = False, new_early: bool = False,
                base_opts: tuple[set, ...] = ()) -> dict[str, tuple]:
    """{"new" | "base" | "base2" ...: (_KERNELS, _CLUSTER_KERNELS, combine kernels,
    _EARLY_KERNELS, COMBINE_CUDA, GRID_MERGE, EARLY_KV)}: each base tree's kernels built from
    the same file and function names under its folder (None: this tree's); ``base_opts[i]``
    holding "early": base i's calls load their first tile before the PDL wait."""
    def rebuild(ks, base):
        if base is None:
            return dict(ks)
        return {k: CudaKernel(str(base / v.src.name), v.name, arch=v.arch) for k, v in ks.items()}
    sets = {"new": (dict(mw._KERNELS), dict(mw._CLUSTER_KERNELS), dict(mcc._KERNELS),
                    dict(mw._EARLY_KERNELS), mw.COMBINE_CUDA, new_merge or mw.GRID_MERGE,
                    new_early or mw.EARLY_KV)}
    for i, base in enumerate(bases):
        opts = base_opts[i] if i < len(base_opts) else set()
        sets[base_name(i)] = (
            rebuild(mw._KERNELS, base), rebuild(mw._CLUSTER_KERNELS, base),
            rebuild(mcc._KERNELS, base), rebuild(mw._EARLY_KERNELS, base), base_cuda_combine,
            False, "early" in opts)
    return sets


def use(sets, name: str) -> None:
    for table, ks in zip((mw._KERNELS, mw._CLUSTER_KERNELS, mcc._KERNELS, mw._EARLY_KERNELS),
                         sets[name][:4]):
        table.clear()
        table.update(ks)
    mw.COMBINE_CUDA, mw.GRID_MERGE, mw.EARLY_KV = sets[name][4:]


def shape_row(sets, kvd, h, q, ctx, bs, reps, dev, nocheck=frozenset()) -> dict:
    fp8 = kvd == FP8_DTYPE
    kv_bytes, copies, batch, flat, cfg, sp = default_setup(kvd, h, q, ctx, bs, dev)
    pool, r2t, rpis, kv_lens, qn, qp, perm = batch
    out = torch.empty_like(qn)
    calls = [lambda r=r: mla_decode_paged(qn, qp, flat, r2t, r, kv_lens, SM_SCALE,
                                          page_size=PAGE, q_len=q, num_splits=sp, config=cfg,
                                          max_kv=ctx, out=out, num_sms=132) for r in rpis]
    tn, tp = qn, qp
    if cfg.e4m3_mma:
        qt = e4m3_rows_round_trip(torch.cat([qn, qp], -1))
        tn, tp = qt[..., :DV], qt[..., DV:]
    ref = mla_decode_ref(tn, tp, flat, r2t, rpis[0], kv_lens, SM_SCALE, q_len=q).float()
    res = {"shape": f"{'fp8' if fp8 else 'bf16'} {h}x{q} ctx {ctx} bs {bs}",
           "variant": f"{cfg.tag}/sp{sp}"}
    times = {name: [] for name in sets}
    try:
        for name in sets:
            use(sets, name)
            calls[0]()
            err = (out.float() - ref).norm() / ref.norm()
            if name not in nocheck and (not torch.isfinite(err) or err > 0.05):
                raise RuntimeError(f"{name} tree: norm error {err:.3g} at {res['shape']}")
            res[f"err_{name}"] = float(err)
        for _ in range(reps):
            for name in sets:
                use(sets, name)
                times[name].append(graph_time(calls))
    finally:
        use(sets, "new")
    for name, t in times.items():
        res[name] = min(t)
        res[f"{name}_range"] = f"{min(t):.2f}-{max(t):.2f}"
    for name in sets:
        if name != "new":
            res[f"new/{name}"] = res["new"] / res[name]
    try:
        ws = [fi_wrapper(pool, perm[r * bs:(r + 1) * bs], bs, q, h, ctx, dev, kvd, True)
              for r in range(min(copies, 16))]
        res["fi"] = graph_time([(lambda r=r: r(qn, qp)) for _, r in ws])
        res["fi/new"] = res["fi"] / res["new"]
    except Exception as e:  # noqa: BLE001
        print(f"   flashinfer FAIL {type(e).__name__}: {str(e)[:200]}", flush=True)
    res["TBps_new"] = kv_bytes / res["new"] / 1e6
    print(res, flush=True)
    del pool
    torch.cuda.empty_cache()
    return res


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--base", help="the other csrc directories, comma-separated (default: "
                                   "this tree's); DIR:early: that base's calls load their "
                                   "first KV tile before the PDL wait; DIR:nocheck: a floor "
                                   "variant, its output not checked")
    ap.add_argument("--base-combine", choices=("cuda", "triton"), default="cuda",
                    help="the combine the base merges its splits with")
    ap.add_argument("--merge", action="store_true",
                    help="this tree merges its splits inside the grid where it can (the base "
                         "never does)")
    ap.add_argument("--early", action="store_true",
                    help="this tree's calls load their first KV tile before the PDL wait "
                         "(mla_decode_wgmma.EARLY_KV; the base's never do)")
    ap.add_argument("--shapes", default=DEFAULT_SHAPES, help="kv:HxQ:ctx[:bs],...")
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
        print("ab_csrc: needs an sm_90 GPU (the wgmma kernels)")
        return
    entries = [e.split(":") for e in args.base.split(",")] if args.base else [[""]]
    base_opts = tuple(set(e[1:]) for e in entries)
    bases = [Path(e[0]).resolve() if e[0] else None for e in entries]
    unknown = set().union(*base_opts) - {"early", "nocheck"}
    if unknown:
        raise SystemExit(f"ab_csrc: unknown base option(s) {sorted(unknown)} "
                         "(DIR[:early][:nocheck])")
    for base in bases:
        if base is not None and not (base / "sm90_wgmma.cuh").is_file():
            raise SystemExit(f"ab_csrc: {base} has no sm90_wgmma.cuh (a copy of the csrc folder)")
    dev = torch.device("cuda")
    sets = kernel_sets(bases, args.base_combine == "cuda", args.merge, args.early, base_opts)
    nocheck = frozenset(base_name(i) for i, o in enumerate(base_opts) if "nocheck" in o)
    rows = [shape_row(sets, *s, args.reps, dev, nocheck) for s in parse_shapes(args.shapes)]
    def cell(key):
        def f(r):
            v = r.get(key, "-")
            return f"{v:.3f}" if isinstance(v, float) else v
        return f
    names = [n for n in sets if n != "new"]
    keys = (["shape", "variant"] + [f"{n}_range" for n in names] + ["new_range"]
            + [f"new/{n}" for n in names] + ["fi", "fi/new", "TBps_new"]
            + [f"err_{n}" for n in names] + ["err_new"])
    cols = [(k, cell(k)) for k in keys]
    print(f"\nµs per call in a CUDA graph (min of {args.reps} alternating runs; base: "
          f"{', '.join(str(b or 'this tree') for b in bases)}, {args.base_combine} combine"
          f"{'; new: the merge inside the grid' if args.merge else ''}"
          f"{'; new: early KV loads' if args.early else ''})")
    print(md_table(cols, rows))


if __name__ == "__main__":
    main()
