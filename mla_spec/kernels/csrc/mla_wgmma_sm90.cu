// Split-KV MLA decode over the paged latent cache with Hopper's warpgroup MMA (sm_90a).
//
// Why: the mma.sync kernel (mla_splitkv_sm90.cu) needs the queries in registers, so every warp
// re-reads all of them from shared memory for every KV tile (147 KB of ldmatrix beside a 74 KB
// tile at 32 rows); its per-tile time, not the memory, bounded it at ~1.5 TB/s. wgmma reads
// both operands straight from shared memory in the layout the TMA engine writes (128-byte
// swizzle), so a tile costs two short MMA batches and a softmax.
//
// The product is "swapped" (as in mla_decode_swapab): the KV tile is the MMA's M side, so the
// 32 query rows of DeepSeek's decode at TP4 (H 32, q_len 1) fill N = 32 without padding to 64:
//   S^T[64 tok, BM] = K[64 tok, 576] . Q^T          (A = K tile, B = Q; both K-major)
//   O^T[512, BM]   += V^T[512, 64 tok] . P^T         (A = V^T: M-major view of the same tile;
//                                                    B = P^T written to shared memory)
// Two consumer warpgroups: each computes half of S^T's 576-deep sum (18 of 36 k16 steps) and
// they add the halves through shared memory; both then hold the whole S^T and run the same
// softmax; each owns 256 of the 512 output dims. A ninth warp produces: it issues a tile's TMA
// loads (9 boxes of [64 tokens, 64 dims], one 8 KB swizzle-128B block per 64 dims) into a stage
// as soon as the 8 consumer warps have released it (an "empty" mbarrier), two stages in all.
//
// What it computes is exactly mla_spec.kernels.mla_decode.mla_decode (fixed q_len, bf16 cache):
// row r = i * H + h of request b sees KV positions j < kv_len - q_len + i + 1 and gets
// v_scale * softmax_j(qk_scale * q . kv_j) @ kv_j[:512] (zeros for an empty window). Split
// output as in mla_splitkv_sm90.cu (fp32 partials + log2-sum-exp, merged by combine_splits).
// Requirements (mla_decode_wgmma.wgmma_mla_supported): page size a multiple of 64 (a tile is
// 64 consecutive slots of one page), the cache a contiguous [slots, 576] bf16 tensor.
#include <stddef.h>

#include "sm90_common.cuh"

namespace {

constexpr int DV = 512, DK = 576, NCH = DK / 64;  // 9 blocks of 64 dims (128 B per row)
constexpr int BN = 64, STAGES = 2, NT = 256;      // tokens per tile, tiles in flight, threads
constexpr int BLK = BN * 128;                     // one 64-dim block of a tile (8 KB)
constexpr int TILE = NCH * BLK;                   // 72 KB
constexpr int OSTRIDE = DV + 4;                   // fp32 output staging row (bank spread)

}  // namespace

struct alignas(64) TmaMap {
  unsigned long long v[16];
};

struct alignas(64) WgParams {
  TmaMap kv_map;  // the cache as [slots, 576] bf16, box [64 tokens, 64 dims], swizzle 128B
  const __nv_bfloat16* qn;
  const __nv_bfloat16* qp;
  const int* r2t;
  const void* rpi;
  const void* kv_lens;
  float* part;
  float* part_lse;
  __nv_bfloat16* out;
  float* lse;
  long long s_qn_t, s_qn_h, s_qp_t, s_qp_h, s_r2t, s_o_t, s_o_h, s_ps, s_ls;
  int H, q_len, num_splits, rpi_i64, kvl_i64, split, write_lse;
  float qk_scale_log2, v_scale;
};
// mla_decode_wgmma._WgParams mirrors this layout (tests/kernels/test_mla_decode_wgmma.py)
static_assert(sizeof(WgParams) == 320 && offsetof(WgParams, qk_scale_log2) == 300, "layout");

