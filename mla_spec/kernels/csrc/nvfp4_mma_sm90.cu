// NVFP4 W4A16 GEMM for few tokens: y[M, N] = x[M, K] @ dequant(W)^T, M <= 16, on Hopper.
//
// Why it exists: at 2-16 tokens the Triton MMA kernels spent their time moving decoded weights
// between register layouts (1.2-2.0x cuBLAS bf16, docs/bench_nvfp4.md), while the bytes allow
// 3.6x. Here every weight is decoded straight into the register fragment `mma.sync` reads and
// is never stored anywhere but registers: the weight rows are the MMA's M side (16 per tile),
// the tokens its N side (8 per MMA, 1-2 MMAs), so few tokens waste MMA slots, never bytes.
//
// Layout: ModelOpt's, read as is (no repacking): w uint8 [N, K/2] (element 2j in byte j's low
// nibble), ws e4m3 [N, K/16], ws2 fp32 scalar, x bf16 [M, K], out bf16 [M, N].
//
// Fragments. A warp reads a 16-row tile in chunks of 128 elements (64 bytes per row): lane
// (g = lane/4, t = lane%4) loads 16 bytes of rows g and g+8 at byte 16t, i.e. elements
// 32t .. 32t+31 of the chunk (two scale blocks). A 32-bit word of it holds elements
// e .. e+7 (e = 32t + 8q) and decodes to four bf16x2 pairs (e+j, e+j+4), j = 0..3. The MMA's
// K order is free as long as A and B agree, so the pairs are its (k, k+1) slots: one word
// feeds two m16n8k16 steps (pairs 0, 1, then 2, 3), and lane t's activations are regrouped
// the same way from x[e .. e+7] with two byte permutes per pair.
//
// Decode (exact): a code's exponent / mantissa bits placed at bf16 bits 8:6 and its sign at
// bit 15 are E2M1 * 2^-126 (subnormal codes included); one bf16x2 multiply by s * 2^118
// gives E2M1 * s * 2^-8, exact in bf16 (2 + 4 significant bits). The e4m3 block scale s is
// placed at bf16 bits 10:4 (s * 2^-120) and multiplied twice by 2^119. ws2 * 2^8 scales the
// fp32 result.
//
// Work split: CTA = R 16-row tiles x one of `splits` K ranges; its WARPS warps take that
// range's chunks round-robin, each through its own ring of STAGES chunks in shared memory
// (cp.async, no registers held while in flight; a lane reads back only what it copied, but
// the scale bytes, hence one __syncwarp); with R = 2 a chunk's activations and their permutes
// serve both tiles. The warps' fp32 sums meet in shared memory. With splits > 1 each CTA
// writes fp32 partials, and the last to arrive on the CTA's counter sums them in split order
// (deterministic), writes y and resets the counter for the next call.
// PDL: weights and scales are read before griddepcontrol.wait, activations after it.
#include "sm90_common.cuh"

struct Nvfp4GemmParams {
  const uint8_t* w;
  const uint8_t* ws;
  const float* ws2;
  const __nv_bfloat16* x;
  __nv_bfloat16* out;
  float* part;    // [splits, M, N] fp32 (splits > 1)
  int* counters;  // [ceil(N / 16)] zero between calls (splits > 1)
  long long stride_w, stride_ws, stride_x, stride_out;  // bytes, bytes, elements, elements
  int m, n, k, splits;
};

