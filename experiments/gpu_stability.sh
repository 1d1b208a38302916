#!/usr/bin/env bash
# Issue 5's stability run on the device, one GPU, one call (< 10 min): graph mode next to
# eager and a rounding-floor eager, 1000 iterations on the committed real-G1 replay rows,
# bounded by a time limit so that a slow eager pace still returns its JSON and figure.
#   device: bash experiments/gpu_stability.sh [ITERATIONS]     (alone or via gpu_two_jobs.sh)
# Returned: replay_stability.json/.png, replay_stability.log.
set -uo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/device_env.sh"
timeout 585 python3 experiments/validate_replay_stability.py --device cuda --mode graph --iterations "${1:-1000}" \
  --time-limit 500 --output "$OUT/replay_stability.json" --plot "$OUT/replay_stability.png" 2>&1 | tee "$OUT/replay_stability.log"
