#!/usr/bin/env bash
# One device call: install the carried wheels, then run the named steps, writing under $OUT.
# usage: bash experiments/gpu_run.sh STEP [STEP...]   (steps: env tests:LIMIT bench:LIMIT;ARGS)
# e.g. next to another job: bash experiments/gpu_two_jobs.sh "gpu_side_by_side.sh pair W1 W3" "gpu_run.sh env tests:570"
set -uo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/device_env.sh"
for step in "$@"; do
  case "$step" in
    env)
      nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv | tee "$OUT/env.txt"
      python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" | tee -a "$OUT/env.txt" ;;
    tests:*)
      timeout "${step#tests:}" python3 -m pytest -q -m gpu -p no:cacheprovider tests/ 2>&1 | tee "$OUT/gpu_tests.log" ;;
    bench:*)
      IFS=';' read -r limit args <<< "${step#bench:}"
      # shellcheck disable=SC2086
      timeout "$limit" python3 experiments/benchmark_learner.py $args 2>&1 | tee -a "$OUT/bench.log" ;;
  esac
done
