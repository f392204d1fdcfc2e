#!/usr/bin/env bash
# Run single-GPU jobs side by side, one per GPU of a multi-GPU host, inside one device call.
# Each job sees only its GPU (CUDA_VISIBLE_DEVICES), runs under `timeout`, and writes its output
# to $RES/<name>.log (and whatever it writes to $OUT, which is set to $RES); the logs' tails and
# a summary come last. Jobs on different GPUs do not share HBM or L2, so their timings are those
# of a lone GPU (the host CPUs are shared: keep CPU-heavy jobs few).
#   LIMIT=300 bash benchmarks/run_gpus_parallel.sh "name1::cmd one" "name2::cmd two" ...
# With more jobs than GPUs the extra jobs queue behind the first ones, round robin.
set -uo pipefail
cd "$(dirname "$0")/.."
RES=${RES:-/tmp/mla_spec_parallel}; mkdir -p "$RES"
source benchmarks/gpu_env.sh  # wheels, PYTHONPATH, NVLink multicast off
NGPU=$(nvidia-smi --query-gpu=index --format=csv,noheader | wc -l)
LIMIT=${LIMIT:-300}
start=$(date +%s)
declare -a lanes
i=0
for job in "$@"; do
  name=${job%%::*}; cmd=${job#*::}
  gpu=$(( i % NGPU ))
  lanes[$gpu]="${lanes[$gpu]:-}${name}::${cmd}"$'\n'
  i=$(( i + 1 ))
done
for gpu in "${!lanes[@]}"; do
  (
    while IFS= read -r job; do
      [ -n "$job" ] || continue
      name=${job%%::*}; cmd=${job#*::}
      t0=$(date +%s)
      CUDA_VISIBLE_DEVICES=$gpu OUT=$RES timeout -k 10 "$LIMIT" bash -c "$cmd" > "$RES/$name.log" 2>&1
      echo "$name (gpu $gpu) rc=$? $(( $(date +%s) - t0 ))s" >> "$RES/summary.txt"
    done <<< "${lanes[$gpu]}"
  ) &
done
wait
for job in "$@"; do
  name=${job%%::*}
  echo "=== $name"; tail -n 30 "$RES/$name.log"
done
echo "parallel total $(( $(date +%s) - start ))s" >> "$RES/summary.txt"
cat "$RES/summary.txt"
if [ -n "${OUT:-}" ]; then tar czf "$OUT/parallel.tgz" -C "$(dirname "$RES")" "$(basename "$RES")"; fi
