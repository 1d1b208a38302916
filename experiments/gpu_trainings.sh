#!/usr/bin/env bash
# Real G1 trainings on the device (issues 4 and 5): stock UniLab 1.5.2 vs patched UniLab with
# flashsac_opt, then stock UniLab's `eval` on the last flashsac_opt run's checkpoint.
#   here:   bash experiments/fetch_device_wheels.sh --training     (carry .whl to the device)
#   device: bash experiments/gpu_trainings.sh U2|U8 [ITERATIONS] [RUN...]   # one call (< 10 min)
#     RUN = [UN:]LEARNER:MODE[:SEED], LEARNER unilab|flashsac_opt, MODE eager|compile|graph;
#     UN (e.g. U8) overrides the first argument's updates per step for that run;
#     default: unilab:graph flashsac_opt:graph (issue 4: stock default vs patched)
#     e.g. U2 1000 unilab:eager flashsac_opt:compile        (issue 5's other matrix rows)
#          U2 1000 unilab:graph:1 flashsac_opt:graph:1 unilab:graph:2 ...   (time-reward seeds)
#          U2 1000 flashsac_opt:graph U8:flashsac_opt:graph     (both update counts in one job)
#     BATCH=2048 bash ... U8 ...                              (UniLab's G1 default batch)
# 256 envs (ENVS=...), batch 256 (BATCH=...), policy frequency 2. ITERATIONS defaults to 1000
# (issue 5's matrix; issue 4 needs >= 300). The call has 585 s: each training gets a
# --time-limit from what is left (stock UniLab's graph mode a longer share: its cold compile
# takes ~150 s against ~55 s), so a slow run is cut, not lost; its JSON says how far it got.
# Returned: one JSON per run, trainings.log (each run's tail), the stock eval log, env.txt.
# Stock and patched UniLab are two copies of the same wheel (/tmp/stock, /tmp/patched); the
# patched one gets `flashsac-opt unilab apply`. G1 meshes are placeholders (visual only, same
# physics; ../shared/reference/unilab.md). UniLab compiles with
# TORCHINDUCTOR_MAX_AUTOTUNE_GEMM_BACKENDS=ATEN (its stock autotuning takes > 7 min).
set -uo pipefail
usage() { echo "usage: $0 U2|U8 [ITERATIONS] [[UN:]LEARNER:MODE[:SEED]...]" >&2; exit 2; }
case "${1:-}" in U2|U8) U=${1#U} ;; *) usage ;; esac
ITER=${2:-1000}
RUNS=("${@:3}"); [ ${#RUNS[@]} -gt 0 ] || RUNS=(unilab:graph flashsac_opt:graph)
for r in "${RUNS[@]}"; do [[ $r =~ ^(U[1-9][0-9]*:)?(unilab|flashsac_opt):(eager|compile|graph)(:[0-9]+)?$ ]] || usage; done
deadline=$((SECONDS + ${CALL_SECONDS:-585}))  # CALL_SECONDS=...: a shorter call (device time left)
# CPU_DRY_RUN=1: a tiny CPU rehearsal of this script on a machine with UniLab, MuJoCo etc.
# already installed (16 envs, eager, CPU-admitting patch); not a measurement.
DRY=${CPU_DRY_RUN:-0}
if [ "$DRY" = 1 ]; then
  export FLASHSAC_WHEELS_INSTALLED=1  # the machine's own UniLab: nothing to install
  DEPS=$(python3 -c "import unilab, pathlib; print(pathlib.Path(unilab.__file__).parents[1])")
  SIZE=(--num-envs 16 --batch-size 32); ITER=${2:-4}
  RUNS=("${RUNS[@]//:graph/:eager}")  # no CUDA: graph mode becomes eager
else
  DEPS=/tmp/site; SIZE=(--num-envs "${ENVS:-256}" --batch-size "${BATCH:-256}")
fi
source "$(dirname "${BASH_SOURCE[0]}")/device_env.sh"
export PYTHONPATH="$DEPS:$PWD" WANDB_MODE=disabled TORCHINDUCTOR_MAX_AUTOTUNE_GEMM_BACKENDS=ATEN HYDRA_FULL_ERROR=1
# (under a lock: two jobs of gpu_two_jobs.sh may both make the copies)
LOCK=(); command -v flock > /dev/null && LOCK=(flock /tmp/.flashsac_unilab_copies.lock)
DEPS=$DEPS DRY=$DRY "${LOCK[@]}" python3 - <<'PY' || exit 1
import os, shutil, sys
from pathlib import Path
sys.path.insert(0, "tests")
from unilab_tree import add_g1_placeholders
from flashsac_opt.unilab import patch as unilab_patch
deps = Path(os.environ["DEPS"])
for name in ("stock", "patched"):
    site = Path("/tmp") / name
    if not (site / "unilab").is_dir():
        shutil.copytree(deps / "unilab", site / "unilab", ignore=shutil.ignore_patterns("__pycache__"))
        for info in deps.glob("unilab-*.dist-info"):
            shutil.copytree(info, site / info.name)
        add_g1_placeholders(site / "unilab")
cpu = os.environ["DRY"] == "1"
if cpu:  # stock UniLab refuses CPU off-policy training: both copies get the CPU admission
    unilab_patch.apply(Path("/tmp/stock"), names=["0002-cpu-offpolicy-smoke"])
unilab_patch.apply(Path("/tmp/patched"), include_optional=cpu)
print(unilab_patch.status(Path("/tmp/patched")))
PY
{ command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; python3 -c "import torch; print('torch', torch.__version__)"; } > "$OUT/env.txt"
# Each run's --time-limit: its start-up cost (launch to first update: UniLab start ~45 s,
# compile, capture; H200 figures of sessions 4-6, cold or after an earlier run of this call
# filled the Inductor cache; warm ones are guesses) plus an
# equal share of the iteration time left after every remaining run's start-up, the eval
# (60 s) and a shutdown grace per run (20 s).
startup() {  # LEARNER:MODE WARM(0|1) -> seconds
  case "$1:$2" in
    unilab:graph:0) echo 250 ;; unilab:graph:1) echo 150 ;;
    unilab:compile:0|flashsac_opt:compile:0) echo 130 ;; unilab:compile:1|flashsac_opt:compile:1) echo 70 ;;
    flashsac_opt:graph:0) echo 135 ;; flashsac_opt:graph:1) echo 70 ;;
    *) echo 50 ;;
  esac
}
# (At these costs two cold runs leave ~50 s of iterations each (1000 at B256 take 30-45 s).)
declare -A SEEN=(); STARTUP=()
for r in "${RUNS[@]}"; do
  lm=$(sed -E 's/^U[0-9]+://' <<< "$r" | cut -d: -f1,2); STARTUP+=("$(startup "$lm" "${SEEN[$lm]:-0}")"); SEEN[$lm]=1
