// The parameters every hand-written MLA split kernel takes (passed by value; ctypes mirrors:
// mla/sm90_mma.py MlaParams, and mla/sm90_wgmma.py _WgParams around it).
#pragma once
#include <cuda_bf16.h>
#include <stddef.h>

struct MlaParams {
  const __nv_bfloat16* qn;
  const __nv_bfloat16* qp;
  const __nv_bfloat16* kv;
  const int* r2t;
  const void* rpi;
  const void* kv_lens;
  float* part;  // fp32 split partials, or bf16 ones (part_bf16; the wgmma kernels only)
  float* part_lse;
  __nv_bfloat16* out;
  float* lse;
  long long s_qn_t, s_qn_h, s_qp_t, s_qp_h, s_r2t, s_o_t, s_o_h, s_ps, s_ls;
  int H, q_len, num_splits, rpi_i64, kvl_i64, split, write_lse, part_bf16;
  float qk_scale_log2, v_scale;
};
// mla/sm90_mma.py MlaParams mirrors this layout (tests/kernels/mla/test_mla_sm90_mma.py
// checks it)
static_assert(sizeof(MlaParams) == 192 && offsetof(MlaParams, qk_scale_log2) == 184, "layout");
