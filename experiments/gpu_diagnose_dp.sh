#!/usr/bin/env bash
# Two diagnoses in one short device call (~7 min) on a 2-GPU kind:
# - issue 7: why do two NCCL ranks of the data-parallel learner end 1 ulp apart in
#   compile/graph mode (bit-identical in eager)? Each variant changes one thing; every JSON
#   says which (its "options").
# - issue 5, at the same time on GPU 1 alone: which of UniLab's runner actions makes
#   compile mode's cudagraph trees re-record (experiments/diagnose_compile_rerecord.py).
#   device: bash experiments/gpu_diagnose_dp.sh
# Returned: diagnose_*.json, diagnose.log, diagnose_rerecord.json, diagnose_rerecord.log.
set -uo pipefail
export FLASHSAC_WHEELS_INSTALLED=1  # needs no UniLab: no wheels to carry
source "$(dirname "${BASH_SOURCE[0]}")/device_env.sh"
CUDA_VISIBLE_DEVICES=1 timeout 400 python3 experiments/diagnose_compile_rerecord.py --variant-timeout 150 \
  --output "$OUT/diagnose_rerecord.json" > "$OUT/diagnose_rerecord.log" 2>&1 &
D="python3 experiments/diagnose_nccl_graph.py --iterations 3"
{
  timeout 150 $D --modes trace --two-devices --output "$OUT/diagnose_trace_two_devices.json"
  timeout 90 $D --modes compile --no-amp --output "$OUT/diagnose_compile_fp32.json"
  timeout 90 $D --modes compile --cache-per-rank --output "$OUT/diagnose_compile_cache_per_rank.json"
  TORCHINDUCTOR_DETERMINISTIC=1 timeout 90 $D --modes compile --cache-per-rank --output "$OUT/diagnose_compile_deterministic_fresh_cache.json"
} 2>&1 | grep -v Warning > "$OUT/diagnose.log"
wait
tail -n 40 "$OUT/diagnose.log"; tail -n 12 "$OUT/diagnose_rerecord.log"
