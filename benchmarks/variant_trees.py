"""Copies of the kernel sources with one experimental change each, for ``ab_csrc.py --base``
and ``bench_call_timeline.py --csrc``.

    python benchmarks/variant_trees.py OUT [--only pf2,qk2]
    python benchmarks/ab_csrc.py --base OUT/pf2,OUT/pfb2 --shapes bf16:32x1:32768
    python benchmarks/bench_call_timeline.py --csrc OUT/pf2d

Why: the twentieth session asked whether the idle HBM before the PDL wait of batch 1 ctx 32k
(the next call's CTAs enter ~1.5-4.8 µs before their release) could be filled by putting
the split's first KV tiles into L2 there, whether the combine's trigger before its wait
helps, and whether Q K's accumulator chain bounds a tile. Each answer is a variant of
``mla_spec/kernels/csrc`` (text replaced at fixed anchors; this script fails loudly if one
moved), timed against this tree in one run (docs/bench_mla.md v18: none was kept):

- ``pf1`` / ``pf2`` / ``pf4``: ``W`` (``mla_wgmma_m32``) built with ``L2PF``: the producer
  lane sends its split's first 1 / 2 / up to 8 tiles to L2 through the tensor map
  (``cp.async.bulk.prefetch.tensor``) before the PDL wait;
- ``pfb2``: the same 2 tiles with one bulk prefetch a tile (``cp.async.bulk.prefetch.L2``,
  a tile's 64 slots of one page are 73.7 KB of contiguous memory);
- ``pfl2``: the 2 tiles by the producer warp's 32 lanes, ``prefetch.global.L2`` a 128-byte line;
- ``ec`` / ``pf2ec`` / ``pf4ec``: the CUDA combine lets its dependent launch before its own PDL
  wait (the next call's split CTAs may then enter as the split grid's CTAs leave), alone and
  with ``pf2`` / ``pf4``;
- ``headd`` / ``pf2d`` / ``pfl2d``: the producer waits 6 µs after the PDL wait before its
  first load, without / with the prefetch (a prefetched tile in L2 would land at once);
- ``qk2``: ``W``'s Q K as two independent accumulator chains (even and odd k16 steps);
- ``lazy``: ``W``'s running max moves only when a tile's max passes it by more than 8 (log2
  units), so O is rarely rescaled after the first tile; ``lazyex2``: and the softmax's exp2
  as ``ex2.approx.ftz``.

Floors of the design (twenty-fourth session; not attention, so ``ab_csrc.py --base
DIR:nocheck``): ``nomath``: ``W``'s consumers wait for each tile and release it without Q K,
softmax or P V; ``nolast``: the same for the split's last tile only; ``noepi``: no O staging
and no rows stored; ``nocomb``: the CUDA combine returns after its PDL wait; ``floor``:
``nomath`` + ``noepi`` + ``nocomb`` (the KV stream, the two grids and their hand-offs).
"""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path

CSRC = Path(__file__).resolve().parent.parent / "mla_spec" / "kernels" / "csrc"
_W, _HDR, _COMB = "mla_wgmma_sm90.cu", "sm90_wgmma.cuh", "mla_combine.cu"

_PF_ON = (_W, "MLA_WGMMA(32, false, KV_BF16, , false)\n", "MLA_WGMMA(32, true, KV_BF16, , false)\n")
_PF_LOOP = "        for (int t = 0; t < STAGES && t < pw.ntiles; ++t) {\n"
_PF_BOXES = ("#pragma unroll\n"
             "          for (int c = 0; c < NCH; ++c) tma_prefetch_2d(&p.kv_map, c * 64, slot0);\n")


def _tiles(n: int):
    return (_HDR, _PF_LOOP, _PF_LOOP.replace("t < STAGES", f"t < {n}"))


_EARLY_TRIGGER = (_COMB, "  griddep_wait();\n  griddep_launch();\n",
                  "  griddep_launch();\n  griddep_wait();\n")
_BULK = (_HDR, _PF_BOXES,
         '          asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;\\n" ::"l"(\n'
         "                           p.m.kv + static_cast<long long>(slot0) * DK),\n"
         '                       "r"(BN * DK * 2) : "memory");\n')
# the producer lane's prefetch block moves out of `if (tid == NT)` so the warp's lanes share it
_LANES_OUT = (_HDR, "      if (L2PF) {\n        CtaWork pw = w;",
              "    }\n    if (L2PF) {\n      {\n        CtaWork pw = w;")
