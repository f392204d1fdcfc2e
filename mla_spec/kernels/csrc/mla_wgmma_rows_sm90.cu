// Split-KV MLA decode with warpgroup MMA, query rows on the MMA's M side (sm_90a): 64 rows per
// CTA, bf16 or e4m3 cache. The 128-row classes (H 128 at q_len 1, H 32 at q_len 4) and 512
// rows.
//
// Why not swapped like mla_wgmma_sm90.cu: a swapped 64-row kernel's warpgroups each multiply
// the whole K tile against their 32 rows (m64n32, 216 KB of shared-memory operand reads per
// tile) and its O^T = V^T P^T reads P^T from shared memory (128 KB more). Its time per tile grew
// with those bytes (a variant with 64 KB more ran 8% slower; it ran 1.15-1.3x slower than this
// kernel; H200, 2026-11-30, docs/bench_mla.md). Here, as in FlashMLA:
//   warpgroup 0:  S[64 rows, 64 tok] = Q . K^T     (A = Q, B = K tile; 36 m64n64k16, 144 KB)
//                 softmax in registers (a row lives in one quad: no cross-warp reduction)
//                 O[:, 0:256]   += P . V[:, 0:256]  (A = P from registers, B = V; 32 KB)
//   warpgroup 1:  O[:, 256:512] += P . V[:, 256:512] (A = P from shared memory; 40 KB)
// 224 KB per tile instead of 344. Warpgroup 0 hands P and the rows' rescale factors to
// warpgroup 1 through shared memory (named barriers FULL / FREE); its P V of tile i is issued
// together with Q K of tile i + 1. A producer warpgroup (TMA, as sm90_wgmma.cuh) gives its
// registers away (setmaxnreg). Shared memory: two KV stages (144 KB), Q (72 KB), P (8 KB).
// An e4m3 tile lands as bytes and both warpgroups widen it to fp16 in place together
// (sm90_fp8.cuh; warpgroup 0 with P V of the tile before on the tensor cores), then the
// MMAs run in fp16 with the queries and P in fp16.
// What it computes: exactly mla_spec.kernels.mla.mla_decode (fixed q_len).
#include "sm90_fp8.cuh"

namespace {

using namespace sm90;

constexpr int BM = 64;
constexpr int B_FULL = 2, B_FREE = 3;  // P(i) written / P(i - 1) read (256 threads each)

// D[64, 64] += A . B, A from registers (an m64k16 fragment: per warp rows g / g + 8 of its 16,
// k 2 t4.. and 8 + 2 t4..), B from shared memory N-major (the V tile's layout); bf16, or fp16
// (F16: an e4m3 cache widened to fp16, sm90_fp8.cuh)
template <bool F16>
__device__ __forceinline__ void wgmma_rs_vn(float (&d)[32], const uint32_t* a, uint64_t db) {
#define RS_VN(T)                                                                              \
  asm volatile("wgmma.mma_async.sync.aligned.m64n64k16.f32." T "." T " " SM90_D32           \
               ", {%32,%33,%34,%35}, %36, 1, 1, 1, 1;\n"                                     \
               : SM90_ACC32(d)                                                               \
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db))
  if constexpr (F16) RS_VN("f16"); else RS_VN("bf16");
#undef RS_VN
}

// B operand of a k16 step of P V: tokens 16 kk.. of the 64-dim block c of a stage (N-major,
// the geometry the swapped kernels read V^T in as an M-major A)
__device__ __forceinline__ uint64_t v_desc(uint32_t stage, int c, int kk) {
  return sw128_desc(stage + c * BLK + kk * 2048, BLK, 1024);
}

// the V dims [256 wg, 256 wg + 256) of a stage's rows [nvalid, 64) zeroed by the warpgroup's
// 128 threads (a freed slot may hold NaN; P = 0 times NaN is NaN), fenced for wgmma, the
// warpgroup synced. Only a split's last tile has such rows (the condition is CTA-uniform).
__device__ __forceinline__ void zero_v_half(unsigned char* stage_s, int nvalid, int wg, int wt) {
  if (nvalid >= BN) return;
  for (int c = wt; c < (BN - nvalid) * 32; c += 128)
    *reinterpret_cast<uint4*>(stage_s + (4 * wg + ((c >> 3) & 3)) * BLK +
                              (nvalid + (c >> 5)) * 128 + (c & 7) * 16) = make_uint4(0, 0, 0, 0);
  fence_proxy_async();
  named_barrier(4 + wg, 128);
}

