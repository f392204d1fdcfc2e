// Split-KV MLA decode over an FP8 (e4m3) paged latent cache, 32 query rows per CTA, with e4m3
// tensor-core products for Q K and the V operand fed to wgmma from registers (sm_90a).
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
//                                               thread loads its fragment's bytes (8 dims of a
//                                               token per 8-byte load), pairs two tokens' bytes
//                                               with one prmt and converts them exactly with
//                                               cvt.f16x2.e4m3x2 (e4m3 takes only K-major
//                                               operands, and V^T would be M-major)
// The work split is mla_wgmma_sm90.cu's: two consumer warpgroups each take half of Q K's depth
// (9 of 18 k32 steps) and add the halves through shared memory, run the same softmax and own
// 256 output dims each; a producer warp issues a tile's five TMA boxes (dims 128 c.., 128-byte
// swizzle; the last box's upper half is past the 576-dim row and TMA fills it with zeros) into
// one of four 40 KB stages. That lockstep leaves a tile one serial chain (~2.2 µs at large
// batch for ~1.2 µs of bytes): mla_wgmma_e4m3pp_sm90.cu (WE2, the default) lets the two
// warpgroups take turns on whole tiles instead, 1.3-1.8x faster (docs/bench_mla.md v11).
//
// Fragment geometry of P V. Thread (warp wq, lane g * 4 + t4) of warpgroup wg owns the 8 dims
// D = 256 wg + 64 wq + 8 g .. D + 7: in m64 tile mt its fragment rows g / g + 8 are the dims
// D + 2 mt / D + 2 mt + 1 (the order of an output's dims is the kernel's to choose; the
// output staging below undoes it). Its k16 step kk holds tokens 16 kk + 2 t4 (+1) and + 8 (+9), in natural
// order, so P^T is written exactly as mla_wgmma_sm90.cu writes it. In a 128-byte-swizzled
// stage the 16 lanes of a half-warp read 4 tokens 2 apart x 32 bytes: 16 distinct banks.
//
// What it computes is mla_spec.kernels.mla_decode.mla_decode_ref with the queries replaced by
// mla_spec.quant.fp8.quantize_rows_e4m3's round trip (tests/kernels/test_mla_decode_wgmma.py),
// up to the e4m3 MMA's own rounding inside each instruction (H200: max 0.3-4.5% of the
// output's largest value, 0.2-0.8% in norm).
#include "sm90_e4m3.cuh"