namespace {

using namespace sm90;

// wgmma shared-memory descriptor, 128-byte swizzle: start, leading and stride byte offsets
__device__ __forceinline__ uint64_t sw128_desc(uint32_t addr, uint32_t lbo, uint32_t sbo) {
  return static_cast<uint64_t>((addr & 0x3FFFF) >> 4) |
         (static_cast<uint64_t>((lbo & 0x3FFFF) >> 4) << 16) |
         (static_cast<uint64_t>((sbo & 0x3FFFF) >> 4) << 32) | (1ull << 62);
}

__device__ __forceinline__ void wgmma_fence() {
  asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
}
__device__ __forceinline__ void wgmma_commit() {
  asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
}
__device__ __forceinline__ void wgmma_wait0() {
  asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory");
}

// D[64, N] += A[64, 16] . B[16, N], bf16 in, fp32 accumulators (N / 2 per thread);
// TA = 1: A is M-major in shared memory (the V^T view), else K-major
template <int N, int TA>
struct Wgmma;

template <int TA>
struct Wgmma<32, TA> {
  __device__ __forceinline__ static void run(float (&d)[16], uint64_t da, uint64_t db) {
    asm volatile(
        "wgmma.mma_async.sync.aligned.m64n32k16.f32.bf16.bf16 "
        "{%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15}, %16, %17, 1, 1, 1, %18, 0;\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]),
          "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]),
          "+f"(d[13]), "+f"(d[14]), "+f"(d[15])
        : "l"(da), "l"(db), "n"(TA));
  }
};

template <int TA>
struct Wgmma<16, TA> {
  __device__ __forceinline__ static void run(float (&d)[8], uint64_t da, uint64_t db) {
    asm volatile(
        "wgmma.mma_async.sync.aligned.m64n16k16.f32.bf16.bf16 "
        "{%0,%1,%2,%3,%4,%5,%6,%7}, %8, %9, 1, 1, 1, %10, 0;\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]),
          "+f"(d[7])
        : "l"(da), "l"(db), "n"(TA));
  }
};

__device__ __forceinline__ void tma_load_2d(void* dst, const TmaMap* map, int c0, int c1,
                                            uint64_t* bar) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes "
      "[%0], [%1, {%2, %3}], [%4];\n" ::"r"(smem_u32(dst)),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(c0), "r"(c1), "r"(smem_u32(bar))
      : "memory");
}

__device__ __forceinline__ void named_barrier(int id, int threads) {
  asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}

// byte offset of 16-byte chunk c of row r in a 128-byte-swizzled block (1024-B aligned)
__device__ __forceinline__ uint32_t sw128(int r, int c) {
  return r * 128 + ((c ^ (r & 7)) << 4);
}

// S^T partial over the k16 steps 2 j + w (j < 18) of warpgroup w: A = K tile, B = Q (both
// K-major). Interleaving the steps makes a step's offset a constant plus w * 32 bytes, so the
// descriptors are one base each (a_desc, b_desc: w's first step) plus immediates.
template <int BM>
__device__ __forceinline__ void qk_half(float (&s)[BM / 2], uint64_t a_desc, uint64_t b_desc) {
#pragma unroll
  for (int j = 0; j < 18; ++j) {
    const uint32_t a_off = (j >> 1) * BLK + (j & 1) * 64, b_off = (j >> 1) * BM * 128 + (j & 1) * 64;
    Wgmma<BM, 0>::run(s, a_desc + (a_off >> 4), b_desc + (b_off >> 4));
  }
}

// P^T (bf16) into shared memory from S^T-layout fragments: per 8 x 8 block (8 tokens x 8 query
// rows) stmatrix .trans stores the transpose, i.e. 8 query rows of 8 consecutive tokens, each
// a 16-byte chunk of the swizzled [BM rows][64 tokens] layout
__device__ __forceinline__ void stsm_x4_t(uint32_t addr, uint32_t r0, uint32_t r1, uint32_t r2,
                                          uint32_t r3) {
  asm volatile("stmatrix.sync.aligned.m8n8.x4.trans.shared.b16 [%0], {%1, %2, %3, %4};\n"
               ::"r"(addr), "r"(r0), "r"(r1), "r"(r2), "r"(r3) : "memory");
}

