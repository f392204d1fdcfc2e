// The parts of the wgmma MLA kernel that multiplies an e4m3 cache as it lands
// (mla_wgmma_e4m3pp_sm90.cu): the e4m3 Q K and register-A P V wgmma wrappers, the queries'
// per-row e4m3 quantization into shared memory, and the V fragments built from the tile's
// bytes (the geometry is in mla_wgmma_e4m3pp_sm90.cu's header).
#pragma once
#include <cuda_fp8.h>

#include "sm90_fp8.cuh"

namespace {

using namespace sm90;

using T8 = KvTraits<KV_E4M3>;
constexpr int NS = T8::stages;  // stages of 40 KB (five 128-dim boxes of 64 tokens' bytes)
constexpr int QBOX = 32 * 128;  // one 128-dim box of 32 rows' e4m3 queries

// D[64, 32] += A . B, e4m3 x e4m3 (k32), both K-major from shared memory
__device__ __forceinline__ void wgmma_e4m3_n32(float (&d)[16], uint64_t da, uint64_t db) {
  asm volatile("wgmma.mma_async.sync.aligned.m64n32k32.f32.e4m3.e4m3 " SM90_D16
               ", %16, %17, 1, 1, 1;\n"
               : SM90_ACC16(d)
               : "l"(da), "l"(db));
}

// D[64, 32] += A . B in fp16, A from registers (an m64k16 fragment), B K-major in shared memory
__device__ __forceinline__ void wgmma_rs_n32(float (&d)[16], const uint32_t (&a)[4], uint64_t db) {
  asm volatile("wgmma.mma_async.sync.aligned.m64n32k16.f32.f16.f16 " SM90_D16
               ", {%16,%17,%18,%19}, %20, 1, 1, 1, 0;\n"
               : SM90_ACC16(d)
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db));
}

// D[64, 32] += A . B, e4m3 x e4m3 (k32), A from registers (an m64k32 fragment: register r of
// lane (g, t4) holds row g + 8 (r & 1), columns k = 16 (r >> 1) + 4 t4 + byte), B K-major in
// shared memory
__device__ __forceinline__ void wgmma_e4m3_rs_n32(float (&d)[16], const uint32_t (&a)[4],
                                                  uint64_t db) {
  asm volatile("wgmma.mma_async.sync.aligned.m64n32k32.f32.e4m3.e4m3 " SM90_D16
               ", {%16,%17,%18,%19}, %20, 1, 1, 1;\n"
               : SM90_ACC16(d)
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db));
}

// four 8 x 8 blocks of 16-bit pairs, transposed: lane l gives the address of row l % 8 of block
// l / 8; lane (g, t4) gets, of block j, pair g of rows 2 t4 (low half) and 2 t4 + 1 in d[j]
__device__ __forceinline__ void ldsm_x4_t(uint32_t addr, uint32_t (&d)[4]) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(d[0]), "=r"(d[1]), "=r"(d[2]), "=r"(d[3]) : "r"(addr));
}

// e4m3 P V (WE2 with pv8): the V^T A fragment of one m64 tile and k32 step from ldsm_x4_t of
// the step's four [8 tokens][16 dims] blocks (block j: tokens 8 j.. of the step; lane (g, t4)
// holds dims 2 g, 2 g + 1 of tokens 8 j + 2 t4 (bytes 0, 1) and + 1 (bytes 2, 3)): one prmt a
// register groups four tokens of one dim. Register r: row g + 8 (r & 1) <-> dim 2 g + (r & 1)
// of the chunk; byte b of it, column k = 16 (r >> 1) + 4 t4 + b <-> token 16 (r >> 1) + 2 t4 +
// (b >> 1) + 8 (b & 1) of the step, the order in which store_p8 lays P^T out
__device__ __forceinline__ void v8_frag(const uint32_t (&d)[4], uint32_t (&a)[4]) {
  a[0] = prmt(d[0], d[1], 0x6240);
  a[1] = prmt(d[0], d[1], 0x7351);
  a[2] = prmt(d[2], d[3], 0x6240);
  a[3] = prmt(d[2], d[3], 0x7351);
}