namespace {

constexpr uint32_t kTwo119x2 = 0x7B007B00u;  // bf16x2 (2^119, 2^119)

__device__ __forceinline__ uint32_t bf16x2_mul(uint32_t a, uint32_t b) {
  uint32_t d;
  asm("mul.rn.bf16x2 %0, %1, %2;\n" : "=r"(d) : "r"(a), "r"(b));
  return d;
}

// e4m3 block scale byte (bits 0-7 of `byte`) -> bf16x2 (s * 2^118, s * 2^118)
__device__ __forceinline__ uint32_t scale_pair(uint32_t byte) {
  const uint32_t s = ((byte & 0xFFu) * 0x10001u) << 4;  // s * 2^-120 in both halves
  return bf16x2_mul(bf16x2_mul(s, kTwo119x2), kTwo119x2);
}

// eight codes (element e + i in nibble i) -> pairs (e+j, e+j+4) as bf16x2 E2M1 * s * 2^-8
__device__ __forceinline__ void decode_word(uint32_t w, uint32_t scale, uint32_t (&p)[4]) {
  constexpr uint32_t kMag = 0x01C001C0u, kSign = 0x80008000u;
  p[0] = bf16x2_mul(((w << 6) & kMag) | ((w << 12) & kSign), scale);
  p[1] = bf16x2_mul(((w << 2) & kMag) | ((w << 8) & kSign), scale);
  p[2] = bf16x2_mul(((w >> 2) & kMag) | ((w << 4) & kSign), scale);
  p[3] = bf16x2_mul(((w >> 6) & kMag) | (w & kSign), scale);
}

__device__ __forceinline__ void mma_bf16(float (&d)[4], uint32_t a0, uint32_t a1, uint32_t a2,
                                         uint32_t a3, uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
      "{%8,%9}, {%0,%1,%2,%3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// one chunk of one warp's shared-memory ring, per 16-row tile r of the warp's R: each lane's 16
// code bytes of rows g and g+8 (at r * 1024 + {0, 512} + 16 lane), then per tile the 16 rows x
// 8 scale bytes (at R * 1024 + 128 r; lane (g, t) copies 4: row g + 8 (t / 2), half t % 2)
template <int R>
__host__ __device__ constexpr int slot_bytes() { return R * (2 * 32 * 16 + 16 * 8); }

__device__ __forceinline__ uint4 lds128(uint32_t addr) {
  uint4 v;
  asm volatile("ld.shared.v4.u32 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "r"(addr));
  return v;
}

__device__ __forceinline__ uint32_t lds32(uint32_t addr) {
  uint32_t v;
  asm volatile("ld.shared.u32 %0, [%1];\n" : "=r"(v) : "r"(addr));
  return v;
}

__device__ __forceinline__ void cp_async16(uint32_t dst, const void* src) {
  asm volatile("cp.async.cg.shared.global.L2::256B [%0], [%1], 16;\n"
               ::"r"(dst), "l"(src) : "memory");
}

__device__ __forceinline__ void cp_async4(uint32_t dst, const void* src) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4;\n" ::"r"(dst), "l"(src) : "memory");
}

__device__ __forceinline__ void cp_async_commit() {
  asm volatile("cp.async.commit_group;\n" ::: "memory");
}

template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}

__device__ __forceinline__ uint32_t word(const uint4& v, int q) {
  return q == 0 ? v.x : q == 1 ? v.y : q == 2 ? v.z : v.w;
}

template <int NT>
struct Acts {
  uint4 v[NT][4];  // x[e .. e+7] of the lane's 4 words, per 8-token tile
};

// The loop keeps running pointers (advanced by a constant per chunk) and 32-bit shared
// addresses: an earlier version recomputed 64-bit addresses per chunk and spent more
// instructions on them than on decoding (docs/bench_nvfp4.md). R 16-row
// tiles per warp share each chunk's activations (and their byte permutes): at 8-16 tokens the
// activations re-read from L2 per tile outweighed the weights.
template <int NT, int WARPS, int STAGES, bool XPF, int R>
__device__ __forceinline__ void body(const Nvfp4GemmParams& p, uint32_t ring) {
  constexpr int kSlot = slot_bytes<R>(), kScales = R * 1024;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int g = lane >> 2, t = lane & 3;
  const int tile = blockIdx.x, split = blockIdx.y;  // tile: R * 16 rows
  const int chunks = p.k >> 7;
  const int c_begin = static_cast<int>(static_cast<long long>(chunks) * split / p.splits);
  const int c_end = static_cast<int>(static_cast<long long>(chunks) * (split + 1) / p.splits);
  // chunks c_begin + warp + i * WARPS, i < steps
  const int steps = max(0, (c_end - c_begin - warp + WARPS - 1) / WARPS);
  const int c0 = c_begin + warp;
  // rows past N and tokens past M read row N-1 / token M-1 and are not stored: MMA rows and
  // columns are independent, so no predication
  const uint8_t* wa[R];
  const uint8_t* wb[R];
  const uint8_t* sp[R];
#pragma unroll
  for (int r = 0; r < R; ++r) {
    const int row0 = (tile * R + r) * 16;
    wa[r] = p.w + min(row0 + g, p.n - 1) * p.stride_w + t * 16 + c0 * 64;
    wb[r] = p.w + min(row0 + g + 8, p.n - 1) * p.stride_w + t * 16 + c0 * 64;
    sp[r] = p.ws + min(row0 + g + 8 * (t >> 1), p.n - 1) * p.stride_ws + (t & 1) * 4 + c0 * 8;
  }
  const __nv_bfloat16* xr[NT];
#pragma unroll
  for (int j = 0; j < NT; ++j)
    xr[j] = p.x + min(8 * j + g, p.m - 1) * p.stride_x + t * 32 + c0 * 128;
  ring += warp * STAGES * kSlot;
  const uint32_t ring_end = ring + STAGES * kSlot;
  const uint32_t dst_code = lane * 16;
  const uint32_t dst_scale = kScales + (t >> 1) * 64 + g * 8 + (t & 1) * 4;
  const uint32_t src_scale = kScales + g * 8 + (t >> 1) * 4;

  uint32_t wr = ring;  // the slot the next issue fills
  int issued = 0;
  auto issue = [&]() {
    if (issued < steps) {
#pragma unroll
      for (int r = 0; r < R; ++r) {
        cp_async16(wr + r * 1024 + dst_code, wa[r]);
        cp_async16(wr + r * 1024 + 512 + dst_code, wb[r]);
        cp_async4(wr + r * 128 + dst_scale, sp[r]);
        wa[r] += WARPS * 64;
        wb[r] += WARPS * 64;
        sp[r] += WARPS * 8;
      }
    }
    ++issued;
    wr = wr + kSlot == ring_end ? ring : wr + kSlot;
    cp_async_commit();  // empty groups keep the count uniform
  };
  int loaded = 0;
  auto load_x = [&](Acts<NT>& a) {
    if (loaded < steps) {
#pragma unroll
      for (int j = 0; j < NT; ++j) {
#pragma unroll
        for (int q = 0; q < 4; ++q)
          a.v[j][q] = __ldg(reinterpret_cast<const uint4*>(xr[j] + q * 8));
        xr[j] += WARPS * 128;
      }
    }
    ++loaded;
  };

  float acc[R][NT][4];
#pragma unroll
  for (int r = 0; r < R; ++r)
#pragma unroll
    for (int j = 0; j < NT; ++j) acc[r][j][0] = acc[r][j][1] = acc[r][j][2] = acc[r][j][3] = 0.f;

  auto compute = [&](uint32_t slot, const Acts<NT>& a) {
    uint4 code_a[R], code_b[R];
    uint32_t sc_a[R], sc_b[R];
#pragma unroll
    for (int r = 0; r < R; ++r) {
      code_a[r] = lds128(slot + r * 1024 + dst_code);
      code_b[r] = lds128(slot + r * 1024 + 512 + dst_code);
      sc_a[r] = lds32(slot + r * 128 + src_scale) >> (16 * (t & 1));
      sc_b[r] = lds32(slot + r * 128 + src_scale + 64) >> (16 * (t & 1));
    }
#pragma unroll
    for (int h = 0; h < 2; ++h) {  // scale block 2t + h: words 2h, 2h+1
      uint32_t s_a[R], s_b[R];
#pragma unroll
      for (int r = 0; r < R; ++r) {
        s_a[r] = scale_pair(sc_a[r] >> (8 * h));
        s_b[r] = scale_pair(sc_b[r] >> (8 * h));
      }
#pragma unroll
      for (int q = 2 * h; q < 2 * h + 2; ++q) {
        uint32_t pa[R][4], pb[R][4];
#pragma unroll
        for (int r = 0; r < R; ++r) {
          decode_word(word(code_a[r], q), s_a[r], pa[r]);
          decode_word(word(code_b[r], q), s_b[r], pb[r]);
        }
#pragma unroll
        for (int j = 0; j < NT; ++j) {
          const uint4 v = a.v[j][q];  // x[e .. e+7] as (e, e+1) .. (e+6, e+7)
          const uint32_t b0 = sm90::prmt(v.x, v.z, 0x5410), b1 = sm90::prmt(v.x, v.z, 0x7632);
          const uint32_t b2 = sm90::prmt(v.y, v.w, 0x5410), b3 = sm90::prmt(v.y, v.w, 0x7632);
#pragma unroll
          for (int r = 0; r < R; ++r) {
            mma_bf16(acc[r][j], pa[r][0], pb[r][0], pa[r][1], pb[r][1], b0, b1);
            mma_bf16(acc[r][j], pa[r][2], pb[r][2], pa[r][3], pb[r][3], b2, b3);
          }
        }
      }
    }
  };

  sm90::griddep_launch();
#pragma unroll
  for (int i = 0; i < STAGES - 1; ++i) issue();
  sm90::griddep_wait();
  // XPF: the next chunk's activations are loaded during this one's math (registers: 16 per
  // token tile); else at the top of the step, while the step waits for its codes
  Acts<NT> cur, nxt;
  if (XPF) load_x(cur);
  uint32_t rd = ring;
#pragma unroll 1
  for (int i = 0; i < steps; ++i) {
    issue();
    load_x(XPF ? nxt : cur);
    cp_async_wait<STAGES - 1>();
    __syncwarp();
    compute(rd, cur);
    __syncwarp();  // the slot is refilled by the next issue
    rd = rd + kSlot == ring_end ? ring : rd + kSlot;
    if (XPF) cur = nxt;
  }
  cp_async_wait<0>();

  // the warps' sums meet in shared memory; warp 0 finishes
  constexpr int kAcc = R * NT * 4;
  __shared__ float red[WARPS > 1 ? WARPS - 1 : 1][kAcc][32];
  __shared__ int last;
  float* const a = &acc[0][0][0];
  if (WARPS > 1) {
    if (warp > 0)
#pragma unroll
      for (int i = 0; i < kAcc; ++i) red[warp - 1][i][lane] = a[i];
    __syncthreads();
    if (warp > 0) return;
#pragma unroll
    for (int w = 0; w < WARPS - 1; ++w)
#pragma unroll
      for (int i = 0; i < kAcc; ++i) a[i] += red[w][i][lane];
  }
  // acc[r][j][i]: row (tile * R + r) * 16 + g + 8 (i / 2), token 8 j + 2 t + i % 2
  auto row_of = [&](int i) { return (tile * R + i / (NT * 4)) * 16 + g + 8 * ((i & 3) >> 1); };
  auto tok_of = [&](int i) { return 8 * ((i / 4) % NT) + 2 * t + (i & 1); };
  const float out_scale = *p.ws2 * 256.f;
  if (p.splits == 1) {
#pragma unroll
    for (int i = 0; i < kAcc; ++i) {
      const int tok = tok_of(i), row = row_of(i);
      if (tok < p.m && row < p.n)
        p.out[tok * p.stride_out + row] = __float2bfloat16_rn(a[i] * out_scale);
    }
    return;
  }
  const long long mn = static_cast<long long>(p.m) * p.n;
#pragma unroll
  for (int i = 0; i < kAcc; ++i) {
    const int tok = tok_of(i), row = row_of(i);
    if (tok < p.m && row < p.n) __stcg(p.part + split * mn + tok * p.n + row, a[i]);
  }
  __threadfence();
  __syncwarp();
  if (lane == 0) last = atomicAdd(p.counters + tile, 1) == p.splits - 1;
  __syncwarp();
  if (!last) return;
  __threadfence();
#pragma unroll
  for (int i = 0; i < kAcc; ++i) {
    const int tok = tok_of(i), row = row_of(i);
    if (tok < p.m && row < p.n) {
      float v = 0.f;
      for (int s = 0; s < p.splits; ++s) v += __ldcg(p.part + s * mn + tok * p.n + row);
      p.out[tok * p.stride_out + row] = __float2bfloat16_rn(v * out_scale);
    }
  }
  if (lane == 0) p.counters[tile] = 0;
}

}  // namespace

