#!/usr/bin/env bash
# Real G1 trainings on the device (issues 4 and 5): stock UniLab 1.5.2 vs patched UniLab with
# flashsac_opt, 256 envs, batch 256, then stock UniLab's `eval` on the patched run's checkpoint.
#   here:   bash experiments/fetch_device_wheels.sh --training     (carry .whl to the device)
#   device: bash experiments/gpu_trainings.sh U2 [ITERATIONS]      # one call (< 10 min) per U
#           bash experiments/gpu_trainings.sh U8 [ITERATIONS]
# ITERATIONS defaults to 1000 (issue 5's matrix; issue 4 needs >= 300). The call has 585 s:
# each training gets a --time-limit from what is left (stock UniLab more: its cold compile
# takes ~150 s against ~55 s), so a slow run is cut, not lost; its JSON says how far it got.
# Stock and patched UniLab are two copies of the same wheel (/tmp/stock, /tmp/patched); the
# patched one gets `flashsac-opt unilab apply`. G1 meshes are placeholders (visual only, same
# physics; ../shared/reference/unilab.md). UniLab compiles with
# TORCHINDUCTOR_MAX_AUTOTUNE_GEMM_BACKENDS=ATEN (its stock autotuning takes > 7 min).
set -uo pipefail
case "${1:-}" in U2|U8) U=${1#U} ;; *) echo "usage: $0 U2|U8 [ITERATIONS]" >&2; exit 2 ;; esac
ITER=${2:-1000}
deadline=$((SECONDS + 585))
# CPU_DRY_RUN=1: a tiny CPU rehearsal of this script on a machine with UniLab, MuJoCo etc.
# already installed (16 envs, eager, CPU-admitting patch); not a measurement.
DRY=${CPU_DRY_RUN:-0}
export PYTHONUNBUFFERED=1 WANDB_MODE=disabled TORCHINDUCTOR_CACHE_DIR="$PWD/.inductor_cache" TORCHINDUCTOR_MAX_AUTOTUNE_GEMM_BACKENDS=ATEN
OUT="${OUT:-/tmp/out}"; mkdir -p "$OUT"
if [ "$DRY" = 1 ]; then
  DEPS=$(python3 -c "import unilab, pathlib; print(pathlib.Path(unilab.__file__).parents[1])")
  MODE=eager; SIZE=(--num-envs 16 --batch-size 32); ITER=${2:-4}
else
  DEPS=/tmp/deps; MODE=graph; SIZE=(--num-envs 256 --batch-size 256)
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/deps .whl/*.whl || exit 1
fi
export PYTHONPATH="$DEPS:$PWD"
DEPS=$DEPS DRY=$DRY python3 - <<'PY' || exit 1
import os, shutil, sys
from pathlib import Path
sys.path.insert(0, "tests")
from unilab_tree import add_g1_placeholders
from flashsac_opt import unilab_patch
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
COMMON=("${SIZE[@]}" --updates-per-step "$U" --policy-frequency 2 --iterations "$ITER" --summary-last $((ITER / 2)) --learning-starts 8 --replay-buffer-n 32 --save-interval $(( ITER < 100 ? ITER : 100 )))
# Seconds for the trainings: what is left, less the eval (60) and two interrupt grace periods.
avail=$((deadline - SECONDS - 60 - 40))
stock_limit=$(( (avail + 95) / 2 ))  # equal time after compiling: stock compiles ~95 s longer
[ "$DRY" = 1 ] && stock_limit=40
timeout $((stock_limit + 90)) python3 experiments/benchmark_flashsac_training.py --unilab-root /tmp/stock --learner unilab --mode $MODE "${COMMON[@]}" \
  --time-limit $stock_limit --log-root /tmp/logs_stock_u$U --output "$OUT/training_u${U}_unilab_$MODE.json" > "$OUT/training_u${U}_unilab_$MODE.log" 2>&1
echo "stock rc=$? at ${SECONDS}s"; tail -n 2 "$OUT/training_u${U}_unilab_$MODE.log"
patched_limit=$((deadline - SECONDS - 60 - 20))
[ "$DRY" = 1 ] && patched_limit=40
timeout $((patched_limit + 90)) python3 experiments/benchmark_flashsac_training.py --unilab-root /tmp/patched --learner flashsac_opt --mode $MODE "${COMMON[@]}" \
  --time-limit $patched_limit --log-root /tmp/logs_patched_u$U --output "$OUT/training_u${U}_flashsac_opt_$MODE.json" > "$OUT/training_u${U}_flashsac_opt_$MODE.log" 2>&1
echo "patched rc=$? at ${SECONDS}s"; tail -n 2 "$OUT/training_u${U}_flashsac_opt_$MODE.log"
# Stock UniLab's eval on the patched run's last checkpoint (a few steps; the video is best effort).
RUN=$(ls -d /tmp/logs_patched_u$U/G1WalkFlat/*/ 2>/dev/null | tail -n 1)
if [ -n "$RUN" ]; then
  # (run from the log dir: Hydra writes its train_flashsac.log into the working directory)
  (cd /tmp/logs_patched_u$U && PYTHONPATH="/tmp/stock:$DEPS" timeout $(( deadline - SECONDS > 20 ? deadline - SECONDS : 20 )) python3 -c "import sys; from unilab.cli import eval_main; sys.argv = ['eval'] + sys.argv[1:]; sys.exit(eval_main())" \
    --algo flashsac --task g1_walk_flat --sim mujoco --load-run "$(basename "$RUN")" --render-mode record \
    training.play_steps=20 training.play_env_num=4 training.export_onnx=false training.log_root=/tmp/logs_patched_u$U \
    env.scene.model_file=/tmp/stock/unilab/assets/robots/g1/scene_flat.xml) > "$OUT/stock_eval_of_patched_u$U.log" 2>&1
  echo "stock eval rc=$?"; grep -m1 "Loading flashsac checkpoint" "$OUT/stock_eval_of_patched_u$U.log"
fi