// this warp's P^T for e4m3 P V: each column c's two probabilities (tokens 16 wq + g and + 8 of
// the tile, s[frag_at(c, 0 / 1)]) times P8_SCALE as one e4m3 pair at byte 16 wq + 2 g of its
// row: the token order of v8_frag (P^T [BM][128 B], 128-byte swizzle, bytes 64.. unused). Why
// the scale: P <= 1, and e4m3 has normal numbers down to 2^-6 only; P8_SCALE P <= 256 < 448
constexpr float P8_SCALE = 256.f;
template <int NC>
__device__ __forceinline__ void store_p8(uint32_t p_base, const float (&s)[2 * NC], int wq,
                                         int g, int t4) {
#pragma unroll
  for (int c = 0; c < NC; ++c) {
    const __nv_fp8x2_storage_t v = __nv_cvt_float2_to_fp8x2(
        make_float2(s[frag_at(c, 0)] * P8_SCALE, s[frag_at(c, 1)] * P8_SCALE), __NV_SATFINITE,
        __NV_E4M3);
    asm volatile("st.shared.u16 [%0], %1;\n"
                 ::"r"(p_base + sw128(frag_col(c, t4), wq) + 2 * g), "h"(v) : "memory");
  }
}

// rows [nvalid, 64) of a landed e4m3 stage's V boxes (0-3) zeroed by one warpgroup (wt: its
// thread): a freed slot may hold NaN bytes, and P = 0 times NaN is NaN. Generic writes, read
// by ldmatrix after a barrier of the warpgroup
__device__ __forceinline__ void zero_v_tail8(unsigned char* stage_s, int nvalid, int wt) {
  for (int c = wt; c < (BN - nvalid) * 32; c += 128)
    *reinterpret_cast<uint4*>(stage_s + ((c >> 3) & 3) * BLK + (nvalid + (c >> 5)) * 128 +
                              (c & 7) * 16) = make_uint4(0, 0, 0, 0);
}

// the CTA's queries (loaded by QueryLoad::issue) as e4m3 rows scaled by 448 / amax into q_s
// ([5 boxes][32 rows][128 B], 128-byte swizzle; the last box's dims 576.. are never read),
// the amax of every row into qmax; the consumer threads only. A row's 72 chunks are with 8
// adjacent lanes (QueryLoad), so its amax is three shuffles
__device__ __forceinline__ void store_queries_e4m3(const QueryLoad<32>& ql, unsigned char* q_s,
                                                   float* qmax, int tid) {
  using QL = QueryLoad<32>;
  static_assert(QL::TPR == 8, "a row's chunks within 8 lanes");
  const auto f = [](uint32_t w, int hi) { return hi ? bf16_hi(w) : bf16_lo(w); };
  const int r = QL::row(tid);
  float amax = 0.f;
#pragma unroll
  for (int j = 0; j < QL::QIT; ++j) {
    const uint32_t w[4] = {ql.v[j].x, ql.v[j].y, ql.v[j].z, ql.v[j].w};
#pragma unroll
    for (int e = 0; e < 8; ++e) amax = fmaxf(amax, fabsf(f(w[e >> 1], e & 1)));
  }
#pragma unroll
  for (int o = 1; o < QL::TPR; o *= 2) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
  if (tid % QL::TPR == 0) qmax[r] = amax;
  const float inv = amax > 0.f ? 448.f / amax : 0.f;
#pragma unroll
  for (int j = 0; j < QL::QIT; ++j) {
    const int k = QL::chunk(tid, j);
    const uint32_t w[4] = {ql.v[j].x, ql.v[j].y, ql.v[j].z, ql.v[j].w};
    uint32_t q8[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const __nv_fp8x2_storage_t lo = __nv_cvt_float2_to_fp8x2(
          make_float2(f(w[2 * h], 0) * inv, f(w[2 * h], 1) * inv), __NV_SATFINITE, __NV_E4M3);
      const __nv_fp8x2_storage_t hi = __nv_cvt_float2_to_fp8x2(
          make_float2(f(w[2 * h + 1], 0) * inv, f(w[2 * h + 1], 1) * inv), __NV_SATFINITE,
          __NV_E4M3);
      q8[h] = static_cast<uint32_t>(lo) | (static_cast<uint32_t>(hi) << 16);
    }
    *reinterpret_cast<uint2*>(q_s + (k >> 4) * QBOX + sw128(r, (k & 15) >> 1) + 8 * (k & 1)) =
        make_uint2(q8[0], q8[1]);
  }
  fence_proxy_async();
  named_barrier(1, NT);
}

