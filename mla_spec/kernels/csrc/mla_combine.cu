// Merge the split-KV partials of the hand-written MLA kernels (flash-decoding's second pass).
//
// Split s of row r (a flattened (token, head)) left a normalized partial o_s [512] (fp32 or
// bf16) and its log2-sum-exp lse_s (-inf: the split saw no KV; its partial may be garbage):
//   out = sum_s w_s o_s / sum_s w_s,  w_s = 2^(lse_s - max_s lse_s),  lse = log2(sum) + max
// (zeros and -inf when every split was empty). Same contract as the Triton combine
// (mla_decode_combine.combine_splits), whose twin combine_splits_ref is the reference.
//
// Why a CUDA kernel: at batch 1 (32 rows x 128 splits) the Triton kernel's program took
// 2.6-3.1 µs from its PDL release to its last store (benchmarks/bench_call_timeline.py): its
// [128 splits, 64 columns] slab on 2 warps compiles to ~1700 instructions, all run once from a
// cold instruction cache. Here a CTA of 256 threads takes R rows x 64 columns; thread t holds
// 8 columns (one 16-byte bf16 load, two fp32) of split group g (splits g, g + G, ...), so that
// a row's loads are one round of at most 4 per thread for S <= 4 G, the weights need one max
// over the row's threads, and the G groups' sums meet by shuffles (and, for G >= 8, in 2 KB of
// shared memory: little, so the next split kernel's CTAs fit beside the combine's). G x R = 32:
// G = 32 for 128 splits (4 a thread), G = 2 for 2 splits (16 rows a CTA). Rows < 2^21
// (div_small); out rows 16-byte aligned (one 16-byte store a thread).
#include <cuda_bf16.h>
#include <math.h>
#include <stddef.h>

#include "sm90_common.cuh"

struct CombineParams {
  const void* part;        // [S][rows][512] fp32 or bf16 (row stride 512)
  const float* part_lse;   // [S][rows] log2 (split stride s_ls)
  __nv_bfloat16* out;      // row r = t * H + h at t * s_o_t + h * s_o_h
  float* lse;              // [rows] natural log, or null
  long long s_ps, s_ls, s_o_t, s_o_h;
  int rows, H, S, pad;
  const int* flags;        // combine_flagged: the split grid's flags [requests][row blocks][S]
  int n_rows, bm, m_blocks, pad2;  // and its rows a request, rows a row block, row blocks
};
// mla_decode_combine_cuda._CombineParams mirrors this layout
static_assert(sizeof(CombineParams) == 104 && offsetof(CombineParams, flags) == 80, "layout");