// CLUSTER: the two splits of a (request, row block) run as one thread-block cluster (the
// launcher's cluster dims (2, 1, 1): rank = split) and merge through distributed shared memory
// instead of the split partials and the combine kernel (2 x 4096 bf16 rows at H 128 bs 32:
// ~5.7 µs a call, H200, 2026-11-30, docs/bench_mla.md). Each CTA stages O in fp32 as always
// and puts its rows' v_scale / l and log2-sum-exp beside it; after a cluster barrier, CTA k
// weighs and adds both CTAs' rows 32 k .. 32 k + 31 (the peer's read from its shared memory)
// and writes the result; a second barrier keeps both CTAs' shared memory alive until both have
// read it. Clusters of 2 CTAs of this size: 66 at once on an H200, all 132 SMs.
template <int KV, bool CLUSTER>
__device__ __forceinline__ void mla_wgmma_rows(const WgParams& wp) {
  const MlaParams& p = wp.m;
  constexpr bool F16 = KvTraits<KV>::f16;
  extern __shared__ unsigned char smem_raw[];
  unsigned char* smem = smem_raw + ((1024 - (smem_u32(smem_raw) & 1023)) & 1023);
  unsigned char* kv_s = smem;                              // [STAGES][9][64 tok][128 B]
  unsigned char* q_s = kv_s + STAGES * TILE;               // [9][64 rows][128 B]
  unsigned char* p_s = q_s + NCH * BM * 128;               // P [64 rows][64 tok], swizzled
  float* alpha_s = reinterpret_cast<float*>(p_s + BM * 128);  // [64] tile's rescale factors
  float* rowv = alpha_s + BM;                                 // [64] v_scale / l
  uint64_t* full = reinterpret_cast<uint64_t*>(rowv + BM);
  uint64_t* empty = full + STAGES;

  const int split = blockIdx.x, mb = blockIdx.y, b = blockIdx.z;
  const int tid = threadIdx.x, wg = tid >> 7, wt = tid & 127, wq = wt >> 5;
  const int lane = tid & 31, g = lane >> 2, t4 = lane & 3;
  CtaWork w;
  QueryLoad<BM> qload;
  if (!cta_begin<BM>(wp, split, mb, b, tid, full, empty, w, qload)) return;
  if (tid >= NT) {
    asm volatile("setmaxnreg.dec.sync.aligned.u32 40;\n" ::: "memory");
    if (tid == NT) produce<KV>(wp, w, kv_s, full, empty);
    return;
  }
  asm volatile("setmaxnreg.inc.sync.aligned.u32 232;\n" ::: "memory");
  qload.store<F16>(q_s, tid);
  fence_proxy_async();
  named_barrier(1, NT);

  const int r0 = 16 * wq + g;  // this thread's rows r0 and r0 + 8 (accumulator rows)
  const uint32_t p_base = smem_u32(p_s);
  const auto stage_u32 = [&](int it) { return smem_u32(kv_s + (it % STAGES) * TILE); };
  const auto wait_full = [&](int it) { mbar_wait(&full[it % STAGES], (it / STAGES) & 1); };
  const auto nvalid = [&](int it) { return w.hi - (w.lo + it * BN); };
  // lane 0's arrival predicated (mbar_arrive_lane0): it may sit between two wgmma waits
  const auto release = [&](int it) { mbar_arrive_lane0(&empty[it % STAGES], 1, lane); };
  // an e4m3 tile is widened to fp16 in place by both warpgroups together (widen_tile's
  // schedule needs all 256 consumer threads): warpgroup 0 before its Q K, warpgroup 1 after
  // its P V of the tile before
  const auto widen = [&](int it) {
    if constexpr (F16) widen_tile(kv_s + (it % STAGES) * TILE, tid);
  };
  // O[64 rows, this warpgroup's 256 dims]: value 4 j + 2 h + c of block nb is row r0 + 8 h,
  // dim 256 wg + 64 nb + 8 j + 2 t4 + c
  float o[4][32];
  zero_acc(o);
  float m_r[2] = {-INFINITY, -INFINITY}, l_r[2] = {0.f, 0.f};
  // O's rows r0 and r0 + 8 times their factors a0 / a1 (skipped when no row of the warp moved)
  const auto rescale = [&](float a0, float a1) {
    if (__any_sync(0xffffffffu, a0 != 1.f || a1 != 1.f))
#pragma unroll
      for (int nb = 0; nb < 4; ++nb)
#pragma unroll
        for (int i = 0; i < 32; ++i) o[nb][i] *= (i >> 1) & 1 ? a1 : a0;
  };

  if (wg == 0) {
    int bound[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) bound[h] = min(window_end(p, w.kv_len, w.m0 + r0 + 8 * h), w.hi);
    const int min_bound = min(window_end(p, w.kv_len, w.m0), w.hi);
    const uint64_t q_desc = sw128_desc(smem_u32(q_s), 16, 1024);
    const float scale = p.qk_scale_log2;
    float s[32];   // S: value 4 j + 2 h + c is row r0 + 8 h, token 8 j + 2 t4 + c
    uint32_t pa[16];  // P as four k16 A fragments (the same registers: stmatrix's 8x8 blocks)
    // tile it landed, its V tail (this warpgroup's dims) zeroed, then its 36 k16 steps of
    // Q K^T issued into d (Q's dim blocks are BLK apart too)
    const auto qk = [&](float(&d)[32], int it) {
      wait_full(it);
      widen(it);
      zero_v_half(kv_s + (it % STAGES) * TILE, nvalid(it), 0, wt);
      zero_acc(d);
      wgmma_fence();
      const uint64_t k_desc = sw128_desc(stage_u32(it), 16, 1024);
#pragma unroll
      for (int j = 0; j < 36; ++j) {
        const uint32_t off = (j >> 2) * BLK + (j & 3) * 32;
        Wgmma<64, 0, F16>::run(d, q_desc + (off >> 4), k_desc + (off >> 4));
      }
    };
    // the online softmax of tile it over s (probabilities in place), its rows' alpha
    const auto softmax = [&](int it, float(&alpha)[2]) {
      const int t0 = w.lo + it * BN;
      const bool masked = t0 + BN > min_bound;
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        float mx = -INFINITY;
#pragma unroll
        for (int j = 0; j < 8; ++j)
#pragma unroll
          for (int c = 0; c < 2; ++c) {
            const int i = 4 * j + 2 * h + c;
            const float x = !masked || t0 + 8 * j + 2 * t4 + c < bound[h] ? s[i] * scale
                                                                        : -INFINITY;
            s[i] = x;
            mx = fmaxf(mx, x);
          }
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
        const float m_new = fmaxf(m_r[h], mx), m_use = m_new == -INFINITY ? 0.f : m_new;
        alpha[h] = exp2f(m_r[h] - m_use);
        m_r[h] = m_new;
        float sum = 0.f;
#pragma unroll
        for (int j = 0; j < 8; ++j)
#pragma unroll
          for (int c = 0; c < 2; ++c) {
            const int i = 4 * j + 2 * h + c;
            s[i] = exp2f(s[i] - m_use);
            sum += s[i];
          }
        l_r[h] = l_r[h] * alpha[h] + sum;
      }
    };
    // P into pa and (for warpgroup 1) shared memory with alpha; O rescaled (P V(it - 1) done)
    const auto hand_over = [&](const float(&alpha)[2]) {
#pragma unroll
      for (int i = 0; i < 16; ++i) pa[i] = pack_h2<F16>(s[2 * i], s[2 * i + 1]);
      named_barrier(B_FREE, NT);  // warpgroup 1 has read P(it - 1) and alpha(it - 1)
#pragma unroll
      for (int kb = 0; kb < 4; ++kb) {
        const int mi = lane >> 3;
        stsm_x4(p_base + sw128(16 * wq + 8 * (mi & 1) + (lane & 7), 2 * kb + (mi >> 1)),
                pa[4 * kb], pa[4 * kb + 1], pa[4 * kb + 2], pa[4 * kb + 3]);
      }
      if (t4 == 0) {
        alpha_s[r0] = alpha[0];
        alpha_s[r0 + 8] = alpha[1];
      }
      fence_proxy_async();
      named_arrive(B_FULL, NT);
      rescale(alpha[0], alpha[1]);
    };
    const auto pv = [&](int it) {  // O[:, 0:256] += P . V[:, 0:256]
      const uint32_t st = stage_u32(it);
#pragma unroll
      for (int kk = 0; kk < 4; ++kk)
#pragma unroll
        for (int nb = 0; nb < 4; ++nb) wgmma_rs_vn<F16>(o[nb], pa + 4 * kk, v_desc(st, nb, kk));
    };
    if (w.ntiles > 0) {
      qk(s, 0);
      wgmma_commit();
      wgmma_wait0();
    }
    // tile it's softmax, then its P V issued, then Q K(it + 1) when there is more, in two
    // wgmma groups: once P V(it) is done (and warpgroup 1's, which ran beside it) tile it's
    // stage goes back to the producer while Q K(it + 1) still runs. With two stages the load
    // of tile it + 2 can only start then, and Q K(it + 2) wants it one softmax later: released
    // after Q K(it + 1) (one group), the load's latency was exposed at every tile (ncu: warpgroup
    // 0 waiting on the full barrier; H 128 bs 32 ctx 4k 88.5-88.7 -> 79.9-81.8 µs, H200,
    // 2026-11-30, docs/bench_mla.md). (Issuing Q K(it + 1) before the softmax instead, into a
    // second S, measured 1.2x slower.) On an e4m3 cache tile it + 1 is widened meanwhile.
    const auto step = [&](int it, bool more) {
      float alpha[2];
      softmax(it, alpha);
      hand_over(alpha);
      wgmma_fence();
      pv(it);
      wgmma_commit();
      if (more) {
        qk(s, it + 1);
        wgmma_commit();
        wgmma_wait1();
        release(it);
        wgmma_wait0();
      } else {
        wgmma_wait0();
        release(it);
      }
    };
    for (int it = 0; it + 1 < w.ntiles; ++it) step(it, true);
    if (w.ntiles > 0) step(w.ntiles - 1, false);
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      l_r[h] += __shfl_xor_sync(0xffffffffu, l_r[h], 1);
      l_r[h] += __shfl_xor_sync(0xffffffffu, l_r[h], 2);
    }
  } else {
    const uint64_t p_desc = sw128_desc(p_base, 16, 1024);
    if (w.ntiles > 0) {
      named_arrive(B_FREE, NT);  // P's buffer starts free
      if constexpr (F16) {
        wait_full(0);
        widen(0);
      }
    }
    for (int it = 0; it < w.ntiles; ++it) {
      wait_full(it);
      zero_v_half(kv_s + (it % STAGES) * TILE, nvalid(it), 1, wt);
      named_barrier(B_FULL, NT);  // P(it) and alpha(it) are in
      const float a0 = alpha_s[r0], a1 = alpha_s[r0 + 8];
      rescale(a0, a1);
      wgmma_fence();
      const uint32_t st = stage_u32(it);
#pragma unroll
      for (int kk = 0; kk < 4; ++kk)
#pragma unroll
        for (int nb = 0; nb < 4; ++nb)
          Wgmma<64, 0, F16, 1>::run(o[nb], p_desc + kk * 2, v_desc(st, 4 + nb, kk));
      wgmma_commit();
      wgmma_wait0();
      release(it);  // before widening tile it + 1, which may wait for it to land
      if (it + 1 < w.ntiles) {
        named_arrive(B_FREE, NT);
        if constexpr (F16) {
          wait_full(it + 1);
          widen(it + 1);
        }
      }
    }
  }
  // the next kernel may launch: here when it is not the combine (one split, or the cluster's
  // merge), else after the stores (kernels/launch/pdl.py rule 5)
  const bool combine_next = p.split && !CLUSTER;
  if (!combine_next) griddep_launch();

  named_barrier(1, NT);  // every MMA is done: the stages are free for the output staging
  float* ost = reinterpret_cast<float*>(kv_s);  // fp32 rows [64][OSTRIDE]
