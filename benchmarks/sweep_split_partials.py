"""Split count x split-partial dtype (or x cluster merge) for one wgmma variant, interleaved.

    python benchmarks/sweep_split_partials.py [--variant WE2] [--kv fp8|bf16]
        [--shapes 32x1:4096:32,...] [--splits 3,4,5,6,8] [--reps 3] [--cluster]

Why: a wgmma kernel writes its split partials in fp32 or bf16 (half the bytes the split kernel
writes and the combine reads; ``mla_decode_wgmma.PART_BF16``), and which one wins moved with the
combine's program shapes (bf16 was slower at 32 rows until the fourteenth session). This
times every (splits, partial dtype) pair of a shape per call in a replayed CUDA graph
(``bench_mla.graph_time``: KV copies rotated past the L2), the pairs interleaved ``--reps``
times so that clock drift during the run hits all of them alike, and checks each against the
reference (for the e4m3 kernels with the queries rounded as they round them). The dtype is
switched by patching ``PART_BF16`` for the run. ``--cluster`` compares instead the combine
kernel (the variant's partial dtype) with the splits merged inside thread-block clusters where
the variant has that (``WR`` at 2 splits; ``mla_decode_wgmma.CLUSTER_MERGE`` patched). GPU
only; a table last.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench_mla import DPE, DV, PAGE, SM_SCALE, build, graph_time  # noqa: E402

from mla_spec.kernels import mla_decode_wgmma as mw  # noqa: E402
from mla_spec.kernels.mla_decode import mla_decode_ref  # noqa: E402
from mla_spec.kernels.mla_decode_paged import mla_decode_paged  # noqa: E402
from mla_spec.kernels.mla_decode_tiles import PAGED_VARIANTS  # noqa: E402
from mla_spec.quant.fp8 import FP8_DTYPE, e4m3_rows_round_trip  # noqa: E402


def sweep(variant: str, h: int, q: int, ctx: int, bs: int, splits, reps: int, dev,
          kvd=FP8_DTYPE, cluster: bool = False):
    """{(splits, mode): ([µs per run], max error over the reference's max)}; mode: bf16
    partials (False / True), or with ``cluster`` the cluster merge (False / True)."""
    cfg = PAGED_VARIANTS[variant]
    pool, r2t, rpis, kv_lens, qn, qp, _ = build(h, q, bs, ctx, kvd, dev, 4)
    flat = pool.kv_buffer[0].view(-1, DV + DPE)
    out = torch.empty_like(qn)
    qt = e4m3_rows_round_trip(torch.cat([qn, qp], -1)) if cfg.e4m3_mma else None
    tn, tp = (qt[..., :DV], qt[..., DV:]) if qt is not None else (qn, qp)
    ref = mla_decode_ref(tn, tp, flat, r2t, rpis[0], kv_lens, SM_SCALE, q_len=q).float()
    kept, kept_cl = mw.PART_BF16, mw.CLUSTER_MERGE
    key = (cfg.block_m, cfg.e4m3_mma)
    res: dict[tuple[int, bool], tuple[list[float], float]] = {}
    try:
        for _ in range(reps):
            for sp in splits:
                for mode in (False, True):
                    if not cluster:
                        mw.PART_BF16 = kept | {key} if mode else kept - {key}
                    mw.CLUSTER_MERGE = cluster and mode
                    calls = [lambda r=r, sp=sp: mla_decode_paged(
                        qn, qp, flat, r2t, r, kv_lens, SM_SCALE, page_size=PAGE, q_len=q,
                        num_splits=sp, config=cfg, max_kv=ctx, out=out, num_sms=132)
                        for r in rpis]
                    calls[0]()
                    torch.cuda.synchronize()
                    err = float((out.float() - ref).abs().max() / ref.abs().max())
                    times, worst = res.get((sp, mode), ([], 0.0))
                    res[(sp, mode)] = (times + [graph_time(calls)], max(worst, err))
    finally:
        mw.PART_BF16, mw.CLUSTER_MERGE = kept, kept_cl
    del pool
    torch.cuda.empty_cache()
    return res


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--variant", default="WE2")
    ap.add_argument("--kv", default="fp8", choices=("fp8", "bf16"))
    ap.add_argument("--shapes", default="32x1:4096:32,32x1:2048:64", help="HxQ:ctx:bs,...")
    ap.add_argument("--splits", default="3,4,5,6,8")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--cluster", action="store_true",
                    help="the combine kernel vs the cluster merge, instead of fp32 vs bf16")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("sweep_split_partials: needs a CUDA GPU")
        return
    dev = torch.device("cuda")
    splits = [int(s) for s in args.splits.split(",")]
    col = "merge" if args.cluster else "partials"
    lines = [f"| shape | splits | {col} | µs per run | max error |", "|---|---|---|---|---|"]
    for item in args.shapes.split(","):
        hq, ctx, bs = item.split(":")
        h, q = (int(v) for v in hq.split("x"))
        kvd = FP8_DTYPE if args.kv == "fp8" else torch.bfloat16
        for (sp, mode), (times, err) in sweep(args.variant, h, q, int(ctx), int(bs), splits,
                                              args.reps, dev, kvd, args.cluster).items():
            name = (("cluster" if mode else "kernel") if args.cluster else
                    ("bf16" if mode else "fp32"))
            lines.append(f"| {item} | {sp} | {name} | "
                         f"{' / '.join(f'{t:.2f}' for t in times)} | {err:.4f} |")
    print(f"\n{args.variant} on a {args.kv} cache, µs per call in a replayed CUDA graph")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
