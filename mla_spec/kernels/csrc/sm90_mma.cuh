// Warpgroup-MMA wrappers of the wgmma MLA kernels: shared-memory descriptors (128-byte
// swizzle), fence / commit / wait, D[64, N] += A . B for N = 16 / 32 / 64 in bf16 or fp16, and
// the 16-bit packings their operands need.
#pragma once
#include <cuda_fp16.h>

#include "sm90_common.cuh"

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
// all but the most recent group done
__device__ __forceinline__ void wgmma_wait1() {
  asm volatile("wgmma.wait_group.sync.aligned 1;\n" ::: "memory");
}

// D[64, N] += A[64, 16] . B[16, N], bf16 (F16: fp16) in, fp32 accumulators (N / 2 per
// thread), both from shared memory; TA = 1: A is M-major (the V^T view), else K-major;
// TB = 1: B is N-major (V read as it lies in the tile), else K-major
template <int N, int TA, bool F16 = false, int TB = 0>
struct Wgmma;

#define SM90_WGMMA(N, T, REGS, NREG, ...)                                                  \
  asm volatile("wgmma.mma_async.sync.aligned.m64n" #N "k16.f32." T "." T " " REGS      \
               ", %" #NREG ", %" NREG1_##NREG ", 1, 1, 1, %" NREG2_##NREG              \
               ", %" NREG3_##NREG ";\n"                                                 \
               : __VA_ARGS__                                                            \
               : "l"(da), "l"(db), "n"(TA), "n"(TB))
#define NREG1_8 "9"
#define NREG2_8 "10"
#define NREG3_8 "11"
#define NREG1_16 "17"
#define NREG2_16 "18"
#define NREG3_16 "19"
#define NREG1_32 "33"
#define NREG2_32 "34"
#define NREG3_32 "35"

// the 16 accumulators of an m64n32 product as asm operands %0-%15 (also the e4m3 and
// register-A wrappers of sm90_e4m3.cuh)
#define SM90_D16 "{%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15}"
#define SM90_ACC16(d)                                                                        \
  "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]),       \
      "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), \
      "+f"(d[14]), "+f"(d[15])

// the 32 accumulators of an m64n64 product as asm operands %0-%31 (also the register-A
// wrapper of mla_wgmma_rows_sm90.cu)
#define SM90_D32                                                                             \
  "{%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21,%22,%23," \
  "%24,%25,%26,%27,%28,%29,%30,%31}"
#define SM90_ACC32(d)                                                                        \
  "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]),       \
      "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), \
      "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]),          \
      "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]),          \
      "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])

template <int TA, bool F16, int TB>
struct Wgmma<16, TA, F16, TB> {
  __device__ __forceinline__ static void run(float (&d)[8], uint64_t da, uint64_t db) {
#define W16_(T) SM90_WGMMA(16, T, "{%0,%1,%2,%3,%4,%5,%6,%7}", 8, "+f"(d[0]), "+f"(d[1]), \
                           "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]))
    if constexpr (F16) W16_("f16"); else W16_("bf16");
#undef W16_
  }
};

template <int TA, bool F16, int TB>
struct Wgmma<32, TA, F16, TB> {
  __device__ __forceinline__ static void run(float (&d)[16], uint64_t da, uint64_t db) {
#define W32_(T) SM90_WGMMA(32, T, SM90_D16, 16, SM90_ACC16(d))
    if constexpr (F16) W32_("f16"); else W32_("bf16");
#undef W32_
  }
};

template <int TA, bool F16, int TB>
struct Wgmma<64, TA, F16, TB> {
  __device__ __forceinline__ static void run(float (&d)[32], uint64_t da, uint64_t db) {
#define W64_(T) SM90_WGMMA(64, T, SM90_D32, 32, SM90_ACC32(d))
    if constexpr (F16) W64_("f16"); else W64_("bf16");
#undef W64_
  }
};

// two floats -> a bf16 pair, or an fp16 pair (F16)
template <bool F16>
__device__ __forceinline__ uint32_t pack_h2(float lo, float hi) {
  if constexpr (F16) {
    __half2 v = __floats2half2_rn(lo, hi);
    return *reinterpret_cast<uint32_t*>(&v);
  } else {
    return pack_bf16(lo, hi);
  }
}

// a bf16 pair -> an fp16 pair, saturating at +-65504 (the FP8 path's queries)
__device__ __forceinline__ uint32_t bf16x2_to_h2(uint32_t v) {
  const float lo = bf16_lo(v), hi = bf16_hi(v);
  return pack_h2<true>(fminf(fmaxf(lo, -65504.f), 65504.f), fminf(fmaxf(hi, -65504.f), 65504.f));
}

}  // namespace
