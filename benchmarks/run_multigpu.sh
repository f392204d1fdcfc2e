#!/usr/bin/env bash
# Tensor parallelism over NCCL on every visible GPU (a 4x or 2x H200 host) in one device call:
# topology, measured collectives, the demo at TP N and TP 1 (accuracy, accept length, tokens/s,
# per-mode time), and the multi-GPU test suite (`pytest -m multigpu`). Modeled on run_h200.sh:
# FlashInfer wheels from .whl/ when present, NVLink multicast off, every step time-boxed, logs and
# JSON in $RES (a tarball in $OUT when set), the summary printed last.
#   bash benchmarks/run_multigpu.sh                                   # default steps, in order
#   STEPS="bench_allreduce demo_tpN" bash benchmarks/run_multigpu.sh  # a subset, in this order
#   LIMIT_multigpu_tests=480 STEPS=multigpu_tests bash benchmarks/run_multigpu.sh
# Default step limits add up to ~560 s (one device command may run 600 s): if a step needs
# more, split the call, e.g. STEPS="nvidia_smi_topo bench_allreduce demo_tpN demo_tp1" then
# STEPS=multigpu_tests. Optional step (name it in STEPS): bench_layer_measured (GPU 0, projection
# with the measured collectives; run after bench_allreduce).
set -uo pipefail
cd "$(dirname "$0")/.."
RES=${RES:-/tmp/mla_spec_multigpu}; mkdir -p "$RES"
source benchmarks/gpu_env.sh  # wheels, PYTHONPATH, NVLink multicast off
# a CLI whose rank died and whose rank 0 stays stuck leaves after this long (mla_spec.runtime.workers)
export MLA_SPEC_HARD_EXIT_S=${MLA_SPEC_HARD_EXIT_S:-15}
start=$(date +%s)
NGPU=$(python3 -c "import torch; print(torch.cuda.device_count())")
nvidia-smi --query-gpu=index,name,driver_version,memory.total --format=csv,noheader | tee "$RES/device.txt"
python3 -c "import torch, triton; print('torch', torch.__version__, '| triton', triton.__version__, '| nccl', '.'.join(map(str, torch.cuda.nccl.version())))" | tee -a "$RES/device.txt"
echo "NGPU=$NGPU" | tee -a "$RES/device.txt"
STEPS=${STEPS:-"nvidia_smi_topo bench_allreduce demo_tpN demo_tp1 multigpu_tests"}

leftovers() {  # report (never kill) GPU processes still alive after a step
  local n
  n=$(nvidia-smi --query-compute-apps=pid --format=csv,noheader 2>/dev/null | grep -c . || true)
  if [ "${n:-0}" != "0" ]; then echo "WARNING: $n GPU processes still running after $1" | tee -a "$RES/summary.txt"; fi
}
_run_step() {  # _run_step log|json NAME SECONDS CMD...
  local kind=$1 name=$2 secs=$3; shift 3
  case " $STEPS " in *" $name "*) ;; *) return 0 ;; esac
  local var="LIMIT_$name"; secs=${!var:-$secs}
  local t0=$(date +%s) log="$RES/$name.log" rc
  echo "=== $name (limit ${secs}s)"
  if [ "$kind" = json ]; then
    OUT=$RES timeout -k 10 "$secs" "$@" > "$RES/$name.json" 2> "$log"; rc=$?
  else
    OUT=$RES timeout -k 10 "$secs" "$@" > "$log" 2>&1; rc=$?
  fi
  echo "$name rc=$rc $(( $(date +%s) - t0 ))s" | tee -a "$RES/summary.txt"
  if [ "$kind" = json ]; then tail -n 15 "$log"; cat "$RES/$name.json"; else tail -n 40 "$log"; fi
  leftovers "$name"
  if [ -n "${OUT:-}" ]; then tar czf "$OUT/results.tgz" -C "$(dirname "$RES")" "$(basename "$RES")"; fi
}
step() { _run_step log "$@"; }       # step NAME SECONDS CMD...   (stdout + stderr -> NAME.log)
step_json() { _run_step json "$@"; }  # stdout -> NAME.json, stderr -> NAME.log

step nvidia_smi_topo 15 nvidia-smi topo -m
step bench_allreduce 60 python3 benchmarks/bench_allreduce.py --world "$NGPU" --json "$RES/bench_allreduce.json"
step_json demo_tpN 150 python3 -m mla_spec.cli demo --tp "$NGPU" --json
step_json demo_tp1 90 python3 -m mla_spec.cli demo --tp 1 --json
case " $STEPS " in *" multigpu_tests "*) t_tests=$(date +%s) ;; esac
step multigpu_tests 300 python3 -m pytest -m multigpu tests -q -p no:cacheprovider -x --durations=0 -rA
case " $STEPS " in *" multigpu_tests "*)
  echo "multigpu_tests wall $(( $(date +%s) - t_tests ))s on $NGPU GPUs (the seed's 4-GPU suite: 386 s)" | tee -a "$RES/summary.txt" ;;
esac
step bench_layer_measured 60 env CUDA_VISIBLE_DEVICES=0 python3 benchmarks/bench_layer.py --quick --budget-s 30 --allreduce-json "$RES/bench_allreduce.json"

# one line per demo: accuracy, accept length, tokens/s (the per-mode tables are in the JSON)
for f in "$RES"/demo_tp*.json; do
  [ -s "$f" ] || continue
  python3 - "$f" <<'EOF' | tee -a "$RES/summary.txt"
import json, sys
try:
    d = json.load(open(sys.argv[1]))
    acc = d["avg_accept_length"]
    print(f"{sys.argv[1].rsplit('/', 1)[-1]}: tp {d['tp_size']} accuracy {d['accuracy']:.3f} "
          f"accept {acc if acc is None else round(acc, 3)} tokens/s {d['tokens_per_s']:.1f} "
          f"wall {d['wall_seconds']:.1f}s")
except Exception as e:
    print(f"{sys.argv[1]}: no report ({type(e).__name__}: {e})")
EOF
done
echo "total $(( $(date +%s) - start ))s" | tee -a "$RES/summary.txt"
if [ -n "${OUT:-}" ]; then tar czf "$OUT/results.tgz" -C "$(dirname "$RES")" "$(basename "$RES")"; fi
cat "$RES/summary.txt"