_LANES = (_HDR, "          const int slot0 = r2t_row[t * BN];\n" + _PF_BOXES,
          "          const char* line0 = reinterpret_cast<const char*>(\n"
          "              p.m.kv + static_cast<long long>(r2t_row[t * BN]) * DK);\n"
          "          for (int l = tid & 31; l < BN * DK * 2 / 128; l += 32)\n"
          '            asm volatile("prefetch.global.L2 [%0];\\n" ::"l"(line0 + l * 128));\n')
_DELAY = (_HDR, "  for (int it = w.early; it < w.ntiles; ++it) {\n",
          "  {\n    unsigned long long t0, t1;\n"
          '    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));\n'
          '    do { asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t1)); } while (t1 - t0 < '
          "6000ull);\n  }\n"
          "  for (int it = w.early; it < w.ntiles; ++it) {\n")
_QK2_FN = (_W, "template <int BM, bool F16>\n__device__ __forceinline__ void qk_half(",
           "template <int BM, bool F16>\n"
           "__device__ __forceinline__ void qk_half2(float (&s)[BM / 2], float (&s2)[BM / 2],\n"
           "                                         uint64_t a_desc, uint64_t b_desc) {\n"
           "#pragma unroll\n  for (int j = 0; j < 18; ++j) {\n"
           "    const uint32_t a_off = (j >> 1) * BLK + (j & 1) * 64,\n"
           "                   b_off = (j >> 1) * BM * 128 + (j & 1) * 64;\n"
           "    Wgmma<BM, 0, F16>::run(j & 1 ? s2 : s, a_desc + (a_off >> 4), "
           "b_desc + (b_off >> 4));\n  }\n}\n\n"
           "template <int BM, bool F16>\n__device__ __forceinline__ void qk_half(")
# qk2 runs on the tile as one group of boxes (W_GROUPS 1)
_ONE_GROUP = (_W, "#define W_GROUPS 3\n", "#define W_GROUPS 1\n")
# the zeros must be written before the fence (an empty asm pins them), else ptxas injects waits
_QK2_CALL = (_W, "    float s[NA];\n    zero_acc(s);\n    wgmma_fence();\n"
             "    if constexpr (NG == 1)\n"
             "      qk_half<BM, T::f16>(s, sw128_desc(kv_base + wg * 32, 16, 1024), q_desc);\n"
             "    else\n"
             "      qk_groups<BM, NG>(s, sw128_desc(kv_base + wg * 32, 16, 1024), q_desc, "
             "full + stage * NG,\n                        (it / STAGES) & 1);\n"
             "    wgmma_commit();\n    wgmma_wait0();\n",
             "    float s[NA], s2[NA];\n    zero_acc(s);\n    zero_acc(s2);\n#pragma unroll\n"
             '    for (int i = 0; i < NA; ++i) asm volatile("" : "+f"(s2[i]), "+f"(s[i]));\n'
             "    wgmma_fence();\n"
             "    qk_half2<BM, T::f16>(s, s2, sw128_desc(kv_base + wg * 32, 16, 1024), q_desc);\n"
             "    wgmma_commit();\n    wgmma_wait0();\n#pragma unroll\n"
             "    for (int i = 0; i < NA; ++i) s[i] += s2[i];\n")

# the running max moves only when a tile's max passes it by more than 8 (log2 units): P <= 2^8,
# O is rescaled (and alpha's exp2 run) only then; exact up to rounding (W only: WE8 scales P by
# 256 into e4m3)
_LAZY_TPL = (_HDR, "template <int NC>\n__device__ __forceinline__ bool tile_softmax(",
             "template <int NC, int TAU = 0>\n__device__ __forceinline__ bool tile_softmax(")
_LAZY_MAX = (_HDR, "    m_use[c] = v == -INFINITY ? 0.f : v;\n"
             "    alpha[c] = exp2f(m_r[c] - m_use[c]);\n",
             "    if (TAU > 0 && v <= m_r[c] + TAU) v = m_r[c];\n"
             "    m_use[c] = v == -INFINITY ? 0.f : v;\n"
             "    alpha[c] = v != m_r[c] ? exp2f(m_r[c] - m_use[c]) : 1.f;\n")
