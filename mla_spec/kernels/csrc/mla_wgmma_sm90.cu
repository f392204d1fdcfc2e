// Split-KV MLA decode over the paged latent cache with Hopper's warpgroup MMA (sm_90a).
//
// Why: the mma.sync kernel (mla_splitkv_sm90.cu) needs the queries in registers, so every warp
// re-reads all of them from shared memory for every KV tile (147 KB of ldmatrix beside a 74 KB
// tile at 32 rows); its per-tile time, not the memory, bounded it at ~1.5 TB/s. wgmma reads
// both operands straight from shared memory in the layout the TMA engine writes (128-byte
// swizzle), so a tile costs two short MMA batches and a softmax.
//
// The product is "swapped" (as in mla/triton_paged.py): the KV tile is the MMA's M side, so the
// 32 query rows of DeepSeek's decode at TP4 (H 32, q_len 1) fill N = 32 without padding to 64:
//   S^T[64 tok, BM] = K[64 tok, 576] . Q^T          (A = K tile, B = Q; both K-major)
//   O^T[512, BM]   += V^T[512, 64 tok] . P^T         (A = V^T: M-major view of the same tile;
//                                                    B = P^T written to shared memory)
// Two consumer warpgroups: each computes half of S^T's 576-deep sum (18 of 36 k16 steps) and
// they add the halves through shared memory; both then hold the whole S^T and run the same
// softmax; each owns 256 of the 512 output dims. A ninth warp produces: it issues a tile's TMA
// loads (9 boxes of [64 tokens, 64 dims], one 8 KB swizzle-128B block per 64 dims) into a stage
// as soon as the 8 consumer warps have released it (an "empty" mbarrier), two stages in all.
// On a bf16 cache the nine boxes complete on three barriers (W_GROUPS), and Q K waits for each
// group just before its k16 steps: a tile streams in over ~2 µs at batch 1 (a CTA's share of
// the HBM), so most of Q K runs before its last box lands and the last tile's chain starts
// later in its work (H200: batch 1 ctx 32k 0.961x, 16k 0.971x, bs 32 ctx 4k 0.995x, bs 128
// ctx 1k 1.001x against one barrier a tile; nine groups 0.989x at 32k; 2026-12-01,
// docs/bench_mla.md).
//
// What it computes is exactly mla_spec.kernels.mla.mla_decode (fixed q_len, bf16 cache):
// row r = i * H + h of request b sees KV positions j < kv_len - q_len + i + 1 and gets
// v_scale * softmax_j(qk_scale * q . kv_j) @ kv_j[:512] (zeros for an empty window). Split
// output as in mla_splitkv_sm90.cu (partials + log2-sum-exp, merged by the combine kernel).
// Requirements (mla/sm90_wgmma.py wgmma_mla_supported): page size a multiple of 64 (a tile is
// 64 consecutive slots of one page), the cache a contiguous [slots, 576] bf16 tensor.
#include "sm90_fp8.cuh"

