// The swapped wgmma kernel's (mla_wgmma_sm90.cu, W) end when its rows leave as bf16 (the
// result, or the split's bf16 partials), without the fp32 staging.
//
// Why: store_rows (sm90_wgmma.cuh) stages O^T as fp32 rows [BM][516] (64 KB at 32 rows, one
// scalar shared store per accumulator), waits for the row sums to be reduced over the CTA by
// 32 threads (finish_rows), and stores 8 bytes a thread; three CTA barriers, ~1.5 µs at the
// end of every CTA at batch 1 (docs/bench_mla.md v18-v19), which nothing overlaps. Here each
// warpgroup sums its own four warps' softmax sums (both groups hold the same P, so the same
// sums: a 128-thread barrier, not a CTA one), scales its accumulators in registers, and
// stmatrix .trans writes them as bf16 query rows [BM][512] into the queries' buffer (free once
// the last Q K is done); one CTA barrier, then 16-byte stores.
//
// This code runs once per CTA, from a cold instruction cache: stamped, each of its steps took
// ~0.25 µs however little it did (docs/bench_mla.md v21). So the producer warp, idle once it
// has issued its last tile, runs the same instructions first with every store and barrier
// off (`warm`: stores predicated, not branched around, so that their lines are fetched too),
// and the consumers find them in the SM's instruction cache.
#pragma once
#include "sm90_wgmma.cuh"

