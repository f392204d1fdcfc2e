// Device helpers shared by the hand-written Hopper kernels of this folder: shared-memory
// addresses, mbarriers, bulk copies, programmatic dependent launch, bf16 packing.
// (cuda_driver.compile_cubin hashes every .cuh here into a kernel's cache key.)
#pragma once
#include <cuda_bf16.h>
#include <stdint.h>

namespace sm90 {

// x / d for 0 <= x < 2^21 and d >= 1 through d's approximate reciprocal: the float quotient is
// within one of the exact one and corrected both ways. Why not `/`: an int division is ~25
// instructions, and code a CTA runs once runs from a cold instruction cache, ~10 cycles an
// instruction (H200, 2026-11-30, docs/bench_mla.md); the wgmma kernels' QueryLoad::issue had
// nine of them
__device__ __forceinline__ int div_small(int x, int d) {
  int q = __float2int_rz(__int2float_rn(x) * __fdividef(1.f, __int2float_rn(d)));
  q -= q * d > x;
  q += (q + 1) * d <= x;
  return q;
}

__device__ __forceinline__ uint32_t smem_u32(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

__device__ __forceinline__ void mbar_init(uint64_t* bar, int count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(smem_u32(bar)), "r"(count));
}

__device__ __forceinline__ void mbar_fence_init() {
  asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
}

__device__ __forceinline__ void mbar_expect_tx(uint64_t* bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(smem_u32(bar)),
               "r"(bytes)
               : "memory");
}

__device__ __forceinline__ void mbar_arrive(uint64_t* bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(smem_u32(bar)) : "memory");
}

// n arrivals at once (a warp standing for several of the count the barrier was made with)
__device__ __forceinline__ void mbar_arrive_n(uint64_t* bar, uint32_t n) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0], %1;\n" ::"r"(smem_u32(bar)), "r"(n)
               : "memory");
}

// lane 0's n arrivals after the warp's __syncwarp, predicated rather than branched to: between
// two wgmma waits a branch makes ptxas serialize every wgmma of the kernel (C7520)
__device__ __forceinline__ void mbar_arrive_lane0(uint64_t* bar, uint32_t n, int lane) {
  __syncwarp();
  asm volatile("{\n.reg .pred p;\nsetp.eq.u32 p, %2, 0;\n"
               "@p mbarrier.arrive.shared::cta.b64 _, [%0], %1;\n}\n"
               ::"r"(smem_u32(bar)), "r"(n), "r"(lane) : "memory");
}

__device__ __forceinline__ void mbar_wait(uint64_t* bar, uint32_t parity) {
  asm volatile(
      "{\n"
      ".reg .pred P1;\n"
      "LAB_WAIT:\n"
      "mbarrier.try_wait.parity.shared::cta.b64 P1, [%0], %1;\n"
      "@P1 bra DONE;\n"
      "bra LAB_WAIT;\n"
      "DONE:\n"
      "}\n" ::"r"(smem_u32(bar)),
      "r"(parity)
      : "memory");
}

// one contiguous global -> shared copy by the bulk-copy engine, completing on `bar`
__device__ __forceinline__ void bulk_g2s(void* dst, const void* src, uint32_t bytes,
                                         uint64_t* bar) {
  asm volatile(
      "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n"
      ::"r"(smem_u32(dst)), "l"(src), "r"(bytes), "r"(smem_u32(bar))
      : "memory");
}

// generic-proxy shared-memory writes become visible to the async proxy (bulk copies, wgmma)
__device__ __forceinline__ void fence_proxy_async() {
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
}

__device__ __forceinline__ void griddep_wait() {
  asm volatile("griddepcontrol.wait;\n" ::: "memory");
}

__device__ __forceinline__ void griddep_launch() {
  asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
}

// thread-block clusters (sm_90): the CTA's rank, a barrier of every non-exited thread of the
// cluster (release / acquire: shared-memory writes before it are seen by reads after it in any
// CTA of the cluster), and loads from the shared memory of the CTA of rank `rank` at the
// address p has in this one (distributed shared memory)
__device__ __forceinline__ uint32_t cluster_rank() {
  uint32_t r;
  asm volatile("mov.u32 %0, %%cluster_ctarank;\n" : "=r"(r));
  return r;
}

__device__ __forceinline__ void cluster_sync() {
  asm volatile("barrier.cluster.arrive.release.aligned;\nbarrier.cluster.wait.acquire.aligned;\n"
               ::: "memory");
}

__device__ __forceinline__ uint32_t peer_addr(const void* p, uint32_t rank) {
  uint32_t a;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;\n" : "=r"(a) : "r"(smem_u32(p)), "r"(rank));
  return a;
}

__device__ __forceinline__ float4 peer_ld_f4(uint32_t a) {
  float4 v;
  asm volatile("ld.shared::cluster.v4.f32 {%0, %1, %2, %3}, [%4];\n"
               : "=f"(v.x), "=f"(v.y), "=f"(v.z), "=f"(v.w) : "r"(a) : "memory");
  return v;
}

__device__ __forceinline__ float peer_ld_f(uint32_t a) {
  float v;
  asm volatile("ld.shared::cluster.f32 %0, [%1];\n" : "=f"(v) : "r"(a) : "memory");
  return v;
}

// bytes of {b, a} picked by the selector's nibbles (PTX prmt, default mode)
__device__ __forceinline__ uint32_t prmt(uint32_t a, uint32_t b, uint32_t sel) {
  uint32_t d;
  asm("prmt.b32 %0, %1, %2, %3;\n" : "=r"(d) : "r"(a), "r"(b), "r"(sel));
  return d;
}

// the low / high bf16 of a packed pair as floats (exact: a bf16 is a float's upper half)
__device__ __forceinline__ float bf16_lo(uint32_t w) { return __uint_as_float(w << 16); }
__device__ __forceinline__ float bf16_hi(uint32_t w) { return __uint_as_float(w & 0xFFFF0000u); }

__device__ __forceinline__ uint32_t pack_bf16(float lo, float hi) {
  __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<uint32_t*>(&v);
}

}  // namespace sm90