template <int BM>
__device__ __forceinline__ void mla_wgmma(const WgParams& p) {
  static_assert(BM == 16 || BM == 32, "rows per CTA");
  constexpr int NA = BM / 2;    // accumulators of one m64nBM tile per thread
  constexpr int NC = BM / 4;    // query rows (S^T / O^T columns) a thread holds
  constexpr int QCH = BM * 72;  // 16-byte chunks of the CTA's queries
  constexpr int QIT = (QCH + NT - 1) / NT;
  extern __shared__ unsigned char smem_raw[];
  unsigned char* smem = smem_raw + ((1024 - (smem_u32(smem_raw) & 1023)) & 1023);
  unsigned char* kv_s = smem;                   // [STAGES][9][64 tok][128 B]
  unsigned char* q_s = kv_s + STAGES * TILE;    // [9][BM][128 B]
  unsigned char* p_s = q_s + NCH * BM * 128;    // P^T as [BM][64 tok] bf16, swizzled
  float* xbuf = reinterpret_cast<float*>(p_s + BM * 128);  // [2 wg][NA / 4][128 thr][4]
  float* red = xbuf + 2 * NA * 128;                         // [8 warps][BM]
  float* rowv = red + 8 * BM;                               // [BM] v_scale / l
  uint64_t* full = reinterpret_cast<uint64_t*>(rowv + 2 * BM);  // [STAGES] tile landed
  uint64_t* empty = full + STAGES;                              // [STAGES] 8 warps done

  const int split = blockIdx.x, mb = blockIdx.y, b = blockIdx.z;
  const int tid = threadIdx.x, wg = tid >> 7, wt = tid & 127, wq = wt >> 5;
  const int lane = tid & 31, g = lane >> 2, t4 = lane & 3;
  if (tid == 0) {
    for (int s = 0; s < STAGES; ++s) {
      mbar_init(&full[s], 1);
      mbar_init(&empty[s], NT / 32);
    }
    mbar_fence_init();
  }
  if (tid == NT)
    asm volatile("prefetch.tensormap [%0];\n" ::"l"(reinterpret_cast<uint64_t>(&p.kv_map))
                 : "memory");
  griddep_wait();
  const int H = p.H, q_len = p.q_len;
  const int n_rows = q_len * H, m0 = mb * BM;
  if (m0 >= n_rows) return;
  const int kv_len = p.kvl_i64 ? static_cast<int>(static_cast<const long long*>(p.kv_lens)[b])
                               : static_cast<const int*>(p.kv_lens)[b];
  const long long req = p.rpi_i64 ? static_cast<const long long*>(p.rpi)[b]
                                  : static_cast<long long>(static_cast<const int*>(p.rpi)[b]);
  // the queries' loads go out beside the index loads (rows past n_rows are zeros)
  uint4 qv[QIT];
  if (tid < NT) {
#pragma unroll
    for (int i = 0; i < QIT; ++i) {
      const int c = tid + i * NT, r = c / 72, k = c % 72, row = m0 + r;
      qv[i] = make_uint4(0, 0, 0, 0);
      if (c < QCH && row < n_rows) {
        const long long tok = static_cast<long long>(b) * q_len + row / H, h = row % H;
        const __nv_bfloat16* src = k < 64 ? p.qn + tok * p.s_qn_t + h * p.s_qn_h + k * 8
                                          : p.qp + tok * p.s_qp_t + h * p.s_qp_h + (k - 64) * 8;
        qv[i] = __ldg(reinterpret_cast<const uint4*>(src));
      }
    }
  }
  const int last_row = min(m0 + BM, n_rows) - 1;
  const int hi_rows = kv_len - q_len + last_row / H + 1;
  const int chunk = ((kv_len + p.num_splits - 1) / p.num_splits + BN - 1) / BN * BN;
  const int lo = split * chunk;
  const int hi = min(min(lo + chunk, kv_len), hi_rows);
  const int ntiles = hi > lo ? (hi - lo + BN - 1) / BN : 0;
  __syncthreads();  // barriers initialized

  if (tid >= NT) {  // producer warp: lane 0 refills a stage as soon as its 8 warps are done
    if (lane == 0) {
      const int* r2t_row = p.r2t + req * p.s_r2t + lo;
      for (int it = 0; it < ntiles; ++it) {
        const int stage = it % STAGES;
        const int slot0 = r2t_row[it * BN];
        if (it >= STAGES) mbar_wait(&empty[stage], ((it / STAGES) - 1) & 1);
        mbar_expect_tx(&full[stage], TILE);
#pragma unroll
        for (int c = 0; c < NCH; ++c)
          tma_load_2d(kv_s + stage * TILE + c * BLK, &p.kv_map, c * 64, slot0, &full[stage]);
      }
    }
    return;
  }

#pragma unroll
  for (int i = 0; i < QIT; ++i) {
    const int c = tid + i * NT, r = c / 72, k = c % 72;
    if (c < QCH) *reinterpret_cast<uint4*>(q_s + (k >> 3) * BM * 128 + sw128(r, k & 7)) = qv[i];
  }
  fence_proxy_async();
  named_barrier(1, NT);  // the queries are in shared memory (consumer warps only from here)

  // the NC query rows this thread holds (S^T / O^T column 8 * jn + 2 * t4 + e, index 2 jn + e)
  int bound[NC];
  float m_r[NC], l_r[NC];
#pragma unroll
  for (int c = 0; c < NC; ++c) {
    const int col = 8 * (c >> 1) + 2 * t4 + (c & 1);
    bound[c] = min(kv_len - q_len + (m0 + col) / H + 1, hi);
    m_r[c] = -INFINITY;
    l_r[c] = 0.f;
  }
  const int min_bound = min(kv_len - q_len + m0 / H + 1, hi);  // of the CTA's first row
  float o[4][NA];
#pragma unroll
  for (int mt = 0; mt < 4; ++mt)
#pragma unroll
    for (int i = 0; i < NA; ++i) o[mt][i] = 0.f;
  const uint32_t p_base = smem_u32(p_s);
  const uint64_t q_desc = sw128_desc(smem_u32(q_s) + wg * 32, 16, 1024);
  const uint64_t p_desc = sw128_desc(p_base, 16, 1024);
  // stmatrix row addresses of this lane: matrix lane / 8 = (token half hf, query-row block jb)
  const int sm_m = lane >> 3, sm_r = lane & 7;
  const float scale = p.qk_scale_log2;
  float4* xmine = reinterpret_cast<float4*>(xbuf) + wg * (NA / 4) * 128 + wt;
  const float4* xother = reinterpret_cast<const float4*>(xbuf) + (1 - wg) * (NA / 4) * 128 + wt;

  for (int it = 0; it < ntiles; ++it) {
    const int stage = it % STAGES, t0 = lo + it * BN;
    const uint32_t kv_base = smem_u32(kv_s + stage * TILE);
    mbar_wait(&full[stage], (it / STAGES) & 1);
    const int nvalid = hi - t0;
    if (nvalid < BN)  // slots past hi may hold anything (a freed slot's NaN): zero their V
      for (int c = tid; c < (BN - nvalid) * 64; c += NT)  // rows, since P = 0 times NaN is NaN
        *reinterpret_cast<uint4*>(kv_s + stage * TILE + ((c >> 3) & 7) * BLK +
                                  (nvalid + (c >> 6)) * 128 + (c & 7) * 16) = make_uint4(0, 0, 0, 0);
    float s[NA];
#pragma unroll
    for (int i = 0; i < NA; ++i) s[i] = 0.f;
    wgmma_fence();
    qk_half<BM>(s, sw128_desc(kv_base + wg * 32, 16, 1024), q_desc);
    wgmma_commit();
    wgmma_wait0();
    // add the other warpgroup's half (a + b == b + a: both hold identical sums)
#pragma unroll
    for (int i = 0; i < NA / 4; ++i)
      xmine[i * 128] = make_float4(s[4 * i], s[4 * i + 1], s[4 * i + 2], s[4 * i + 3]);
    named_barrier(1, NT);
#pragma unroll
    for (int i = 0; i < NA / 4; ++i) {
      const float4 v = xother[i * 128];
      s[4 * i] += v.x;
      s[4 * i + 1] += v.y;
      s[4 * i + 2] += v.z;
      s[4 * i + 3] += v.w;
    }

    // scale, causal / split mask (only where some row's window ends in this tile), column
    // (query row) max over the tile's 64 tokens
    const int tok0 = t0 + wq * 16 + g;
    const bool masked = t0 + BN > min_bound;
    float mx[NC];
#pragma unroll
    for (int c = 0; c < NC; ++c) {
      float v = -INFINITY;
#pragma unroll
      for (int hf = 0; hf < 2; ++hf) {
        const int i = 4 * (c >> 1) + 2 * hf + (c & 1);
        const float x = !masked || tok0 + 8 * hf < bound[c] ? s[i] * scale : -INFINITY;
        s[i] = x;
        v = fmaxf(v, x);
      }
      v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, 4));
      v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, 8));
      v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, 16));
      mx[c] = v;
    }
    if (g == 0)
