"""Where one CTA of the ``W``, ``WE2`` or ``WR`` attention kernel spends its time: timer stamps.

    python benchmarks/bench_cta_phases.py [--kernel W|WE2|WR] [--ctx 64,1024,8192] [--bs 128]
        [--splits 1] [--csrc DIR]

Why: per call in a CUDA graph, ``WE2`` on an FP8 cache costs about ``a + b * tiles`` µs, and
in the thirteenth session ``a`` (what a call costs beyond streaming its tiles) was ~20 µs
against ~12 for ``W`` and ~13 for FlashInfer (bs 128: 21.6 µs at ctx 64, one tile a CTA).
This script builds a copy of ``csrc/mla_wgmma_e4m3pp_sm90.cu`` with timer reads at the phase
boundaries (text inserted at fixed anchors: the script fails loudly if the kernel's text moved),
runs it in the same replayed graph as ``bench_mla`` (PDL on, KV copies rotated past the L2,
``--splits`` KV splits a request: each CTA writes its stamps into its ``WORDS`` words of a buffer
passed as the unused ``p.kv`` once it is done) and prints, per phase, the median across
CTAs of when it ended, relative to the first CTA's entry. ``--csrc`` stamps another copy
of the sources (e.g. the tree before a change) for a before / after in one run.
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
stored). ``W`` (H 32 q 1 on a bf16 cache; batch 1 ctx 32k is ``--bs 1 --ctx 32768 --splits
128``): ``entry``, ``begun``, ``prod0`` / ``prodend``, ``qstored``, ``tile0`` .. ``tile3`` (the
first four tiles landed), ``loopend``, ``staged`` (O in the fp32 staging), ``finished``
(the rows' factors and lse), ``end`` (rows stored), ``merged`` (its share of the merge inside
the grid done, when ``mla_decode_wgmma.GRID_MERGE`` is on; the merge's own steps go to the
words from ``GM_WORD0`` on through ``GM_STAMP``; the last tile's steps, ``LAST_TILE_STEPS``,
to the words from ``LT_WORD0`` on, printed by ``bench_call_timeline.py``). GPU only (sm_90 and
nvcc).
"""

from __future__ import annotations

import argparse
import hashlib
import os
import re
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench_mla import DPE, DV, PAGE, SM_SCALE, build, graph_time  # noqa: E402

from mla_spec.kernels import mla_decode_wgmma as mw  # noqa: E402
from mla_spec.kernels.launch.cuda_driver import CSRC, CudaKernel  # noqa: E402
from mla_spec.kernels.mla_decode_paged import mla_decode_paged  # noqa: E402
from mla_spec.kernels.mla_decode_tiles import PAGED_VARIANTS  # noqa: E402
from mla_spec.quant.fp8 import FP8_DTYPE  # noqa: E402

_GTIME = ('__device__ __forceinline__ unsigned long long gtime() { unsigned long long t; '
          'asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t) :: "memory"); return t; }\n')
_ENTRY = ("const int lane = tid & 31, g = lane >> 2, t4 = lane & 3;\n",
          "  __shared__ unsigned long long st_[16];\n  const unsigned long long st0_ = gtime();\n")


#: words of a CTA's row of the stamp buffer: its phases and tile count, then from GM_WORD0 the
#: steps of W's merge inside the grid (GM_STAMP in csrc/sm90_grid_merge.cuh), from LT_WORD0
#: W's last tile: Q K done, the S halves added, P^T stored, P V done (LAST_TILE_STEPS)
WORDS, GM_WORD0, LT_WORD0 = 24, 16, 20
LAST_TILE_STEPS = ("Q K done", "S halves added", "P^T stored", "P V done")
_GM_STAMP = ("#define GM_STAMP(i) asm volatile(\"mov.u64 %0, %%globaltimer;\" : \"=l\"("
             "(reinterpret_cast<unsigned long long*>(const_cast<__nv_bfloat16*>(wp.m.kv)) + "
             f"((blockIdx.z * gridDim.y + blockIdx.y) * gridDim.x + blockIdx.x) * {WORDS})"
             f"[{GM_WORD0} + (i)]) :: \"memory\")\n")


def _last_tile_stamp(k: int) -> str:
    """W's step k of its last tile, by thread 0, into word LT_WORD0 + k (through GM_STAMP)."""
    return f"    if (tid == 0 && it + 1 == w.ntiles) GM_STAMP({LT_WORD0 - GM_WORD0 + k});\n"


