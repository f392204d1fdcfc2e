// Split-KV MLA decode over an FP8 (e4m3) paged latent cache, 32 query rows per CTA, with e4m3
// tensor-core products for Q K and the V operand fed to wgmma from registers (sm_90a; variants
// WE2 and, with PV8, WE8).
//
// Why: the swapped kernel (mla_wgmma_sm90.cu) widens every e4m3 tile to fp16 in shared memory
// before multiplying it in fp16 (sm90_fp8.cuh): a 36 KB read and a 72 KB write per tile on top
// of the MMAs' reads, and a barrier that stalls both warpgroups, so at large batch it was no
// faster than its bf16 self (bs 128 ctx 8k: 341 vs 302 µs) although it reads half the bytes.
// Here nothing is widened in shared memory:
//   S^T[64 tok, 32] = K[64 tok, 576] . Q^T      e4m3 x e4m3 wgmma (m64n32k32), straight from
//                                               the TMA tile; the queries quantized to e4m3
//                                               per row (scale amax / 448) when the CTA starts
//                                               (as TRT-LLM-gen quantizes them; the error this
//                                               adds is bounded in mla_spec.quant.fp8)
//   O^T[512, 32]  += V^T[512, 64 tok] . P^T      fp16 wgmma, A = V^T from registers: each
//                                               thread loads its fragment's bytes, pairs two
//                                               tokens' bytes with one prmt and converts them
//                                               exactly with cvt.f16x2.e4m3x2 (e4m3 takes only
//                                               K-major operands, and V^T would be M-major)
// A producer warpgroup (one thread) issues a tile's five TMA boxes (dims 128 c.., 128-byte
// swizzle; the last box's upper half is past the 576-dim row and TMA fills it with zeros) into
// one of four 40 KB stages. The two consumer warpgroups take turns: warpgroup c multiplies the
// tiles it = c, c + 2, ... whole (all 18 e4m3 Q K steps, all 512 dims of P V), with its own
// running max, sum and O, and the two merge once at the end. With both warpgroups on the same
// tile in lockstep (half of Q K's depth each, added through shared memory, then the same
// softmax) a tile took ~2.2 µs at large batch against ~1.2 µs to read its bytes; taking turns,
// no barrier joins the two warpgroups inside the loop: while one runs its softmax or builds V
// fragments, the tensor cores can do the other's MMAs (FA3's ping-pong, without its explicit
// turns): 1.3-1.8x faster (H200, 2026-11-30, docs/bench_mla.md).
//
// Per warpgroup and tile: S^T[64 tok, 32] in 18 m64n32k32 e4m3 steps, the softmax over its 4
// warps (a reduction through shared memory and a 128-thread barrier), P^T into its own buffer,
// O^T[512, 32] += V^T . P^T in 4 k16 steps of 8 m64 tiles with A from registers. Thread (warp
// wq, lane g * 4 + t4) owns the 16 dims D = 128 wq + 16 g .. D + 15 (box wq, 16-byte chunk g:
// one 16-byte load per token; a quarter-warp reads 4 tokens 2 apart x 32 bytes, 8 distinct
// chunks of the swizzle); m64 tile mt's rows g / g + 8 are the dims D + 2 mt / + 1. O holds
// 128 registers a thread, so the warpgroups get 232 with setmaxnreg and a producer warpgroup
// (one thread issues the TMA boxes) keeps 40.
//
// What it computes is mla_spec.kernels.mla.reference.mla_decode_ref with the queries replaced by
// mla_spec.quant.fp8.quantize_rows_e4m3's round trip (tests/kernels/mla/test_mla_sm90_wgmma.py),
// up to the e4m3 MMA's own rounding inside each instruction; a row's two partial results merge
// as split-KV partials do.
//
// PV8 (kernel mla_wgmma_e4m3pp8_m32, variant WE8): P V as e4m3 MMAs too. P is rounded to e4m3
// after a scale of 256 (store_p8), V^T's A fragments come from ldmatrix .trans of the tile's
// bytes and one prmt a register (v8_frag: no conversion), 16 m64n32k32 MMAs a tile in four
// groups; the stage goes back once V is in registers. Thread (wq, g, t4) then holds dims
// 128 wq + 16 mt + 2 g (+1) of m64 tile mt (pairs 16 apart: store_row16<16>). Measured (H200,
// 2026-11-30, docs/bench_mla.md): bs 32 ctx 4k 31.6 vs 34.2 µs, bs 128 ctx 8k 155 vs 177; the
// error P's rounding adds: quant.fp8.fp8_probability_attention_error_bound.
#include "sm90_e4m3.cuh"

