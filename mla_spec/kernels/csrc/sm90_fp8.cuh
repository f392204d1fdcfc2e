// The wgmma MLA kernels' FP8 (e4m3) cache: a tile lands as bytes and is widened to fp16 in
// place, in shared memory, before the tile's first MMA.
//
// Why fp16 and not e4m3 MMAs: wgmma multiplies e4m3 only with both operands K-major, and V^T
// (the P V product's A operand, an M-major view of the tile) is not. Why fp16 and not bf16:
// every e4m3 value is exactly an fp16 value (and Hopper converts e4m3 pairs to fp16 pairs in
// one instruction); the queries are rounded to fp16 (saturating at +-65504; 10 mantissa bits,
// as the Triton kernels' FP8 path does) and the probabilities P go as fp16 too.
//
// Layout: the TMA engine writes a tile's nine [64 tokens, 64 dims] boxes of bytes, unswizzled
// (4 KB each, rows of 64 B), into the upper half of the stage; the 256 consumer threads widen
// them into the fp16 tile over the whole stage, in the 128-byte swizzle the bf16 kernels' TMA
// boxes have, so from there on the kernels multiply exactly as for a bf16 cache. A freed
// slot's NaN byte (0x7F) becomes a NaN, zeroed in V as for bf16 (zero_v_tail). Widening with
// integer operations instead (the byte at bits 8-15 of a half, less its magnitude at bits
// 7-13, is the fp16 of value / 256) measured 1-5% slower on the H200 (2026-11-30,
// docs/bench_mla.md).
#pragma once
#include "sm90_wgmma.cuh"

namespace {

// four e4m3 bytes -> two fp16 pairs (byte 0 in lo's low half), exactly
__device__ __forceinline__ void e4m3x4_to_h2x2(uint32_t w, uint32_t& lo, uint32_t& hi) {
  asm("{\n.reg .b16 a, b;\nmov.b32 {a, b}, %2;\n"
      "cvt.rn.f16x2.e4m3x2 %0, a;\ncvt.rn.f16x2.e4m3x2 %1, b;\n}\n"
      : "=r"(lo), "=r"(hi) : "r"(w));
}

// the landed e4m3 tile of a stage -> its fp16 tile over the whole stage, by the NT consumer
// threads (thread t: token row t / 4, bytes 16 (t % 4).. of each box); ends with the fp16 tile
// visible to wgmma. fp16 blocks 0-3 lie below the bytes; block c >= 4 overwrites boxes 2c-9
// and 2c-8 (box 0 for c = 4), so a barrier separates every thread's reads of a box from the
// first write over it (two barriers keep 16 registers of bytes live at most). A CPU model of
// this schedule checks it (test_fp8_in_place_widening_schedule_...): change both together.
__device__ __forceinline__ void widen_boxes(unsigned char* stage_s, const uint4* v, int c0,
                                            int n, int r, int j) {
#pragma unroll
  for (int i = 0; i < n; ++i) {
    uint4 lo, hi;
    e4m3x4_to_h2x2(v[i].x, lo.x, lo.y);
    e4m3x4_to_h2x2(v[i].y, lo.z, lo.w);
    e4m3x4_to_h2x2(v[i].z, hi.x, hi.y);
    e4m3x4_to_h2x2(v[i].w, hi.z, hi.w);
    unsigned char* blk = stage_s + (c0 + i) * BLK;
    *reinterpret_cast<uint4*>(blk + sw128(r, 2 * j)) = lo;
    *reinterpret_cast<uint4*>(blk + sw128(r, 2 * j + 1)) = hi;
  }
}

__device__ __forceinline__ void widen_tile(unsigned char* stage_s, int tid) {
  const int r = tid >> 2, j = tid & 3;
  const unsigned char* src = stage_s + TILE / 2 + r * 64 + j * 16;
  const auto box = [&](int c) { return *reinterpret_cast<const uint4*>(src + c * (BLK / 2)); };
  uint4 v[4];
#pragma unroll
  for (int c = 0; c < 4; ++c) v[c] = box(c);
  widen_boxes(stage_s, v, 0, 4, r, j);
  const uint4 b8 = box(8);
#pragma unroll
  for (int c = 4; c < 7; ++c) v[c - 4] = box(c);
  named_barrier(1, NT);  // boxes 0-6 and 8 read
  widen_boxes(stage_s, v, 4, 3, r, j);  // over boxes 0-4
  v[0] = box(7);
  widen_boxes(stage_s, v, 7, 1, r, j);  // over boxes 5-6
  named_barrier(1, NT);  // box 7 read
  widen_boxes(stage_s, &b8, 8, 1, r, j);  // over boxes 7-8
  fence_proxy_async();
  named_barrier(1, NT);
}

// tile `it` of a CTA ready for its MMAs: landed (full), widened when the cache is e4m3, the V
// rows past the split's end zeroed. The e4m3 kernels ready tile it + 1 during tile it's P V
// (pv_tile's meanwhile), so the widening overlaps the tensor cores; the bf16 ones at the top
// of each tile.
template <int KV>
__device__ __forceinline__ void ready_tile(unsigned char* kv_s, uint64_t* full, int it, int lo,
                                           int hi, int tid) {
  const int stage = it % STAGES;
  mbar_wait(&full[stage], (it / STAGES) & 1);
  if constexpr (KvTraits<KV>::f16) widen_tile(kv_s + stage * TILE, tid);
  zero_v_tail(kv_s + stage * TILE, hi - (lo + it * BN), tid);
}

}  // namespace
