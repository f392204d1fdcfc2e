// Split-KV MLA decode with warpgroup MMA for 64 query rows per CTA (sm_90a): the 128-row
// classes (H 128 at q_len 1, DECODE without tensor parallelism; H 32 at q_len 4, TARGET_VERIFY
// at TP4), where mla_wgmma_sm90.cu's 32-row CTAs made four CTAs per request that each streamed
// the request's KV. Here two do. (Since the twelfth session the defaults run
// mla_wgmma_rows_sm90.cu, WR, for these classes: the rows on the MMA's M side read 35% fewer
// operand bytes and ran 1.15-1.3x faster; this kernel stays as variant W64.)
//
// Same tile, stages, producer warp and output path as mla_wgmma_sm90.cu (sm90_wgmma.cuh); the
// two consumer warpgroups split the work by rows instead of by the QK depth:
//   S_w^T[64 tok, 32] = K[64 tok, 576] . Q_w^T      warpgroup w: its 32 rows, all 36 k16 steps
//   softmax of its 32 rows (no exchange of S halves; the row max crosses its own 4 warps)
//   O_w^T[256, 64]   += V_w^T[256, 64 tok] . P^T     its 256 output dims, all 64 rows
// so P^T and every row's rescale factor cross through shared memory. The producer is a whole
// warpgroup that hands its registers to the consumers (setmaxnreg). Shared memory: two KV
// stages (144 KB), the queries (72 KB), P^T (8 KB), reductions: 227 KB less 480 bytes.
// What it computes: exactly mla_spec.kernels.mla_decode.mla_decode (fixed q_len, bf16 cache).
#include "sm90_fp8.cuh"