namespace {

constexpr int BM = 32, NA = BM / 2, NC = BM / 4;
constexpr int B_PAIR = 1, B_WG = 2;  // named barriers: both consumer warpgroups / one (2 + c)

// dims 4q .. 4q + 3 of the thread's 16 (D + 2 mt + j: m64 tiles 2q and 2q + 1) of S^T column c's
// row, times k
__device__ __forceinline__ float4 o_quad(const float (&o)[8][NA], int c, int q, float k) {
  const int i0 = 4 * (c >> 1) + (c & 1);
  return make_float4(o[2 * q][i0] * k, o[2 * q][i0 + 2] * k, o[2 * q + 1][i0] * k,
                     o[2 * q + 1][i0 + 2] * k);
}

template <bool PV8, bool EARLY>
__device__ __forceinline__ void mla_wgmma_e4m3pp(const WgParams& wp) {
  const MlaParams& p = wp.m;
  extern __shared__ unsigned char smem_raw[];
  unsigned char* smem = smem_raw + ((1024 - (smem_u32(smem_raw) & 1023)) & 1023);
  unsigned char* kv_s = smem;                        // [NS][5][64 tok][128 B] e4m3
  unsigned char* q_s = kv_s + NS * T8::stage_bytes;  // [5][BM][128 B] e4m3
  unsigned char* p_s = q_s + 5 * QBOX;  // [2 wg] P^T [BM][64 tok] fp16 (e4m3: 64 of 128 B)
  float* red = reinterpret_cast<float*>(p_s + 2 * BM * 128);  // [2 wg][4 warps][BM]
  float* mx = red + 8 * BM;                                   // [2 wg][BM] running maxima
  float* rowv = mx + 2 * BM;                                  // [BM] v_scale / l
  float* qmax = rowv + BM;                                    // [BM] each query row's amax
  uint64_t* full = reinterpret_cast<uint64_t*>(qmax + BM);    // [NS] tile landed
  uint64_t* empty = full + NS;                                // [NS] its warpgroup done

  const int split = blockIdx.x, mb = blockIdx.y, b = blockIdx.z;
  const int tid = threadIdx.x, wg = tid >> 7, wt = tid & 127, wq = wt >> 5;
  const int lane = tid & 31, g = lane >> 2, t4 = lane & 3;
  CtaWork w;
  QueryLoad<BM> qload;
  constexpr int EARLY_KV = EARLY ? KV_E4M3 : -1;  // produce_early (sm90_wgmma.cuh)
  if (!cta_begin<BM, NS, EARLY_KV>(wp, split, mb, b, tid, full, empty, w, qload, kv_s))
    return;
  if (tid >= NT) {  // the producer warpgroup
    asm volatile("setmaxnreg.dec.sync.aligned.u32 40;\n" ::: "memory");
    if (tid == NT) produce<KV_E4M3>(wp, w, kv_s, full, empty);
    return;
  }
  asm volatile("setmaxnreg.inc.sync.aligned.u32 232;\n" ::: "memory");
  store_queries_e4m3(qload, q_s, qmax, tid);

  int bound[NC];
  float m_r[NC], l_r[NC];
  const int min_bound = init_rows<NC>(p, w, 0, t4, bound, m_r, l_r);
  const float kq = p.qk_scale_log2 * (1.f / 448.f);
  const float* qm = qmax + 2 * t4;
  float o[8][NA];
  zero_acc(o);
  const uint32_t p_base = smem_u32(p_s + wg * BM * 128);
  const uint64_t q_desc = sw128_desc(smem_u32(q_s), 16, 1024);
  const uint64_t p_desc = sw128_desc(p_base, 16, 1024);
  float* red_wg = red + wg * 4 * BM;

  for (int it = wg; it < w.ntiles; it += 2) {
    const int stage = it % NS, t0 = w.lo + it * BN, nvalid = w.hi - t0;
    const uint32_t kv_base = smem_u32(kv_s + stage * T8::stage_bytes);
    mbar_wait(&full[stage], (it / NS) & 1);
    float s[1][NA];
    zero_acc(s);
    wgmma_fence();
    qk_e4m3<18, 1>(s, sw128_desc(kv_base, 16, 1024), q_desc);
    wgmma_commit();
    uint32_t v[2][2][4];  // k16 step 0's V bytes while the tensor cores multiply Q K
    if constexpr (!PV8) load_v<4>(v, kv_base + wq * BLK, 0, t4, g, nvalid);
    wgmma_wait0();
    if (PV8 && nvalid < BN) zero_v_tail8(kv_s + stage * T8::stage_bytes, nvalid, wt);
    scale_cols(s[0], qm, kq);
    tile_col_max<NC>(s[0], bound, t0 + BN > min_bound, t0 + wq * 16 + g, 1.f,
                     red_wg + wq * BM, g, t4);
    named_barrier(B_WG + wg, 128);  // the tile's V tail zeroed (pv8)
    // pv8: the first 4 m64 tiles' V blocks while the softmax runs (ldsm_x4_t: lane l reads row
    // l % 8 of block l / 8, chunk mt of box wq: 16-byte chunks of 8 rows, one per 128-B swizzle
    // row offset, free of bank conflicts)
    const uint32_t vrow = kv_base + wq * BLK + (lane >> 3) * 1024 + (lane & 7) * 128;
    uint32_t d[4][4];
    if constexpr (PV8)
#pragma unroll
      for (int i = 0; i < 4; ++i) ldsm_x4_t(vrow + ((i ^ (lane & 7)) << 4), d[i]);
    float alpha[NC];
    const bool rescale = tile_softmax<NC>(s[0], m_r, l_r, alpha, red_wg, BM, t4);
    if constexpr (PV8) {
      store_p8<NC>(p_base, s[0], wq, g, t4);
    } else {
      uint32_t pk[NA / 2];
#pragma unroll
      for (int i = 0; i < NA; i += 2) pk[i / 2] = pack_h2<true>(s[0][i], s[0][i + 1]);
      store_pt<BM>(p_base, pk, 0, wq, lane);  // each warp its 16 tokens
    }
    rescale_cols(o, alpha, rescale);
    fence_proxy_async();
    named_barrier(B_WG + wg, 128);  // the warpgroup's P^T complete, its maxima read
    if constexpr (PV8) {
      // 4 groups (k32 step j >> 1, m64 tiles 4 (j & 1)..) of 4 e4m3 MMAs with A from registers,
      // built into two alternating sets: a group's fragments are built while the one before
      // runs. V is in registers once the last group's are built: the stage goes back then.
      uint32_t a[2][4][4];
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const int ks = j >> 1, mt0 = 4 * (j & 1);
        if (j > 0)
#pragma unroll
          for (int i = 0; i < 4; ++i)
            ldsm_x4_t(vrow + ks * 4096 + (((mt0 + i) ^ (lane & 7)) << 4), d[i]);
        if (j >= 2) wgmma_wait1();  // group j - 2 done: its set is free
#pragma unroll
        for (int i = 0; i < 4; ++i) v8_frag(d[i], a[j & 1][i]);
        if (j == 3) mbar_arrive_lane0(&empty[stage], 2, lane);
        wgmma_fence();
#pragma unroll
        for (int i = 0; i < 4; ++i) wgmma_e4m3_rs_n32(o[mt0 + i], a[j & 1][i], p_desc + ks * 2);
        wgmma_commit();
      }
      wgmma_wait0();
    } else {
#pragma unroll
      for (int kk = 0; kk < BN / 16; ++kk) {
        uint32_t a[8][4];
        v_frags<4>(v, a);
        if (kk + 1 < BN / 16) load_v<4>(v, kv_base + wq * BLK, kk + 1, t4, g, nvalid);
        wgmma_fence();
#pragma unroll
        for (int mt = 0; mt < 8; ++mt) wgmma_rs_n32(o[mt], a[mt], p_desc + kk * 2);
        wgmma_commit();
        wgmma_wait0();  // a's registers are the MMAs' until they finish
      }
      mbar_arrive_lane0(&empty[stage], 2, lane);  // 4 warps stand for the 8 it counts
    }
  }
  if (!p.split) griddep_launch();  // the next kernel may launch (pdl.py rule 5)

