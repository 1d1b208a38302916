#!/usr/bin/env bash
# The learner side-by-side on the device, in calls of <= 10 min that follow each other
# while the machine is warm (the Inductor cache under .inductor_cache/ survives between them):
#   bash experiments/gpu_side_by_side.sh prewarm      # cold compiles, in parallel, + GPU tests
#   bash experiments/gpu_side_by_side.sh main W1 W2   # timed run, one process, warm cache
#   bash experiments/gpu_side_by_side.sh main W3 W4
# or, one workload per call from a cold machine (UniLab (c) compiles ~300 s of the ~9 min):
#   bash experiments/gpu_side_by_side.sh one W3
# or two workloads in one call from a cold machine: cold compiles of both in parallel
# processes (cold-start figures, an upper bound), then the timed runs, one after the other,
# on the Inductor cache those left; profiles come after each run's timing and are saved one
# by one, so the call's time limit cuts profiles of the second workload first:
#   bash experiments/gpu_side_by_side.sh pair W3 W4
#   bash experiments/gpu_side_by_side.sh pair W1 W3   # the issue's six variants + ours_graph_no_combo
# or flashsac_opt's Inductor studies (graph mode with one option changed), same scheme:
#   bash experiments/gpu_side_by_side.sh study W1 W3
# Cold-start figures come from the prewarm processes (7 compiling at once on 16 cores:
# an upper bound); the main run's cold_start_s is with a warm Inductor cache.
# UniLab compiles with TORCHINDUCTOR_MAX_AUTOTUNE_GEMM_BACKENDS=ATEN (its stock GEMM
# autotuning did not finish a W3 compile in 415 s).
set -uo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/device_env.sh"
export TORCHINDUCTOR_MAX_AUTOTUNE_GEMM_BACKENDS=ATEN
B="python3 experiments/benchmark_learner.py"
merge_reports() {  # OUT IN...: one JSON with every input's cells (the device returns <= 8 files)
  python3 - "$@" <<'PY'
import json, sys
reports = [json.load(open(p)) for p in sys.argv[2:]]
merged = dict(reports[0]) if reports else {}
merged["command"] = [r["command"] for r in reports]
merged["cells"] = [c for r in reports for c in r["cells"]]
json.dump(merged, open(sys.argv[1], "w"), indent=1)
PY
}
ALL="unilab_eager unilab_compile unilab_graph ours_eager ours_compile ours_graph ours_graph_fused ours_graph_split ours_graph_replay"
SIX="unilab_eager unilab_compile unilab_graph ours_eager ours_compile ours_graph"  # the issue's variants
WARMED="cold machine; Inductor cache warmed by the prewarm processes of this call${FLASHSAC_RUN_NOTE:+; $FLASHSAC_RUN_NOTE}"
gpu_env() { nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv > "$OUT/env.txt"; }
prewarm_cell() {  # NAME BENCHMARK-ARGS...: one cold compile in the background (2 iterations, no profile)
  local name=$1; shift
  timeout 300 $B "$@" --iters 2 --warmup 1 --no-profile --note "$PREWARM_NOTE" --output "/tmp/$name.json" > "/tmp/$name.log" 2>&1 &
}
collect_prewarm() {  # JSON LOG PREFIX: wait for the prewarm cells /tmp/PREFIX*, merge their JSON and log tails
  wait
  echo "prewarm done at ${SECONDS}s"
  merge_reports "$1" /tmp/"$3"*.json
  tail -n 4 /tmp/"$3"*.log > "$2"
}
case "${1:-}" in
  prewarm)
    gpu_env
    python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" >> "$OUT/env.txt"
    for w in W1 W2 W3 W4; do
      timeout 550 $B --variants unilab_graph unilab_compile --workloads $w --iters 3 --warmup 1 --no-profile \
        --note "prewarm: cold Inductor cache, 7 processes compiling at once" --output "$OUT/prewarm_unilab_$w.json" > "$OUT/prewarm_unilab_$w.log" 2>&1 &
    done
    for w in W1 W3 W4; do  # W2 has W1's shapes: its compiled functions are W1's
      timeout 550 $B --variants ours_graph ours_compile ours_graph_fused ours_graph_split ours_graph_replay --workloads $w --iters 3 --warmup 1 --no-profile \
        --note "prewarm: cold Inductor cache, 7 processes compiling at once" --output "$OUT/prewarm_ours_$w.json" > "$OUT/prewarm_ours_$w.log" 2>&1 &
    done
    timeout 550 python3 -m pytest -q -m gpu -p no:cacheprovider tests/ > "$OUT/gpu_tests.log" 2>&1 &
    wait
    tail -n 3 "$OUT"/*.log ;;
  main)
    shift
    tag=$(IFS=_; echo "$*")
    timeout 590 $B --variants $ALL --workloads "$@" --iters 30 --note "warm Inductor cache (prewarmed in the previous call)" \
      --output "$OUT/side_by_side_$tag.json" 2>&1 | tee "$OUT/side_by_side_$tag.log" ;;
  one)
    timeout 590 $B --variants $SIX --workloads "$2" --iters 30 \
      --note "cold Inductor cache, one workload per process" --output "$OUT/side_by_side_$2.json" 2>&1 | tee "$OUT/side_by_side_$2.log" ;;
  pair)
    [ $# -eq 3 ] || { echo "usage: $0 pair W W" >&2; exit 2; }
    w1=$2; w2=$3; deadline=$((SECONDS + 585))
    gpu_env
    PREWARM_NOTE="prewarm: cold Inductor cache, 6 processes compiling at once (cold_start_s is an upper bound; ms figures are not timings: the GPU is shared)${FLASHSAC_RUN_NOTE:+; $FLASHSAC_RUN_NOTE}"
    for w in $w1 $w2; do
      prewarm_cell pair_prewarm_a_$w --variants unilab_graph --workloads $w
      prewarm_cell pair_prewarm_b_$w --variants unilab_compile ours_compile --workloads $w
      prewarm_cell pair_prewarm_c_$w --variants ours_graph ours_graph_no_combo --workloads $w
    done
    collect_prewarm "$OUT/prewarm_${w1}_$w2.json" "$OUT/prewarm.log" pair_prewarm_
    out="$OUT/side_by_side_${w1}_$w2.json"
    timeout $(( (deadline - SECONDS) * 3 / 5 )) $B --variants $SIX ours_graph_no_combo --workloads $w1 --iters 30 \
      --note "$WARMED" --output "$out" 2>&1 | tee "$OUT/side_by_side_${w1}_$w2.log"
    # the second workload's most wanted cells first, so a time limit cuts the least
    timeout $(( deadline - SECONDS )) $B --variants unilab_graph ours_graph ours_graph_no_combo unilab_compile ours_compile unilab_eager ours_eager --workloads $w2 --iters 30 \
      --note "$WARMED" --merge "$out" --output "$out" 2>&1 | tee -a "$OUT/side_by_side_${w1}_$w2.log" ;;
  study)
    shift
    [ $# -ge 1 ] || { echo "usage: $0 study W..." >&2; exit 2; }
    deadline=$((SECONDS + 585))
    gpu_env
    studies="ours_graph ours_graph_percast ours_graph_no_combo ours_graph_aggressive ours_graph_tuned"
    PREWARM_NOTE="prewarm: cold Inductor cache, one process per cell compiling at once (cold_start_s is an upper bound; ms figures are not timings)${FLASHSAC_RUN_NOTE:+; $FLASHSAC_RUN_NOTE}"
    for w in "$@"; do for v in $studies; do
      prewarm_cell study_prewarm_${v}_$w --variants $v --workloads $w
    done; done
    collect_prewarm "$OUT/prewarm_study.json" "$OUT/prewarm_study.log" study_prewarm_
    tag=$(IFS=_; echo "$*")
    timeout $(( deadline - SECONDS )) $B --variants $studies --workloads "$@" --iters 30 \
      --note "$WARMED" --output "$OUT/study_$tag.json" 2>&1 | tee "$OUT/study_$tag.log" ;;
  *) echo "usage: $0 prewarm | main W... | one W | pair W W | study W..." >&2; exit 2 ;;
esac