namespace {

using namespace sm90;

constexpr int DV = 512, NT = 256, COLS = 64, CPT = 8;  // columns per CTA / per thread
constexpr int KMAX = 4;                                // a thread's splits per load round

// CG: through L2 only (the flagged combine reads partials stored while it runs), else the
// read-only path
template <bool BF16, bool CG = false>
__device__ __forceinline__ void load8(const CombineParams& p, long long s, long long row, int col,
                                      float (&v)[CPT]) {
  const long long off = s * p.s_ps + row * DV + col;
  if constexpr (BF16) {
    const uint4* src = reinterpret_cast<const uint4*>(static_cast<const __nv_bfloat16*>(p.part) + off);
    const uint4 x = CG ? __ldcg(src) : __ldg(src);
    const uint32_t w[4] = {x.x, x.y, x.z, x.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) v[2 * i] = bf16_lo(w[i]), v[2 * i + 1] = bf16_hi(w[i]);
  } else {
    const float4* src = reinterpret_cast<const float4*>(static_cast<const float*>(p.part) + off);
    const float4 a = CG ? __ldcg(src) : __ldg(src), b = CG ? __ldcg(src + 1) : __ldg(src + 1);
    v[0] = a.x, v[1] = a.y, v[2] = a.z, v[3] = a.w, v[4] = b.x, v[5] = b.y, v[6] = b.z,
    v[7] = b.w;
  }
}

// one split's share: weight w (0 for an empty split, whose partial v is not used: it may be
// NaN) into the row's sum and its 8 columns
__device__ __forceinline__ void add_split(float (&acc)[CPT], float& den, float w,
                                          const float (&v)[CPT]) {
  den += w;
#pragma unroll
  for (int i = 0; i < CPT; ++i) acc[i] += w > 0.f ? w * v[i] : 0.f;
}

// a row's 8 merged columns (and its natural lse, from column 0's thread): acc / den, zeros
// and -inf when every split was empty (den 0); m: the max log2-sum-exp the sums are taken at
__device__ __forceinline__ void store_row(const CombineParams& p, int row, int col,
                                          const float (&acc)[CPT], float den, float m) {
  const float inv = den > 0.f ? 1.f / den : 0.f;
  uint32_t h2[CPT / 2];
#pragma unroll
  for (int i = 0; i < CPT / 2; ++i) h2[i] = pack_bf16(acc[2 * i] * inv, acc[2 * i + 1] * inv);
  const int t = div_small(row, p.H);
  *reinterpret_cast<uint4*>(p.out + t * p.s_o_t + static_cast<long long>(row - t * p.H) * p.s_o_h +
                            col) = make_uint4(h2[0], h2[1], h2[2], h2[3]);
  if (p.lse != nullptr && col == 0)
    p.lse[row] = den > 0.f ? (m + log2f(den)) * 0.6931471805599453f : -INFINITY;
}

template <bool BF16, int G>
__device__ __forceinline__ void combine(const CombineParams& p) {
  constexpr int R = 32 / G, TPR = COLS / CPT * G;  // rows a CTA, threads a row
  constexpr int WPR = TPR > 32 ? TPR / 32 : 1;      // warps a row
  __shared__ float acc_s[R][WPR][COLS];             // 2 KB: small beside the next split CTA
  __shared__ float den_s[R][WPR], max_s[NT / 32];
  const int tid = threadIdx.x, c8 = tid % (COLS / CPT), g = (tid / (COLS / CPT)) % G;
  const int rl = tid / TPR, row = blockIdx.x * R + rl, col = blockIdx.y * COLS + c8 * CPT;
  const bool live = row < p.rows;
  griddep_wait();
  griddep_launch();

  // the first round's LSEs and partials at once (all of them when S <= KMAX G), then the max
  float v[KMAX][CPT], l[KMAX];
#pragma unroll
  for (int k = 0; k < KMAX; ++k) {
    const int s = g + k * G;
    l[k] = -INFINITY;
#pragma unroll
    for (int i = 0; i < CPT; ++i) v[k][i] = 0.f;
    if (live && s < p.S) {
      l[k] = p.part_lse[s * p.s_ls + row];
      load8<BF16>(p, s, row, col, v[k]);
    }
  }
  float m = fmaxf(fmaxf(l[0], l[1]), fmaxf(l[2], l[3]));
  if (live)
#pragma unroll 1
    for (int s = g + KMAX * G; s < p.S; s += G) m = fmaxf(m, p.part_lse[s * p.s_ls + row]);
#pragma unroll
  for (int o = COLS / CPT; o < 32 && o < TPR; o *= 2)  // over the row's groups in this warp
    m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o));
  if constexpr (WPR > 1) {  // and over the row's warps
    if (tid % 32 == 0) max_s[tid / 32] = m;
    __syncthreads();
#pragma unroll
    for (int w = 0; w < WPR; ++w) m = fmaxf(m, max_s[rl * WPR + w]);
  }
  const float m_use = m == -INFINITY ? 0.f : m;

  float acc[CPT] = {}, den = 0.f;
#pragma unroll
  for (int k = 0; k < KMAX; ++k) add_split(acc, den, exp2f(l[k] - m_use), v[k]);
  if (live)
#pragma unroll 1
    for (int s = g + KMAX * G; s < p.S; s += G) {  // more than KMAX splits a thread
      float x[CPT];
      load8<BF16>(p, s, row, col, x);
      add_split(acc, den, exp2f(p.part_lse[s * p.s_ls + row] - m_use), x);
    }
  // the groups' sums: over this warp's by shuffles, then (G >= 8) over the row's warps
