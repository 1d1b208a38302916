# Sourced by every experiments/gpu_*.sh: the device-side environment in one place.
# - The carried wheels (.whl/, experiments/fetch_device_wheels.sh) go into /tmp/site once per
#   machine: gpu_two_jobs.sh sources this before starting its two jobs, which then skip it.
# - NVLink multicast stays off (the device notes: it can take a shared host's GPUs out of service).
# - One Inductor cache under the checkout, unbuffered Python, $OUT for what comes back.
export PYTHONUNBUFFERED=1 TORCHINDUCTOR_CACHE_DIR="$PWD/.inductor_cache"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
if [ "${FLASHSAC_WHEELS_INSTALLED:-0}" != 1 ]; then
  ls .whl/*.whl > /dev/null 2>&1 || { echo "device_env.sh: no wheels under .whl/: run experiments/fetch_device_wheels.sh here and carry .whl" >&2; exit 1; }
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
  export FLASHSAC_WHEELS_INSTALLED=1
fi
export PYTHONPATH="/tmp/site:$PWD"
OUT="${OUT:-/tmp/out}"; mkdir -p "$OUT"
