// Split-KV MLA decode over the paged latent cache, hand-written for Hopper (sm_90).
//
// Why a CUDA kernel beside the Triton ones: at batch 1 the attention is a few MB of KV streamed
// by a few dozen programs, and its time is latency, not bandwidth. Triton 3.6 issues the KV
// loads of a program from its own warps in the software-pipelined loop; here one warp hands
// whole KV rows to the bulk-copy engine (cp.async.bulk, completion on an mbarrier) as soon as a
// stage is free, and every warp only multiplies (mma.sync m16n8k16, bf16 in, fp32 out).
//
// What it computes is exactly mla_spec.kernels.mla.mla_decode (fixed q_len, bf16 cache):
// row r = i * H + h of request b sees KV positions j < kv_len - q_len + i + 1 and gets
// v_scale * softmax_j(qk_scale * q . kv_j) @ kv_j[:512] (zeros for an empty window).
//
// One CTA = (split, row block of BM rows, request); NW warps. Per KV tile of BN tokens:
//   S[BM, BN]   = Q[BM, 576] K^T : warp w owns tokens [w*BN/NW, (w+1)*BN/NW), all 576 dims
//   row max     : across warps through shared memory (one barrier); l stays per warp
//   P -> smem   : bf16, so that every warp sees the whole tile's probabilities
//   O[BM, 512] += P V          : warp w owns output columns [w*512/NW, (w+1)*512/NW)
// Shared memory rows are 576 + 8 elements apart (1168 B), so ldmatrix's eight row addresses
// fall in distinct banks; each KV row is therefore its own 1152-byte bulk copy.
// Output: with split, the normalized fp32 partial and its log2-sum-exp per row (merged by
// mla/combine.py combine_splits); without, the bf16 result and optionally the natural lse.
#include "mla_params.cuh"
#include "sm90_common.cuh"

constexpr int DV = 512, DPE = 64, DK = DV + DPE, SK = DK + 8;

namespace {

using namespace sm90;

__device__ __forceinline__ void ldsm_x4(uint32_t addr, uint32_t (&r)[4]) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(addr));
}

__device__ __forceinline__ void ldsm_x4_t(uint32_t addr, uint32_t (&r)[4]) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(addr));
}