#pragma unroll
  for (int o = COLS / CPT; o < 32 && o < TPR; o *= 2) {
    den += __shfl_xor_sync(0xffffffffu, den, o);
#pragma unroll
    for (int i = 0; i < CPT; ++i) acc[i] += __shfl_xor_sync(0xffffffffu, acc[i], o);
  }
  if constexpr (WPR > 1) {
    const int wr = (tid / 32) % WPR, lane = tid % 32;
    if (lane < COLS / CPT) {
#pragma unroll
      for (int i = 0; i < CPT; ++i) acc_s[rl][wr][c8 * CPT + i] = acc[i];
      if (c8 == 0) den_s[rl][wr] = den;
    }
    __syncthreads();
    if (wr != 0 || lane >= COLS / CPT) return;
    for (int w = 1; w < WPR; ++w) {
      den += den_s[rl][w];
#pragma unroll
      for (int i = 0; i < CPT; ++i) acc[i] += acc_s[rl][w][c8 * CPT + i];
    }
  }
  if (!live || g != 0) return;
  store_row(p, row, col, acc, den, m);
}

// The flagged combine: launched while the split grid still stores its rows (split_trigger in
// sm90_wgmma.cuh), it merges each split as soon as its CTA's flag is up rather than once the
// whole grid has ended and its memory is flushed. Why: at batch 1 ctx 32k (128 splits x 32
// rows) the combine kernel's PDL release came ~0.5 µs after the split grid's last store and its
// program took 2.6-3.1 µs more, mostly the L2 round trips of all 4 MB of partials at once
// (docs/bench_mla.md v16); here most partials are merged while the last CTAs still run, and
// after the last flag a thread has at most its last splits to load. Same threads and columns as
// combine(); each thread keeps a running (max, sum, 8 columns) instead of one max first, and
// adds its splits in split order whatever order their flags go up in (a split up early waits
// for the ones before it), so that a call gives the same bits every time. The lanes c8 < KMAX of a group poll its KMAX splits of a round (relaxed loads, then
// one acquire fence for the ones up); loads go through L2 (.cg): a line cached in L1 before
// another CTA's rows of it were stored must not be read. Rule 1 of kernels/pdl.py does not
// hold here: the launcher pairs it only with a split kernel that raises the flags. It lets the
// next grid launch at once, as combine() does after its wait (triggered after the merge, the
// next split kernel's CTAs entered only when this grid was nearly done, and their start was no
// longer hidden: +2.5 µs a call at batch 1 ctx 32k), and waits for the split grid's end before
// its own (griddep_wait): when a kernel after it is released, the split grid has ended too. A flag not up within ~4 s traps (a launch error, not a hang).
template <bool BF16, int G>
__device__ __forceinline__ void combine_flagged(const CombineParams& p) {
  constexpr int R = 32 / G, TPR = COLS / CPT * G, WPR = TPR > 32 ? TPR / 32 : 1;
  __shared__ float acc_s[R][WPR][COLS];
  __shared__ float den_s[R][WPR], max_s[R][WPR];
  const int tid = threadIdx.x, lane = tid % 32, c8 = tid % (COLS / CPT);
  const int g = (tid / (COLS / CPT)) % G, rl = tid / TPR, row = blockIdx.x * R + rl;
  const int col = blockIdx.y * COLS + c8 * CPT;
  const bool live = row < p.rows;
  const int b = live ? div_small(row, p.n_rows) : 0;
  const int* fl = p.flags + (static_cast<long long>(b) * p.m_blocks +
                             div_small(row - b * p.n_rows, p.bm)) * p.S * SPLIT_FLAG_STRIDE;
  // the next grid may launch once every CTA of this one is resident (the split grid's next
  // call: its CTAs enter, load their first tile with early_kv and wait for this grid's end)
  griddep_launch();
  float m = -INFINITY, den = 0.f, acc[CPT] = {};
  const unsigned long long t0 = global_ns();
#pragma unroll 1
  for (int s0 = g; s0 - g < p.S; s0 += KMAX * G) {  // a round: splits s0 + k G, k < KMAX
    unsigned pend = 0;
#pragma unroll
    for (int k = 0; k < KMAX; ++k) pend |= (live && s0 + k * G < p.S) ? 1u << k : 0u;
    while (__any_sync(0xffffffffu, pend != 0)) {
      const bool up = c8 < KMAX && ((pend >> c8) & 1) &&
                      ld_relaxed_gpu(fl + (s0 + c8 * G) * SPLIT_FLAG_STRIDE) != 0;
      unsigned ready = (__ballot_sync(0xffffffffu, up) >> (lane & ~7)) & pend;
      ready &= ~(ready + (pend & -pend));  // the splits up from the first pending one on, in order
      if (ready == 0) {
        if (pend != 0 && global_ns() - t0 > 4000000000ull) __trap();
        continue;
      }
      fence_acq_rel_gpu();  // behind the flags seen up: their CTAs' partials
      float l[KMAX], v[KMAX][CPT];
#pragma unroll
      for (int k = 0; k < KMAX; ++k)
        if ((ready >> k) & 1) {
          const int s = s0 + k * G;
          l[k] = __ldcg(p.part_lse + s * p.s_ls + row);
          load8<BF16, true>(p, s, row, col, v[k]);
        }
#pragma unroll
      for (int k = 0; k < KMAX; ++k)
        if ((ready >> k) & 1) {  // one split at a time, in split order: the same bits every run
          const float mx = fmaxf(m, l[k]), mu = mx == -INFINITY ? 0.f : mx;
          const float a = exp2f(m - mu);
          den *= a;
#pragma unroll
          for (int i = 0; i < CPT; ++i) acc[i] *= a;
          add_split(acc, den, exp2f(l[k] - mu), v[k]);
          m = mx;
        }
      pend &= ~ready;
    }
  }
  griddep_wait();  // the split grid has ended (so has it once this grid has: pdl.py rule 3)
  // the groups' states: over this warp's by shuffles, then (G >= 8) over the row's warps
#pragma unroll
  for (int o = COLS / CPT; o < 32 && o < TPR; o *= 2) {
    float acc2[CPT];
#pragma unroll
    for (int i = 0; i < CPT; ++i) acc2[i] = __shfl_xor_sync(0xffffffffu, acc[i], o);
    const float m2 = __shfl_xor_sync(0xffffffffu, m, o), d2 = __shfl_xor_sync(0xffffffffu, den, o);
    merge_into(m, den, acc, m2, d2, acc2);
  }
  if constexpr (WPR > 1) {
    const int wr = (tid / 32) % WPR;
    if (lane < COLS / CPT) {
#pragma unroll
      for (int i = 0; i < CPT; ++i) acc_s[rl][wr][c8 * CPT + i] = acc[i];
      if (c8 == 0) den_s[rl][wr] = den, max_s[rl][wr] = m;
    }
    __syncthreads();
    if (wr != 0 || lane >= COLS / CPT) return;
    for (int w = 1; w < WPR; ++w) {
      float acc2[CPT];
#pragma unroll
      for (int i = 0; i < CPT; ++i) acc2[i] = acc_s[rl][w][c8 * CPT + i];
      merge_into(m, den, acc, max_s[rl][w], den_s[rl][w], acc2);
    }
  }
  if (!live || g != 0) return;
  store_row(p, row, col, acc, den, m);
}

}  // namespace