def _dump(n: int) -> str:
    """Thread 0 writes the n stamps and the CTA's tile count into the CTA's first words of the
    stamp buffer, which the benchmark passes as ``p.kv`` (unused by the wgmma kernels: their
    tiles come through the tensor map)."""
    return ("  if (tid == 0) {\n"
            f"    st_[{n}] = w.ntiles;\n"
            "    unsigned long long* o = reinterpret_cast<unsigned long long*>(\n"
            "        const_cast<__nv_bfloat16*>(p.kv)) +\n"
            "        ((blockIdx.z * gridDim.y + blockIdx.y) * gridDim.x + blockIdx.x) * "
            f"{WORDS};\n"
            f"    for (int i = 0; i <= {n}; ++i) o[i] = st_[i];\n  }}\n")


# per kernel: its source, its mla_decode_wgmma._KERNELS key and name, the phases, (anchor, text
# inserted after it) and (old, new) replacements; tid 0 / the producer lane / lane 0 of each
# warpgroup stamp
SPECS = {
    "WE2": dict(
        source=mw._E4M3PP_SOURCE, key=(32, False, True, False, True, True, False),
        name="mla_wgmma_e4m3pp_m32", h=32, kvd=FP8_DTYPE,
        phases=["entry", "begun", "prod0", "prodend", "qstored", "t0land", "t1land", "wg0end",
                "wg1end", "mrg0", "scales", "end"],
        after=[
            ("namespace {\n", _GTIME), _ENTRY,
            (("w, qload, kv_s))\n    return;\n",
              "NS>(wp, split, mb, b, tid, full, empty, w, qload)) return;\n"),
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
            ("  // merge the warpgroups' partial rows",
             "  if (wt == 0) st_[7 + wg] = gtime();\n  // merge the warpgroups' partial rows"),
            ("  float4* stage_o4", "  if (tid == 0) st_[10] = gtime();\n  float4* stage_o4"),
            ("    store_row16(p, w, split, b, frag_col(c, t4), 128 * wq + 16 * g, v);\n  }\n",
             "    store_row16(p, w, split, b, frag_col(c, t4), 128 * wq + 16 * g, v);\n  }\n"
             "  named_barrier(B_PAIR, NT);\n  if (tid == 0) st_[11] = gtime();\n" + _dump(12)),
        ]),
    "WR": dict(
        source=mw._ROWS_SOURCE, key=(64, False, False, True, False, False, False),
        name="mla_wgmma_rows64", h=128, kvd=torch.bfloat16,
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
            ("  if (!combine_next) griddep_launch();\n",
             "  if (wt == 0) st_[6 + wg] = gtime();\n  if (!combine_next) griddep_launch();\n"),
            ("    named_barrier(1, NT);\n    store_rows<BM>(p, w, split, b, ost, rowv, tid);\n",
             "    named_barrier(1, NT);\n    if (tid == 0) st_[8] = gtime();\n"
             "    store_rows<BM>(p, w, split, b, ost, rowv, tid);\n    named_barrier(1, NT);\n"
             "    if (tid == 0) st_[9] = gtime();\n"
             + _dump(10).replace("\n  ", "\n    ")),
        ]),
    "W": dict(
        source=mw._SOURCES[32][0], key=(32, False, False, False, False, False, False),
        name="mla_wgmma_m32", h=32, kvd=torch.bfloat16,
        phases=["entry", "begun", "prod0", "prodend", "qstored", "tile0", "tile1", "tile2",
                "tile3", "loopend", "staged", "finished", "end", "merged"],
        after=[
            ("namespace {\n", _GTIME),
            (_ENTRY[0], _ENTRY[1] + "  if (tid == 0) st_[5] = st_[6] = st_[7] = st_[8] = 0;\n"),
            (("qload,\n                                                  kv_s))\n    return;\n",
              "w, qload, kv_s))\n    return;\n",
              "if (!cta_begin<BM, L2PF>(wp, split, mb, b, tid, full, empty, w, qload)) return;\n"),
             "  if (tid == 0) { st_[0] = st0_; st_[1] = gtime(); }\n"),
            ("named_barrier(1, NT);  // the queries are in shared memory (consumer warps only "
             "from here)\n", "  if (tid == 0) st_[4] = gtime();\n"),
            ("    wgmma_commit();\n    wgmma_wait0();\n", _last_tile_stamp(0)),
            ("    add_other_half(s, xmine, xother);\n", _last_tile_stamp(1)),
            ("    named_barrier(1, NT);  // P^T complete\n", _last_tile_stamp(2)),
            ("    });  // then the stage is free\n", _last_tile_stamp(3)),
            # with box groups (W_GROUPS > 1): the tile's start, before its first group's wait
            (("    if (NG == 1 && (!T::f16 || it == 0)) ready_tile<KV>(kv_s, full, it, w.lo, w.hi, "
              "tid);\n",
              "    if (!T::f16 || it == 0) ready_tile<KV>(kv_s, full, it, w.lo, w.hi, tid);\n"),
             "    if (it < 4 && tid == 0) st_[5 + it] = gtime();\n"),
            ("  stage_o<NA>(ost, o, wg, wq, g, t4);\n  named_barrier(1, NT);\n",
             "  if (tid == 0) st_[10] = gtime();\n"),
            ("  finish_rows<BM>(p, w, split, b, red, mrow, rowv, tid);\n  named_barrier(1, NT);\n",
             "  if (tid == 0) st_[11] = gtime();\n"),
        ],
        replace=[
            (("    if (lane == 0) produce<KV, NG>(wp, w, kv_s, full, empty);",
              "    if (lane == 0) produce<KV>(wp, w, kv_s, full, empty);"),
             ("    if (lane == 0) { st_[2] = gtime(); produce<KV, NG>(wp, w, kv_s, full, empty); "
              "st_[3] = gtime(); }",
              "    if (lane == 0) { st_[2] = gtime(); produce<KV>(wp, w, kv_s, full, empty); "
              "st_[3] = gtime(); }")),
            ("  // l over the tile rows (lanes g)",
             "  if (tid == 0) st_[9] = gtime();\n  // l over the tile rows (lanes g)"),
            ("  store_rows<BM>(p, w, split, b, ost, rowv, tid);\n",
             "  store_rows<BM>(p, w, split, b, ost, rowv, tid);\n  named_barrier(1, NT);\n"
             "  if (tid == 0) st_[12] = gtime();\n"),
            ("grid_merge<BM, false>(wp, w, split, b, tid, 1, ost);\n  }\n}\n",
             "grid_merge<BM, false>(wp, w, split, b, tid, 1, ost);\n  }\n"
             "  if (tid == 0) st_[13] = gtime();\n" + _dump(14) + "}\n"),
        ]),
}