_LAZY_CALL = (_W, "tile_softmax<NC>(s, m_r, l_r, alpha, red + wg * 4 * BM, BM, t4);",
              "tile_softmax<NC, 8>(s, m_r, l_r, alpha, red + wg * 4 * BM, BM, t4);")
_EX2 = (_HDR, "      s[i] = exp2f(s[i] - m_use[c]);\n",
        '      asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(s[i]) : "f"(s[i] - m_use[c]));\n')

# Floors of the split-and-combine design (not attention: time with ``ab_csrc.py --base
# DIR:nocheck``): what a call costs with a part of W's work compiled out
_TILE_TOP = "    const int stage = it % STAGES, t0 = w.lo + it * BN;\n"
_SKIP = ("      for (int g = 0; g < NG; ++g) mbar_wait(&full[stage * NG + g], (it / STAGES) & 1);\n"
         "      __syncwarp();\n"
         "      if (lane == 0) mbar_arrive(&empty[stage]);\n      continue;\n    }\n")
_NOMATH = (_W, _TILE_TOP, _TILE_TOP + "    {\n" + _SKIP)
_NOLAST = (_W, _TILE_TOP, _TILE_TOP + "    if (it == w.ntiles - 1) {\n" + _SKIP)
_NOEPI = (_W, "  stage_o<NA>(ost, o, wg, wq, g, t4);\n  named_barrier(1, NT);\n"
          "  finish_rows<BM>(p, w, split, b, red, mrow, rowv, tid);\n  named_barrier(1, NT);\n"
          "  store_rows<BM>(p, w, split, b, ost, rowv, tid);\n", "")
_NOCOMB = (_COMB, "  griddep_wait();\n  griddep_launch();\n",
           "  griddep_wait();\n  griddep_launch();\n  if (p.rows >= 0) return;\n")

#: variant name -> its (file, old text, new text) replacements, applied in order
VARIANTS: dict[str, tuple] = {
    "pf1": (_PF_ON, _tiles(1)),
    "pf2": (_PF_ON,),
    "pf4": (_PF_ON, _tiles(8)),
    "pfb2": (_PF_ON, _BULK),
    "pfl2": (_PF_ON, _LANES_OUT, _LANES),
    "ec": (_EARLY_TRIGGER,),
    "pf2ec": (_PF_ON, _EARLY_TRIGGER),
    "pf4ec": (_PF_ON, _tiles(8), _EARLY_TRIGGER),
    "headd": (_DELAY,),
    "pf2d": (_PF_ON, _DELAY),
    "pfl2d": (_PF_ON, _LANES_OUT, _LANES, _DELAY),
    "qk2": (_ONE_GROUP, _QK2_FN, _QK2_CALL),
    "lazy": (_LAZY_TPL, _LAZY_MAX, _LAZY_CALL),
    "lazyex2": (_LAZY_TPL, _LAZY_MAX, _LAZY_CALL, _EX2),
    "nomath": (_NOMATH,),
    "nolast": (_NOLAST,),
    "noepi": (_NOEPI,),
    "nocomb": (_NOCOMB,),
    "floor": (_NOMATH, _NOEPI, _NOCOMB),
}


def make_tree(out: Path, name: str, csrc: Path = CSRC) -> Path:
    """``out/name``: a copy of ``csrc`` with the variant's replacements (each old text must
    occur exactly once; ValueError names the one that does not)."""
    dst = out / name
    if dst.exists():
        shutil.rmtree(dst)
    shutil.copytree(csrc, dst)
    for fname, old, new in VARIANTS[name]:
        path = dst / fname
        text = path.read_text()
        if text.count(old) != 1:
            raise ValueError(f"variant {name}: anchor moved in {fname}: {old[:60]!r}")
        path.write_text(text.replace(old, new))
    return dst


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("out", help="folder for the variant trees (one subfolder each)")
    ap.add_argument("--only", default="", help=f"comma-separated names of {list(VARIANTS)}")
    args = ap.parse_args(argv)
    names = [n for n in args.only.split(",") if n] or list(VARIANTS)
    unknown = sorted(set(names) - set(VARIANTS))
    if unknown:
        sys.exit(f"variant_trees: unknown {unknown}; known: {list(VARIANTS)}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for n in names:
        print(make_tree(out, n))


if __name__ == "__main__":
    main()
