#!/usr/bin/env bash
# Two single-GPU device jobs side by side on a 2-GPU machine (nvidia-h200-x2), one call:
#   bash experiments/gpu_two_jobs.sh "gpu_side_by_side.sh pair W4 W2" "gpu_side_by_side.sh study W1 W3"
#   bash experiments/gpu_two_jobs.sh "gpu_trainings.sh U2" "gpu_trainings.sh U8"
#   bash experiments/gpu_two_jobs.sh "BATCH=2048 gpu_trainings.sh U8 1000 unilab:graph" "BATCH=2048 gpu_trainings.sh U8 1000 flashsac_opt:graph"
# Job i (0, 1) sees only GPU i (CUDA_VISIBLE_DEVICES) and is pinned to half of the cores
# (taskset), so each has what a one-GPU, 16-core nvidia-h200 gives: ratios inside a job stay
# side by side in one process or one job; the JSON says so (environment.run_note,
# cpu_cores_usable). The two jobs share the host's memory bandwidth and PCIe root.
# Job i writes under $OUT/jobI; its logs and env.txt are packed into $OUT/jobI/logs.tgz
# (the device returns at most 8 files).
set -uo pipefail
[ $# -eq 2 ] || { echo "usage: $0 'SCRIPT ARGS' 'SCRIPT ARGS'   (scripts under experiments/)" >&2; exit 2; }
source "$(dirname "${BASH_SOURCE[0]}")/device_env.sh"  # installs the wheels once for both jobs
cores=$(nproc --all); half=$((cores / 2))
gpus=$(nvidia-smi -L | wc -l)
[ "$gpus" -ge 2 ] || { echo "needs 2 GPUs, found $gpus" >&2; exit 1; }
jobs=("$1" "$2")
for i in 0 1; do
  mkdir -p "$OUT/job$i"
  read -r -a cmd <<< "${jobs[$i]}"
  vars=()  # leading NAME=VALUE words are the job's environment, e.g. "BATCH=2048 gpu_trainings.sh U8"
  while [ ${#cmd[@]} -gt 0 ] && [[ ${cmd[0]} =~ ^[A-Z_][A-Z0-9_]*=.*$ ]]; do vars+=("${cmd[0]}"); cmd=("${cmd[@]:1}"); done
  [ ${#cmd[@]} -gt 0 ] && [ -f "experiments/${cmd[0]}" ] || { echo "job $i: no script under experiments/ in '${jobs[$i]}'" >&2; exit 2; }
  first=$((i * half)); last=$(((i + 1) * half - 1))
  note="job $i of 2 run side by side on a $gpus-GPU host: GPU $i only, cores $first-$last of $cores; the other job: ${jobs[$((1 - i))]}"
  CUDA_VISIBLE_DEVICES=$i OUT="$OUT/job$i" FLASHSAC_RUN_NOTE="$note" \
    taskset -c "$first-$last" env "${vars[@]}" bash "experiments/${cmd[0]}" "${cmd[@]:1}" > "$OUT/job$i/job.log" 2>&1 &
done
wait
for i in 0 1; do
  echo "== job $i: ${jobs[$i]}"; tail -n 15 "$OUT/job$i/job.log"
  (cd "$OUT/job$i" && shopt -s nullglob && files=(*.log *.txt) && [ ${#files[@]} -gt 0 ] && tar czf logs.tgz "${files[@]}" && rm -f "${files[@]}")
done
ls -R "$OUT"