def stamped_source(kernel: str = "WE2", csrc: Path = CSRC) -> str:
    """The kernel's text (from ``csrc``: this tree's, or a copy as it was) with the stamps
    (headers included by absolute path; a hash of them in a comment, so the cubin cache sees a
    header change)."""
    spec = SPECS[kernel]
    src = (csrc / spec["source"]).read_text()
    for anchors, text in spec["after"]:
        # an anchor may have forms (a tuple): this tree's and an older tree's (--csrc)
        found = [a for a in ((anchors,) if isinstance(anchors, str) else anchors)
                 if src.count(a) == 1]
        if not found:
            raise RuntimeError(f"anchor moved in {spec['source']}: {anchors!r}")
        src = src.replace(found[0], found[0] + text)
    for olds, news in spec["replace"]:
        # forms as above: (this tree's old, new), (an older tree's ...)
        pairs = list(zip(olds, news)) if isinstance(olds, tuple) else [(olds, news)]
        found = [(o, n) for o, n in pairs if src.count(o) == 1]
        if not found:
            raise RuntimeError(f"anchor moved in {spec['source']}: {olds!r}")
        src = src.replace(*found[0])
    src = re.sub(r'#include "(\w+\.cuh)"', lambda m: f'#include "{csrc / m.group(1)}"', src)
    if kernel == "W":
        src = _GM_STAMP + src
    headers = b"".join(h.read_bytes() for h in sorted(csrc.glob("*.cuh")))
    return f"// headers {hashlib.sha256(headers).hexdigest()[:16]}\n" + src