__device__ __forceinline__ void mma_bf16(float (&c)[4], const uint32_t (&a)[4], uint32_t b0,
                                         uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
      "{%8,%9}, {%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

template <int A, int B>
__device__ __forceinline__ void zero_frags(float (&f)[A][B][4]) {  // mma accumulators
#pragma unroll
  for (int a = 0; a < A; ++a)
#pragma unroll
    for (int b = 0; b < B; ++b)
#pragma unroll
      for (int e = 0; e < 4; ++e) f[a][b][e] = 0.f;
}

template <int BM, int BN, int STAGES, int NW>
__device__ __forceinline__ void mla_splitkv(const MlaParams& p) {
  static_assert(BM % 16 == 0 && (BN / NW) % 8 == 0 && (DV / NW) % 16 == 0 && STAGES < 16,
                "tile shape");
  constexpr int MT = BM / 16;           // m16 tiles of the rows
  constexpr int TW = BN / NW;           // tokens per warp in S
  constexpr int NTW = TW / 8;           // n8 tiles per warp in S
  constexpr int CW = DV / NW;           // output columns per warp
  constexpr int NPV = CW / 8;           // n8 tiles per warp in O
  constexpr int SP = BN + 8;            // P row stride (elements)
  extern __shared__ __align__(128) unsigned char smem[];
  uint64_t* bars = reinterpret_cast<uint64_t*>(smem);  // [STAGES + 1], in the first 128 B
  __nv_bfloat16* qs = reinterpret_cast<__nv_bfloat16*>(smem + 128);
  __nv_bfloat16* ks = qs + BM * SK;
  __nv_bfloat16* ps = ks + STAGES * BN * SK;
  float* red = reinterpret_cast<float*>(ps + BM * SP);  // [NW][BM]

  const int split = blockIdx.x, mb = blockIdx.y, b = blockIdx.z;
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane >> 2, t4 = lane & 3;
  if (tid == 0) {
    for (int s = 0; s <= STAGES; ++s) mbar_init(&bars[s], 1);  // KV stages, then Q
    mbar_fence_init();
  }
  griddep_wait();
  const int H = p.H, q_len = p.q_len;
  const int kv_len = p.kvl_i64 ? static_cast<int>(static_cast<const long long*>(p.kv_lens)[b])
                               : static_cast<const int*>(p.kv_lens)[b];
  const int n_rows = q_len * H, m0 = mb * BM;
  if (m0 >= n_rows) return;
  const long long req = p.rpi_i64 ? static_cast<const long long*>(p.rpi)[b]
                                  : static_cast<long long>(static_cast<const int*>(p.rpi)[b]);
  const int last_row = min(m0 + BM, n_rows) - 1;
  const int hi_rows = kv_len - q_len + last_row / H + 1;
  const int chunk = ((kv_len + p.num_splits - 1) / p.num_splits + BN - 1) / BN * BN;
  const int lo = split * chunk;
  const int hi = min(min(lo + chunk, kv_len), hi_rows);
  const int ntiles = hi > lo ? (hi - lo + BN - 1) / BN : 0;
  const int* r2t_row = p.r2t + req * p.s_r2t;
  __syncthreads();  // barriers initialized

  auto issue = [&](int tile, int stage) {  // warp 0: one bulk copy per KV row of the tile
    const long long slot0 = r2t_row[lo + tile * BN];
    if (lane == 0) mbar_expect_tx(&bars[stage], BN * DK * 2);
    __syncwarp();
    for (int r = lane; r < BN; r += 32)
      bulk_g2s(ks + (stage * BN + r) * SK, p.kv + (slot0 + r) * DK, DK * 2, &bars[stage]);
  };
  if (warp == 0)
    for (int s = 0; s < STAGES && s < ntiles; ++s) issue(s, s);

  // queries -> shared by bulk copies too (a plain load loop waits one memory latency per
  // trip): warp 1 copies the valid rows (q_nope 1024 B + q_pe 128 B each) onto bars[STAGES],
  // the other warps zero the rows past n_rows
  const int q_rows = min(BM, n_rows - m0);
  if (warp == 1 % NW) {
    if (lane == 0) mbar_expect_tx(&bars[STAGES], q_rows * DK * 2);
    __syncwarp();
    for (int r = lane; r < q_rows; r += 32) {
      const int row = m0 + r;
      const long long tok = static_cast<long long>(b) * q_len + row / H, h = row % H;
      bulk_g2s(qs + r * SK, p.qn + tok * p.s_qn_t + h * p.s_qn_h, DV * 2, &bars[STAGES]);
      bulk_g2s(qs + r * SK + DV, p.qp + tok * p.s_qp_t + h * p.s_qp_h, DPE * 2,
               &bars[STAGES]);
    }
  }
  for (int c = q_rows * 72 + tid; c < BM * 72; c += NW * 32)
    *reinterpret_cast<uint4*>(qs + (c / 72) * SK + (c % 72) * 8) = make_uint4(0, 0, 0, 0);
  __syncthreads();
  mbar_wait(&bars[STAGES], 0);

  float o[MT][NPV][4];
  zero_frags(o);
  float m_r[MT][2], l_r[MT][2];
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int hf = 0; hf < 2; ++hf) {
      m_r[mt][hf] = -INFINITY;
      l_r[mt][hf] = 0.f;
    }
  const int nbase = warp * TW, cbase = warp * CW;
  const float scale = p.qk_scale_log2;

  for (int it = 0; it < ntiles; ++it) {
    const int stage = it % STAGES;
    mbar_wait(&bars[stage], (it / STAGES) & 1);
    const __nv_bfloat16* kt = ks + stage * BN * SK;
    const int nvalid = hi - (lo + it * BN);
    if (nvalid < BN)  // slots past hi may hold anything (a freed slot's NaN): zero their V
      for (int c = tid; c < (BN - nvalid) * (DV / 8); c += NW * 32)  // rows (P = 0 times NaN)
        *reinterpret_cast<uint4*>(ks + (stage * BN + nvalid + c / (DV / 8)) * SK +
                                  c % (DV / 8) * 8) = make_uint4(0, 0, 0, 0);
    float s[MT][NTW][4];
    zero_frags(s);
#pragma unroll 2
    for (int kk = 0; kk < DK; kk += 32) {
      uint32_t bfr[NTW][4];
#pragma unroll
      for (int nt = 0; nt < NTW; ++nt)
        ldsm_x4(smem_u32(kt + (nbase + nt * 8 + (lane & 7)) * SK + kk + (lane >> 3) * 8),
                bfr[nt]);
#pragma unroll
      for (int ksub = 0; ksub < 2; ++ksub) {
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
          uint32_t a[4];
          ldsm_x4(smem_u32(qs + (mt * 16 + (lane & 7) + ((lane >> 3) & 1) * 8) * SK + kk +
                           ksub * 16 + (lane >> 4) * 8),
                  a);
#pragma unroll
          for (int nt = 0; nt < NTW; ++nt)
            mma_bf16(s[mt][nt], a, bfr[nt][2 * ksub], bfr[nt][2 * ksub + 1]);
        }
      }
    }
    // scale, mask, this warp's row max
    const int tok0 = lo + it * BN + nbase;
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
      for (int hf = 0; hf < 2; ++hf) {
        const int row = m0 + mt * 16 + g + hf * 8;
        const int bound = min(kv_len - q_len + row / H + 1, hi);
        float v = -INFINITY;
#pragma unroll
        for (int nt = 0; nt < NTW; ++nt)
#pragma unroll
          for (int e = 0; e < 2; ++e) {
            const int j = tok0 + nt * 8 + 2 * t4 + e;
            const float x = j < bound ? s[mt][nt][hf * 2 + e] * scale : -INFINITY;
            s[mt][nt][hf * 2 + e] = x;
            v = fmaxf(v, x);
          }
        v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, 1));
        v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, 2));
        if (t4 == 0) red[warp * BM + mt * 16 + g + hf * 8] = v;
      }
    __syncthreads();
    float alpha[MT][2], m_use[MT][2];
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
      for (int hf = 0; hf < 2; ++hf) {
        float v = m_r[mt][hf];
#pragma unroll
        for (int w = 0; w < NW; ++w) v = fmaxf(v, red[w * BM + mt * 16 + g + hf * 8]);
        m_use[mt][hf] = v == -INFINITY ? 0.f : v;
        alpha[mt][hf] = exp2f(m_r[mt][hf] - m_use[mt][hf]);
        m_r[mt][hf] = v;
      }
    // probabilities: this warp's part of l, and P to shared memory
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
      for (int hf = 0; hf < 2; ++hf) {
        float sum = 0.f;
#pragma unroll
        for (int nt = 0; nt < NTW; ++nt) {
          const float p0 = exp2f(s[mt][nt][hf * 2] - m_use[mt][hf]);
          const float p1 = exp2f(s[mt][nt][hf * 2 + 1] - m_use[mt][hf]);
          sum += p0 + p1;
          *reinterpret_cast<uint32_t*>(ps + (mt * 16 + g + hf * 8) * SP + nbase + nt * 8 +
                                       2 * t4) = pack_bf16(p0, p1);
        }
        l_r[mt][hf] = l_r[mt][hf] * alpha[mt][hf] + sum;
      }
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
      for (int j = 0; j < NPV; ++j) {
        o[mt][j][0] *= alpha[mt][0];
        o[mt][j][1] *= alpha[mt][0];
        o[mt][j][2] *= alpha[mt][1];
        o[mt][j][3] *= alpha[mt][1];
      }
    __syncthreads();
    // O += P V over this warp's columns
