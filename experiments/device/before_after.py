"""Graph-mode learner before and after a code change, on one GPU, in one device run.

Each side is a tree with its own benchmark_learner.py (before: an earlier commit's code in
.baseline/, from `run.py --prepare-baseline COMMIT`; after: the working tree), run in processes
of its own, alternating on the same GPU:
1. a throwaway compile, so the files a compile reads are in the OS file cache before any cold start;
2. cold: per workload and side a fresh process on an EMPTY Inductor and Triton cache, the first
   side alternating by workload (before W1, after W1, after W3, before W3); --cold-pairs N: N such
   processes, the median reported. `cold_start_s`: construction to the end of the first iteration;
3. warm: rounds of one fresh process per workload and side, a round's first side alternating, as
   many as --rounds and the time limit allow. --warm-cache shared (default): both sides on one
   copy of the before side's cold cache, so they run the same autotuned kernels (two cold compiles
   of one graph can pick different launch configs), and an after-side process that misses nothing
   in it (compile_cache_counters) compiled identical graphs;
4. compare: per workload, the median over a side's warm processes (else its cold ones) of ms
   median and p90, after/before ratios, kernels per iteration, cold start, and the spread of one
   side's process medians (the noise a ratio must beat).

    python3 experiments/device/before_after.py run --work DIR --output FILE [--time-limit S] [--dry-run]
    python3 experiments/device/before_after.py compare RAW_DIR --output FILE
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SIDES = ("before", "after")
# Timed iterations per warm process: about 2-3 s of iterations each (W1 ~1.5 ms, W3 ~9 ms on the H200).
WARM_ITERS = {"W1": 1500, "W2": 400, "W3": 300, "W4": 250}
WARM_WARMUP = 20
COLD_CAP_S = 240  # one cold process (compile + capture ~45-110 s on the H200, then its timing)
WARM_CAP_S = 120  # one warm process
FIRST_WARM_GUESS_S = 35  # a warm process's length before one was seen
MIN_COLD_S = 30  # a cold process given less is not started
RESERVE_S = 10  # left for the comparison
RAW_NAME = re.compile(r"^(before|after)_(W\d+)_(cold\d*|warm\d+)$")
# Runs the benchmark script as `python3 SCRIPT ARGS` would, after saying which flashsac_opt
# it will import and refusing if that is not the side's own tree.
LAUNCH = """
import importlib.util, os, runpy, sys
script = os.path.abspath(sys.argv[1])
sys.argv = sys.argv[1:]
sys.path[0] = os.path.dirname(script)
origin = os.path.abspath(importlib.util.find_spec("flashsac_opt").origin)
expected = os.path.join(os.environ["FLASHSAC_SIDE_ROOT"], "flashsac_opt", "__init__.py")
print("flashsac_opt from", origin, flush=True)
if origin != expected:
    sys.exit(f"flashsac_opt would come from {origin}, not from {expected}")