def phases(kernel: str, stamped: CudaKernel, ctx: int, bs: int, splits: int, dev,
           raw: bool = False):
    """(µs per call of the kernel, of the stamped copy, [CTAs, phases] µs after the first
    entry, the fewest tiles of a CTA[, with ``raw`` the stamps as read: [CTAs, WORDS] ns]). The
    stamped copy gets the stamp buffer as ``p.kv`` (``split_params`` patched for its runs);
    CTAs that exited at once (no stamps) are dropped."""
    spec = SPECS[kernel]
    n = len(spec["phases"])
    pool, r2t, rpis, kv_lens, qn, qp, _ = build(spec["h"], 1, bs, ctx, spec["kvd"], dev, 4)
    flat = pool.kv_buffer[0].view(-1, DV + DPE)
    out = torch.empty_like(qn)
    calls = [lambda r=r: mla_decode_paged(qn, qp, flat, r2t, r, kv_lens, SM_SCALE, page_size=PAGE,
                                          q_len=1, num_splits=splits,
                                          config=PAGED_VARIANTS[kernel], max_kv=ctx, out=out,
                                          num_sms=132) for r in rpis]
    stamps = torch.zeros(bs * splits * 8, WORDS, dtype=torch.int64, device=dev)
    real, real_split_params = mw._KERNELS[spec["key"]], mw.split_params

    def stamping_split_params(*a, **k):
        m, part, part_lse = real_split_params(*a, **k)
        m.kv = stamps.data_ptr()
        return m, part, part_lse

    us = graph_time(calls)
    # with early_kv (MLA_SPEC_EARLY_KV=1) the call runs the kernel's _ek build: stamp it too
    real_ek = mw._EARLY_KERNELS.get(spec["key"])
    try:
        mw._KERNELS[spec["key"]], mw.split_params = stamped, stamping_split_params
        if real_ek is not None:
            mw._EARLY_KERNELS[spec["key"]] = CudaKernel(str(stamped.src), stamped.name + "_ek",
                                                        arch=stamped.arch)
        us_stamped = graph_time(calls)  # the last call's stamps stay in the buffer
    finally:
        mw._KERNELS[spec["key"]], mw.split_params = real, real_split_params
        if real_ek is not None:
            mw._EARLY_KERNELS[spec["key"]] = real_ek
    st = stamps.cpu()
    st = st[st[:, 0] != 0]
    t = st[:, :n].double()
    t[st[:, :n] == 0] = float("nan")  # phases a CTA did not reach (tiles it did not have)
    rel = (t - t[:, 0].min()) / 1e3
    ntiles = int(st[:, n].min())
    if ntiles < 2 and "t1land" in spec["phases"]:
        rel[:, spec["phases"].index("t1land")] = float("nan")  # warpgroup 1 had no tile
    return (us, us_stamped, rel, ntiles, st) if raw else (us, us_stamped, rel, ntiles)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--kernel", default="WE2", choices=sorted(SPECS))
    ap.add_argument("--ctx", default="64,1024,8192", help="context lengths")
    ap.add_argument("--bs", type=int, default=128)
    ap.add_argument("--splits", type=int, default=1, help="KV splits a request")
    ap.add_argument("--csrc", default=str(CSRC),
                    help="the source tree to stamp (a copy of mla_spec/kernels/csrc)")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
        print("bench_cta_phases: needs an sm_90 GPU (the wgmma kernels)")
        return
    dev = torch.device("cuda")
    spec = SPECS[args.kernel]
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / f"{args.kernel}_stamped.cu"
        path.write_text(stamped_source(args.kernel, Path(args.csrc).resolve()))
        kernel = CudaKernel(str(path), spec["name"], arch="sm_90a")
        results = [(ctx, *phases(args.kernel, kernel, ctx, args.bs, args.splits, dev))
                   for ctx in (int(c) for c in args.ctx.split(","))]
    kv = "fp8" if spec["kvd"] == FP8_DTYPE else "bf16"
    print(f"\n{args.kernel} ({args.csrc}), H {spec['h']} q 1 {kv}, bs {args.bs}, {args.splits} "
          "split(s): µs after the first CTA's entry, median over CTAs (step: median of the "
          "difference to the phase above)")
    for ctx, us, us_st, rel, ntiles in results:
        print(f"\nctx {ctx} ({ntiles}+ tiles a CTA, {rel.shape[0]} CTAs): {us:.2f} µs per call "
              f"in a graph (stamped copy {us_st:.2f})")
        print("| phase | median | step | min | max |\n|---|---|---|---|---|")
        prev = None
        for i, name in enumerate(spec["phases"]):
            c = rel[:, i]
            if torch.isnan(c).all():
                continue
            step = "" if prev is None else f"{(c - prev).nanmedian():.2f}"
            ok = c[~torch.isnan(c)]
            print(f"| {name} | {c.nanmedian():.2f} | {step} | {ok.min():.2f} | {ok.max():.2f} |")
            prev = c


if __name__ == "__main__":
    main()