done
: > "$OUT/trainings.log"
LAST_OURS=""; LAST_TAG=""
for i in "${!RUNS[@]}"; do
  run=${RUNS[$i]}; u=$U
  [[ $run =~ ^U([0-9]+):(.*)$ ]] && { u=${BASH_REMATCH[1]}; run=${BASH_REMATCH[2]}; }
  IFS=: read -r learner mode seed <<< "$run"; seed=${seed:-1}
  n=$(( ${#RUNS[@]} - i )); fixed=0
  for t in "${STARTUP[@]:$i}"; do fixed=$((fixed + t)); done
  share=$(( STARTUP[i] + (deadline - SECONDS - 60 - 20 * n - fixed) / n ))
  [ "$DRY" = 1 ] && share=40
  [ $share -ge 30 ] || { echo "skipped $learner:$mode:$seed: only ${share}s left" | tee -a "$OUT/trainings.log"; continue; }
  root=/tmp/stock; [ "$learner" = flashsac_opt ] && root=/tmp/patched
  TAG="u${u}_b${SIZE[3]}"
  name="training_${TAG}_${learner}_${mode}_s$seed"
  logs="/tmp/logs_${name}"
  timeout $((share + 90)) python3 experiments/benchmark_flashsac_training.py --unilab-root $root --learner $learner --mode $mode --seed $seed \
    "${SIZE[@]}" --updates-per-step "$u" --policy-frequency 2 --iterations "$ITER" --summary-last $((ITER / 2)) \
    --learning-starts 8 --replay-buffer-n 32 --save-interval $(( ITER < 100 ? ITER : 100 )) \
    --time-limit $share --log-root "$logs" --output "$OUT/$name.json" > "/tmp/$name.log" 2>&1
  rc=$?
  # a failed run keeps its whole traceback (HYDRA_FULL_ERROR below), a good one its last lines
  keep=6; [ $rc -ne 0 ] && { keep=150; cp "/tmp/$name.log" "$OUT/$name.full.log"; }  # (gpu_two_jobs.sh packs *.log)
  # TORCH_LOGS=recompiles,cudagraphs,...: keep what Dynamo and the cudagraph trees said, success or not
  [ -n "${TORCH_LOGS:-}" ] && grep -E "ecompil|e-record|cudagraph|guard" "/tmp/$name.log" | head -n 400 > "$OUT/$name.torch_logs.log"
  { echo "== $name: rc=$rc, limit ${share}s, done at ${SECONDS}s"; grep -v "^[│╭╰├┃]" "/tmp/$name.log" | tail -n $keep; } | tee -a "$OUT/trainings.log"
  [ "$learner" = flashsac_opt ] && { LAST_OURS="$logs"; LAST_TAG="$TAG"; }
done
# Stock UniLab's eval on the last flashsac_opt run's checkpoint (a few steps; the video is best effort).
RUN=$( [ -n "$LAST_OURS" ] && ls -d "$LAST_OURS"/G1WalkFlat/*/ 2>/dev/null | tail -n 1)
if [ -n "$RUN" ] && ! ls "$RUN"/model_*.pt > /dev/null 2>&1; then
  # (UniLab's eval exits 0 after "Could not find checkpoint": say it here instead)
  echo "stock eval skipped: the flashsac_opt run $RUN wrote no checkpoint" | tee -a "$OUT/trainings.log"
elif [ -n "$RUN" ]; then
  # (run from the log dir: Hydra writes its train_flashsac.log into the working directory)
  (cd "$LAST_OURS" && PYTHONPATH="/tmp/stock:$DEPS" timeout $(( deadline - SECONDS > 20 ? deadline - SECONDS : 20 )) python3 -c "import sys; from unilab.cli import eval_main; sys.argv = ['eval'] + sys.argv[1:]; sys.exit(eval_main())" \
    --algo flashsac --task g1_walk_flat --sim mujoco --load-run "$(basename "$RUN")" --render-mode record \
    training.play_steps=20 training.play_env_num=4 training.export_onnx=false training.log_root="$LAST_OURS" \
    env.scene.model_file=/tmp/stock/unilab/assets/robots/g1/scene_flat.xml) > "$OUT/stock_eval_of_flashsac_opt_$LAST_TAG.log" 2>&1
  echo "stock eval rc=$?"; grep -m1 "Loading flashsac checkpoint" "$OUT/stock_eval_of_flashsac_opt_$LAST_TAG.log"
fi
