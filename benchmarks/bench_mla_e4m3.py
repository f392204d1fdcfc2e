"""``WE`` / ``WE2`` (e4m3 Q K MMAs, V fed to wgmma from registers; ``WE2``'s warpgroups take
turns on whole tiles) against ``W`` on the same FP8 cache,
and FlashInfer's MLA on a bf16 and on an FP8 cache, at the 32-row shapes (DECODE at TP 4).

    python benchmarks/bench_mla_e4m3.py [--shapes 32x1:8192:128,32x1:4096:32,...]

Issue 4 asks an FP8 cache for >= 1.5x FlashInfer's bf16 where the call is memory-bound; this
prints the ratio against both of FlashInfer's paths measured in the same run. Times are µs per
call in a replayed CUDA graph that rotates KV copies past the L2 (``bench_mla.graph_time``),
every kernel at the split count the backend picks for the default. Accuracy, per row of the table:
``err_twin`` is the max-abs error over the output's max against ``mla_decode_ref`` with the
queries as the kernel multiplies them (``quant.fp8.e4m3_rows_round_trip`` for ``WE``: what is
left is the kernel's own arithmetic), ``err_ref`` the same against the plain bf16 queries (what
a user sees: the queries' e4m3 rounding included), ``err_twin_q/8`` ``err_twin`` with the
queries scaled by 1/8 (small logits; the same e4m3 codes), ``rms_twin`` the norm of the error
against the twin over the twin's. GPU only; prints a table last.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench_mla import DPE, DV, PAGE, SM_SCALE, build, fi_wrapper, graph_time  # noqa: E402
from bench_nvfp4 import md_table  # noqa: E402

from mla_spec.kernels.mla_decode import mla_decode_ref  # noqa: E402
from mla_spec.kernels.mla_decode_paged import mla_decode_paged  # noqa: E402
from mla_spec.kernels.mla_decode_tiles import PAGED_VARIANTS, paged_choice, splits_for  # noqa: E402
from mla_spec.quant.fp8 import FP8_DTYPE, e4m3_rows_round_trip  # noqa: E402

SHAPES = "32x1:8192:128,32x1:4096:32,32x1:32768:64,32x1:1024:128,32x1:32768:1"


def _errors(out, qn, qp, flat, r2t, rpi, kv_lens, q, twin: bool):
    """(max-abs error against the twin, the same against plain queries, the twin's
    norm-relative error), each over the reference's max-abs or norm."""
    ref = mla_decode_ref(qn, qp, flat, r2t, rpi, kv_lens, SM_SCALE, q_len=q).float()
    scale = ref.abs().max()
    err_ref = float((out.float() - ref).abs().max() / scale)
    tw = ref
    if twin:
        qt = e4m3_rows_round_trip(torch.cat([qn, qp], -1))
        tw = mla_decode_ref(qt[..., :DV], qt[..., DV:], flat, r2t, rpi, kv_lens, SM_SCALE,
                            q_len=q).float()
    d = out.float() - tw
    return float(d.abs().max() / scale), err_ref, float(d.norm() / tw.norm())


