"""Where batch-1 attention time goes: the split kernel alone, the combine alone, the whole call.

    python benchmarks/bench_mla_breakdown.py [--shapes bf16:32x1:4096,...] [--variants K,W]
        [--splits 16,32,64]

The batch-1 goals (< 10 µs at ctx 4k, >= 2.5 TB/s at 32k, in a CUDA graph) sit far above the
chip's read floor (``bench_floors.py``: 2.3 / 11.3 µs), so the question is which part of the
call costs the rest. Per shape (``kv:HxQ:ctx[:bs]``; batch 1 unless a
fourth field says otherwise), at the default variant and split count (``paged_choice``),
each timed per call inside a replayed CUDA graph that rotates KV copies past the L2:

- ``full``: ``mla_decode_paged`` as the backend calls it;
- ``split``: the same with the combine launch left out (its output is then garbage);
- ``combine``: the combine the call runs (``combine_splits``, or for the wgmma kernels
  ``combine_splits_fast``: the CUDA one where it is the faster) alone on partials of the same
  shape and dtype;
- ``empty2``: two empty PDL launches (what any split + combine pair pays to launch);
- ``fi``: FlashInfer's ``BatchMLAPagedAttentionWrapper`` in the same run (``FI/ours``: its
  time over ours; ``TBps`` / ``TFs``: KV bytes read once and attention FLOPs over ``full``);
- with ``--eager``: the default call and FlashInfer's as plain calls (``do_bench`` median).

``--variants`` adds rows for other ``PAGED_VARIANTS`` (e.g. the mma.sync kernel ``K``) at each
of ``--splits``: full and split-only times, each checked against ``mla_decode_ref`` first
(variants that do not take a shape's cache are skipped).
Prints a table last. GPU only.
"""

from __future__ import annotations

import argparse
import os
import sys
from unittest import mock

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench_mla import DPE, DV, PAGE, SM_SCALE, build, fi_wrapper, graph_time  # noqa: E402
from bench_nvfp4 import md_table  # noqa: E402

from experiments.mla.read_floor import empty_launch  # noqa: E402
from mla_spec.kernels.mla import (  # noqa: E402
    PAGED_VARIANTS,
    combine_splits,
    mla_decode_paged,
    mla_decode_ref,
    paged_choice,
    sm90_mma,
    sm90_wgmma,
    splits_for,
    triton_paged,
    triton_vsplit,
    variant_name,
)
from mla_spec.kernels.mla.choice import cuda_cache_ok  # noqa: E402
from mla_spec.kernels.mla.combine import combine_splits_fast  # noqa: E402
from mla_spec.quant.fp8 import FP8_DTYPE, e4m3_rows_round_trip  # noqa: E402

DEFAULT_SHAPES = ("bf16:32x1:1024,bf16:32x1:4096,bf16:32x1:32768,bf16:32x4:4096,"
                  "fp8:32x1:4096,fp8:32x1:32768")


def parse_shapes(text: str):
    """``kv:HxQ:ctx[:bs],...`` -> [(kv dtype, H, q, ctx, bs)] (bs 1 unless given)."""
    out = []
    for item in text.split(","):
        kv, hq, ctx, *bs = item.split(":")
        h, q = hq.split("x")
        out.append((FP8_DTYPE if kv == "fp8" else torch.bfloat16, int(h), int(q), int(ctx),
                    int(bs[0]) if bs else 1))
    return out


