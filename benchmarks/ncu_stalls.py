"""Where an attention kernel's warps wait: ``ncu``'s warp-stall samples, per reason and per SASS
instruction.

    python benchmarks/ncu_stalls.py [--variant WR] [--kv bf16|fp8] [--shape 128x1:4096:32]
        [--splits 1] [--kernel mla_wgmma] [--top 25]

Why: the phase stamps of ``bench_cta_phases.py`` say how long a CTA's phases take, not what a
warp is waiting for inside its tile loop. ``ncu`` samples every warp's stall reason at its
program counter; summed per instruction, the top entries name the wait (a wgmma wait, a
named barrier, an mbarrier try-wait loop on a TMA stage) and how much of the kernel's warp time
sits there. In the sixteenth session it showed ``WR``'s warpgroup 0 waiting on the full barrier
of its next tile at every tile (9% of all samples at H 128 bs 32 ctx 4k, one split), which led
to releasing each stage once P V was done (docs/bench_mla.md v14).

The script runs itself under ``ncu --clock-control none`` (``--child``: build one paged batch
of the shape ``HxQ:ctx:bs``, call ``mla_decode_paged`` twice with the variant and split count;
the second launch of the first kernel matching ``--kernel`` is profiled), exports the source
page as CSV and prints the stall reasons' shares, then the ``--top`` instructions by samples
with their two main reasons. Needs a CUDA GPU and ``ncu`` on the PATH.
"""

from __future__ import annotations

import argparse
import csv
import io
import os
import shutil
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

SAMPLES = "Warp Stall Sampling (All Samples)"


def _num(x: str) -> float:
    try:
        return float(x.replace(",", ""))
    except ValueError:
        return 0.0


def stall_table(source_csv: str, top: int = 25) -> tuple[dict[str, float], list[dict]]:
    """Parse ``ncu --page source --csv --print-source sass`` output: (each stall reason's share
    of all samples, sorted; the ``top`` instructions by samples, each {"address", "sass",
    "share", "reasons": [(reason, samples), (reason, samples)]})."""
    rows = list(csv.reader(io.StringIO(source_csv)))
    at = next(i for i, r in enumerate(rows) if "Address" in r and SAMPLES in r)
    hdr, data = rows[at], [r for r in rows[at + 1:] if len(r) == len(rows[at])]
    ia, isrc, iall = hdr.index("Address"), hdr.index("Source"), hdr.index(SAMPLES)
    reasons = {h: i for i, h in enumerate(hdr) if h.startswith("stall_") and "Not Issued" not in h}
    total = sum(_num(r[iall]) for r in data) or 1.0
    shares = {k[len("stall_"):]: sum(_num(r[i]) for r in data) / total
              for k, i in reasons.items()}
    shares = dict(sorted(((k, v) for k, v in shares.items() if v > 0), key=lambda kv: -kv[1]))
    hot = []
    for r in sorted(data, key=lambda r: -_num(r[iall]))[:top]:
        why = sorted(((k[len("stall_"):], _num(r[i])) for k, i in reasons.items()),
                     key=lambda kv: -kv[1])[:2]
        hot.append({"address": r[ia], "sass": " ".join(r[isrc].split()),
                    "share": _num(r[iall]) / total, "reasons": why})
    return shares, hot


def report(shares: dict[str, float], hot: list[dict]) -> str:
    """The tables the script prints."""
    out = ["| stall reason | share of samples |", "|---|---|"]
    out += [f"| {k} | {v * 100:.1f}% |" for k, v in shares.items() if v >= 0.005]
    out += ["", "| share | instruction | main reasons |", "|---|---|---|"]
    out += [f"| {h['share'] * 100:.1f}% | `{h['sass'][:70]}` | "
            f"{', '.join(f'{k} {n:.0f}' for k, n in h['reasons'] if n)} |" for h in hot]
    return "\n".join(out)


def _child(args) -> None:
    import torch
    from bench_mla import DPE, DV, PAGE, SM_SCALE, build

    from mla_spec.kernels.mla_decode_paged import mla_decode_paged
    from mla_spec.kernels.mla_decode_tiles import PAGED_VARIANTS
    from mla_spec.quant.fp8 import FP8_DTYPE

    hq, ctx, bs = args.shape.split(":")
    h, q = (int(v) for v in hq.split("x"))
    kvd = FP8_DTYPE if args.kv == "fp8" else torch.bfloat16
    dev = torch.device("cuda")
    pool, r2t, rpis, kv_lens, qn, qp, _ = build(h, q, int(bs), int(ctx), kvd, dev, 1)
    flat = pool.kv_buffer[0].view(-1, DV + DPE)
    for _ in range(2):
        mla_decode_paged(qn, qp, flat, r2t, rpis[0], kv_lens, SM_SCALE, page_size=PAGE, q_len=q,
                         num_splits=args.splits, config=PAGED_VARIANTS[args.variant],
                         max_kv=int(ctx), num_sms=132)
    torch.cuda.synchronize()


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--variant", default="WR")
    ap.add_argument("--kv", default="bf16", choices=("bf16", "fp8"))
    ap.add_argument("--shape", default="128x1:4096:32", help="HxQ:ctx:bs")
    ap.add_argument("--splits", type=int, default=1)
    ap.add_argument("--kernel", default="mla_wgmma", help="regex of the kernel to profile")
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        _child(args)
        return
    ncu = shutil.which("ncu")
    if ncu is None:
        print("ncu_stalls: needs ncu (Nsight Compute) on the PATH and a CUDA GPU")
        return
    with tempfile.TemporaryDirectory() as tmp:
        rep = os.path.join(tmp, "stalls")
        child = [sys.executable, os.path.abspath(__file__), "--child", "--variant", args.variant,
                 "--kv", args.kv, "--shape", args.shape, "--splits", str(args.splits)]
        subprocess.run([ncu, "--clock-control", "none", "--section", "WarpStateStats",
                        "--section", "SourceCounters", "-k", f"regex:{args.kernel}",
                        "--launch-skip", "1", "--launch-count", "1", "-o", rep, *child],
                       check=True, stdout=subprocess.DEVNULL)
        src = subprocess.run([ncu, "--import", rep + ".ncu-rep", "--page", "source", "--csv",
                              "--print-source", "sass"], check=True, capture_output=True,
                             text=True).stdout
    print(f"\n{args.variant} ({args.kv}) {args.shape} sp{args.splits}: ncu warp-stall samples")
    print(report(*stall_table(src, args.top)))


if __name__ == "__main__":
    main()
