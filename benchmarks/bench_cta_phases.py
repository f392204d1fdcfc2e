"""Where one CTA of the ``WE2`` or ``WR`` attention kernel spends its time: ``%globaltimer`` stamps.

    python benchmarks/bench_cta_phases.py [--kernel WE2|WR] [--ctx 64,1024,8192] [--bs 128]

Why: per call in a CUDA graph, ``WE2`` on an FP8 cache costs about ``a + b * tiles`` µs, and
in the thirteenth session ``a`` (what a call costs beyond streaming its tiles) was ~20 µs
against ~12 for ``W`` and ~13 for FlashInfer (bs 128: 21.6 µs at ctx 64, one tile a CTA).
This script builds a copy of ``csrc/mla_wgmma_e4m3pp_sm90.cu`` with timer reads at the phase
boundaries (text inserted at fixed anchors: the script fails loudly if the kernel's text moved),
runs it in the same replayed graph as ``bench_mla`` (PDL on, KV copies rotated past the L2,
one split: the stamps of request b go into its first output row once the CTA is done) and
prints, per phase, the median across CTAs of when it ended, relative to the first CTA's entry.
What it found (docs/bench_mla.md v12): code that runs once per CTA runs from a cold
instruction cache, ~10 cycles an instruction; the old epilogue (a 4-lane finish looping over
8 rows, an fp32 staging of [32][512], a strided store loop) cost ~11 µs a CTA and the same
code run a second time in the same CTA ~4.

WE2's phases: ``entry`` (kernel start), ``begun`` (PDL wait, barriers, the request's
metadata), ``prod0`` / ``prodend`` (the producer's first and last TMA issue), ``qstored``
(queries quantized into shared memory), ``t0land`` / ``t1land`` (the first tile of warpgroup 0
/ 1 landed), ``wg0end`` / ``wg1end`` (loops done), ``mrg0`` (maxima and sums exchanged),
``scales`` (each row's factors), ``end`` (rows stored). ``WR`` (H 128 q 1 on a bf16 cache, one
split; the stamps of row block 0): ``entry``, ``begun``, ``prod0``, ``prodend``, ``qstored``
(queries in shared memory), ``qk0`` (the first tile landed and its Q K done), ``wg0end`` /
``wg1end``, ``staged`` (O in the fp32 staging, the rows' factors written), ``end`` (rows
stored). GPU only (sm_90 and nvcc).
"""

from __future__ import annotations

import argparse
import hashlib
import os
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench_mla import DPE, DV, PAGE, SM_SCALE, build, graph_time  # noqa: E402

from mla_spec.kernels import mla_decode_wgmma as mw  # noqa: E402
from mla_spec.kernels.cuda_driver import CSRC, CudaKernel  # noqa: E402
from mla_spec.kernels.mla_decode_paged import mla_decode_paged  # noqa: E402
from mla_spec.kernels.mla_decode_tiles import PAGED_VARIANTS  # noqa: E402
from mla_spec.quant.fp8 import FP8_DTYPE  # noqa: E402

_GTIME = ('__device__ __forceinline__ unsigned long long gtime() { unsigned long long t; '
          'asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t) :: "memory"); return t; }\n')
_ENTRY = ("const int lane = tid & 31, g = lane >> 2, t4 = lane & 3;\n",
          "  __shared__ unsigned long long st_[16];\n  const unsigned long long st0_ = gtime();\n")


def _dump(n: int, first: str = "") -> str:
    """Thread 0 writes the n stamps and the CTA's tile count into its request's first output
    row (``first``: a condition for which CTAs write)."""
    cond = f"tid == 0{first}"
    return (f"  if ({cond}) {{\n    st_[{n}] = w.ntiles;\n"
            "    unsigned long long* o = reinterpret_cast<unsigned long long*>(\n"
            "        p.out + static_cast<long long>(b) * p.q_len * p.s_o_t);\n"
            f"    for (int i = 0; i <= {n}; ++i) o[i] = st_[i];\n  }}\n")


