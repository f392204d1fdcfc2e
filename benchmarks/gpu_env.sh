# Sourced (from the repo root) by the device scripts run_h200.sh, run_multigpu.sh and
# run_gpus_parallel.sh: the FlashInfer wheels carried in .whl/ go to /tmp/site (once per machine),
# PYTHONPATH points at the checkout (and /tmp/site), and NVLink multicast stays off.
if ls .whl/*.whl >/dev/null 2>&1; then
  if [ ! -d /tmp/site/flashinfer ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl
  fi
  export PYTHONPATH=$PWD:/tmp/site
else
  export PYTHONPATH=$PWD
fi
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
