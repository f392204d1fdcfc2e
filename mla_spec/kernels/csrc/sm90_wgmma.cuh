// What the warpgroup-MMA MLA kernels (mla_wgmma_sm90.cu, mla_wgmma_rows_sm90.cu,
// mla_wgmma_e4m3pp_sm90.cu) share: the parameter struct, the tile geometry, TMA / stmatrix
// wrappers (the wgmma ones: sm90_mma.cuh), and the parts of a CTA's life that do not depend on
// how it multiplies (its start and work range, the queries' way into shared memory, the
// producer, the output rows).
#pragma once
#include "mla_params.cuh"
#include "sm90_common.cuh"
#include "sm90_mma.cuh"

namespace {

constexpr int DV = 512, DK = 576, NCH = DK / 64;  // 9 blocks of 64 dims (128 B per row)
constexpr int BN = 64, STAGES = 2, NT = 256;      // tokens per tile, tiles in flight, threads
constexpr int BLK = BN * 128;                     // one 64-dim block of a tile (8 KB)
constexpr int TILE = NCH * BLK;                   // 72 KB
constexpr int OSTRIDE = DV + 4;                   // fp32 output staging row (bank spread)

// the cache the wgmma kernels read: bf16, e4m3 widened to fp16 in shared memory
// (sm90_fp8.cuh), or e4m3 multiplied as it lands (mla_wgmma_e4m3pp_sm90.cu: boxes of 128 dims,
// 128-byte swizzled, the fifth half past the row's end and zero-filled by TMA)
enum KvKind { KV_BF16 = 0, KV_FP8 = 1, KV_E4M3 = 2 };

template <int KV>
struct KvTraits {
  static constexpr bool f16 = KV == KV_FP8;                     // fp16 MMAs (else bf16)
  static constexpr bool e4m3 = KV == KV_E4M3;
  static constexpr int nbox = e4m3 ? 5 : NCH;                  // TMA boxes per tile
  static constexpr int box_dims = e4m3 ? 128 : 64;
  static constexpr int box_bytes = f16 ? BLK / 2 : BLK;
  static constexpr int tile_bytes = nbox * box_bytes;          // TMA bytes per tile
  static constexpr int land = f16 ? TILE / 2 : 0;              // where the TMA boxes land
  static constexpr int stage_bytes = e4m3 ? tile_bytes : TILE;
  static constexpr int stages = e4m3 ? 4 : STAGES;
};

}  // namespace

struct alignas(64) TmaMap {
  unsigned long long v[16];
};

// the split kernels' parameters and the cache's TMA descriptor (the cache as [slots, 576] bf16,
// box [64 tokens, 64 dims], swizzle 128B); mla/sm90_wgmma.py _WgParams mirrors this layout
struct alignas(64) WgParams {
  MlaParams m;  // m.kv is unused: the tiles come through kv_map
  TmaMap kv_map;
  int early_kv;  // tiles the producer loads before the PDL wait (produce_early), at most
                 // its stages; 0: none
};
static_assert(sizeof(WgParams) == 384 && offsetof(WgParams, kv_map) == 192 &&
              offsetof(WgParams, early_kv) == 320, "layout");

// The extern "C" entry NAME(WgParams) of a split kernel: THREADS threads (the launcher's
// mla/sm90_wgmma.py WgmmaKind.threads), one CTA an SM, running the device function given last
// (a template instance: its commas pass through __VA_ARGS__)
#define WGMMA_ENTRY(NAME, THREADS, ...)                                                      \
  extern "C" __global__ void __launch_bounds__(THREADS, 1)                                   \
      NAME(const __grid_constant__ WgParams p) {                                             \
    __VA_ARGS__(p);                                                                          \
  }

