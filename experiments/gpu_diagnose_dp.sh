#!/usr/bin/env bash
# Issue 7 on a 2-GPU kind, one short device call (~5 min): why do two NCCL ranks of the
# data-parallel learner end 1 ulp apart in compile/graph mode (bit-identical in eager)?
# Each variant changes one thing; every JSON says which (its "options").
#   device: bash experiments/gpu_diagnose_dp.sh
# Returned: diagnose_*.json, diagnose.log.
set -uo pipefail
export FLASHSAC_WHEELS_INSTALLED=1  # needs no UniLab: no wheels to carry
source "$(dirname "${BASH_SOURCE[0]}")/device_env.sh"
D="python3 experiments/diagnose_nccl_graph.py --iterations 3"
{
  timeout 150 $D --modes trace --two-devices --output "$OUT/diagnose_trace_two_devices.json"
  timeout 90 $D --modes compile --no-amp --output "$OUT/diagnose_compile_fp32.json"
  timeout 90 $D --modes compile --cache-per-rank --output "$OUT/diagnose_compile_cache_per_rank.json"
  TORCHINDUCTOR_DETERMINISTIC=1 timeout 90 $D --modes compile --cache-per-rank --output "$OUT/diagnose_compile_deterministic_fresh_cache.json"
} 2>&1 | grep -v Warning > "$OUT/diagnose.log"
tail -n 40 "$OUT/diagnose.log"