#pragma unroll
  for (int nb = 0; nb < 4; ++nb)
#pragma unroll
    for (int i = 0; i < 32; ++i)
      ost[(r0 + 8 * ((i >> 1) & 1)) * OSTRIDE + 256 * wg + 64 * nb + 8 * (i >> 2) + 2 * t4 +
          (i & 1)] = o[nb][i];
  float* rlse = reinterpret_cast<float*>(q_s);  // CLUSTER: [64] the rows' log2-sum-exp
  if (wg == 0 && t4 == 0) {
    if (CLUSTER) {
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        rowv[r0 + 8 * h] = row_factor(p.v_scale, l_r[h]);
        rlse[r0 + 8 * h] = row_lse2(m_r[h], l_r[h]);
      }
    } else {
      finish_row(p, w, split, b, r0, l_r[0], m_r[0], rowv);
      finish_row(p, w, split, b, r0 + 8, l_r[1], m_r[1], rowv);
    }
  }
  if (!CLUSTER) {
    named_barrier(1, NT);
    store_rows<BM>(p, w, split, b, ost, rowv, tid);
    if (combine_next) griddep_launch();
    return;
  }
  cluster_sync();  // both CTAs' rows, factors and lse are in
  // CTA k: rows 32 k .. 32 k + 31, 2 a pass, 4 dims a thread; the other CTA's staging through
  // its shared-memory window (byte offsets add); (token, head) stepped as in store_rows
  constexpr int RS = NT / (DV / 4);
  const uint32_t rank = cluster_rank(), peer = rank ^ 1;
  const int d = (tid % (DV / 4)) * 4, i0 = tid / (DV / 4), rb = (BM / 2) * rank;
  const int r_end = min(BM / 2, w.n_rows - w.m0 - rb), row0 = w.m0 + rb + i0;
  const uint32_t p_ost = peer_addr(ost + d, peer), p_lse = peer_addr(rlse, peer),
                 p_rowv = peer_addr(rowv, peer);
  const int ti = div_small(row0, p.H);
  int h = row0 - ti * p.H;
  __nv_bfloat16* dst = out_row(p, b, ti, h) + d;
  const long long wrap = p.s_o_t - static_cast<long long>(p.H) * p.s_o_h;
  float* lse_out = p.lse + static_cast<long long>(b) * w.n_rows + row0;
