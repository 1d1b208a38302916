"""One start-up patch, UniLab's bytecode, precompiled steps or another switch on and off: launch -> learner,
the start-up compile and -> first update, alternating processes.

Two patched copies of the installed UniLab under --work (CPU smoke patch without CUDA): with
--patch, one has that patch reverted; with --bytecode, one has no .pyc files (a wheel installed
with --no-compile under PYTHONDONTWRITEBYTECODE=1, which every training here then runs under);
with --precompiled (or --switch NAME) the on side runs with FLASHSAC_OPT_PRECOMPILED_STEPS=1 (NAME=1),
the off side with 0 (both warm: one throw-away launch per side first, on one shared cache). --rounds short G1 trainings each
(experiments/benchmark_flashsac_training.py, --override passed to UniLab), off and on
alternating; medians per side of the start-up timeline's learner_constructed_s, the runner's wait
for its collector, the start-up compile's seconds and the first logged row's wall_s, and on/off.

    python experiments/bench/startup_patch_pair.py --patch 0006-startup-probe-eager --output results/startup/probe_eager_cpu.json
    python experiments/bench/startup_patch_pair.py --bytecode --output results/startup/bytecode_cpu.json
    python experiments/bench/startup_patch_pair.py --precompiled --mode compile --output results/startup/precompiled_cpu.json
    python experiments/bench/startup_patch_pair.py --switch FLASHSAC_OPT_COLLECTOR_PRELOAD_COMPILER --num-envs 256 \
        --output results/startup/collector_preload_compiler_cpu.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # experiments/: common
from common import collector_start_wait_s, compile_bytecode, run_environment, write_report  # noqa: E402
from device.trainings import cli, copy_installed_unilab, prebuild_native_extension  # noqa: E402

TRAIN = Path(__file__).resolve().parents[1] / "benchmark_flashsac_training.py"


def prepare(work: Path, patch: str | None, cpu: bool) -> dict[str, Path]:
    """{"on": copy with every patch and its bytecode, "off": the same without ``patch``, or
    without bytecode where ``patch`` is None}: UniLab package dirs."""
    copies = {}
    for side in ("off", "on"):
        site = work / side
        copy_installed_unilab(site)
        subprocess.run(cli("unilab", "apply", "--root", str(site / "unilab"), *(["--with-cpu-smoke"] if cpu else [])), check=True, capture_output=True)
        if side == "off" and patch is not None:
            subprocess.run(cli("unilab", "revert", "--root", str(site / "unilab"), "--patch", patch), check=True, capture_output=True)
        if not cpu:  # UniLab's native H2D extension, built once per copy before any timed launch
            prebuild_native_extension(site)
        if side == "on" or patch is not None:
            compile_bytecode(site)  # as pip writes it at install: no launch compiles UniLab from source
        copies[side] = site / "unilab"
    return copies


def median(values: list[float | None]) -> float | None:
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    toggle = parser.add_mutually_exclusive_group(required=True)
    toggle.add_argument("--patch", help="the series name of the patch to toggle (e.g. 0006-startup-probe-eager)")
    toggle.add_argument("--bytecode", action="store_true", help="toggle the UniLab copy's .pyc files instead")
    toggle.add_argument("--precompiled", action="store_true", help="toggle FLASHSAC_OPT_PRECOMPILED_STEPS instead")
    toggle.add_argument("--switch", metavar="NAME", help="toggle the environment switch NAME instead (0 off, 1 on; one copy, "
                        "one cache), e.g. FLASHSAC_OPT_COLLECTOR_PRELOAD_COMPILER")
    parser.add_argument("--override", action="append", default=[], help="Hydra override for UniLab's train (repeatable)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--mode", choices=("eager", "compile", "graph"), help="learner mode (default: graph on CUDA, eager on the CPU)")
    parser.add_argument("--num-envs", type=int, default=16)
    parser.add_argument("--iterations", type=int, default=4)
    parser.add_argument("--work", type=Path, default=Path("/tmp/flashsac_startup_patch_pair"))
    parser.add_argument("--output", type=Path, required=True)
    args = parser.parse_args(argv)
    import torch

    cpu = not torch.cuda.is_available()
    mode = args.mode or ("eager" if cpu else "graph")
    copies = prepare(args.work, args.patch, cpu)
    if args.precompiled:
        args.switch = "FLASHSAC_OPT_PRECOMPILED_STEPS"
    if args.switch:  # one copy, one cache: only the switch differs
        copies["off"] = copies["on"]
    switch = {side: {args.switch: "1" if side == "on" else "0"} if args.switch else {} for side in ("off", "on")}
    runs = []  # a throw-away first launch (round -1) fills the compile caches and the OS file cache for both sides
    for k in range(-1, args.rounds):
        for side in ("off", "on") if k >= 0 or args.switch else ("on",):
            out = args.work / f"{side}_{k}.json"
            cmd = [sys.executable, str(TRAIN), "--unilab-root", str(copies[side]), "--learner", "flashsac_opt", "--mode", mode,
                   "--num-envs", str(args.num_envs), "--batch-size", "32", "--updates-per-step", "2", "--iterations", str(args.iterations),
                   "--learning-starts", "2", "--replay-buffer-n", "32", "--summary-last", "1", "--seed", str(2 + k),
                   "--log-root", str(args.work / f"logs_{side}_{k}"), "--output", str(out), *(f"--override={o}" for o in args.override)]
            # no process writes bytecode: the off side keeps none (as on the device machines)
            done = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "PYTHONDONTWRITEBYTECODE": "1", **switch[side]})
            if done.returncode or not out.is_file():
                print(done.stdout[-2000:], done.stderr[-3000:], file=sys.stderr)
                raise SystemExit(f"startup_patch_pair: the {side} training of round {k} failed (rc={done.returncode})")
            report = json.loads(out.read_text())
            timeline, rows = report.get("startup_timeline") or {}, report.get("rows_all") or []
            if k < 0:
                continue
            compile_at = next((p for p in ("startup_idle_compile", "prepare_for_collection") if f"{p}_end_s" in timeline), None)
            wait = collector_start_wait_s(timeline)
            runs.append({"round": k, "patch": side, "learner_constructed_s": timeline.get("learner_constructed_s"),
                         # the runner's wait for its collector's ready signal (the start-up compile inside it)
                         "collector_start_wait_s": round(wait, 3) if wait is not None else None,
                         # the start-up compile (in the runner's wait, or at prepare_for_collection)
                         "startup_compile_s": round(timeline[f"{compile_at}_end_s"] - timeline[f"{compile_at}_start_s"], 3) if compile_at else None,
                         "first_update_s": rows[0]["wall_s"] if rows and "wall_s" in rows[0] else None})
            print(runs[-1], flush=True)
            # after every launch: a call stopped at its limit still returns the rounds it finished
            write(args, mode, cpu, runs, complete=k == args.rounds - 1 and side == "on")
    sides, ratio = summarize(runs)
    print(json.dumps({"median": sides, "on_over_off": ratio}))
    return 0


def summarize(runs: list[dict]) -> tuple[dict, dict]:
    sides = {side: {key: median([r[key] for r in runs if r["patch"] == side])
                    for key in ("learner_constructed_s", "collector_start_wait_s", "startup_compile_s", "first_update_s")}
             for side in ("off", "on")}
    ratio = {key: (sides["on"][key] / sides["off"][key] if sides["on"][key] and sides["off"][key] else None) for key in sides["on"]}
    return sides, ratio


def write(args: argparse.Namespace, mode: str, cpu: bool, runs: list[dict], complete: bool) -> None:
    sides, ratio = summarize(runs)
    write_report({"experiment": "startup_patch_pair", "patch": args.patch, "toggle": "bytecode" if args.bytecode else args.switch or "patch", "what": __doc__.split("\n\n")[0],
                  "configuration": {"mode": mode, "num_envs": args.num_envs, "iterations": args.iterations, "rounds": args.rounds, "overrides": args.override,
                                    "device": "cpu" if cpu else "cuda", "order": ("one throw-away launch per side" if args.switch else "one throw-away launch") + ", then off, on alternating"},
                  "environment": run_environment("cpu" if cpu else "cuda"), "runs": runs, "complete": complete,
                  "rounds_completed": sum(r["patch"] == "on" for r in runs),  # "on" runs second in each round
                  "median": sides, "on_over_off": ratio},
                 args.output)


if __name__ == "__main__":
    sys.exit(main())