#pragma unroll
      for (int c = 0; c < NC; ++c) red[(wg * 4 + wq) * BM + 8 * (c >> 1) + 2 * t4 + (c & 1)] = mx[c];
    named_barrier(2 + wg, 128);
    float alpha[NC], m_use[NC];
    bool rescale = false;
#pragma unroll
    for (int c = 0; c < NC; ++c) {
      const int col = 8 * (c >> 1) + 2 * t4 + (c & 1);
      float v = m_r[c];
#pragma unroll
      for (int w = 0; w < 4; ++w) v = fmaxf(v, red[(wg * 4 + w) * BM + col]);
      m_use[c] = v == -INFINITY ? 0.f : v;
      alpha[c] = exp2f(m_r[c] - m_use[c]);
      rescale |= v != m_r[c];
      m_r[c] = v;
    }
    // probabilities: l per thread (its two tokens); P^T to shared memory by the warps of
    // warpgroup w whose 16 tokens are w's half of the tile (both groups hold the same P)
    uint32_t pk[NA / 2];
#pragma unroll
    for (int c = 0; c < NC; ++c) {
      float sum = 0.f;
#pragma unroll
      for (int hf = 0; hf < 2; ++hf) {
        const int i = 4 * (c >> 1) + 2 * hf + (c & 1);
        s[i] = exp2f(s[i] - m_use[c]);
        sum += s[i];
      }
      l_r[c] = l_r[c] * alpha[c] + sum;
    }
