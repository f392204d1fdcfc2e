// The split-KV merge inside the split kernel: the splits of a (request, row block) wait for
// each other at a barrier in global memory, then each merges a share of the rows. No combine
// kernel, so none of its two hand-offs (the split grid's completion and memory flush before
// the combine's PDL release, then the combine's before the next call's).
//
// Why: at batch 1 ctx 32k (128 splits x 32 rows) the combine took ~4.6 µs between the split
// kernel's last store and the next call's release (benchmarks/bench_call_timeline.py,
// docs/bench_mla.md v16), of a ~19.5 µs call. Here the CTAs that finished early wait at the
// barrier anyway, and the merge reads 32 KB of L2 a CTA. Measured (v17): 1-2% faster (ctx 32k
// 19.03-19.09 vs 19.23-19.44 µs). After the last CTA's stores, ~1.3 µs to the barrier's opening
// (the add's round trip, the reset seen), ~1.3 to the loads' arrival, ~0.8 to the stores, then
// the grid's end and the next call's PDL release: about what the combine kernel's two hand-offs
// cost. Off by default (mla_decode_wgmma.GRID_MERGE: the barrier needs every CTA resident).
//
// The barrier may only wait for CTAs that are resident: the launcher takes this path only when
// every CTA of the grid fits on the GPU at once (mla_decode_wgmma.grid_merges: the kernel
// holds one CTA an SM, and the grid has no more CTAs than the device has SMs). One counter per (request, row block) (mla_spec.kernels.arrival's
// arrival_counters: zero between calls): each CTA adds its arrival; the last one sets it back
// to zero, which is what the others wait for (the next call's CTAs cannot arrive before this
// grid has ended: they wait for it at their PDL wait). No memset per call, and a CUDA graph
// replays it. A barrier that does not open within ~4 s traps (a launch error, not a hang).
//
// The merge (same formula and contract as mla_combine.cu): split s of row r left a normalized
// partial o_s [512] and its log2-sum-exp lse_s (-inf: no KV, o_s unused); out = sum_s w_s o_s /
// sum_s w_s with w_s = 2^(lse_s - max lse). A row's 64 chunks of 8 columns are dealt out in
// contiguous ranges, ceil(rows * 64 / splits) chunks a CTA, 16 chunks a pass. Thread t takes
// chunk t % 16 of the pass and split group g = t / 16 (splits g, g + 16, ...), so that a
// half-warp reads 256 contiguous bytes of one split (a first version gave a chunk's 16 splits
// to 16 lanes: 16-byte pieces 32 KB apart, ~5 µs for the 32 KB a CTA merges at batch 1 ctx
// 32k instead of one L2 round trip). A thread merges its splits online (running max, rescaled
// sums); the two groups of a warp meet by a shuffle, the 8 warps in shared memory (the free KV
// stages), where a thread a column adds them up at their common max. Twin:
// mla_spec.kernels.grid_merge (the same ranges and order; its test compares it with
// combine_splits_ref).
#pragma once
#include "sm90_wgmma.cuh"