namespace {

using namespace sm90;

// S^T partial over the k16 steps 2 j + w (j < 18) of warpgroup w: A = K tile, B = Q (both
// K-major). Interleaving the steps makes a step's offset a constant plus w * 32 bytes, so the
// descriptors are one base each (a_desc, b_desc: w's first step) plus immediates.
template <int BM, bool F16>
__device__ __forceinline__ void qk_step(float (&s)[BM / 2], uint64_t a_desc, uint64_t b_desc,
                                        int j) {
  const uint32_t a_off = (j >> 1) * BLK + (j & 1) * 64, b_off = (j >> 1) * BM * 128 + (j & 1) * 64;
  Wgmma<BM, 0, F16>::run(s, a_desc + (a_off >> 4), b_desc + (b_off >> 4));
}

template <int BM, bool F16>
__device__ __forceinline__ void qk_half(float (&s)[BM / 2], uint64_t a_desc, uint64_t b_desc) {
#pragma unroll
  for (int j = 0; j < 18; ++j) qk_step<BM, F16>(s, a_desc, b_desc, j);
}

// qk_half with the tile's boxes in NG groups, each waited for just before its k16 steps (the
// bf16 cache: Q K runs on the boxes that have landed while the rest of the tile streams in)
template <int BM, int NG>
__device__ __forceinline__ void qk_groups(float (&s)[BM / 2], uint64_t a_desc, uint64_t b_desc,
                                          uint64_t* full_g, uint32_t parity) {
#pragma unroll
  for (int g = 0; g < NG; ++g) {
    mbar_wait(&full_g[g], parity);
    wgmma_fence();
#pragma unroll
    for (int j = 18 * g / NG; j < 18 * (g + 1) / NG; ++j) qk_step<BM, false>(s, a_desc, b_desc, j);
  }
}

#ifndef W_GROUPS
#define W_GROUPS 3
#endif

template <int BM, int KV, bool EARLY>
__device__ __forceinline__ void mla_wgmma(const WgParams& wp) {
  const MlaParams& p = wp.m;
  using T = KvTraits<KV>;
  static_assert(BM == 16 || BM == 32, "rows per CTA");
  constexpr int NA = BM / 2;  // accumulators of one m64nBM tile per thread
  constexpr int NC = BM / 4;  // query rows (S^T / O^T columns) a thread holds
  constexpr int NG = KV == KV_BF16 ? W_GROUPS : 1;  // a tile's box groups (qk_groups)
  extern __shared__ unsigned char smem_raw[];
  unsigned char* smem = smem_raw + ((1024 - (smem_u32(smem_raw) & 1023)) & 1023);
  unsigned char* kv_s = smem;                   // [STAGES][9][64 tok][128 B]
  unsigned char* q_s = kv_s + STAGES * TILE;    // [9][BM][128 B]
  unsigned char* p_s = q_s + NCH * BM * 128;    // P^T as [BM][64 tok] bf16, swizzled
  float* xbuf = reinterpret_cast<float*>(p_s + BM * 128);  // [2 wg][NA / 4][128 thr][4]
  float* red = xbuf + 2 * NA * 128;                         // [8 warps][BM]
  float* rowv = red + 8 * BM;                               // [2][BM] v_scale / l, maxima
  uint64_t* full = reinterpret_cast<uint64_t*>(rowv + 2 * BM);  // [STAGES][NG] boxes landed
  uint64_t* empty = full + STAGES * NG;                         // [STAGES] 8 warps done

  const int split = blockIdx.x, mb = blockIdx.y, b = blockIdx.z;
  const int tid = threadIdx.x, wg = tid >> 7, wt = tid & 127, wq = wt >> 5;
  const int lane = tid & 31, g = lane >> 2, t4 = lane & 3;
  CtaWork w;
  QueryLoad<BM> qload;
  constexpr int EARLY_KV = EARLY ? KV : -1;  // produce_early (sm90_wgmma.cuh)
  if (!cta_begin<BM, STAGES, EARLY_KV, NG>(wp, split, mb, b, tid, full, empty, w, qload,
                                                  kv_s))
    return;
  if (tid >= NT) {  // the producer warp
    if (lane == 0) produce<KV, NG>(wp, w, kv_s, full, empty);
    return;
  }
  qload.template store<T::f16>(q_s, tid);
  fence_proxy_async();
  named_barrier(1, NT);  // the queries are in shared memory (consumer warps only from here)

  // the NC query rows this thread holds (S^T / O^T column 8 * jn + 2 * t4 + e, index 2 jn + e)
  int bound[NC];
  float m_r[NC], l_r[NC];
  const int min_bound = init_rows<NC>(p, w, 0, t4, bound, m_r, l_r);
  float o[4][NA];
  zero_acc(o);
  const uint32_t p_base = smem_u32(p_s);
  const uint64_t q_desc = sw128_desc(smem_u32(q_s) + wg * 32, 16, 1024);
  const uint64_t p_desc = sw128_desc(p_base, 16, 1024);
  const float scale = p.qk_scale_log2;
  float4* xmine = reinterpret_cast<float4*>(xbuf) + wg * (NA / 4) * 128 + wt;
  const float4* xother = reinterpret_cast<const float4*>(xbuf) + (1 - wg) * (NA / 4) * 128 + wt;

  for (int it = 0; it < w.ntiles; ++it) {
    const int stage = it % STAGES, t0 = w.lo + it * BN;
    const uint32_t kv_base = smem_u32(kv_s + stage * TILE);
    if (NG == 1 && (!T::f16 || it == 0)) ready_tile<KV>(kv_s, full, it, w.lo, w.hi, tid);
    float s[NA];
    zero_acc(s);
    wgmma_fence();
    if constexpr (NG == 1)
      qk_half<BM, T::f16>(s, sw128_desc(kv_base + wg * 32, 16, 1024), q_desc);
    else
      qk_groups<BM, NG>(s, sw128_desc(kv_base + wg * 32, 16, 1024), q_desc, full + stage * NG,
                        (it / STAGES) & 1);
    wgmma_commit();
    wgmma_wait0();
    add_other_half(s, xmine, xother);
    // both groups' Q K are done (add_other_half's barrier): the tile's V rows past hi may be
    // zeroed now (fenced with P^T below)
    if (NG > 1) zero_v_tail(kv_s + stage * TILE, w.hi - t0, tid);

    // scale, causal / split mask, each query row's max over the tile's 64 tokens
    tile_col_max<NC>(s, bound, t0 + BN > min_bound, t0 + wq * 16 + g, scale,
                     red + (wg * 4 + wq) * BM, g, t4);
    named_barrier(2 + wg, 128);
    float alpha[NC];
    const bool rescale = tile_softmax<NC>(s, m_r, l_r, alpha, red + wg * 4 * BM, BM, t4);
    // P^T to shared memory by the warps of warpgroup w whose 16 tokens are w's half of the
    // tile (both groups hold the same P)
    uint32_t pk[NA / 2];
#pragma unroll
    for (int i = 0; i < NA; i += 2) pk[i / 2] = pack_h2<T::f16>(s[i], s[i + 1]);
    if ((wq >> 1) == wg) store_pt<BM>(p_base, pk, 0, wq, lane);
    rescale_cols(o, alpha, rescale);
    fence_proxy_async();
    named_barrier(1, NT);  // P^T complete
    pv_tile<BM, T::f16>(o, kv_base, p_desc, wg, lane, &empty[stage], [&] {
      if (T::f16 && it + 1 < w.ntiles) ready_tile<KV>(kv_s, full, it + 1, w.lo, w.hi, tid);
    });  // then the stage is free
  }
  // the next kernel may launch: here when it is not the combine (one split), else after the
  // stores (kernels/launch/pdl.py rule 5)
  const bool combine_next = p.split;
  if (!combine_next) griddep_launch();

  // l over the tile rows (lanes g) and warps of warpgroup 0, then v_scale / l and lse per row
  sum_over_g<NC>(l_r);
  named_barrier(1, NT);  // the KV stages and red are free
  float* mrow = rowv + BM;  // [BM] the rows' running maxima (free after the loop)
  if (wg == 0 && g == 0) put_row_sums<BM>(red, mrow, l_r, m_r, wq, t4);
  float* ost = reinterpret_cast<float*>(kv_s);  // O^T -> fp32 rows [BM][512]
  stage_o<NA>(ost, o, wg, wq, g, t4);
  named_barrier(1, NT);
  finish_rows<BM>(p, w, split, b, red, mrow, rowv, tid);
  named_barrier(1, NT);
  store_rows<BM>(p, w, split, b, ost, rowv, tid);
  // the combine may launch now (it waits for this grid to finish): after the stores, not
  // after the loop, 1.4-3.1% a call at batch 1 (kernels/launch/pdl.py rule 5)
  if (combine_next) griddep_launch();
}

}  // namespace

#define MLA_WGMMA(BM, KV, SUFFIX, EARLY) \
  WGMMA_ENTRY(mla_wgmma_m##BM##SUFFIX, NT + 32, mla_wgmma<BM, KV, EARLY>)

MLA_WGMMA(32, KV_BF16, , false)
MLA_WGMMA(32, KV_FP8, _f8, false)  // an e4m3 cache (sm90_fp8.cuh)
// the first tile into shared memory before the PDL wait (produce_early: WgParams::early_kv);
// builds of their own, so that the others carry none of its code
MLA_WGMMA(32, KV_BF16, _ek, true)
MLA_WGMMA(32, KV_FP8, _f8_ek, true)