#pragma unroll
    for (int i = 0; i < NA; i += 2) pk[i / 2] = pack_bf16(s[i], s[i + 1]);
    if ((wq >> 1) == wg) {
      // pk[2 jb + hf]: block (tokens 16 wq + 8 hf.., query rows 8 jb..); x4 covers two jb
#pragma unroll
      for (int jb = 0; jb < BM / 8; jb += 2) {
        const int mjb = jb + (sm_m >> 1), mhf = sm_m & 1;
        stsm_x4_t(p_base + sw128(8 * mjb + sm_r, 2 * wq + mhf), pk[2 * jb], pk[2 * jb + 1],
                  pk[2 * jb + 2], pk[2 * jb + 3]);
      }
    }
    if (__any_sync(0xffffffffu, rescale))  // the running max moved for some row
#pragma unroll
      for (int mt = 0; mt < 4; ++mt)
#pragma unroll
        for (int i = 0; i < NA; ++i) o[mt][i] *= alpha[2 * (i >> 2) + (i & 1)];
    fence_proxy_async();
    named_barrier(1, NT);  // P^T complete
    // O^T[dims of this warpgroup] += V^T . P^T over the tile's 64 tokens
    const uint64_t v_desc = sw128_desc(kv_base + wg * 4 * BLK, BLK, 1024);
    wgmma_fence();
#pragma unroll
    for (int mt = 0; mt < 4; ++mt)
