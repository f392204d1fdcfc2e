// Merge the split-KV partials of the hand-written MLA kernels (flash-decoding's second pass).
//
// Split s of row r (a flattened (token, head)) left a normalized partial o_s [512] (fp32 or
// bf16) and its log2-sum-exp lse_s (-inf: the split saw no KV; its partial may be garbage):
//   out = sum_s w_s o_s / sum_s w_s,  w_s = 2^(lse_s - max_s lse_s),  lse = log2(sum) + max
// (zeros and -inf when every split was empty). Same contract as the Triton combine
// (mla/combine.py combine_splits), whose twin combine_splits_ref is the reference.
//
// Why a CUDA kernel: at batch 1 (32 rows x 128 splits) the Triton kernel's program took
// 2.6-3.1 µs from its PDL release to its last store (H200, 2026-11-30, global timer): its
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

#include "sm90_common.cuh"

struct CombineParams {
  const void* part;        // [S][rows][512] fp32 or bf16 (row stride 512)
  const float* part_lse;   // [S][rows] log2 (split stride s_ls)
  __nv_bfloat16* out;      // row r = t * H + h at t * s_o_t + h * s_o_h
  float* lse;              // [rows] natural log, or null
  long long s_ps, s_ls, s_o_t, s_o_h;
  int rows, H, S, pad;
};
// mla/combine.py _CombineParams mirrors this layout
static_assert(sizeof(CombineParams) == 80, "layout");

namespace {

using namespace sm90;

constexpr int DV = 512, NT = 256, COLS = 64, CPT = 8;  // columns per CTA / per thread
constexpr int KMAX = 4;                                // a thread's splits per load round

template <bool BF16>
__device__ __forceinline__ void load8(const CombineParams& p, long long s, long long row, int col,
                                      float (&v)[CPT]) {
  const long long off = s * p.s_ps + row * DV + col;
  if constexpr (BF16) {
    const uint4 x = __ldg(reinterpret_cast<const uint4*>(
        static_cast<const __nv_bfloat16*>(p.part) + off));
    const uint32_t w[4] = {x.x, x.y, x.z, x.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) v[2 * i] = bf16_lo(w[i]), v[2 * i + 1] = bf16_hi(w[i]);
  } else {
    const float4* src = reinterpret_cast<const float4*>(static_cast<const float*>(p.part) + off);
    const float4 a = __ldg(src), b = __ldg(src + 1);
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

}  // namespace

#define MLA_COMBINE(BF16, G, NAME)                                                  \
  extern "C" __global__ void __launch_bounds__(NT) NAME(const __grid_constant__ CombineParams p) { \
    combine<BF16, G>(p);                                                            \
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
