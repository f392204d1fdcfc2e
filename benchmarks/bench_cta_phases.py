"""Where one CTA of the ``WE2`` attention kernel spends its time: ``%globaltimer`` stamps.

    python benchmarks/bench_cta_phases.py [--ctx 64,1024,8192] [--bs 128]

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

Phases: ``entry`` (kernel start), ``begun`` (PDL wait, barriers, the request's metadata),
``prod0`` / ``prodend`` (the producer's first and last TMA issue), ``qstored`` (queries
quantized into shared memory), ``t0land`` / ``t1land`` (the first tile of warpgroup 0 / 1
landed), ``wg0end`` / ``wg1end`` (loops done), ``mrg0`` (maxima and sums exchanged),
``scales`` (each row's factors), ``end`` (rows stored). GPU only (sm_90 and nvcc).
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

PHASES = ["entry", "begun", "prod0", "prodend", "qstored", "t0land", "t1land", "wg0end",
          "wg1end", "mrg0", "scales", "end"]
KEY = (32, False, True, False, True, True)  # WE2 in mla_decode_wgmma._KERNELS
_GTIME = ('__device__ __forceinline__ unsigned long long gtime() { unsigned long long t; '
          'asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t) :: "memory"); return t; }\n')
# (anchor, text inserted after it); tid 0 / the producer lane / lane 0 of each warpgroup stamp
_AFTER = [
    ("namespace {\n", _GTIME),
    ("const int lane = tid & 31, g = lane >> 2, t4 = lane & 3;\n",
     "  __shared__ unsigned long long st_[16];\n  const unsigned long long st0_ = gtime();\n"),
    ("NS>(wp, split, mb, b, tid, full, empty, w, qload)) return;\n",
     "  if (tid == 0) { st_[0] = st0_; st_[1] = gtime(); }\n"),
    ("store_queries_e4m3(qload, q_s, qmax, tid);\n", "  if (tid == 0) st_[4] = gtime();\n"),
    ("mbar_wait(&full[stage], (it / NS) & 1);\n",
     "    if (it < 2 && wt == 0) st_[5 + it] = gtime();\n"),
    ("named_barrier(B_PAIR, NT);  // the KV stages are free, every max and sum written\n",
     "  if (tid == 0) st_[9] = gtime();\n"),
]
_REPLACE = [
    ("if (tid == NT) produce<KV_E4M3>(wp, w, kv_s, full, empty);",
     "if (tid == NT) { st_[2] = gtime(); produce<KV_E4M3>(wp, w, kv_s, full, empty); "
     "st_[3] = gtime(); }"),
    ("  griddep_launch();\n", "  if (wt == 0) st_[7 + wg] = gtime();\n  griddep_launch();\n"),
    ("  float4* stage_o4", "  if (tid == 0) st_[10] = gtime();\n  float4* stage_o4"),
]
_END = ("    store_row16(p, w, split, b, frag_col(c, t4), 128 * wq + 16 * g, v);\n  }\n}\n",
        "    store_row16(p, w, split, b, frag_col(c, t4), 128 * wq + 16 * g, v);\n  }\n"
        "  named_barrier(B_PAIR, NT);\n"
        "  if (tid == 0) {\n    st_[11] = gtime();\n    st_[12] = w.ntiles;\n"
        "    unsigned long long* o = reinterpret_cast<unsigned long long*>(\n"
        "        p.out + static_cast<long long>(b) * p.q_len * p.s_o_t);\n"
        "    for (int i = 0; i < 13; ++i) o[i] = st_[i];\n  }\n}\n")


def stamped_source() -> str:
    """The WE2 kernel's text with the stamps (headers included by absolute path; a hash of them
    in a comment, so the cubin cache sees a header change)."""
    src = (CSRC / mw._E4M3PP_SOURCE).read_text()
    for anchor, text in _AFTER:
        if src.count(anchor) != 1:
            raise RuntimeError(f"anchor moved in {mw._E4M3PP_SOURCE}: {anchor!r}")
        src = src.replace(anchor, anchor + text)
    for old, new in _REPLACE + [_END]:
        if src.count(old) != 1:
            raise RuntimeError(f"anchor moved in {mw._E4M3PP_SOURCE}: {old!r}")
        src = src.replace(old, new)
    src = src.replace('#include "sm90_e4m3.cuh"', f'#include "{CSRC / "sm90_e4m3.cuh"}"')
    headers = b"".join(h.read_bytes() for h in sorted(CSRC.glob("*.cuh")))
    return f"// headers {hashlib.sha256(headers).hexdigest()[:16]}\n" + src


def phases(kernel: CudaKernel, ctx: int, bs: int, dev) -> tuple[float, float, torch.Tensor, int]:
    """(µs per call of WE2, of the stamped copy, [CTAs, phases] µs after the first entry,
    tiles per CTA)."""
    pool, r2t, rpis, kv_lens, qn, qp, _ = build(32, 1, bs, ctx, FP8_DTYPE, dev, 4)
    flat = pool.kv_buffer[0].view(-1, DV + DPE)
    out = torch.empty_like(qn)
    calls = [lambda r=r: mla_decode_paged(qn, qp, flat, r2t, r, kv_lens, SM_SCALE, page_size=PAGE,
                                          q_len=1, num_splits=1, config=PAGED_VARIANTS["WE2"],
                                          max_kv=ctx, out=out, num_sms=132) for r in rpis]
    real = mw._KERNELS[KEY]
    us = graph_time(calls)
    try:
        mw._KERNELS[KEY] = kernel
        us_stamped = graph_time(calls)  # the last call's stamps stay in out
    finally:
        mw._KERNELS[KEY] = real
    st = out.view(bs, -1).view(torch.int64)[:, :13].cpu()
    t = st[:, :12].double()
    rel = (t - t[:, 0].min()) / 1e3
    ntiles = int(st[:, 12].min())
    if ntiles < 2:
        rel[:, PHASES.index("t1land")] = float("nan")  # warpgroup 1 had no tile
    return us, us_stamped, rel, ntiles


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ctx", default="64,1024,8192", help="context lengths (one split each)")
    ap.add_argument("--bs", type=int, default=128)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
        print("bench_cta_phases: needs an sm_90 GPU (the WE2 kernel)")
        return
    dev = torch.device("cuda")
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "we2_stamped.cu"
        path.write_text(stamped_source())
        kernel = CudaKernel(str(path), "mla_wgmma_e4m3pp_m32", arch="sm_90a")
        results = [(ctx, *phases(kernel, ctx, args.bs, dev)) for ctx in
                   (int(c) for c in args.ctx.split(","))]
    print(f"\nWE2, H 32 q 1 fp8, bs {args.bs}, one split: µs after the first CTA's entry, "
          "median over CTAs (step: median of the difference to the phase above)")
    for ctx, us, us_st, rel, ntiles in results:
        print(f"\nctx {ctx} ({ntiles} tiles a CTA): {us:.2f} µs per call in a graph "
              f"(stamped copy {us_st:.2f})")
        print("| phase | median | step | min | max |\n|---|---|---|---|---|")
        prev = None
        for i, name in enumerate(PHASES):
            c = rel[:, i]
            step = "" if prev is None else f"{(c - prev).nanmedian():.2f}"
            print(f"| {name} | {c.nanmedian():.2f} | {step} | {c.min():.2f} | {c.max():.2f} |")
            if not torch.isnan(c).all():
                prev = c


if __name__ == "__main__":
    main()