#pragma unroll
    for (int kk = 0; kk < BN; kk += 16) {
      uint32_t a[MT][4];
#pragma unroll
      for (int mt = 0; mt < MT; ++mt)
        ldsm_x4(smem_u32(ps + (mt * 16 + (lane & 7) + ((lane >> 3) & 1) * 8) * SP + kk +
                         (lane >> 4) * 8),
                a[mt]);
#pragma unroll
      for (int j = 0; j < NPV; j += 2) {
        uint32_t bv[4];
        ldsm_x4_t(smem_u32(kt + (kk + (lane & 7) + ((lane >> 3) & 1) * 8) * SK + cbase + j * 8 +
                           (lane >> 4) * 8),
                  bv);
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
          mma_bf16(o[mt][j], a[mt], bv[0], bv[1]);
          mma_bf16(o[mt][j + 1], a[mt], bv[2], bv[3]);
        }
      }
    }
    __syncthreads();  // every warp is done with this stage and with P
    if (warp == 0 && it + STAGES < ntiles) {
      fence_proxy_async();
      issue(it + STAGES, stage);
    }
  }
  griddep_launch();  // the combine may launch now (it waits for this grid to finish)

  // l over the warps, then normalize and write
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int hf = 0; hf < 2; ++hf) {
      float l = l_r[mt][hf];
      l += __shfl_xor_sync(0xffffffffu, l, 1);
      l += __shfl_xor_sync(0xffffffffu, l, 2);
      if (t4 == 0) red[warp * BM + mt * 16 + g + hf * 8] = l;
    }
  __syncthreads();
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int hf = 0; hf < 2; ++hf) {
      const int rl = mt * 16 + g + hf * 8, row = m0 + rl;
      if (row >= n_rows) continue;
      float l = 0.f;
#pragma unroll
      for (int w = 0; w < NW; ++w) l += red[w * BM + rl];
      const bool has = l > 0.f;
      const float inv = has ? p.v_scale / l : 0.f;
      const float lse2 = has ? m_r[mt][hf] + log2f(l) : -INFINITY;
      const long long grow = static_cast<long long>(b) * n_rows + row;  // tok * H + h
      if (p.split) {
        float* dst = p.part + split * p.s_ps + grow * DV + cbase + 2 * t4;
#pragma unroll
        for (int j = 0; j < NPV; ++j)
          *reinterpret_cast<float2*>(dst + j * 8) =
              make_float2(o[mt][j][hf * 2] * inv, o[mt][j][hf * 2 + 1] * inv);
        if (warp == 0 && t4 == 0) p.part_lse[split * p.s_ls + grow] = lse2;
      } else {
        const long long tok = static_cast<long long>(b) * q_len + row / H, h = row % H;
        __nv_bfloat16* dst = p.out + tok * p.s_o_t + h * p.s_o_h + cbase + 2 * t4;
#pragma unroll
        for (int j = 0; j < NPV; ++j)
          *reinterpret_cast<uint32_t*>(dst + j * 8) =
              pack_bf16(o[mt][j][hf * 2] * inv, o[mt][j][hf * 2 + 1] * inv);
        if (p.write_lse && warp == 0 && t4 == 0) p.lse[grow] = lse2 * 0.6931471805599453f;
      }
    }
}

}  // namespace

#define MLA_SPLITKV(BM, BN, ST, NW)                                                          \
  extern "C" __global__ void __launch_bounds__(NW * 32, 1)                                   \
      mla_splitkv_m##BM##_n##BN##_s##ST##_w##NW(const MlaParams p) {                         \
    mla_splitkv<BM, BN, ST, NW>(p);                                                          \
  }

MLA_SPLITKV(32, 64, 2, 4)