namespace {

using namespace sm90;

constexpr int BM = 64, RW = 32;  // query rows per CTA, per warpgroup

// S_w^T over all 36 k16 steps: A = K tile, B = the warpgroup's 32 query rows (both K-major)
template <bool F16>
__device__ __forceinline__ void qk_rows(float (&s)[RW / 2], uint64_t a_desc, uint64_t b_desc) {
#pragma unroll
  for (int j = 0; j < 36; ++j) {
    const uint32_t a_off = (j >> 2) * BLK + (j & 3) * 32, b_off = (j >> 2) * BM * 128 + (j & 3) * 32;
    Wgmma<RW, 0, F16>::run(s, a_desc + (a_off >> 4), b_desc + (b_off >> 4));
  }
}

template <bool L2PF, int KV>
__device__ __forceinline__ void mla_wgmma64(const WgParams& wp) {
  const MlaParams& p = wp.m;
  using T = KvTraits<KV>;
  constexpr int NA = RW / 2;  // S^T accumulators (m64n32) per thread
  constexpr int NC = RW / 4;  // own query rows a thread holds (S^T column 8 jn + 2 t4 + e)
  constexpr int NO = BM / 2;  // O^T accumulators per m64n64 tile
  extern __shared__ unsigned char smem_raw[];
  unsigned char* smem = smem_raw + ((1024 - (smem_u32(smem_raw) & 1023)) & 1023);
  unsigned char* kv_s = smem;                          // [STAGES][9][64 tok][128 B]
  unsigned char* q_s = kv_s + STAGES * TILE;           // [9][64 rows][128 B]
  unsigned char* p_s = q_s + NCH * BM * 128;           // P^T [64 rows][64 tok] bf16, swizzled
  float* red = reinterpret_cast<float*>(p_s + BM * 128);  // [2 wg][4 warps][RW]
  float* alpha_s = red + 8 * RW;                          // [BM] this tile's rescale factors
  float* rowv = alpha_s + BM;                             // [BM] v_scale / l
  uint64_t* full = reinterpret_cast<uint64_t*>(rowv + BM);
  uint64_t* empty = full + STAGES;

  const int split = blockIdx.x, mb = blockIdx.y, b = blockIdx.z;
  const int tid = threadIdx.x, wg = tid >> 7, wq = (tid & 127) >> 5;
  const int lane = tid & 31, g = lane >> 2, t4 = lane & 3;
  CtaWork w;
  QueryLoad<BM> qload;
  if (!cta_begin<BM, L2PF>(wp, split, mb, b, tid, full, empty, w, qload)) return;
  if (tid >= NT) {  // a producer warpgroup (one lane works) gives its registers away
    asm volatile("setmaxnreg.dec.sync.aligned.u32 40;\n" ::: "memory");
    if (tid == NT) produce<KV>(wp, w, kv_s, full, empty);
    return;
  }
  asm volatile("setmaxnreg.inc.sync.aligned.u32 232;\n" ::: "memory");
  qload.store<T::f16>(q_s, tid);
  fence_proxy_async();
  named_barrier(1, NT);

  const int rbase = RW * wg;  // this warpgroup's rows
  int bound[NC];
  float m_r[NC], l_r[NC];
  const int min_bound = init_rows<NC>(p, w, rbase, t4, bound, m_r, l_r);
  float o[4][NO];
  zero_acc(o);
  const uint32_t p_base = smem_u32(p_s);
  const uint64_t q_desc = sw128_desc(smem_u32(q_s) + rbase * 128, 16, 1024);
  const uint64_t p_desc = sw128_desc(p_base, 16, 1024);
  const float scale = p.qk_scale_log2;

  for (int it = 0; it < w.ntiles; ++it) {
    const int stage = it % STAGES, t0 = w.lo + it * BN;
    const uint32_t kv_base = smem_u32(kv_s + stage * TILE);
    if (!T::f16 || it == 0) ready_tile<KV>(kv_s, full, it, w.lo, w.hi, tid);
    float s[NA];
    zero_acc(s);
    wgmma_fence();
    qk_rows<T::f16>(s, sw128_desc(kv_base, 16, 1024), q_desc);
    wgmma_commit();
    wgmma_wait0();

    tile_col_max<NC>(s, bound, t0 + BN > min_bound, t0 + wq * 16 + g, scale,
                     red + (wg * 4 + wq) * RW, g, t4);
    named_barrier(1, NT);  // also: every warp is past PV(it - 1), so P^T and alpha_s are free
    float alpha[NC];
    tile_softmax<NC>(s, m_r, l_r, alpha, red + wg * 4 * RW, RW, t4);
    uint32_t pk[NA / 2];
#pragma unroll
    for (int i = 0; i < NA; i += 2) pk[i / 2] = pack_h2<T::f16>(s[i], s[i + 1]);
    // P^T rows of this warpgroup, this warp's 16 tokens (blocks: 8 tokens x 8 rows)
    store_pt<RW>(p_base, pk, rbase, wq, lane);
    if (wq == 0 && g == 0)
#pragma unroll
      for (int c = 0; c < NC; ++c) alpha_s[rbase + frag_col(c, t4)] = alpha[c];
    fence_proxy_async();
    named_barrier(1, NT);  // P^T and alpha of all 64 rows
    float a[NO / 2];  // the rescale factors of this thread's O^T columns (rows 8 jn + 2 t4 + e)
    bool rescale = false;
#pragma unroll
    for (int i = 0; i < NO / 2; ++i) {
      a[i] = alpha_s[8 * (i >> 1) + 2 * t4 + (i & 1)];
      rescale |= a[i] != 1.f;
    }
    if (__any_sync(0xffffffffu, rescale))
#pragma unroll
      for (int mt = 0; mt < 4; ++mt)
#pragma unroll
        for (int i = 0; i < NO; ++i) o[mt][i] *= a[2 * (i >> 2) + (i & 1)];
    pv_tile<BM, T::f16>(o, kv_base, p_desc, wg, lane, &empty[stage], [&] {
      if (T::f16 && it + 1 < w.ntiles) ready_tile<KV>(kv_s, full, it + 1, w.lo, w.hi, tid);
    });  // then the stage is free
  }
  if (!p.split) griddep_launch();  // the next kernel; the combine after the stores (pdl.py rule 5)

  sum_over_g<NC>(l_r);
  named_barrier(1, NT);  // the KV stages and red are free
  if (g == 0)
#pragma unroll
    for (int c = 0; c < NC; ++c) red[(wg * 4 + wq) * RW + frag_col(c, t4)] = l_r[c];
  float* ost = reinterpret_cast<float*>(kv_s);  // O^T -> fp32 rows [64][512]
  stage_o<NO>(ost, o, wg, wq, g, t4);
  named_barrier(1, NT);
  if (wq == 0 && g == 0)  // lanes 0-3 of a warpgroup's first warp hold its 32 rows
#pragma unroll
    for (int c = 0; c < NC; ++c) {
      const int col = frag_col(c, t4);
      const float* rr = red + wg * 4 * RW + col;
      finish_row(p, w, split, b, rbase + col, rr[0] + rr[RW] + rr[2 * RW] + rr[3 * RW], m_r[c],
                 rowv);
    }
  named_barrier(1, NT);
  store_rows<BM>(p, w, split, b, ost, rowv, tid);
  if (p.split) griddep_launch();
}

}  // namespace

// 3 warpgroups: registers are allocated per warpgroup, and 64 rows of O^T take 128 per thread
#define MLA_WGMMA64(L2PF, KV, SUFFIX) \
  WGMMA_ENTRY(mla_wgmma_m64##SUFFIX, NT + 128, mla_wgmma64<L2PF, KV>)

MLA_WGMMA64(false, KV_BF16, )
MLA_WGMMA64(true, KV_BF16, p)  // the first tiles into L2 before the PDL wait
MLA_WGMMA64(false, KV_FP8, _f8)  // an e4m3 cache (sm90_fp8.cuh)