namespace {

constexpr int ROW_BYTES = DV * 2;  // a bf16 row of the staging: 64 chunks of 16 B
constexpr int B_WARM = 14;         // the producer warp's barrier in its warm pass (32 threads)

// stores that a warm pass skips: predicated in the instruction, so their lines are fetched
__device__ __forceinline__ void stsm_x4_t_if(uint32_t addr, uint32_t r0, uint32_t r1,
                                             uint32_t r2, uint32_t r3, bool on) {
  asm volatile("{\n.reg .pred q;\nsetp.ne.b32 q, %5, 0;\n"
               "@q stmatrix.sync.aligned.m8n8.x4.trans.shared.b16 [%0], {%1, %2, %3, %4};\n}\n"
               ::"r"(addr), "r"(r0), "r"(r1), "r"(r2), "r"(r3), "r"(int(on)) : "memory");
}
__device__ __forceinline__ void st_global_v4_if(void* ptr, uint4 v, bool on) {
  asm volatile("{\n.reg .pred q;\nsetp.ne.b32 q, %5, 0;\n"
               "@q st.global.v4.b32 [%0], {%1, %2, %3, %4};\n}\n"
               ::"l"(ptr), "r"(v.x), "r"(v.y), "r"(v.z), "r"(v.w), "r"(int(on)) : "memory");
}
__device__ __forceinline__ void st_global_v2_if(void* ptr, uint32_t a, uint32_t b, bool on) {
  asm volatile("{\n.reg .pred q;\nsetp.ne.b32 q, %3, 0;\n@q st.global.v2.b32 [%0], {%1, %2};\n}\n"
               ::"l"(ptr), "r"(a), "r"(b), "r"(int(on)) : "memory");
}

// byte offset of 16-byte chunk c of staging row r: chunks XOR-swizzled by r % 8, so the eight
// rows of one stmatrix block land in eight different bank groups
__device__ __forceinline__ uint32_t row_chunk(int r, int c) {
  return r * ROW_BYTES + ((c ^ (r & 7)) << 4);
}

// Normalize this thread's O^T accumulators (o[mt][i]: dim (wg 4 + mt) 64 + 16 wq + g + 8 hf,
// query row frag_col) by v_scale / l of their rows and stage them as bf16 rows at stage_s
// ([BM][512], row_chunk layout). l_r: this thread's softmax sums (its tokens), m_r: the rows'
// running maxima (log2 units, the same in every warp). red: [8 warps][BM] floats and mrow:
// [BM], both free (the loop's last P^T barrier is behind); warpgroup 0 leaves its rows' sums
// and maxima there for write_rows_lse. Every consumer thread calls it (warm: the producer
// warp's pass, nothing written, wg 2 read as 0); a CTA barrier must follow before
// store_bf16_rows.
template <int BM, int NC, int NA>
__device__ __forceinline__ void stage_bf16_rows(const MlaParams& p, const CtaWork& w, int split,
                                                int b, const float (&o)[4][NA], float (&l_r)[NC],
                                                const float (&m_r)[NC], float* red,
                                                float* mrow, uint32_t stage_s, int wg, int wq,
                                                int lane, bool warm) {
  static_assert(NC * 2 == NA && BM == 4 * NC, "a thread's columns");
  const int g = lane >> 2, t4 = lane & 3;
  wg &= 1;
  sum_over_g<NC>(l_r);
  float* mine = red + wg * 4 * BM;
  if (g == 0 && !warm) {
#pragma unroll
    for (int c = 0; c < NC; ++c) {
      mine[wq * BM + frag_col(c, t4)] = l_r[c];
      if (wg == 0 && wq == 0) mrow[frag_col(c, t4)] = m_r[c];
    }
  }
  named_barrier(warm ? B_WARM : 2 + wg, warm ? 32 : 128);
  float fac[NC];
#pragma unroll
  for (int c = 0; c < NC; ++c) {
    const int col = frag_col(c, t4);
    fac[c] = row_factor(p.v_scale,
                        mine[col] + mine[BM + col] + mine[2 * BM + col] + mine[3 * BM + col]);
  }
  // block k of an x4: 8 query rows 8 (2 jj + k / 2).. x 8 dims 8 (k % 2).. of the warp's 16;
  // lane l addresses row l % 8 of block l / 8
  const int sm_k = lane >> 3, sm_r = lane & 7;
#pragma unroll
  for (int mt = 0; mt < 4; ++mt) {
    const int ch = (wg * 4 + mt) * 8 + wq * 2 + (sm_k & 1);
#pragma unroll
    for (int jj = 0; jj < BM / 16; ++jj) {
      uint32_t r[4];
#pragma unroll
      for (int k = 0; k < 4; ++k) {
        const int jb = 2 * jj + (k >> 1), i = 4 * jb + 2 * (k & 1);
        r[k] = pack_bf16(o[mt][i] * fac[2 * jb], o[mt][i + 1] * fac[2 * jb + 1]);
      }
      stsm_x4_t_if(stage_s + row_chunk(8 * (2 * jj + (sm_k >> 1)) + sm_r, ch), r[0], r[1],
                   r[2], r[3], !warm);
    }
  }
}

// the rows' lse from warpgroup 0's sums and maxima (stage_bf16_rows), one a thread: threads
// tid < BM, all in warpgroup 0 (one copy of log2f's code, not one per column of a thread)
template <int BM>
__device__ __forceinline__ void write_rows_lse(const MlaParams& p, const CtaWork& w, int split,
                                               int b, const float* red, const float* mrow,
                                               int tid) {
  if (tid < BM && w.m0 + tid < w.n_rows)
    write_row_lse(p, split, static_cast<long long>(b) * w.n_rows + w.m0 + tid, mrow[tid],
                  red[tid] + red[BM + tid] + red[2 * BM + tid] + red[3 * BM + tid]);
}

// The staged bf16 rows (stage_bf16_rows, after a CTA barrier) to the split's bf16 partials or
// to the result: thread tid moves chunk tid % 64 of rows tid / 64, + 4, ..., 16 bytes a row
// (the result's rows are 8-byte aligned: two 8-byte stores there); warm: the producer warp's
// pass (rows 4, 8, ..), nothing stored
template <int BM>
__device__ __forceinline__ void store_bf16_rows(const MlaParams& p, const CtaWork& w, int split,
                                                int b, const unsigned char* stage_s, int tid,
                                                bool warm) {
  constexpr int CH = ROW_BYTES / 16, RS = NT / CH;  // chunks a row, rows a pass
  const int q_rows = min(BM, w.n_rows - w.m0), ch = tid % CH, r0 = tid / CH;
  if (p.split) {
    uint4* dst = reinterpret_cast<uint4*>(
        reinterpret_cast<__nv_bfloat16*>(p.part) + split * p.s_ps +
        (static_cast<long long>(b) * w.n_rows + w.m0 + r0) * DV) + ch;
#pragma unroll 4
    for (int r = r0; r < q_rows; r += RS, dst += RS * CH)
      st_global_v4_if(dst, *reinterpret_cast<const uint4*>(stage_s + row_chunk(r, ch)), !warm);
  } else {
    // row m0 + r is head h of the request's query token i; the thread's next row is RS heads on
    const int row0 = w.m0 + r0, ti = div_small(row0, p.H);
    int h = row0 - ti * p.H;
    __nv_bfloat16* dst = out_row(p, b, ti, h) + ch * 8;
    const long long wrap = p.s_o_t - static_cast<long long>(p.H) * p.s_o_h;
#pragma unroll 4
    for (int r = r0; r < q_rows; r += RS) {
      const uint4 v = *reinterpret_cast<const uint4*>(stage_s + row_chunk(r, ch));
      st_global_v2_if(dst, v.x, v.y, !warm);
      st_global_v2_if(dst + 4, v.z, v.w, !warm);
      dst += RS * p.s_o_h;
      for (h += RS; h >= p.H; h -= p.H) dst += wrap;
    }
  }
}

}  // namespace