runpy.run_path(script, run_name="__main__")
"""


def side_spec(text: str) -> tuple[Path, str]:
    root, sep, script = text.partition(":")
    if not sep:
        raise argparse.ArgumentTypeError(f"expected ROOT:SCRIPT, got {text!r}")
    return (REPO / root).resolve(), script


def process_env(root: Path, cache: Path) -> dict[str, str]:
    """A side's variables: its own tree first on the path (never the other side's), its cache."""
    site = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p and Path(p).resolve() != REPO]
    return {
        "PYTHONPATH": os.pathsep.join([*site, str(root)]),
        "FLASHSAC_SIDE_ROOT": str(root),
        "TORCHINDUCTOR_CACHE_DIR": str(cache),
        "TRITON_CACHE_DIR": str(cache / "triton"),
    }


def plan(args) -> list[dict]:
    """Every process the run may start, in order (warm rounds after the cold ones)."""
    steps = []
    for pair in range(args.cold_pairs):  # the side that goes first alternates by workload and pair
        for i, w in enumerate(args.workloads):
            for side in SIDES if (i + pair) % 2 == 0 else SIDES[::-1]:
                steps.append(dict(side=side, workload=w, phase="cold" if pair == 0 else f"cold{pair + 1}"))
    for r in range(1, args.rounds + 1):
        order = SIDES[::-1] if r % 2 else SIDES
        for w in args.workloads:
            for side in order:
                steps.append(dict(side=side, workload=w, phase=f"warm{r}"))
    for step in steps:
        root, script = args.before if step["side"] == "before" else args.after
        name = f"{step['side']}_{step['workload']}_{step['phase']}"
        cold = step["phase"].startswith("cold")
        iters = ["--iters", str(args.warm_iters or WARM_ITERS[step["workload"]]), "--warmup", str(WARM_WARMUP)]
        shared = not cold and args.warm_cache == "shared"
        side_w = f"{step['side']}_{step['workload']}"
        if cold:  # every cold process its own empty cache
            cache = args.work / "cache" / (side_w if step["phase"] == "cold" else f"{side_w}_{step['phase']}")
        else:  # one copy of the before side's first cold cache, or the side's own first cold cache
            cache = args.work / "cache" / (f"shared_{step['workload']}" if shared else side_w)
        note = ("empty Inductor cache: cold start" if cold else
                "a copy of the before side's cold cache, shared by both sides" if shared else
                "the Inductor cache its side's cold process filled") + f"; {step['side']} side of engine_before_after"
        raw = args.work / "raw"
        step.update(
            name=name,
            cwd=root,
            cache=cache,
            env=process_env(root, cache),
            cmd=[sys.executable, "-c", LAUNCH, str(root / script), "--variants", "ours_graph", "--workloads", step["workload"],
                 *iters, "--note", note, "--output", str(raw / f"{name}.json")],
            log=raw / f"{name}.log",
            cap=COLD_CAP_S if cold else WARM_CAP_S,
        )
    return steps


def warm_up_imports(args) -> dict:
    """A tiny compile in a throwaway cache: torch, Inductor and Triton files into the OS cache."""
    code = ("import torch\n"
            "f = torch.compile(lambda x: torch.nn.functional.gelu(x @ x).sum())\n"
            "print('throwaway compile:', float(f(torch.randn(64, 64, device='cuda'))))\n")
    cache = args.work / "cache" / "throwaway"
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(cache), "TRITON_CACHE_DIR": str(cache / "triton")}
    start = time.monotonic()
    try:
        done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
        rc, tail = done.returncode, (done.stdout + done.stderr)[-500:]
    except subprocess.TimeoutExpired:
        rc, tail = None, "timed out"
    print(f"-- throwaway compile: rc={rc}, {time.monotonic() - start:.1f} s", flush=True)
    return {"name": "throwaway_compile", "rc": rc, "seconds": round(time.monotonic() - start, 1), "tail": tail}


def run(args) -> int:
    steps = plan(args)
    if args.dry_run:
        print(f"{len(steps)} processes at most, within {args.time_limit:.0f} s (warm rounds only while they fit); LAUNCH is:")
        print("\n".join("    " + line for line in LAUNCH.strip().splitlines()))
        for s in steps:
            env = " ".join(f"{k}={shlex.quote(v)}" for k, v in s["env"].items())
            bench = shlex.join(s["cmd"][3:])
            print(f"[{s['name']}] cd {s['cwd']} && {env} python3 -c LAUNCH {bench}  (cap {s['cap']} s)")
        return 0
    for side, (root, script) in (("before", args.before), ("after", args.after)):
        if not (root / script).is_file():
            hint = " (run `python experiments/device/run.py --prepare-baseline COMMIT` and carry .baseline)" if side == "before" else ""
            sys.exit(f"before_after: the {side} side's {root / script} is missing{hint}")
    deadline = time.monotonic() + args.time_limit - RESERVE_S
    (args.work / "raw").mkdir(parents=True, exist_ok=True)
    done = [warm_up_imports(args)] if not args.no_warm_up else []
    seen: dict[tuple[str, str], float] = {}  # (side, workload) -> seconds of its last warm process
    i = 0
    try:
        while i < len(steps):
            step = steps[i]
            # warm processes go in (before, after) pairs: both or neither
            cold = step["phase"].startswith("cold")
            pair = steps[i:i + 2] if not cold else [step]
            guess = sum(seen.get((s["side"], s["workload"]), FIRST_WARM_GUESS_S) for s in pair)
            left = deadline - time.monotonic()
            if cold and left < MIN_COLD_S:
                print(f"-- {left:.0f} s left: {step['name']} and what follows skipped", flush=True)
                break
            if not cold and left < guess:
                print(f"-- {left:.0f} s left, a {step['workload']} pair takes ~{guess:.0f} s: no more warm processes", flush=True)
                break
            for s in pair:
                if not cold and args.warm_cache == "shared" and not s["cache"].exists():
                    shutil.copytree(args.work / "cache" / f"before_{s['workload']}", s["cache"])
                done.append(execute(s, min(s["cap"], deadline - time.monotonic())))
                if not cold:
                    seen[(s["side"], s["workload"])] = done[-1]["seconds"]
            i += len(pair)
    except KeyboardInterrupt:
        print("-- interrupted: comparing what was measured", flush=True)
    report = compare(args.work / "raw")
    report["processes"] = done
    report["before_commit"] = _read(args.before[0] / "BASELINE_COMMIT")
    report["before"] = {"root": str(args.before[0]), "script": args.before[1]}
    report["after"] = {"root": str(args.after[0]), "script": args.after[1]}
    report["command"] = " ".join(["python3", *sys.argv])
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(report, indent=1))
    print(summary(report), flush=True)
    return 0


def execute(step: dict, limit: float) -> dict:
    start = time.monotonic()
    print(f"-- {step['name']} (limit {limit:.0f} s)", flush=True)
    with step["log"].open("w") as log:
        # same process group as this script: the driver's stop reaches the benchmark too
        proc = subprocess.Popen(step["cmd"], cwd=step["cwd"], env={**os.environ, **step["env"]}, stdout=log, stderr=subprocess.STDOUT)
        try:
            rc = proc.wait(timeout=max(limit, 1))
        except subprocess.TimeoutExpired:
            proc.kill()
            rc = proc.wait()
            print(f"   stopped at {limit:.0f} s", flush=True)
    seconds = round(time.monotonic() - start, 1)
    tail = step["log"].read_text(errors="replace").splitlines()[-3:]
    print(f"   rc={rc}, {seconds} s: " + " | ".join(t.strip()[:160] for t in tail), flush=True)
    return {"name": step["name"], "rc": rc, "seconds": seconds, "command": shlex.join(step["cmd"][3:]),
            "env": step["env"], "cwd": str(step["cwd"])}


def _read(path: Path) -> str | None:
    return path.read_text().strip() if path.is_file() else None


def _ratio(a, b):
    return a / b if isinstance(a, (int, float)) and isinstance(b, (int, float)) and b else None


def compare(raw: Path) -> dict:
    """The results JSON from the raw benchmark outputs `{side}_{workload}_{cold|warmN}.json`."""
    cells: dict[str, dict[str, dict[str, dict]]] = {}
    environment, errors = None, []
    for path in sorted(raw.glob("*.json")):
        match = RAW_NAME.match(path.stem)
        if not match:
            continue
        side, workload, phase = match.groups()
        report = json.loads(path.read_text())
        cell = next((c for c in report.get("cells", []) if c.get("variant") == "ours_graph" and c.get("workload") == workload), None)
        if cell is None or "error" in cell:
            errors.append({"file": path.name, "error": (cell or {}).get("error", "no ours_graph cell")})
            continue
        cells.setdefault(workload, {}).setdefault(side, {})[phase] = cell
        if side == "after" or environment is None:
            environment = report.get("environment")
    workloads = {}
    for workload in sorted(cells, key=lambda w: int(w[1:])):
        row = {}
        for side in SIDES:
            phases = cells[workload].get(side, {})
            warm = [phases[p] for p in sorted((p for p in phases if p.startswith("warm")), key=lambda p: int(p[4:]))]
            cold = phases.get("cold", {})
            colds = [phases[p] for p in sorted((p for p in phases if p.startswith("cold")), key=lambda p: int(p[4:] or 1))]
            cold_starts = [c["cold_start_s"] for c in colds if c.get("cold_start_s") is not None]
            timed = [c for c in warm if "ms_median" in c] or [c for c in [cold] if "ms_median" in c]
            medians = [c["ms_median"] for c in timed]
            p90s = [c["ms_p90"] for c in timed]
            kernels = [c["kernels_per_iteration"] for c in timed if "kernels_per_iteration" in c]
            row[side] = {
                "ms_median": statistics.median(medians) if medians else None,
                "ms_p90": statistics.median(p90s) if p90s else None,
                "ms_median_per_round": medians,
                "ms_p90_per_round": p90s,
                # the spread of one side's round medians: the noise any after/before ratio must beat
                "ms_median_spread": (max(medians) - min(medians)) / statistics.median(medians) if len(medians) > 1 else None,
                "processes": [p for p in [*(f"cold{i}" if i > 1 else "cold" for i in range(1, len(colds) + 1)),
                                          *(f"warm{i}" for i in range(1, len(warm) + 1))] if p in phases],
                "timed_processes": "warm" if any("ms_median" in c for c in warm) else "cold",
                "warm_compile_cache_counters": [c.get("compile_cache_counters") for c in warm],
                "warm_start_s": [c.get("cold_start_s") for c in warm],
                "iterations_per_round": [c.get("iterations") for c in timed],
                "kernels_per_iteration": kernels[0] if kernels and len(set(kernels)) == 1 else None,
                "kernels_per_iteration_per_round": kernels,
                "launches_per_iteration": next((c["launches_per_iteration"] for c in timed if "launches_per_iteration" in c), None),
                # the median over the cold processes (one per --cold-pairs pair), each with an empty cache
                "cold_start_s": statistics.median(cold_starts) if cold_starts else None,
                "cold_start_s_per_process": cold_starts,
                "cold_construct_s": cold.get("construct_s"),
                "cold_graph_capture_s": cold.get("graph_capture_s"),
                "cold_compile_phase_s": cold.get("compile_phase_s"),
                "peak_memory_mib": max((c.get("peak_memory_mib", 0) for c in timed), default=None),
            }
        before, after = row["before"], row["after"]
        row["after_vs_before"] = {
            "ms_median": _ratio(after["ms_median"], before["ms_median"]),
            "ms_p90": _ratio(after["ms_p90"], before["ms_p90"]),
            "cold_start_s": _ratio(after["cold_start_s"], before["cold_start_s"]),
            # pair k: the two sides' k-th cold processes, run back to back (the first side alternates),
            # so host drift between pairs cancels; the spread of these is the noise of the median ratio
            "cold_start_s_per_pair": [_ratio(a, b) for a, b in zip(after["cold_start_s_per_process"], before["cold_start_s_per_process"])],
            "kernels_per_iteration": _ratio(after["kernels_per_iteration"], before["kernels_per_iteration"]),
        }
        ms = row["after_vs_before"]["ms_median"]
        row["checks"] = {
            "ms_median_within_3pct": abs(ms - 1) <= 0.03 if ms is not None else None,
            "kernels_equal": (after["kernels_per_iteration"] == before["kernels_per_iteration"]) if before["kernels_per_iteration"] is not None else None,
            "cold_start_not_slower": (after["cold_start_s"] <= before["cold_start_s"]) if before["cold_start_s"] and after["cold_start_s"] else None,
        }
        workloads[workload] = row
    return {
        "experiment": "engine_before_after",
        "variant": "ours_graph",
        "timed": "each process: host clock around update + metrics read + stream synchronize, batch pre-sampled (benchmark_learner)",
        "workloads": workloads,
        "errors": errors,
        "environment": environment,
    }


def summary(report: dict) -> str:
    lines = [f"{'':3} {'side':6} {'ms med':>8} {'ms p90':>8} {'spread':>7} {'kernels':>8} {'cold s':>7}"]
    fmt = lambda v, f: format(v, f) if isinstance(v, (int, float)) else "-"  # noqa: E731
    for w, row in report["workloads"].items():
        for side in SIDES:
            s = row[side]
            lines.append(f"{w:3} {side:6} {fmt(s['ms_median'], '8.3f')} {fmt(s['ms_p90'], '8.3f')} {fmt(s['ms_median_spread'], '7.3f')} "
                         f"{fmt(s['kernels_per_iteration'], '8.0f')} {fmt(s['cold_start_s'], '7.1f')}")
        r = row["after_vs_before"]
        lines.append(f"{w:3} after/before: ms median {fmt(r['ms_median'], '.3f')}, p90 {fmt(r['ms_p90'], '.3f')}, "
                     f"kernels {fmt(r['kernels_per_iteration'], '.3f')}, cold start {fmt(r['cold_start_s'], '.3f')}; {row['checks']}")
    for e in report["errors"]:
        lines.append(f"error in {e['file']}: {e['error'][:200]}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="action", required=True)
    p = sub.add_parser("run", help="the processes, then the comparison")
    p.add_argument("--before", type=side_spec, default=side_spec(".baseline:experiments/benchmark_learner.py"), metavar="ROOT:SCRIPT")
    p.add_argument("--after", type=side_spec, default=side_spec(".:experiments/bench/benchmark_learner.py"), metavar="ROOT:SCRIPT")
    p.add_argument("--workloads", nargs="+", default=["W1", "W3"], choices=list(WARM_ITERS))
    p.add_argument("--rounds", type=int, default=3, help="warm rounds at most (the time limit may allow fewer)")
    p.add_argument("--cold-pairs", type=int, default=1,
                   help="cold processes per workload and side, the first side alternating (cold start's median)")
    p.add_argument("--warm-cache", choices=("shared", "own"), default="shared",
                   help="warm processes on one copy of the before side's cold cache (shared) or on their side's own")
    p.add_argument("--warm-iters", type=int, help="timed iterations per warm process (default: per workload, ~2-3 s)")
    p.add_argument("--time-limit", type=float, default=480.0, help="seconds for the whole run")
    p.add_argument("--work", type=Path, default=REPO / ".device_work" / "engine_before_after")
    p.add_argument("--output", type=Path, required=True)
    p.add_argument("--dry-run", action="store_true", help="print the processes, start none")
    p.add_argument("--no-warm-up", action="store_true", help="skip the throwaway compile (1.)")
    c = sub.add_parser("compare", help="only the comparison, from a folder of raw benchmark JSON")
    c.add_argument("raw", type=Path)
    c.add_argument("--output", type=Path, required=True)
    args = parser.parse_args(argv)
    if args.action == "compare":
        report = compare(args.raw)
        report["command"] = " ".join(["python3", *sys.argv])
        args.output.write_text(json.dumps(report, indent=1))
        print(summary(report))
        return 0
    args.work = args.work.resolve()
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