// kernels nvfp4_mma_n<NT>_w<WARPS>_s<STAGES>_x<XPF>_r<R>
#define NVFP4_MMA(NT, WARPS, STAGES, XPF, R)                                                \
  extern "C" __global__ void __launch_bounds__(WARPS * 32)                                 \
      nvfp4_mma_n##NT##_w##WARPS##_s##STAGES##_x##XPF##_r##R(                              \
          const __grid_constant__ Nvfp4GemmParams p) {                                     \
    __shared__ __align__(16) uint8_t ring[WARPS * STAGES * slot_bytes<R>()];              \
    body<NT, WARPS, STAGES, XPF, R>(p, sm90::smem_u32(ring));                             \
  }

NVFP4_MMA(1, 4, 2, 1, 1)
NVFP4_MMA(1, 4, 4, 1, 1)
NVFP4_MMA(1, 4, 8, 1, 1)
NVFP4_MMA(1, 8, 4, 1, 1)
NVFP4_MMA(1, 4, 4, 0, 1)
NVFP4_MMA(2, 4, 4, 1, 1)
NVFP4_MMA(2, 4, 2, 0, 1)
NVFP4_MMA(2, 4, 4, 0, 1)
NVFP4_MMA(2, 4, 8, 0, 1)
NVFP4_MMA(2, 8, 4, 0, 1)
NVFP4_MMA(1, 4, 4, 1, 2)
NVFP4_MMA(1, 8, 4, 1, 2)
NVFP4_MMA(1, 4, 8, 1, 2)
NVFP4_MMA(2, 4, 4, 0, 2)
NVFP4_MMA(2, 8, 4, 0, 2)
NVFP4_MMA(2, 4, 2, 0, 2)