#pragma unroll
      for (int kk = 0; kk < BN / 16; ++kk)
        Wgmma<BM, 1>::run(o[mt], v_desc + ((mt * BLK + kk * 2048) >> 4), p_desc + kk * 2);
    wgmma_commit();
    wgmma_wait0();
    __syncwarp();
    if (lane == 0) mbar_arrive(&empty[stage]);  // this warp is done with the stage
  }
  griddep_launch();  // the combine may launch now (it waits for this grid to finish)

  // l over the tile rows (lanes g) and warps of warpgroup 0, then v_scale / l and lse per row
#pragma unroll
  for (int c = 0; c < NC; ++c) {
    float l = l_r[c];
    l += __shfl_xor_sync(0xffffffffu, l, 4);
    l += __shfl_xor_sync(0xffffffffu, l, 8);
    l += __shfl_xor_sync(0xffffffffu, l, 16);
    l_r[c] = l;
  }
  named_barrier(1, NT);  // the KV stages and red are free
  if (wg == 0 && g == 0)
#pragma unroll
    for (int c = 0; c < NC; ++c) red[wq * BM + 8 * (c >> 1) + 2 * t4 + (c & 1)] = l_r[c];
  // O^T fragments -> fp32 rows [BM][512] in the freed KV stages
  float* ost = reinterpret_cast<float*>(kv_s);
#pragma unroll
  for (int mt = 0; mt < 4; ++mt)
#pragma unroll
    for (int i = 0; i < NA; ++i) {
      const int col = 8 * (i >> 2) + 2 * t4 + (i & 1);
      const int dim = (wg * 4 + mt) * 64 + wq * 16 + g + 8 * ((i >> 1) & 1);
      ost[col * OSTRIDE + dim] = o[mt][i];
    }
  named_barrier(1, NT);
  if (wg == 0 && wq == 0 && g == 0)  // lanes 0-3 of warp 0 hold every row between them
#pragma unroll
    for (int c = 0; c < NC; ++c) {
      const int col = 8 * (c >> 1) + 2 * t4 + (c & 1), row = m0 + col;
      const float l = red[col] + red[BM + col] + red[2 * BM + col] + red[3 * BM + col];
      const bool has = l > 0.f;
      rowv[col] = has ? p.v_scale / l : 0.f;
      if (row < n_rows) {
        const float lse2 = has ? m_r[c] + log2f(l) : -INFINITY;
        const long long grow = static_cast<long long>(b) * n_rows + row;
        if (p.split)
          p.part_lse[split * p.s_ls + grow] = lse2;
        else if (p.write_lse)
          p.lse[grow] = lse2 * 0.6931471805599453f;
      }
    }
  named_barrier(1, NT);
  const int q_rows = min(BM, n_rows - m0);
  for (int c = tid; c < q_rows * (DV / 4); c += NT) {
    const int r = c / (DV / 4), d = (c % (DV / 4)) * 4, row = m0 + r;
    const float inv = rowv[r];
    const float4 v = *reinterpret_cast<const float4*>(ost + r * OSTRIDE + d);
    const long long grow = static_cast<long long>(b) * n_rows + row;  // tok * H + h
    if (p.split) {
      *reinterpret_cast<float4*>(p.part + split * p.s_ps + grow * DV + d) =
          make_float4(v.x * inv, v.y * inv, v.z * inv, v.w * inv);
    } else {
      const long long tok = static_cast<long long>(b) * q_len + row / H, h = row % H;
      *reinterpret_cast<uint2*>(p.out + tok * p.s_o_t + h * p.s_o_h + d) =
          make_uint2(pack_bf16(v.x * inv, v.y * inv), pack_bf16(v.z * inv, v.w * inv));
    }
  }
}

}  // namespace

#define MLA_WGMMA(BM)                                                                        \
  extern "C" __global__ void __launch_bounds__(NT + 32, 1)                                   \
      mla_wgmma_m##BM(const __grid_constant__ WgParams p) {                                  \
    mla_wgmma<BM>(p);                                                                        \
  }

MLA_WGMMA(32)
MLA_WGMMA(16)