# per kernel: its source, its mla_decode_wgmma._KERNELS key and name, the phases, (anchor, text
# inserted after it) and (old, new) replacements; tid 0 / the producer lane / lane 0 of each
# warpgroup stamp
SPECS = {
    "WE2": dict(
        source=mw._E4M3PP_SOURCE, key=(32, False, True, False, True, True, False),
        name="mla_wgmma_e4m3pp_m32", include="sm90_e4m3.cuh", h=32, kvd=FP8_DTYPE,
        phases=["entry", "begun", "prod0", "prodend", "qstored", "t0land", "t1land", "wg0end",
                "wg1end", "mrg0", "scales", "end"],
        after=[
            ("namespace {\n", _GTIME), _ENTRY,
            ("NS>(wp, split, mb, b, tid, full, empty, w, qload)) return;\n",
             "  if (tid == 0) { st_[0] = st0_; st_[1] = gtime(); }\n"),
            ("store_queries_e4m3(qload, q_s, qmax, tid);\n", "  if (tid == 0) st_[4] = gtime();\n"),
            ("mbar_wait(&full[stage], (it / NS) & 1);\n",
             "    if (it < 2 && wt == 0) st_[5 + it] = gtime();\n"),
            ("named_barrier(B_PAIR, NT);  // the KV stages are free, every max and sum written\n",
             "  if (tid == 0) st_[9] = gtime();\n"),
        ],
        replace=[
            ("if (tid == NT) produce<KV_E4M3>(wp, w, kv_s, full, empty);",
             "if (tid == NT) { st_[2] = gtime(); produce<KV_E4M3>(wp, w, kv_s, full, empty); "
             "st_[3] = gtime(); }"),
            ("  griddep_launch();\n",
             "  if (wt == 0) st_[7 + wg] = gtime();\n  griddep_launch();\n"),
            ("  float4* stage_o4", "  if (tid == 0) st_[10] = gtime();\n  float4* stage_o4"),
            ("    store_row16(p, w, split, b, frag_col(c, t4), 128 * wq + 16 * g, v);\n  }\n}\n",
             "    store_row16(p, w, split, b, frag_col(c, t4), 128 * wq + 16 * g, v);\n  }\n"
             "  named_barrier(B_PAIR, NT);\n  if (tid == 0) st_[11] = gtime();\n" + _dump(12)
             + "}\n"),
        ]),
    "WR": dict(
        source=mw._ROWS_SOURCE, key=(64, False, False, True, False, False, False),
        name="mla_wgmma_rows64", include="sm90_fp8.cuh", h=128, kvd=torch.bfloat16,
        phases=["entry", "begun", "prod0", "prodend", "qstored", "qk0", "wg0end", "wg1end",
                "staged", "end"],
        after=[
            ("namespace {\n", _GTIME), _ENTRY,
            ("if (!cta_begin<BM, false>(wp, split, mb, b, tid, full, empty, w, qload)) return;\n",
             "  if (tid == 0) { st_[0] = st0_; st_[1] = gtime(); }\n"),
            ("  qload.store<F16>(q_s, tid);\n  fence_proxy_async();\n  named_barrier(1, NT);\n",
             "  if (tid == 0) st_[4] = gtime();\n"),
            ("      qk(s, 0);\n      wgmma_commit();\n      wgmma_wait0();\n",
             "      if (tid == 0) st_[5] = gtime();\n"),
        ],
        replace=[
            ("if (tid == NT) produce<KV>(wp, w, kv_s, full, empty);",
             "if (tid == NT) { st_[2] = gtime(); produce<KV>(wp, w, kv_s, full, empty); "
             "st_[3] = gtime(); }"),
            ("  griddep_launch();\n",
             "  if (wt == 0) st_[6 + wg] = gtime();\n  griddep_launch();\n"),
            ("    named_barrier(1, NT);\n    store_rows<BM>(p, w, split, b, ost, rowv, tid);\n",
             "    named_barrier(1, NT);\n    if (tid == 0) st_[8] = gtime();\n"
             "    store_rows<BM>(p, w, split, b, ost, rowv, tid);\n    named_barrier(1, NT);\n"
             "    if (tid == 0) st_[9] = gtime();\n"
             + _dump(10, " && mb == 0").replace("\n  ", "\n    ")),
        ]),
}