#pragma unroll 4
  for (int i = i0; i < r_end; i += RS, lse_out += RS) {
    const int r = rb + i;
    const float l0 = rlse[r], l1 = peer_ld_f(p_lse + 4 * r);
    const float4 x = *reinterpret_cast<const float4*>(ost + r * OSTRIDE + d);
    const float4 y = peer_ld_f4(p_ost + 4 * r * OSTRIDE);
    const float v1 = peer_ld_f(p_rowv + 4 * r);
    const float m = fmaxf(l0, l1), mu = m == -INFINITY ? 0.f : m;
    const float e0 = exp2f(l0 - mu), e1 = exp2f(l1 - mu), den = e0 + e1;
    const float inv = den > 0.f ? __fdividef(1.f, den) : 0.f;
    const float w0 = e0 * inv * rowv[r], w1 = e1 * inv * v1;
    *reinterpret_cast<uint2*>(dst) =
        make_uint2(pack_bf16(w0 * x.x + w1 * y.x, w0 * x.y + w1 * y.y),
                   pack_bf16(w0 * x.z + w1 * y.z, w0 * x.w + w1 * y.w));
    if (p.write_lse && d == 0)
      *lse_out = den > 0.f ? (mu + log2f(den)) * 0.6931471805599453f : -INFINITY;
    dst += RS * p.s_o_h;
    for (h += RS; h >= p.H; h -= p.H) dst += wrap;
  }
  cluster_sync();  // nobody leaves while the other CTA may still read its shared memory
}

}  // namespace

// the kernels: a bf16 cache, or an e4m3 one widened to fp16 in shared memory (sm90_fp8.cuh; fp16
// MMAs), each also as 2 splits in clusters of (2, 1, 1) CTAs merging in distributed shared
// memory (CLUSTER above; suffix _cl)
WGMMA_ENTRY(mla_wgmma_rows64, NT + 128, mla_wgmma_rows<KV_BF16, false>)
WGMMA_ENTRY(mla_wgmma_rows64_f8, NT + 128, mla_wgmma_rows<KV_FP8, false>)
WGMMA_ENTRY(mla_wgmma_rows64_cl, NT + 128, mla_wgmma_rows<KV_BF16, true>)
WGMMA_ENTRY(mla_wgmma_rows64_f8_cl, NT + 128, mla_wgmma_rows<KV_FP8, true>)
