#!/usr/bin/env bash
# Issue 7 on a multi-GPU kind (nvidia-h200-x2 or larger), one device call (< 10 min):
# the data-parallel benchmark at every world size up to the GPUs present (W3 then W4 by
# default; each world size also checks that all ranks end bit-identical), then the 2-GPU
# NCCL graph-mode test if time is left.
#   device: [BROADCAST=0|1] bash experiments/gpu_multigpu.sh [WORKLOAD...]
# Returned: benchmark_multigpu_xN.json/.png, gpu_test_multigpu.log, env.txt.
# NVLink multicast stays off (the device notes: it can take the host's GPUs out of service).
set -uo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/device_env.sh"
deadline=$((SECONDS + 570))
WORKLOADS=("$@"); [ ${#WORKLOADS[@]} -gt 0 ] || WORKLOADS=(W3 W4)
{ nvidia-smi --query-gpu=index,name,driver_version,memory.total --format=csv; nvidia-smi topo -m
  python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, 'gpus', torch.cuda.device_count())"; } > "$OUT/env.txt" 2>&1
n=$(python3 -c "import torch; print(torch.cuda.device_count())")
NPROC=(); for w in 1 2 4 8; do [ "$w" -le "$n" ] && NPROC+=("$w"); done
# The learner's dp_broadcast_params (rank 0's parameters broadcast once per iteration:
# bit-identical ranks by construction, one more collective) is on by default in graph mode
# on CUDA; BROADCAST=0 measures without it, BROADCAST=1 forces it (files get a suffix).
EXTRA=(); SUFFIX=""
case "${BROADCAST:-}" in 1) EXTRA=(--broadcast-params on); SUFFIX="_broadcast" ;; 0) EXTRA=(--broadcast-params off); SUFFIX="_no_broadcast" ;; esac
timeout $((deadline - SECONDS - 100)) python3 experiments/benchmark_multigpu.py --nproc "${NPROC[@]}" --workloads "${WORKLOADS[@]}" "${EXTRA[@]}" \
  --cell-timeout 240 --output "$OUT/benchmark_multigpu_x$n$SUFFIX.json" --plot "$OUT/benchmark_multigpu_x$n$SUFFIX.png" 2>&1 | tee "$OUT/benchmark_multigpu.log"
left=$((deadline - SECONDS))
if [ "$left" -gt 60 ]; then
  timeout "$left" python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_data_parallel.py 2>&1 | tee "$OUT/gpu_test_multigpu.log"
else
  echo "2-GPU test skipped: ${left}s left" | tee "$OUT/gpu_test_multigpu.log"
fi