#define MLA_COMBINE(BF16, G, NAME)                                                  \
  extern "C" __global__ void __launch_bounds__(NT) NAME(const __grid_constant__ CombineParams p) { \
    combine<BF16, G>(p);                                                            \
  }

// bf16 partials only: the split kernel that raises the flags (W) writes bf16 at 32 rows
#define MLA_COMBINE_FLAGGED(G, NAME)                                                \
  extern "C" __global__ void __launch_bounds__(NT) NAME(const __grid_constant__ CombineParams p) { \
    combine_flagged<true, G>(p);                                                    \
  }

MLA_COMBINE(true, 32, mla_combine_bf16_g32)
MLA_COMBINE(true, 16, mla_combine_bf16_g16)
MLA_COMBINE(true, 8, mla_combine_bf16_g8)
MLA_COMBINE(true, 4, mla_combine_bf16_g4)
MLA_COMBINE(true, 2, mla_combine_bf16_g2)
MLA_COMBINE(false, 32, mla_combine_f32_g32)
MLA_COMBINE(false, 16, mla_combine_f32_g16)
MLA_COMBINE(false, 8, mla_combine_f32_g8)
MLA_COMBINE(false, 4, mla_combine_f32_g4)
MLA_COMBINE(false, 2, mla_combine_f32_g2)
MLA_COMBINE_FLAGGED(32, mla_combine_fl_bf16_g32)
MLA_COMBINE_FLAGGED(16, mla_combine_fl_bf16_g16)
MLA_COMBINE_FLAGGED(8, mla_combine_fl_bf16_g8)
MLA_COMBINE_FLAGGED(4, mla_combine_fl_bf16_g4)
MLA_COMBINE_FLAGGED(2, mla_combine_fl_bf16_g2)