namespace {

constexpr int BM = 32, NA = BM / 2, NC = BM / 4;  // rows, S^T accumulators, rows per thread
// Q K in three accumulator chains summed in fp32: 2-3% faster than one (bs 128 ctx 8k 276.9 vs
// 281.9 µs) and exactly as accurate (the e4m3 MMA rounds inside each instruction)
constexpr int NACC = 3;

__device__ __forceinline__ void mla_wgmma_e4m3(const WgParams& wp) {
  const MlaParams& p = wp.m;
  extern __shared__ unsigned char smem_raw[];
  unsigned char* smem = smem_raw + ((1024 - (smem_u32(smem_raw) & 1023)) & 1023);
  unsigned char* kv_s = smem;                        // [NS][5][64 tok][128 B] e4m3
  unsigned char* q_s = kv_s + NS * T8::stage_bytes;  // [5][BM][128 B] e4m3
  unsigned char* p_s = q_s + 5 * QBOX;               // P^T as [BM][64 tok] fp16, swizzled
  float* xbuf = reinterpret_cast<float*>(p_s + BM * 128);  // [2 wg][NA / 4][128 thr][4]
  float* red = xbuf + 2 * NA * 128;                         // [8 warps][BM]
  float* rowv = red + 8 * BM;                               // [BM] v_scale / l
  float* qmax = rowv + BM;                                  // [BM] each query row's amax
  uint64_t* full = reinterpret_cast<uint64_t*>(qmax + BM);  // [NS] tile landed
  uint64_t* empty = full + NS;                              // [NS] 8 warps done

  const int split = blockIdx.x, mb = blockIdx.y, b = blockIdx.z;
  const int tid = threadIdx.x, wg = tid >> 7, wt = tid & 127, wq = wt >> 5;
  const int lane = tid & 31, g = lane >> 2, t4 = lane & 3;
  CtaWork w;
  QueryLoad<BM> qload;
  if (!cta_begin<BM, false, NS>(wp, split, mb, b, tid, full, empty, w, qload)) return;
  if (tid >= NT) {  // the producer warp
    if (lane == 0) produce<KV_E4M3>(wp, w, kv_s, full, empty);
    return;
  }
  store_queries_e4m3(qload, q_s, qmax, tid);

  int bound[NC];
  float m_r[NC], l_r[NC];
  const int min_bound = init_rows<NC>(p, w, 0, t4, bound, m_r, l_r);
  // S^T column c's scale: its query row's (amax / 448), then the softmax's (read per tile from
  // shared memory: registers are what this kernel is short of)
  const float kq = p.qk_scale_log2 * (1.f / 448.f);
  const float* qm = qmax + 2 * t4;
  float o[4][NA];
  zero_acc(o);
  const uint32_t p_base = smem_u32(p_s);
  const uint64_t q_desc = sw128_desc(smem_u32(q_s) + wg * 32, 16, 1024);
  const uint64_t p_desc = sw128_desc(p_base, 16, 1024);
  // this thread's V bytes: box 2 wg + wq / 2, 16-byte chunk 4 (wq % 2) + g / 2, half g % 2
  const int chunk0 = 4 * (wq & 1) + (g >> 1);
  const uint32_t v_off = (2 * wg + (wq >> 1)) * BLK + 8 * (g & 1);
  float4* xmine = reinterpret_cast<float4*>(xbuf) + wg * (NA / 4) * 128 + wt;
  const float4* xother = reinterpret_cast<const float4*>(xbuf) + (1 - wg) * (NA / 4) * 128 + wt;

  for (int it = 0; it < w.ntiles; ++it) {
    const int stage = it % NS, t0 = w.lo + it * BN, nvalid = w.hi - t0;
    const uint32_t kv_base = smem_u32(kv_s + stage * T8::stage_bytes);
    mbar_wait(&full[stage], (it / NS) & 1);
    float sc[NACC][NA];
    zero_acc(sc);
    wgmma_fence();
    qk_e4m3<9, 2>(sc, sw128_desc(kv_base + wg * 32, 16, 1024), q_desc);
    wgmma_commit();
    wgmma_wait0();
    float s[NA];
#pragma unroll
    for (int i = 0; i < NA; ++i) {
      s[i] = sc[0][i];
#pragma unroll
      for (int c = 1; c < NACC; ++c) s[i] += sc[c][i];
    }
    add_other_half(s, xmine, xother);
    scale_cols(s, qm, kq);
    tile_col_max<NC>(s, bound, t0 + BN > min_bound, t0 + wq * 16 + g, 1.f,
                     red + (wg * 4 + wq) * BM, g, t4);
    named_barrier(2 + wg, 128);
    float alpha[NC];
    const bool rescale = tile_softmax<NC>(s, m_r, l_r, alpha, red + wg * 4 * BM, BM, t4);
    uint32_t pk[NA / 2];
#pragma unroll
    for (int i = 0; i < NA; i += 2) pk[i / 2] = pack_h2<true>(s[i], s[i + 1]);
    if ((wq >> 1) == wg) store_pt<BM>(p_base, pk, 0, wq, lane);  // as mla_wgmma_sm90.cu
    rescale_cols(o, alpha, rescale);
    fence_proxy_async();
    named_barrier(1, NT);  // P^T complete
    uint32_t v[BN / 16][2][2][2];  // (loaded during Q K, they cost the registers of a spill-free
#pragma unroll               // kernel: 168 a thread at 9 warps; measured no faster)
    for (int kk = 0; kk < BN / 16; ++kk) load_v(v[kk], kv_base + v_off, kk, t4, chunk0, nvalid);
#pragma unroll
    for (int kk = 0; kk < BN / 16; ++kk) {  // step kk's fragments while step kk - 1 multiplies
      uint32_t a[4][4];
      v_frags(v[kk], a);
      wgmma_fence();
#pragma unroll
      for (int mt = 0; mt < 4; ++mt) wgmma_rs_n32(o[mt], a[mt], p_desc + kk * 2);
    }
    wgmma_commit();
    wgmma_wait0();
    __syncwarp();
    if (lane == 0) mbar_arrive(&empty[stage]);
  }
  if (!p.split) griddep_launch();  // the next kernel; the combine after the stores (pdl.py rule 5)

  sum_over_g<NC>(l_r);
  named_barrier(1, NT);  // the KV stages and red are free
  float* mrow = qmax;  // [BM] the rows' running maxima (free after the loop)
  if (wg == 0 && g == 0) put_row_sums<BM>(red, mrow, l_r, m_r, wq, t4);
  float* ost = reinterpret_cast<float*>(kv_s);  // O^T -> fp32 rows [BM][512]
#pragma unroll
  for (int mt = 0; mt < 4; ++mt)
#pragma unroll
    for (int i = 0; i < NA; ++i)
      ost[frag_col(2 * (i >> 2) + (i & 1), t4) * OSTRIDE + 256 * wg + 64 * wq + 8 * g + 2 * mt +
          ((i >> 1) & 1)] = o[mt][i];
  named_barrier(1, NT);
  finish_rows<BM>(p, w, split, b, red, mrow, rowv, tid);
  named_barrier(1, NT);
  store_rows<BM>(p, w, split, b, ost, rowv, tid);
  if (p.split) griddep_launch();
}

}  // namespace

WGMMA_ENTRY(mla_wgmma_e4m3_m32, NT + 32, mla_wgmma_e4m3)