def default_setup(kvd, h, q, ctx, bs, dev):
    """A shape's batch (KV copies rotated past the L2: ``build``) and the backend's default
    config and split count for it: (kv bytes, copies, (pool, r2t, rpis, kv_lens, qn, qp, perm),
    the flat cache, config, splits)."""
    fp8 = kvd == FP8_DTYPE
    kv_bytes = bs * ctx * (DV + DPE) * (1 if fp8 else 2)
    copies = max(2, min(64, -(-250_000_000 // kv_bytes)))
    batch = build(h, q, bs, ctx, kvd, dev, copies)
    flat = batch[0].kv_buffer[0].view(-1, DV + DPE)
    rows = h * q
    cfg, pin = paged_choice(rows, kvd, dev, PAGE, bs, ctx)
    sp = pin or splits_for(cfg, bs, -(-rows // cfg.block_m), ctx, rows,
                           (DV + DPE) * (1 if fp8 else 2), 132, DV)
    return kv_bytes, copies, batch, flat, cfg, sp


def row(kvd, h, q, ctx, bs, dev, variants=(), splits=(), eager=False):
    fp8 = kvd == FP8_DTYPE
    kv_bytes, reps, batch, flat, cfg, sp = default_setup(kvd, h, q, ctx, bs, dev)
    pool, r2t, rpis, kv_lens, qn, qp, perm = batch
    out = torch.empty_like(qn)

    def call(rpi, cfg=cfg, sp=sp):
        return lambda: mla_decode_paged(qn, qp, flat, r2t, rpi, kv_lens, SM_SCALE,
                                        page_size=PAGE, q_len=q, num_splits=sp, config=cfg,
                                        max_kv=ctx, out=out, num_sms=132)

    shape = f"{'fp8' if fp8 else 'bf16'} {h}x{q} {ctx}" + (f" bs{bs}" if bs > 1 else "")
    res = {"shape": shape, "variant": f"{variant_name(cfg) or cfg.tag}/sp{sp}",
           "MB": kv_bytes / 1e6}
    res["full"], res["split"] = _full_and_split([call(r) for r in rpis])
    if sp > 1:
        bf16 = cfg.wgmma or cfg.part_bf16  # the dtype the split kernel writes
        pdt = torch.bfloat16 if bf16 else torch.float32
        parts = [(torch.randn(sp, bs * q * h, DV, device=dev).to(pdt),
                  torch.randn(sp, bs * q * h, device=dev)) for _ in range(4)]
        merge = combine_splits_fast if cfg.wgmma else combine_splits  # what the call runs
        res["combine"] = graph_time([lambda p=p: merge(p[0], p[1], out) for p in parts])
    flag = torch.zeros(1, dtype=torch.int32, device=dev)
    res["empty2"] = graph_time([lambda: (empty_launch(flag), empty_launch(flag))])
    try:
        ws = [fi_wrapper(pool, perm[r * bs:(r + 1) * bs], bs, q, h, ctx, dev, kvd, True)
              for r in range(min(reps, 16))]
        res["fi"] = graph_time([(lambda r=r: r(qn, qp)) for _, r in ws])
    except Exception as e:  # noqa: BLE001
        print(f"   flashinfer FAIL {type(e).__name__}: {str(e)[:200]}", flush=True)
    if eager:  # a plain call each (do_bench: median, L2 flushed between calls)
        from triton.testing import do_bench
        res["eager"] = do_bench(call(rpis[0]), warmup=10, rep=40) * 1e3
        if "fi" in res:
            res["fi_eager"] = do_bench(lambda: ws[0][1](qn, qp), warmup=10, rep=40) * 1e3
    flops = 2.0 * bs * q * h * ctx * (DV + DPE + DV)
    _add_rates(res, kv_bytes, flops)
    print(res, flush=True)
    out_rows = [res]
    ref = (mla_decode_ref(qn, qp, flat, r2t, rpis[0], kv_lens, SM_SCALE, q_len=q).float()
           if variants else None)
    for variant in variants:
        vcfg = PAGED_VARIANTS[variant]
        if vcfg.cuda and not cuda_cache_ok(vcfg, kvd):
            continue
        vref = ref
        if vcfg.e4m3_mma:  # checked against its twin: the queries rounded to e4m3 per row
            qt = e4m3_rows_round_trip(torch.cat([qn, qp], -1))
            vref = mla_decode_ref(qt[..., :DV], qt[..., DV:], flat, r2t, rpis[0], kv_lens,
                                  SM_SCALE, q_len=q).float()
        for vsp in splits:
            r = _variant_row(call, rpis, vcfg, vsp, vref, out)
            if r:
                r.update(shape=shape, variant=f"{variant}/sp{vsp}", MB=kv_bytes / 1e6)
                if "fi" in res:
                    r["fi"] = res["fi"]
                _add_rates(r, kv_bytes, flops)
                print(r, flush=True)
                out_rows.append(r)
    del pool
    torch.cuda.empty_cache()
    return out_rows


def _add_rates(r, kv_bytes, flops):
    """TB/s (KV read once), TFLOP/s and FlashInfer's time over ours, all of ``r["full"]``."""
    r["TBps"] = kv_bytes / r["full"] / 1e6
    r["TFs"] = flops / r["full"] / 1e6
    if "fi" in r:
        r["FI/ours"] = r["fi"] / r["full"]


def _variant_row(call, rpis, vcfg, vsp, ref, out):
    """{full, split} of one extra variant at ``vsp`` splits, or None (printed) when it fails
    or disagrees with ``mla_decode_ref``."""
    tag = f"{variant_name(vcfg) or vcfg.tag}/sp{vsp}"
    try:
        call(rpis[0], vcfg, vsp)()
        err = ((out.float() - ref).abs().max() / ref.abs().max()).item()
        # the e4m3 MMAs round inside each instruction (test_e4m3_mma_kernel_matches_its_twin)
        if not err < (0.06 if vcfg.e4m3_mma else 1e-2):
            print(f"   {tag} WRONG: rel err {err:.3g}", flush=True)
            return None
        full, split = _full_and_split([call(r, vcfg, vsp) for r in rpis])
    except Exception as e:  # noqa: BLE001
        print(f"   {tag} FAIL {type(e).__name__}: {str(e)[:300]}", flush=True)
        return None
    return {"full": full, "split": split}


def _full_and_split(fns):
    """Graph µs of ``fns`` as they are, and with every combine launch left out."""
    full = graph_time(fns)
    noop = lambda *a, **k: None  # noqa: E731
    with mock.patch.object(triton_paged, "combine_splits", noop), \
            mock.patch.object(triton_vsplit, "combine_splits", noop), \
            mock.patch.object(sm90_mma, "combine_splits", noop), \
            mock.patch.object(sm90_wgmma, "combine_splits_fast", noop):
        split = graph_time(fns)
    return full, split


def table(rows) -> str:
    cols = ("shape", "variant", "MB", "full", "split", "combine", "empty2", "fi", "FI/ours",
            "TBps", "TFs")
    if any("eager" in r for r in rows):
        cols += ("eager", "fi_eager")

    def cell(c):  # 2 decimals for times and rates, "-" where a row has none
        return lambda r: f"{r[c]:.2f}" if isinstance(r.get(c), float) else str(r.get(c, "-"))

    return md_table([(c, cell(c)) for c in cols], rows)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shapes", default=DEFAULT_SHAPES)
    ap.add_argument("--variants", default="", help="extra PAGED_VARIANTS names, e.g. K,W")
    ap.add_argument("--splits", default="16,32,64", help="split counts of the extra variants")
    ap.add_argument("--eager", action="store_true",
                    help="also time the default and FlashInfer as plain calls (do_bench)")
    args = ap.parse_args(argv)
    variants = [v for v in args.variants.split(",") if v]
    bad = [v for v in variants if v not in PAGED_VARIANTS]
    if bad:
        raise SystemExit(f"unknown variants {bad}: one of {', '.join(PAGED_VARIANTS)}")
    splits = [int(v) for v in args.splits.split(",") if v]
    if not torch.cuda.is_available():
        print("bench_mla_breakdown: needs a CUDA GPU")
        return
    dev = torch.device("cuda")
    rows = [r for s in parse_shapes(args.shapes)
            for r in row(*s, dev, variants, splits, args.eager)]
    print("\nµs per call in a replayed CUDA graph; TBps = KV bytes / full")
    print(table(rows))
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "mla_breakdown.md"), "w") as f:
            f.write(table(rows) + "\n")


if __name__ == "__main__":
    main()
