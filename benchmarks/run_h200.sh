#!/usr/bin/env bash
# Every GPU check and benchmark of the project in one device call (an H200 with torch, triton and
# nvcc, no internet). Run from the repo root with the FlashInfer wheels in .whl/ (see
# ../shared/tools/flashinfer-wheels.sh). Each step is time-boxed so the whole call ends inside its
# lease; results land in $RES (a tarball in $OUT when set) and a summary is printed last.
#   bash benchmarks/run_h200.sh                      # every step
#   STEPS="gpu_tests bench_layer" bash benchmarks/run_h200.sh   # a subset, in this order
# Step limits can be raised per step: LIMIT_bench_layer=240.
set -uo pipefail
cd "$(dirname "$0")/.."
RES=${RES:-/tmp/mla_spec_results}; mkdir -p "$RES"
source benchmarks/gpu_env.sh  # wheels, PYTHONPATH, NVLink multicast off
start=$(date +%s)
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$RES/device.txt"
python3 -c "import torch, triton; print('torch', torch.__version__, '| triton', triton.__version__)" | tee -a "$RES/device.txt"
STEPS=${STEPS:-"sweep_mla sweep_nvfp4 gpu_tests bench_pad bench_layer bench_e2e demo_tp1"}
# optional steps (named in STEPS): sweep_gemv, bench_rope, profile_layer, bench_router, bench_bf16_gemv,
# bench_nvfp4 (--pinned: the model's configs with PDL on / off),
# layer_tests, pad_tests, nvfp4_tests, nvfp4_cuda (sweep_nvfp4_cuda.py: the mma.sync kernel),
# norm_tests, paged_tests, cuda_tests, mla_breakdown, moe_pdl
step() {  # step NAME SECONDS CMD...
  local name=$1 secs=$2; shift 2
  case " $STEPS " in *" $name "*) ;; *) return 0 ;; esac
  local var="LIMIT_$name"; secs=${!var:-$secs}
  local t0=$(date +%s)
  echo "=== $name (limit ${secs}s)"
  OUT=$RES timeout "$secs" "$@" > "$RES/$name.log" 2>&1
  local rc=$?
  echo "$name rc=$rc $(( $(date +%s) - t0 ))s" | tee -a "$RES/summary.txt"
  tail -n 40 "$RES/$name.log"
  if [ -n "${OUT:-}" ]; then tar czf "$OUT/results.tgz" -C "$(dirname "$RES")" "$(basename "$RES")"; fi
}
step sweep_mla   95 python3 benchmarks/sweep_mla.py ${SWEEP_MLA_ARGS:---deadline 75}
step sweep_nvfp4 90 env SWEEP_DEADLINE_S=${SWEEP_DEADLINE_S:-60} python3 benchmarks/sweep_nvfp4.py ${SWEEP_NVFP4_ARGS:-}
step sweep_gemv  270 python3 benchmarks/sweep_gemv.py ${SWEEP_GEMV_ARGS:---moe --deadline 14}
step pad_tests   90 python3 -m pytest tests/kernels/pad -q -x -p no:cacheprovider
step nvfp4_tests 90 python3 -m pytest tests/kernels/nvfp4 -q -p no:cacheprovider
step nvfp4_cuda 120 python3 benchmarks/sweep_nvfp4_cuda.py ${SWEEP_NVFP4_CUDA_ARGS:-}
step layer_tests 120 python3 -m pytest tests/kernels/ops/test_rope_kernel.py tests/models/test_rope.py tests/models/test_qkv_a_fusion.py tests/kernels/ops/test_moe_router.py tests/models/test_moe_routing.py tests/models/test_shared_expert_fusion.py tests/kernels/ops/test_bf16_gemv.py tests/kernels/test_launch_pdl.py -q -p no:cacheprovider
step norm_tests  60 python3 -m pytest -m gpu tests/kernels/ops/test_rmsnorm.py -q -s -p no:cacheprovider
step paged_tests 120 python3 -m pytest tests/kernels/mla/test_mla_paged.py tests/kernels/mla/test_mla_choice.py -q -x -p no:cacheprovider
step cuda_tests  120 python3 -m pytest tests/kernels/mla/test_mla_sm90_mma.py tests/kernels/mla/test_mla_sm90_wgmma.py tests/kernels/mla/test_mla_combine.py tests/kernels/mla/test_mla_gather.py -q -p no:cacheprovider
step mla_breakdown 120 python3 benchmarks/bench_mla_breakdown.py ${MLA_BREAKDOWN_ARGS:-}
step moe_pdl     90 python3 benchmarks/bench_nvfp4.py --moe-pdl
step gpu_tests  200 python3 -m pytest -m gpu tests -q -p no:cacheprovider
step bench_pad   60 python3 benchmarks/bench_pad.py ${BENCH_PAD_ARGS:---quick}
step bench_rope  60 python3 benchmarks/bench_rope.py
step bench_router 90 python3 benchmarks/bench_router.py
step bench_nvfp4 150 python3 benchmarks/bench_nvfp4.py ${BENCH_NVFP4_ARGS:---pinned}
step bench_bf16_gemv 150 python3 benchmarks/bench_bf16_gemv.py ${BENCH_BF16_GEMV_ARGS:---deadline 110}
step profile_layer 90 python3 benchmarks/profile_layer.py ${PROFILE_LAYER_ARGS:-}
step bench_layer 55 python3 benchmarks/bench_layer.py ${BENCH_LAYER_ARGS:---quick --budget-s 30}
step bench_e2e   30 python3 benchmarks/bench_e2e.py --device cuda --batch-sizes 1,32 --max-new-tokens ${E2E_TOKENS:-32}
step demo_tp1    25 python3 -m mla_spec.cli demo --tp 1 --json
echo "total $(( $(date +%s) - start ))s" | tee -a "$RES/summary.txt"
cat "$RES/summary.txt"