namespace {

using namespace sm90;

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

// count this warp's arrival at barrier id (of `threads` in all) without waiting for it
__device__ __forceinline__ void named_arrive(int id, int threads) {
  asm volatile("bar.arrive %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}

// byte offset of 16-byte chunk c of row r in a 128-byte-swizzled block (1024-B aligned)
__device__ __forceinline__ uint32_t sw128(int r, int c) {
  return r * 128 + ((c ^ (r & 7)) << 4);
}

// P^T (bf16) into shared memory from S^T-layout fragments: per 8 x 8 block (8 tokens x 8 query
// rows) stmatrix .trans stores the transpose, i.e. 8 query rows of 8 consecutive tokens, each
// a 16-byte chunk of the swizzled [BM rows][64 tokens] layout
__device__ __forceinline__ void stsm_x4_t(uint32_t addr, uint32_t r0, uint32_t r1, uint32_t r2,
                                          uint32_t r3) {
  asm volatile("stmatrix.sync.aligned.m8n8.x4.trans.shared.b16 [%0], {%1, %2, %3, %4};\n"
               ::"r"(addr), "r"(r0), "r"(r1), "r"(r2), "r"(r3) : "memory");
}

// four 8 x 8 bf16 blocks from accumulator-layout registers (thread t: row t / 4, columns
// 2 (t % 4)..) into shared memory as they are: lane l gives the address of row l % 8 of block
// l / 8
__device__ __forceinline__ void stsm_x4(uint32_t addr, uint32_t r0, uint32_t r1, uint32_t r2,
                                        uint32_t r3) {
  asm volatile("stmatrix.sync.aligned.m8n8.x4.shared.b16 [%0], {%1, %2, %3, %4};\n"
               ::"r"(addr), "r"(r0), "r"(r1), "r"(r2), "r"(r3) : "memory");
}

// the CTA's (split, row block, request) work: rows, KV range [lo, hi), tiles
struct CtaWork {
  int n_rows, m0, kv_len, lo, hi, ntiles;
  long long req;
  int early;     // the producer lane: tiles it issued before the PDL wait (produce_early)
  int eslot[4];  // and their first slots
};

// the end of a row's causal window: row r (= i * H + h, query token i) sees the KV positions
// j < kv_len - q_len + i + 1
__device__ __forceinline__ int window_end(const MlaParams& p, int kv_len, int row) {
  return kv_len - p.q_len + div_small(row, p.H) + 1;
}

// kv_len and the request slot of request b, then the split's tile range (0 tiles when the
// split sees no visible KV); chunks are whole tiles
template <int BM>
__device__ __forceinline__ void cta_range(const MlaParams& p, int split, int b, CtaWork& w) {
  w.kv_len = p.kvl_i64 ? static_cast<int>(static_cast<const long long*>(p.kv_lens)[b])
                       : static_cast<const int*>(p.kv_lens)[b];
  w.req = p.rpi_i64 ? static_cast<const long long*>(p.rpi)[b]
                    : static_cast<long long>(static_cast<const int*>(p.rpi)[b]);
  const int hi_rows = window_end(p, w.kv_len, min(w.m0 + BM, w.n_rows) - 1);
  const int chunk = ((w.kv_len + p.num_splits - 1) / p.num_splits + BN - 1) / BN * BN;
  w.lo = split * chunk;
  w.hi = min(min(w.lo + chunk, w.kv_len), hi_rows);
  w.ntiles = w.hi > w.lo ? (w.hi - w.lo + BN - 1) / BN : 0;
}

// the request's req_to_token row from the split's first position: tile t starts at slot
// split_slots(p, w)[t * BN] (a tile is 64 consecutive slots of one page)
__device__ __forceinline__ const int* split_slots(const MlaParams& p, const CtaWork& w) {
  return p.r2t + w.req * p.s_r2t + w.lo;
}

// whether the split's tile t holds only KV rows older than this step (positions below
// kv_len - q_len: written before the kernel ahead began, under early_kv's contract)
__device__ __forceinline__ bool tile_predates_step(const MlaParams& p, const CtaWork& w, int t) {
  return w.lo + (t + 1) * BN <= w.kv_len - p.q_len;
}

// a tile's TMA boxes (nine [64 tok, 64 dim], or five of 128 dims for KV_E4M3) into stage
// `stage`, completing on full[stage] (a KV_FP8 tile: into the stage's upper half, see
// sm90_fp8.cuh); with NG > 1 groups of nbox / NG boxes, group g completing on
// full[stage * NG + g], so that Q K can start on the boxes that have landed
template <int KV, int NG = 1>
__device__ __forceinline__ void issue_tile(const WgParams& p, unsigned char* kv_s, uint64_t* full,
                                           int stage, int slot0) {
  using T = KvTraits<KV>;
  static_assert(T::nbox % NG == 0, "whole boxes a group");
  constexpr int PER = T::nbox / NG;
#pragma unroll
  for (int g = 0; g < NG; ++g) mbar_expect_tx(&full[stage * NG + g], PER * T::box_bytes);
#pragma unroll
  for (int c = 0; c < T::nbox; ++c)
    tma_load_2d(kv_s + stage * T::stage_bytes + T::land + c * T::box_bytes, &p.kv_map,
                c * T::box_dims, slot0, &full[stage * NG + c / PER]);
}

// The producer lane, before the PDL wait: the split's first WgParams::early_kv tiles (at most
// the stages) into their stages, as long as a tile holds only KV rows older than this step
// (positions < kv_len - q_len). Why: the next call's CTAs enter while the previous call's
// combine runs and wait with the HBM idle (~1.5 µs a call at batch 1 ctx 32k; H200,
// 2026-11-30, docs/bench_mla.md); an L2 prefetch there did not fill it, a TMA load into shared
// memory cannot be dropped. One tile: all the stages (2 x 72 KB bf16, 4 x 40 KB e4m3) flooded
// the memory system while the previous call's combine still read its partials, and the calls
// got slower. Sound only under the launcher's contract (mla/sm90_wgmma.py launch_wgmma_mla,
// early_kv): the
// metadata (kv_lens, req_pool_indices, req_to_token) and every KV row but a request's last
// q_len were written before the kernel ahead of this one began. produce() reads the slots
// again after the wait and traps if they moved.
template <int BM, int KV, int NG = 1>
__device__ __forceinline__ void produce_early(const WgParams& p, int split, int b, CtaWork& w,
                                              unsigned char* kv_s, uint64_t* full) {
  static_assert(KvTraits<KV>::stages <= 4, "CtaWork::eslot");
  CtaWork e = w;
  cta_range<BM>(p.m, split, b, e);
  const int* r2t_row = split_slots(p.m, e);
#pragma unroll
  for (int n = 0; n < KvTraits<KV>::stages; ++n)  // unrolled: eslot stays in registers
    if (w.early == n && n < p.early_kv && n < e.ntiles && tile_predates_step(p.m, e, n)) {
      w.eslot[n] = r2t_row[n * BN];
      issue_tile<KV, NG>(p, kv_s, full, n, w.eslot[n]);
      w.early = n + 1;
    }
}

// Named barrier B_START: the stage barriers are initialized (the producer warps arrive, the
// consumer warps wait; ids 1-5 are the kernels' own)
constexpr int B_START = 15;

// The producer lane initializes the stage barriers (full: one arrival + the TMA bytes; empty:
// the 8 consumer warps), prefetches the tensor map and, when the call asks for early tiles,
// issues them (produce_early); its warps arrive at B_START; then the grid waits for its
// predecessor. The producer does not wait for the consumer warps: its first TMA loads go out
// as soon as it knows the split's range, while the consumers still issue the queries' loads
// (behind a __syncthreads after those and an earlier form of QueryLoad::issue, the first load
// went out 0.8 µs later at batch 1 ctx 32k; H200, 2026-11-30, docs/bench_mla.md).
// False when the row block is past the request's rows (the whole CTA exits, before any
// barrier).
template <int BM, int NSTAGE = STAGES, int KV = -1, int NG = 1>
__device__ __forceinline__ bool cta_start(const WgParams& p, int split, int mb, int b, int tid,
                                          uint64_t* full, uint64_t* empty, CtaWork& w,
                                          unsigned char* kv_s) {
  w.n_rows = p.m.q_len * p.m.H;
  w.m0 = mb * BM;
  w.early = 0;
  if (w.m0 >= w.n_rows) return false;
  if (tid >= NT) {
    if (tid == NT) {
      for (int s = 0; s < NSTAGE; ++s) {
        for (int g = 0; g < NG; ++g) mbar_init(&full[s * NG + g], 1);
        mbar_init(&empty[s], NT / 32);
      }
      mbar_fence_init();
      asm volatile("prefetch.tensormap [%0];\n" ::"l"(reinterpret_cast<uint64_t>(&p.kv_map))
                   : "memory");
      if constexpr (KV >= 0)
        if (p.early_kv > 0) produce_early<BM, KV, NG>(p, split, b, w, kv_s, full);
    }
    __syncwarp();
    named_arrive(B_START, blockDim.x);
  }
  griddep_wait();
  return true;
}

// the CTA's BM query rows (q_nope | q_pe, 576 dims: 72 chunks of 16 bytes) into shared memory
// in the swizzled K-major layout [9][BM][128 B]: issue() loads into registers (rows past n_rows
// are zeros), store() writes them once the consumer warps are on their own. Thread t holds row
// t / TPR, chunks t % TPR + TPR j: one row's address a thread (one division, see div_small), and
// whether chunk j is q_nope or q_pe is known at compile time. This runs once a CTA from a cold
// instruction cache: with the chunks dealt round-robin (nine rows a thread, a division and both
// pointers each) it was ~700 instructions in front of the producer's first TMA load
template <int BM>
struct QueryLoad {
  static constexpr int TPR = NT / BM < 8 ? NT / BM : 8, QIT = 72 / TPR;  // threads a row, chunks
  static_assert(64 % TPR == 0 && BM * TPR <= NT, "a thread's chunks are of one row");
  uint4 v[QIT];

  __device__ __forceinline__ static int row(int tid) { return tid / TPR; }
  __device__ __forceinline__ static int chunk(int tid, int j) { return tid % TPR + TPR * j; }

  __device__ __forceinline__ void issue(const MlaParams& p, int b, int m0, int n_rows, int tid) {
    const int r = m0 + row(tid), ti = div_small(r, p.H), h = r - ti * p.H;
    const long long tok = static_cast<long long>(b) * p.q_len + ti;
    const uint4* qn = reinterpret_cast<const uint4*>(p.qn + tok * p.s_qn_t + h * p.s_qn_h);
    const uint4* qp = reinterpret_cast<const uint4*>(p.qp + tok * p.s_qp_t + h * p.s_qp_h);
    const bool ok = tid < BM * TPR && r < n_rows;
#pragma unroll
    for (int j = 0; j < QIT; ++j) {
      const int k = chunk(tid, j);
      v[j] = ok ? __ldg(j < 64 / TPR ? qn + k : qp + (k - 64)) : make_uint4(0, 0, 0, 0);
    }
  }

  // F16: as fp16 (the FP8 path; saturating, see bf16x2_to_h2)
  template <bool F16>
  __device__ __forceinline__ void store(unsigned char* q_s, int tid) const {
    if (tid >= BM * TPR) return;
    const int r = row(tid);
#pragma unroll
    for (int j = 0; j < QIT; ++j) {
      const int k = chunk(tid, j);
      uint4 x = v[j];
      if constexpr (F16)
        x = make_uint4(bf16x2_to_h2(x.x), bf16x2_to_h2(x.y), bf16x2_to_h2(x.z), bf16x2_to_h2(x.w));
      *reinterpret_cast<uint4*>(q_s + (k >> 3) * BM * 128 + sw128(r, k & 7)) = x;
    }
  }
};

// an accumulator zeroed (S before a tile's Q K, O before the first tile)
template <int N>
__device__ __forceinline__ void zero_acc(float (&a)[N]) {
#pragma unroll
  for (int i = 0; i < N; ++i) a[i] = 0.f;
}

template <int M, int N>
__device__ __forceinline__ void zero_acc(float (&a)[M][N]) {
#pragma unroll
  for (int i = 0; i < M; ++i)
#pragma unroll
    for (int j = 0; j < N; ++j) a[i][j] = 0.f;
}

// a CTA's start shared by the wgmma kernels: barriers, the work range, the queries' loads
// issued by the consumer warps (stored by them once the producer has split off); the consumer
// warps leave once the stage barriers are initialized, the producer warps at once (cta_start).
// False when the row block is past the request's rows (the whole CTA exits)
template <int BM, int NSTAGE = STAGES, int KV = -1, int NG = 1>
__device__ __forceinline__ bool cta_begin(const WgParams& wp, int split, int mb, int b, int tid,
                                          uint64_t* full, uint64_t* empty, CtaWork& w,
                                          QueryLoad<BM>& qload, unsigned char* kv_s = nullptr) {
  if (!cta_start<BM, NSTAGE, KV, NG>(wp, split, mb, b, tid, full, empty, w, kv_s))
    return false;
  if (tid < NT) qload.issue(wp.m, b, w.m0, w.n_rows, tid);  // beside the index loads
  cta_range<BM>(wp.m, split, b, w);
  if (tid < NT) named_barrier(B_START, blockDim.x);
  return true;
}

// producer warp, lane 0: the split's tiles into the stages as soon as the consumer warps have
// released them (empty), after the w.early ones produce_early issued; those are checked
// against the metadata as it is now (a change means the launcher's contract was broken: the
// CTA traps, and the launch fails rather than return attention over rows it did not mean)
template <int KV, int NG = 1>
__device__ __forceinline__ void produce(const WgParams& p, const CtaWork& w, unsigned char* kv_s,
                                        uint64_t* full, uint64_t* empty) {
  constexpr int NS = KvTraits<KV>::stages;
  const int* r2t_row = split_slots(p.m, w);
  for (int it = w.early; it < w.ntiles; ++it) {
    const int stage = it % NS;
    const int slot0 = r2t_row[it * BN];  // before the wait: its round trip hides behind it
    if (it >= NS) mbar_wait(&empty[stage], ((it / NS) - 1) & 1);
    issue_tile<KV, NG>(p, kv_s, full, stage, slot0);
  }
  // the check after the loads: nothing in front of the first one on the path that times a
  // call (code run once runs from a cold instruction cache); a trap fails the launch
  // all the same
  if (__builtin_expect(w.early > 0, 0)) {
#pragma unroll
    for (int it = 0; it < NS; ++it)
      if (it < w.early && (r2t_row[it * BN] != w.eslot[it] || !tile_predates_step(p.m, w, it)))
        __trap();
  }
}

// slots past hi may hold anything (a freed slot's NaN), and P = 0 times NaN is NaN: zero the V
// part of the tile rows [nvalid, 64) of a landed stage (a generic write: fence before wgmma)
__device__ __forceinline__ void zero_v_tail(unsigned char* stage_s, int nvalid, int tid) {
  if (nvalid < BN)
    for (int c = tid; c < (BN - nvalid) * 64; c += NT)
      *reinterpret_cast<uint4*>(stage_s + ((c >> 3) & 7) * BLK + (nvalid + (c >> 6)) * 128 +
                                (c & 7) * 16) = make_uint4(0, 0, 0, 0);
}

// a finished row's output factor v_scale / l and its log2-sum-exp m2 + log2 l (m2: its running
// max, l: its softmax sum); 0 and -inf for a row that saw no KV (l = 0). No division slow path:
// l >= 1 for a row with KV
__device__ __forceinline__ float row_factor(float v_scale, float l) {
  return l > 0.f ? __fdividef(v_scale, l) : 0.f;
}
__device__ __forceinline__ float row_lse2(float m2, float l) {
  return l > 0.f ? m2 + log2f(l) : -INFINITY;
}

// the row's log2-sum-exp (split partials) or natural lse (when asked); -inf for no KV
__device__ __forceinline__ void write_row_lse(const MlaParams& p, int split, long long grow,
                                              float m2, float l) {
  const float lse2 = row_lse2(m2, l);
  if (p.split)
    p.part_lse[split * p.s_ls + grow] = lse2;
  else if (p.write_lse)
    p.lse[grow] = lse2 * 0.6931471805599453f;
}

// the end of the CTA's row r (one thread per row), l its softmax sum and m2 its running max:
// the output scale v_scale / l (0 for a row that saw no KV) into rowv[r], and its lse
__device__ __forceinline__ void finish_row(const MlaParams& p, const CtaWork& w, int split, int b,
                                           int r, float l, float m2, float* rowv) {
  rowv[r] = row_factor(p.v_scale, l);
  const int row = w.m0 + r;
  if (row < w.n_rows) write_row_lse(p, split, static_cast<long long>(b) * w.n_rows + row, m2, l);
}

// the bf16 out row of request b's query token ti, head h
__device__ __forceinline__ __nv_bfloat16* out_row(const MlaParams& p, int b, int ti, int h) {
  return p.out + (static_cast<long long>(b) * p.q_len + ti) * p.s_o_t +
         static_cast<long long>(h) * p.s_o_h;
}

// one thread's 16 output dims of the CTA's row r, normalized, straight from registers: v[2 k]
// and v[2 k + 1] are dims d0 + PAIRS k and + 1 (PAIRS 2: d0 .. d0 + 15; 16: WE8). The
// bf16 result (8-byte stores: out rows are 8-byte aligned), or the split's partials (fp32, or
// bf16 with part_bf16; 16-byte stores into the launcher's buffers); pairs apart go as 8- / 4-byte
// stores
template <int PAIRS = 2>
__device__ __forceinline__ void store_row16(const MlaParams& p, const CtaWork& w, int split, int b,
                                            int r, int d0, const float (&v)[16]) {
  const int row = w.m0 + r;
  if (row >= w.n_rows) return;
  const long long grow = static_cast<long long>(b) * w.n_rows + row;  // tok * H + h
  if (p.split && !p.part_bf16) {
    float* dst = p.part + split * p.s_ps + grow * DV + d0;
#pragma unroll
    for (int q = 0; q < 4; ++q)
      if constexpr (PAIRS == 2) {
        reinterpret_cast<float4*>(dst)[q] =
            make_float4(v[4 * q], v[4 * q + 1], v[4 * q + 2], v[4 * q + 3]);
      } else {
        *reinterpret_cast<float2*>(dst + PAIRS * 2 * q) = make_float2(v[4 * q], v[4 * q + 1]);
        *reinterpret_cast<float2*>(dst + PAIRS * (2 * q + 1)) =
            make_float2(v[4 * q + 2], v[4 * q + 3]);
      }
    return;
  }
  uint32_t h[8];
#pragma unroll
  for (int k = 0; k < 8; ++k) h[k] = pack_bf16(v[2 * k], v[2 * k + 1]);
  __nv_bfloat16* dst;
  if (p.split) {
    dst = reinterpret_cast<__nv_bfloat16*>(p.part) + split * p.s_ps + grow * DV + d0;
  } else {
    const int ti = div_small(row, p.H);
    dst = out_row(p, b, ti, row - ti * p.H) + d0;
  }
  if constexpr (PAIRS != 2) {
#pragma unroll
    for (int k = 0; k < 8; ++k) *reinterpret_cast<uint32_t*>(dst + PAIRS * k) = h[k];
  } else if (p.split) {
    reinterpret_cast<uint4*>(dst)[0] = make_uint4(h[0], h[1], h[2], h[3]);
    reinterpret_cast<uint4*>(dst)[1] = make_uint4(h[4], h[5], h[6], h[7]);
  } else {
#pragma unroll
    for (int k = 0; k < 4; ++k) reinterpret_cast<uint2*>(dst)[k] = make_uint2(h[2 * k], h[2 * k + 1]);
  }
}

// the CTA's output rows from the fp32 staging [BM][OSTRIDE] scaled by rowv (v_scale / l):
// normalized partials of the split (fp32, or bf16: half the bytes the split kernel writes and
// the combine reads), or the bf16 result (coalesced, 16 B per thread). One loop per kind, and
// no division or 64-bit product per row: this runs once per CTA from a cold instruction cache,
// and with the kinds' branches and a (token, head) division in every row it took ~4.8 µs for
// WR's 64 rows (H200, 2026-11-30, a global-timer stamp per phase; docs/bench_mla.md)
template <int BM>
__device__ __forceinline__ void store_rows(const MlaParams& p, const CtaWork& w, int split, int b,
                                           const float* ost, const float* rowv, int tid) {
  static_assert(NT % (DV / 4) == 0, "a thread keeps its 4 dims on every row it stores");
  constexpr int RS = NT / (DV / 4);  // rows a pass
  const int q_rows = min(BM, w.n_rows - w.m0), d = (tid % (DV / 4)) * 4, r0 = tid / (DV / 4);
  const float* src = ost + r0 * OSTRIDE + d;
  const long long grow0 = static_cast<long long>(b) * w.n_rows + w.m0 + r0;  // tok * H + h
  if (p.split && p.part_bf16) {
    uint2* dst = reinterpret_cast<uint2*>(reinterpret_cast<__nv_bfloat16*>(p.part) +
                                          split * p.s_ps + grow0 * DV + d);
#pragma unroll 4
    for (int r = r0; r < q_rows; r += RS, src += RS * OSTRIDE, dst += RS * DV / 4) {
      const float inv = rowv[r];
      const float4 v = *reinterpret_cast<const float4*>(src);
      *dst = make_uint2(pack_bf16(v.x * inv, v.y * inv), pack_bf16(v.z * inv, v.w * inv));
    }
  } else if (p.split) {
    float4* dst = reinterpret_cast<float4*>(p.part + split * p.s_ps + grow0 * DV + d);
#pragma unroll 4
    for (int r = r0; r < q_rows; r += RS, src += RS * OSTRIDE, dst += RS * DV / 4) {
      const float inv = rowv[r];
      const float4 v = *reinterpret_cast<const float4*>(src);
      *dst = make_float4(v.x * inv, v.y * inv, v.z * inv, v.w * inv);
    }
  } else {
    // row m0 + r is head h of the request's query token i; the next row of this thread is RS
    // heads on (wrapping into the next token)
    const int row0 = w.m0 + r0, ti = div_small(row0, p.H);
    int h = row0 - ti * p.H;
    __nv_bfloat16* dst = out_row(p, b, ti, h) + d;
    const long long wrap = p.s_o_t - static_cast<long long>(p.H) * p.s_o_h;
#pragma unroll 4
    for (int r = r0; r < q_rows; r += RS, src += RS * OSTRIDE) {
      const float inv = rowv[r];
      const float4 v = *reinterpret_cast<const float4*>(src);
      *reinterpret_cast<uint2*>(dst) =
          make_uint2(pack_bf16(v.x * inv, v.y * inv), pack_bf16(v.z * inv, v.w * inv));
      dst += RS * p.s_o_h;
      for (h += RS; h >= p.H; h -= p.H) dst += wrap;
    }
  }
}

// A thread's S^T (m64nN) fragments: value i sits at token row 16 warp + g + 8 ((i >> 1) & 1)
// and query-row column 8 (i >> 2) + 2 t4 + (i & 1). Per query-row column c = 2 jn + e of the
// thread (column col(c)), its two tokens are the values at(c, 0) and at(c, 1).
__device__ __forceinline__ constexpr int frag_at(int c, int hf) { return 4 * (c >> 1) + 2 * hf + (c & 1); }
__device__ __forceinline__ int frag_col(int c, int t4) { return 8 * (c >> 1) + 2 * t4 + (c & 1); }

// the query rows a thread holds (S^T columns first_col + col(c)): where each one's window
// ends inside the split, running max -inf, sum 0; returns the window end of the CTA's first
// row (no tile before it needs the mask)
template <int NC>
__device__ __forceinline__ int init_rows(const MlaParams& p, const CtaWork& w, int first_col,
                                         int t4, int (&bound)[NC], float (&m_r)[NC],
                                         float (&l_r)[NC]) {
#pragma unroll
  for (int c = 0; c < NC; ++c) {
    bound[c] = min(window_end(p, w.kv_len, w.m0 + first_col + frag_col(c, t4)), w.hi);
    m_r[c] = -INFINITY;
    l_r[c] = 0.f;
  }
  return min(window_end(p, w.kv_len, w.m0), w.hi);
}

// scale S^T, mask the tokens past each column's window (only where some window ends in this
// tile: masked), and leave each column's max over the warp's 16 tokens in red_w (lanes g 0)
template <int NC>
__device__ __forceinline__ void tile_col_max(float (&s)[2 * NC], const int (&bound)[NC],
                                             bool masked, int tok0, float scale, float* red_w,
                                             int g, int t4) {
  float mx[NC];
#pragma unroll
  for (int c = 0; c < NC; ++c) {
    float v = -INFINITY;
#pragma unroll
    for (int hf = 0; hf < 2; ++hf) {
      const int i = frag_at(c, hf);
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
    for (int c = 0; c < NC; ++c) red_w[frag_col(c, t4)] = mx[c];
}

// the online-softmax step once the 4 warps' maxima are in red_wg ([4][stride]): new running
// max m_r, rescale factors alpha, probabilities in place of S^T, l_r; true when a max moved
template <int NC>
__device__ __forceinline__ bool tile_softmax(float (&s)[2 * NC], float (&m_r)[NC],
                                             float (&l_r)[NC], float (&alpha)[NC],
                                             const float* red_wg, int stride, int t4) {
  float m_use[NC];
  bool moved = false;
#pragma unroll
  for (int c = 0; c < NC; ++c) {
    const int col = frag_col(c, t4);
    float v = m_r[c];
#pragma unroll
    for (int w = 0; w < 4; ++w) v = fmaxf(v, red_wg[w * stride + col]);
    m_use[c] = v == -INFINITY ? 0.f : v;
    alpha[c] = exp2f(m_r[c] - m_use[c]);
    moved |= v != m_r[c];
    m_r[c] = v;
  }
#pragma unroll
  for (int c = 0; c < NC; ++c) {
    float sum = 0.f;
#pragma unroll
    for (int hf = 0; hf < 2; ++hf) {
      const int i = frag_at(c, hf);
      s[i] = exp2f(s[i] - m_use[c]);
      sum += s[i];
    }
    l_r[c] = l_r[c] * alpha[c] + sum;
  }
  return moved;
}

// S^T's partial sums of the two warpgroups (each half of Q K's depth) added through shared
// memory (xmine / xother: this thread's float4 slots of [2 wg][NA / 4][128 threads]); a + b ==
// b + a, so both warpgroups then hold identical sums
template <int NA>
__device__ __forceinline__ void add_other_half(float (&s)[NA], float4* xmine,
                                               const float4* xother) {
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
}

// this warp's 16 tokens of P^T (fp16 / bf16 pairs pk from S^T-layout fragments: pk[2 jb + hf]
// is block (tokens 16 wq + 8 hf.., query rows 8 jb..)) into the swizzled [rows][64 tok] layout
// from row rbase, one x4 stmatrix .trans per two 8-row blocks
template <int ROWS>
__device__ __forceinline__ void store_pt(uint32_t p_base, const uint32_t (&pk)[ROWS / 4],
                                         int rbase, int wq, int lane) {
  const int sm_m = lane >> 3, sm_r = lane & 7;
#pragma unroll
  for (int jb = 0; jb < ROWS / 8; jb += 2) {
    const int mjb = jb + (sm_m >> 1), mhf = sm_m & 1;
    stsm_x4_t(p_base + sw128(rbase + 8 * mjb + sm_r, 2 * wq + mhf), pk[2 * jb], pk[2 * jb + 1],
              pk[2 * jb + 2], pk[2 * jb + 3]);
  }
}

// O^T's accumulators (m64 tiles x N query-row columns) times their columns' alpha, skipped
// when no row's running max moved in the warp
template <int NM, int NO>
__device__ __forceinline__ void rescale_cols(float (&o)[NM][NO], const float (&alpha)[NO / 2],
                                             bool moved) {
  if (__any_sync(0xffffffffu, moved))
#pragma unroll
    for (int mt = 0; mt < NM; ++mt)
#pragma unroll
      for (int i = 0; i < NO; ++i) o[mt][i] *= alpha[2 * (i >> 2) + (i & 1)];
}

// the CTA's rows finished, one a thread (tid < BM): the four warps' softmax sums in red
// ([4][BM]) and the running maxima in mrow ([BM]). Four lanes looping over 8 rows each took
// ~2 µs a CTA, ~6 from a cold instruction cache (H200, 2026-11-30, docs/bench_mla.md)
template <int BM>
__device__ __forceinline__ void finish_rows(const MlaParams& p, const CtaWork& w, int split,
                                            int b, const float* red, const float* mrow,
                                            float* rowv, int tid) {
  if (tid < BM)
    finish_row(p, w, split, b, tid, red[tid] + red[BM + tid] + red[2 * BM + tid] + red[3 * BM + tid],
               mrow[tid], rowv);
}

// this warp's softmax sums into red ([4 warps][BM]: row col(c, t4) at wq * BM) and, by warp 0,
// the running maxima into mrow ([BM]); called by the lanes g = 0 once sum_over_g has run
template <int BM, int NC>
__device__ __forceinline__ void put_row_sums(float* red, float* mrow, const float (&l_r)[NC],
                                             const float (&m_r)[NC], int wq, int t4) {
#pragma unroll
  for (int c = 0; c < NC; ++c) {
    red[wq * BM + frag_col(c, t4)] = l_r[c];
    if (wq == 0) mrow[frag_col(c, t4)] = m_r[c];
  }
}

// l over the 8 lanes g of the warp (its 16 tokens per tile)
template <int NC>
__device__ __forceinline__ void sum_over_g(float (&l)[NC]) {
#pragma unroll
  for (int c = 0; c < NC; ++c) {
    l[c] += __shfl_xor_sync(0xffffffffu, l[c], 4);
    l[c] += __shfl_xor_sync(0xffffffffu, l[c], 8);
    l[c] += __shfl_xor_sync(0xffffffffu, l[c], 16);
  }
}

// a warpgroup's O^T fragments (4 m64 tiles of its 256 dims x N query rows) -> fp32 rows
// [N][OSTRIDE] of the staging buffer
template <int NO>
__device__ __forceinline__ void stage_o(float* ost, const float (&o)[4][NO], int wg, int wq,
                                        int g, int t4) {
#pragma unroll
  for (int mt = 0; mt < 4; ++mt)
#pragma unroll
    for (int i = 0; i < NO; ++i) {
      const int col = 8 * (i >> 2) + 2 * t4 + (i & 1);
      const int dim = (wg * 4 + mt) * 64 + wq * 16 + g + 8 * ((i >> 1) & 1);
      ost[col * OSTRIDE + dim] = o[mt][i];
    }
}

// O^T[the warpgroup's 256 dims, N rows] += V^T . P^T over a landed tile's 64 tokens (A: the
// tile's dim blocks 4 wg.. read M-major; B: P^T [N][64 tok]); meanwhile() runs while the
// tensor cores do (it must not touch o); then the warp releases the stage
template <int N, bool F16, typename F>
__device__ __forceinline__ void pv_tile(float (&o)[4][N / 2], uint32_t kv_base, uint64_t p_desc,
                                        int wg, int lane, uint64_t* empty_bar, F&& meanwhile) {
  const uint64_t v_desc = sw128_desc(kv_base + wg * 4 * BLK, BLK, 1024);
  wgmma_fence();
#pragma unroll
  for (int mt = 0; mt < 4; ++mt)
#pragma unroll
    for (int kk = 0; kk < BN / 16; ++kk)
      Wgmma<N, 1, F16>::run(o[mt], v_desc + ((mt * BLK + kk * 2048) >> 4), p_desc + kk * 2);
  wgmma_commit();
  meanwhile();
  wgmma_wait0();
  __syncwarp();
  if (lane == 0) mbar_arrive(empty_bar);
}

}  // namespace