namespace {

__device__ __forceinline__ int ld_acquire_gpu(const int* a) {
  int v;
  asm volatile("ld.acquire.gpu.global.b32 %0, [%1];\n" : "=r"(v) : "l"(a) : "memory");
  return v;
}

__device__ __forceinline__ void st_release_gpu(int* a, int v) {
  asm volatile("st.release.gpu.global.b32 [%0], %1;\n" ::"l"(a), "r"(v) : "memory");
}

__device__ __forceinline__ int atom_add_acq_rel_gpu(int* a, int v) {
  int old;
  asm volatile("atom.acq_rel.gpu.global.add.s32 %0, [%1], %2;\n"
               : "=r"(old) : "l"(a), "r"(v) : "memory");
  return old;
}

__device__ __forceinline__ unsigned long long global_ns() {
  unsigned long long t;
  asm volatile("mov.u64 %0, %%globaltimer;\n" : "=l"(t));
  return t;
}

// one thread of each of the `arrivals` CTAs sharing `count`, after a CTA barrier behind its
// threads' stores (the release of the add covers them: cumulativity); true for the last one,
// which opens the barrier
__device__ __forceinline__ bool split_arrive(int* count, int arrivals) {
  if (atom_add_acq_rel_gpu(count, 1) != arrivals - 1) return false;
  st_release_gpu(count, 0);
  return true;
}

// the others wait for the last one (then a CTA barrier in front of the loads of the other
// CTAs' stores)
__device__ __forceinline__ void split_wait(const int* count) {
  const unsigned long long t0 = global_ns();
  while (ld_acquire_gpu(count) != 0)
    if (global_ns() - t0 > 4000000000ull) __trap();
}

// benchmarks/bench_cta_phases.py defines it to stamp the merge's steps
#ifndef GM_STAMP
#define GM_STAMP(i)
#endif

constexpr int GM_CPP = 16, GM_G = NT / GM_CPP, GM_KR = 8;  // chunks a pass, split groups, and
                                                          // splits a thread loads in one round

// the raw 8 columns of a partial (bf16: one 16-byte word; fp32: two)
template <bool BF16>
struct Raw8 {
  uint4 x[BF16 ? 1 : 2];
};

// split s's partial row grow at column col (written by other CTAs of this grid: not the
// non-coherent path; weak loads are enough behind the barrier's acquire, which invalidates the
// SM's L1, and a strong load, e.g. __ldcg's, costs more); unconverted, so that a round's loads
// all go out before any use
template <bool BF16>
__device__ __forceinline__ Raw8<BF16> load_raw8(const MlaParams& p, int s, long long grow,
                                                int col) {
  const long long off = s * p.s_ps + grow * DV + col;
  Raw8<BF16> r;
  if constexpr (BF16) {
    r.x[0] = *reinterpret_cast<const uint4*>(reinterpret_cast<const __nv_bfloat16*>(p.part) + off);
  } else {
    const uint4* src = reinterpret_cast<const uint4*>(p.part + off);
    r.x[0] = src[0];
    r.x[1] = src[1];
  }
  return r;
}

template <bool BF16>
__device__ __forceinline__ void unpack8(const Raw8<BF16>& r, float (&v)[8]) {
  if constexpr (BF16) {
    const uint32_t u[4] = {r.x[0].x, r.x[0].y, r.x[0].z, r.x[0].w};
#pragma unroll
    for (int i = 0; i < 4; ++i) v[2 * i] = bf16_lo(u[i]), v[2 * i + 1] = bf16_hi(u[i]);
  } else {
    const uint32_t u[8] = {r.x[0].x, r.x[0].y, r.x[0].z, r.x[0].w,
                           r.x[1].x, r.x[1].y, r.x[1].z, r.x[1].w};
#pragma unroll
    for (int i = 0; i < 8; ++i) v[i] = __uint_as_float(u[i]);
  }
}

// (m, den, acc) and the partial (m2, den2, acc2) as one: both rescaled to the larger max
__device__ __forceinline__ void merge_into(float& m, float& den, float (&acc)[8], float m2,
                                           float den2, const float (&acc2)[8]) {
  const float mx = fmaxf(m, m2), mu = mx == -INFINITY ? 0.f : mx;
  const float a = exp2f(m - mu), c = exp2f(m2 - mu);
  den = den * a + den2 * c;
#pragma unroll
  for (int i = 0; i < 8; ++i) acc[i] = acc[i] * a + acc2[i] * c;
  m = mx;
}

// After store_rows (every thread of the NT consumer threads; bar: a named barrier of theirs;
// xs: 5 KB of free shared memory): the split barrier, then this CTA's chunks of the row block
// merged into out (and lse). BF16: the partials are bf16 (p.part_bf16)
template <int BM, bool BF16>
__device__ __forceinline__ void grid_merge(const WgParams& wp, const CtaWork& w, int split,
                                           int b, int tid, int bar, float* xs) {
  const MlaParams& p = wp.m;
  const int S = p.num_splits;
  named_barrier(bar, NT);
  if (tid == 0) {
    GM_STAMP(0);
    int* count = wp.merge + b * gridDim.y + blockIdx.y;
    if (!split_arrive(count, S)) {
      GM_STAMP(1);
      split_wait(count);
    }
    GM_STAMP(2);
  }
  named_barrier(bar, NT);
  const int nck = min(BM, w.n_rows - w.m0) * (DV / 8), per = (nck + S - 1) / S;
  const int lo = split * per, hi = min(lo + per, nck), cl = tid % GM_CPP, g = tid / GM_CPP;
  float* xw = xs + (g >> 1) * GM_CPP * 10 + cl;  // [8 warps][m, den, acc 8][16 chunks]
  for (int c0 = lo; c0 < hi; c0 += GM_CPP) {
    const int c = min(c0 + cl, hi - 1), r = c >> 6, col = (c & 63) * 8;
    const long long grow = static_cast<long long>(b) * w.n_rows + w.m0 + r;
    float m = -INFINITY, den = 0.f, acc[8] = {};
    for (int s0 = g; s0 < S; s0 += GM_G * GM_KR) {
      float l[GM_KR];
      Raw8<BF16> raw[GM_KR];
#pragma unroll
      for (int k = 0; k < GM_KR; ++k) {  // one round of loads (past S: split S - 1 again)
        const int s = min(s0 + k * GM_G, S - 1);
        l[k] = p.part_lse[s * p.s_ls + grow];
        raw[k] = load_raw8<BF16>(p, s, grow, col);
      }
      float mx = m;
#pragma unroll
      for (int k = 0; k < GM_KR; ++k) {
        if (s0 + k * GM_G >= S) l[k] = -INFINITY;
        mx = fmaxf(mx, l[k]);
      }
      if (tid == 0) GM_STAMP(3);
      const float mu = mx == -INFINITY ? 0.f : mx, a = exp2f(m - mu);
      den *= a;
#pragma unroll
      for (int i = 0; i < 8; ++i) acc[i] *= a;
#pragma unroll
      for (int k = 0; k < GM_KR; ++k) {
        const float wk = exp2f(l[k] - mu);  // 0 for an empty split, whose partial may be NaN
        float v[8];
        unpack8<BF16>(raw[k], v);
        den += wk;
#pragma unroll
        for (int i = 0; i < 8; ++i) acc[i] += wk > 0.f ? wk * v[i] : 0.f;
      }
      m = mx;
    }
    {  // the warp's two split groups (lanes cl and cl + 16)
      float acc2[8];
#pragma unroll
      for (int i = 0; i < 8; ++i) acc2[i] = __shfl_xor_sync(0xffffffffu, acc[i], 16);
      merge_into(m, den, acc, __shfl_xor_sync(0xffffffffu, m, 16),
                 __shfl_xor_sync(0xffffffffu, den, 16), acc2);
    }
    if ((tid & 31) < GM_CPP) {
      xw[0] = m;
      xw[GM_CPP] = den;
#pragma unroll
      for (int i = 0; i < 8; ++i) xw[(2 + i) * GM_CPP] = acc[i];
    }
    named_barrier(bar, NT);
    // the 8 warps' sums at their common max: thread t < 128 takes column t % 8 of chunk t / 8
    const int fc = (tid >> 3) & (GM_CPP - 1), fi = tid & 7;
    if (tid < GM_CPP * 8 && c0 + fc < hi) {
      float mv[NT / 32], mx = -INFINITY;
#pragma unroll
      for (int v = 0; v < NT / 32; ++v) mx = fmaxf(mx, mv[v] = xs[v * GM_CPP * 10 + fc]);
      const float mu = mx == -INFINITY ? 0.f : mx;
      float dsum = 0.f, osum = 0.f;
#pragma unroll
      for (int v = 0; v < NT / 32; ++v) {
        const float wv = exp2f(mv[v] - mu);
        dsum += wv * xs[(v * 10 + 1) * GM_CPP + fc];
        osum += wv * xs[(v * 10 + 2 + fi) * GM_CPP + fc];
      }
      const int cc = c0 + fc, row = w.m0 + (cc >> 6), ti = div_small(row, p.H);
      const float o = dsum > 0.f ? osum / dsum : 0.f;
      out_row(p, b, ti, row - ti * p.H)[(cc & 63) * 8 + fi] = __float2bfloat16_rn(o);
      if (p.write_lse && (cc & 63) == 0 && fi == 0)
        p.lse[static_cast<long long>(b) * w.n_rows + row] =
            row_lse2(mx, dsum) * 0.6931471805599453f;
    }
    if (c0 + GM_CPP < hi) named_barrier(bar, NT);  // xs read before the next pass
  }
}

}  // namespace