def stamped_source(kernel: str = "WE2") -> str:
    """The kernel's text with the stamps (headers included by absolute path; a hash of them in
    a comment, so the cubin cache sees a header change)."""
    spec = SPECS[kernel]
    src = (CSRC / spec["source"]).read_text()
    for anchor, text in spec["after"]:
        if src.count(anchor) != 1:
            raise RuntimeError(f"anchor moved in {spec['source']}: {anchor!r}")
        src = src.replace(anchor, anchor + text)
    for old, new in spec["replace"]:
        if src.count(old) != 1:
            raise RuntimeError(f"anchor moved in {spec['source']}: {old!r}")
        src = src.replace(old, new)
    inc = spec["include"]
    src = src.replace(f'#include "{inc}"', f'#include "{CSRC / inc}"')
    headers = b"".join(h.read_bytes() for h in sorted(CSRC.glob("*.cuh")))
    return f"// headers {hashlib.sha256(headers).hexdigest()[:16]}\n" + src


def phases(kernel: str, stamped: CudaKernel, ctx: int, bs: int,
           dev) -> tuple[float, float, torch.Tensor, int]:
    """(µs per call of the kernel, of the stamped copy, [CTAs, phases] µs after the first
    entry, tiles per CTA)."""
    spec = SPECS[kernel]
    n = len(spec["phases"])
    pool, r2t, rpis, kv_lens, qn, qp, _ = build(spec["h"], 1, bs, ctx, spec["kvd"], dev, 4)
    flat = pool.kv_buffer[0].view(-1, DV + DPE)
    out = torch.empty_like(qn)
    calls = [lambda r=r: mla_decode_paged(qn, qp, flat, r2t, r, kv_lens, SM_SCALE, page_size=PAGE,
                                          q_len=1, num_splits=1, config=PAGED_VARIANTS[kernel],
                                          max_kv=ctx, out=out, num_sms=132) for r in rpis]
    real = mw._KERNELS[spec["key"]]
    us = graph_time(calls)
    try:
        mw._KERNELS[spec["key"]] = stamped
        us_stamped = graph_time(calls)  # the last call's stamps stay in out
    finally:
        mw._KERNELS[spec["key"]] = real
    st = out.view(bs, -1).view(torch.int64)[:, :n + 1].cpu()
    t = st[:, :n].double()
    rel = (t - t[:, 0].min()) / 1e3
    ntiles = int(st[:, n].min())
    if ntiles < 2 and "t1land" in spec["phases"]:
        rel[:, spec["phases"].index("t1land")] = float("nan")  # warpgroup 1 had no tile
    return us, us_stamped, rel, ntiles


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--kernel", default="WE2", choices=sorted(SPECS))
    ap.add_argument("--ctx", default="64,1024,8192", help="context lengths (one split each)")
    ap.add_argument("--bs", type=int, default=128)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
        print("bench_cta_phases: needs an sm_90 GPU (the wgmma kernels)")
        return
    dev = torch.device("cuda")
    spec = SPECS[args.kernel]
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / f"{args.kernel}_stamped.cu"
        path.write_text(stamped_source(args.kernel))
        kernel = CudaKernel(str(path), spec["name"], arch="sm_90a")
        results = [(ctx, *phases(args.kernel, kernel, ctx, args.bs, dev)) for ctx in
                   (int(c) for c in args.ctx.split(","))]
    kv = "fp8" if spec["kvd"] == FP8_DTYPE else "bf16"
    print(f"\n{args.kernel}, H {spec['h']} q 1 {kv}, bs {args.bs}, one split: µs after the first "
          "CTA's entry, median over CTAs (step: median of the difference to the phase above)")
    for ctx, us, us_st, rel, ntiles in results:
        print(f"\nctx {ctx} ({ntiles} tiles a CTA): {us:.2f} µs per call in a graph "
              f"(stamped copy {us_st:.2f})")
        print("| phase | median | step | min | max |\n|---|---|---|---|---|")
        prev = None
        for i, name in enumerate(spec["phases"]):
            c = rel[:, i]
            step = "" if prev is None else f"{(c - prev).nanmedian():.2f}"
            print(f"| {name} | {c.nanmedian():.2f} | {step} | {c.min():.2f} | {c.max():.2f} |")
            if not torch.isnan(c).all():
                prev = c


if __name__ == "__main__":
    main()