  // merge the warpgroups' partial rows: one thread per row works out its common max, softmax
  // sum and each group's share factor, both stage their normalized O shares in thread-private
  // float4 slots (conflict-free), and each thread adds and stores 4 rows x its 16 dims. This
  // runs once per CTA from a cold instruction cache; the earlier merge (fp32 rows through
  // shared memory, a finish by 4 lanes looping over 8 rows, then a strided store loop) cost
  // ~11 µs a CTA (H200, 2026-11-30, docs/bench_mla.md).
  sum_over_g<NC>(l_r);
  if (g == 0) put_row_sums<BM>(red_wg, mx + wg * BM, l_r, m_r, wq, t4);
  named_barrier(B_PAIR, NT);  // the KV stages are free, every max and sum written
  float* gs = rowv;  // [2 wg][BM] each group's share factor over the row's sum (rowv, qmax)
  if (tid < BM) {      // one row a thread: the common max, the sum, the factors, the lse
    const float m0 = mx[tid], m1 = mx[BM + tid], m = fmaxf(m0, m1);
    const float f0 = m == -INFINITY ? 0.f : exp2f(m0 - m);
    const float f1 = m == -INFINITY ? 0.f : exp2f(m1 - m);
    const float* r = red + tid;
    const float l = f0 * (r[0] + r[BM] + r[2 * BM] + r[3 * BM]) +
                    f1 * (r[4 * BM] + r[5 * BM] + r[6 * BM] + r[7 * BM]);
    const float vs = PV8 ? p.v_scale * (1.f / P8_SCALE) : p.v_scale;  // pv8's P was scaled
    const float inv = row_factor(vs, l);
    gs[tid] = f0 * inv;
    gs[BM + tid] = f1 * inv;
    if (w.m0 + tid < w.n_rows)
      write_row_lse(p, split, static_cast<long long>(b) * w.n_rows + w.m0 + tid, m, l);
  }
  named_barrier(B_PAIR, NT);
  float gsc[NC];  // this warpgroup's O times gsc: its normalized share of the row
#pragma unroll
  for (int c = 0; c < NC; ++c) gsc[c] = gs[wg * BM + frag_col(c, t4)];
  // both warpgroups stage their shares ([2 wg][8 rows c][4 quads][128 threads] float4, 128 KB
  // of the free KV stages); then warpgroup w adds the two shares of rows c = 4 w .. 4 w + 3 of
  // the same thread slot and stores them (O is dead by then: no registers are short)
  float4* stage_o4 = reinterpret_cast<float4*>(kv_s) + wt;
#pragma unroll
  for (int c = 0; c < NC; ++c)
#pragma unroll
    for (int q = 0; q < 4; ++q) stage_o4[((wg * NC + c) * 4 + q) * 128] = o_quad(o, c, q, gsc[c]);
  named_barrier(B_PAIR, NT);
#pragma unroll
  for (int cc = 0; cc < NC / 2; ++cc) {
    const int c = wg * (NC / 2) + cc;
    float v[16];
#pragma unroll
    for (int q = 0; q < 4; ++q) {
      const float4 x = stage_o4[(c * 4 + q) * 128], y = stage_o4[((NC + c) * 4 + q) * 128];
      v[4 * q] = x.x + y.x;
      v[4 * q + 1] = x.y + y.y;
      v[4 * q + 2] = x.z + y.z;
      v[4 * q + 3] = x.w + y.w;
    }
    if constexpr (PV8)  // dims 128 wq + 16 mt + 2 g (+1) for m64 tile mt
      store_row16<16>(p, w, split, b, frag_col(c, t4), 128 * wq + 2 * g, v);
    else
      store_row16(p, w, split, b, frag_col(c, t4), 128 * wq + 16 * g, v);
  }
  if (p.split) griddep_launch();  // the combine: after the stores (pdl.py rule 5)
}

}  // namespace

WGMMA_ENTRY(mla_wgmma_e4m3pp_m32, NT + 128, mla_wgmma_e4m3pp<false, false>)
WGMMA_ENTRY(mla_wgmma_e4m3pp8_m32, NT + 128, mla_wgmma_e4m3pp<true, false>)
// the first tile into shared memory before the PDL wait (produce_early: WgParams::early_kv)
WGMMA_ENTRY(mla_wgmma_e4m3pp_m32_ek, NT + 128, mla_wgmma_e4m3pp<false, true>)
WGMMA_ENTRY(mla_wgmma_e4m3pp8_m32_ek, NT + 128, mla_wgmma_e4m3pp<true, true>)