def shape_rows(h, q, ctx, bs, dev):
    rows_per = h * q
    kv_bytes = bs * ctx * (DV + DPE)
    reps = max(2, min(64, -(-250_000_000 // kv_bytes)))
    fi = {}
    for kvd in (torch.bfloat16, FP8_DTYPE):  # FlashInfer's two paths, each on its own pool
        pool, _, _, _, qn, qp, perm = build(h, q, bs, ctx, kvd, dev, min(reps, 16))
        ws = [fi_wrapper(pool, perm[r * bs:(r + 1) * bs], bs, q, h, ctx, dev, kvd, True)
              for r in range(min(reps, 16))]
        fi[kvd] = graph_time([(lambda r=r, a=qn, b=qp: r(a, b)) for _, r in ws])
        del ws, pool
        torch.cuda.empty_cache()
    pool, r2t, rpis, kv_lens, qn, qp, _ = build(h, q, bs, ctx, FP8_DTYPE, dev, reps)
    flat = pool.kv_buffer[0].view(-1, DV + DPE)
    cfg_w, pin = paged_choice(rows_per, FP8_DTYPE, dev, PAGE, bs, ctx)
    sp = pin or splits_for(cfg_w, bs, 1, ctx, rows_per, DV + DPE, 132, DV)
    out = torch.empty_like(qn)
    shape = f"{h}x{q} ctx {ctx} bs {bs}"
    rows = []
    for name, cfg in (("default " + cfg_w.tag, cfg_w), ("W", PAGED_VARIANTS["W"]),
                      ("WE", PAGED_VARIANTS["WE"]), ("WE2", PAGED_VARIANTS["WE2"]),
                      ("WE8", PAGED_VARIANTS["WE8"])):
        kern = cfg.e4m3_mma  # checked against the e4m3-query twin
        def call(rpi, cfg=cfg):
            return lambda: mla_decode_paged(qn, qp, flat, r2t, rpi, kv_lens, SM_SCALE,
                                            page_size=PAGE, q_len=q, num_splits=sp, config=cfg,
                                            max_kv=ctx, out=out, num_sms=132)

        try:
            call(rpis[0])()
            torch.cuda.synchronize()
            e_twin, e_ref, e_rms = _errors(out, qn, qp, flat, r2t, rpis[0], kv_lens, q, kern)
            qs = (qn * 0.125, qp * 0.125)  # small logits: what is left of err_twin
            mla_decode_paged(*qs, flat, r2t, rpis[0], kv_lens, SM_SCALE, page_size=PAGE,
                             q_len=q, num_splits=sp, config=cfg, max_kv=ctx, out=out)
            e_small, _, _ = _errors(out, *qs, flat, r2t, rpis[0], kv_lens, q, kern)
            us = graph_time([call(r) for r in rpis])
        except Exception as e:  # noqa: BLE001
            print(f"   {shape} {name} FAIL {type(e).__name__}: {str(e)[:300]}", flush=True)
            continue
        r = {"shape": shape, "kernel": f"{name}/sp{sp}", "us": us, "fi_fp8": fi[FP8_DTYPE],
             "fi_bf16": fi[torch.bfloat16], "x_fi_fp8": fi[FP8_DTYPE] / us,
             "x_fi_bf16": fi[torch.bfloat16] / us, "TBps": kv_bytes / us / 1e6,
             "err_twin": e_twin, "err_ref": e_ref, "err_twin_q/8": e_small, "rms_twin": e_rms}
        print(r, flush=True)
        rows.append(r)
    del pool
    torch.cuda.empty_cache()
    return rows


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shapes", default=SHAPES, help="HxQ:ctx:bs,...")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_mla_e4m3: needs a CUDA GPU")
        return
    dev = torch.device("cuda")
    rows = []
    for item in args.shapes.split(","):
        hq, ctx, bs = item.split(":")
        h, q = (int(v) for v in hq.split("x"))
        rows += shape_rows(h, q, int(ctx), int(bs), dev)

    def cell(c, fmt):
        return lambda r: fmt.format(r[c]) if isinstance(r.get(c), float) else str(r.get(c, "-"))

    cols = [("shape", cell("shape", "{}")), ("kernel", cell("kernel", "{}"))]
    cols += [(c, cell(c, "{:.2f}")) for c in ("us", "fi_fp8", "fi_bf16", "x_fi_fp8",
                                                "x_fi_bf16", "TBps")]
    cols += [(c, cell(c, "{:.4f}")) for c in ("err_twin", "err_ref", "err_twin_q/8", "rms_twin")]
    print("\nµs per call in a replayed CUDA graph; x_fi_*: FlashInfer's time over ours")
    print(md_table(cols, rows))


if __name__ == "__main__":
    main()