// S^T column c (query row 8 (c / 2) + 2 t4 + c % 2, accumulators 4 (c / 2) + c % 2 and + 2)
// times its row's amax / 448 and the softmax's scale: kq = qk_scale_log2 / 448, qm = qmax +
// 2 t4 (read per tile from shared memory: registers are what these kernels are short of)
__device__ __forceinline__ void scale_cols(float (&s)[16], const float* qm, float kq) {
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float2 c = *reinterpret_cast<const float2*>(qm + 8 * i);
    s[4 * i] *= c.x * kq;
    s[4 * i + 1] *= c.y * kq;
    s[4 * i + 2] *= c.x * kq;
    s[4 * i + 3] *= c.y * kq;
  }
}

// S^T over NSTEP k32 steps STRIDE apart (step st: box st / 4, bytes 32 (st % 4) past a_desc /
// b_desc, which point at the first), step j into accumulator chain j % NACC (summed by the
// caller in fp32): the 32-row kernel's warpgroup w takes steps 2 j + w, the ping-pong one all 18
template <int NSTEP, int STRIDE, int NACC>
__device__ __forceinline__ void qk_e4m3(float (&s)[NACC][16], uint64_t a_desc, uint64_t b_desc) {
#pragma unroll
  for (int j = 0; j < NSTEP; ++j) {
    const int st = STRIDE * j;
    const uint32_t a_off = (st >> 2) * BLK + (st & 3) * 32, b_off = (st >> 2) * QBOX + (st & 3) * 32;
    wgmma_e4m3_n32(s[j % NACC], a_desc + (a_off >> 4), b_desc + (b_off >> 4));
  }
}

// the thread's V bytes of k16 step kk: NW words (4 NW dims, 16-byte chunk c0 of a 128-dim
// box's row, from byte `half` 8 of it when NW = 2) of the tokens 16 kk + 2 t4 + 8 p + e in
// v[p][e]; tokens at or past nvalid (a freed slot may hold NaN, and P = 0 times NaN is NaN)
// read zero. vrow: the box's base plus the byte within the chunk.
template <int NW>
__device__ __forceinline__ void load_v(uint32_t (&v)[2][2][NW], uint32_t vrow, int kk, int t4,
                                       int c0, int nvalid) {
#pragma unroll
  for (int p = 0; p < 2; ++p)
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      const int tok = 16 * kk + 8 * p + 2 * t4 + e;
      const uint32_t addr = vrow + tok * 128 + ((c0 ^ (tok & 7)) << 4);
      uint32_t (&x)[NW] = v[p][e];
      if constexpr (NW == 2)
        asm volatile("ld.shared.v2.u32 {%0, %1}, [%2];\n" : "=r"(x[0]), "=r"(x[1]) : "r"(addr));
      else
        asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];\n"
                     : "=r"(x[0]), "=r"(x[1]), "=r"(x[2]), "=r"(x[3]) : "r"(addr));
      if (tok >= nvalid)
#pragma unroll
        for (int i = 0; i < NW; ++i) x[i] = 0;
    }
}

// v's bytes -> the A fragments of k16 step kk for 2 NW m64 tiles: a[mt] = {dim D + 2 mt,
// D + 2 mt + 1} x {tokens 2 t4 (+1), 2 t4 + 8 (+9)} (D: the thread's first dim), each register
// a token pair of one dim, paired by one prmt per two dims and converted exactly
template <int NW>
__device__ __forceinline__ void v_frags(const uint32_t (&v)[2][2][NW], uint32_t (&a)[2 * NW][4]) {
#pragma unroll
  for (int p = 0; p < 2; ++p)
#pragma unroll
    for (int wd = 0; wd < NW; ++wd) {  // word wd: dims 4 wd .. 4 wd + 3 of both tokens
      const uint32_t x0 = v[p][0][wd], x1 = v[p][1][wd];
      e4m3x4_to_h2x2(prmt(x0, x1, 0x5140), a[2 * wd][2 * p], a[2 * wd][2 * p + 1]);
      e4m3x4_to_h2x2(prmt(x0, x1, 0x7362), a[2 * wd + 1][2 * p], a[2 * wd + 1][2 * p + 1]);
    }
}

}  // namespace
