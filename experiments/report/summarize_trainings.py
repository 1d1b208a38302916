"""The training matrix's summary table from benchmark_flashsac_training.py's JSON.

One row per run: configuration (updates per step, batch, learner, mode, seed), how far it
got (a run stopped by its time limit says so; one that ended before its last iteration
without being stopped is marked: it crashed), whether the Inductor cache was warm at launch
(as the report recorded it; unknown where it did not), when its first learner iteration came
(seconds from UniLab's launch: start-up and compile), learner / iteration / collector ms
(median and p90 over the run's summarized tail) and reward, plus the learner-time ratio against stock UniLab's default (whole-cycle
graph) run of the same updates, batch, seed and number of GPUs when one is among the inputs. A
data-parallel run (UniLab's launch, one rank per visible GPU) says on how many GPUs it ran and,
for flashsac_opt, whether its ranks ended bit-identical (the ranks' end-state digests). Writes JSON and
a markdown table.

    python experiments/report/summarize_trainings.py results/trainings/training_*.json \\
        --output results/trainings/summary.json --markdown results/trainings/summary.md
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # experiments/: common
from common import read_json, report_name, write_report  # noqa: E402

REFERENCE = ("unilab", "graph")  # stock UniLab's default learner


def gpus_of(report: dict) -> int:
    """How many GPUs (data-parallel ranks) the training used: the ranks flashsac_opt reported, else
    UniLab's launch of one rank per entry of CUDA_VISIBLE_DEVICES on a CUDA run, else 1."""
    if report.get("data_parallel"):
        return report["data_parallel"]["world_size"]
    env = report["environment"]
    visible = [d for d in (env.get("cuda_visible_devices") or "").split(",") if d.strip()]
    return len(visible) if env.get("device") == "cuda" and visible else 1


def summarize_run(path: Path, report: dict | None = None) -> dict:
    """One training report's row; ``report``: its content where the caller has read it already."""
    report = read_json(path) if report is None else report
    if report.get("experiment") != "benchmark_flashsac_training":
        raise ValueError(f"{path}: not a benchmark_flashsac_training.py report")
    cfg = report["training_config"]
    rows_all = report["rows_all"]
    rewards = [r["reward"] for r in rows_all if "reward" in r]
    tail_rewards = [r["reward"] for r in report["rows"] if "reward" in r]
    stat = lambda key, q: (report.get(key) or {}).get(q)  # noqa: E731
    # (reports written before the "completed" field: derived the same way)
    last_iteration = rows_all[-1].get("iteration", len(rows_all)) if rows_all else 0
    completed = report.get("completed", report["stopped_by_time_limit"] or last_iteration >= cfg["iterations"])
    return {
        "file": report_name(path),
        "updates_per_step": cfg["updates_per_step"], "batch_size": cfg["batch_size"], "num_envs": cfg["num_envs"],
        "learner": report["learner"], "mode": report["mode"], "seed": cfg["seed"], "gpus": gpus_of(report),
        # flashsac_opt data parallel: every rank's end state equal (None: one GPU, or stock UniLab)
        "ranks_bit_identical": (report.get("data_parallel") or {}).get("ranks_equal"),
        "iterations_planned": cfg["iterations"], "iterations_logged": report["iterations_logged"],
        "stopped_by_time_limit": report["stopped_by_time_limit"], "completed": completed,
        "first_learner_iteration_s": min((r["wall_s"] for r in rows_all if "wall_s" in r), default=None),
        # None (unknown) for reports written before the field: never inferred from the run order
        "inductor_cache_warm_at_launch": (report.get("inductor_cache_at_launch") or {}).get("warm"),
        "summarized_iterations": len(report["rows"]),
        "learner_ms_median": stat("learner_train_ms", "median"), "learner_ms_p90": stat("learner_train_ms", "p90"),
        "iter_ms_median": stat("iter_ms", "median"), "iter_ms_p90": stat("iter_ms", "p90"),
        "collector_ms_median": stat("collector_cycle_ms", "median"),
        "reward_last": rewards[-1] if rewards else None,
        "reward_tail_mean": sum(tail_rewards) / len(tail_rewards) if tail_rewards else None,
        "gpu": report["environment"].get("gpu"), "torch": report["environment"].get("torch"),
        "date": report["environment"].get("date"), "run_note": report["environment"].get("run_note", ""),
    }


def add_ratios(runs: list[dict]) -> None:
    for run in runs:
        ref = next((r for r in runs if (r["learner"], r["mode"]) == REFERENCE and r["seed"] == run["seed"]
                    and r["updates_per_step"] == run["updates_per_step"] and r["batch_size"] == run["batch_size"]
                    and r.get("gpus", 1) == run.get("gpus", 1)), None)
        if ref and ref["learner_ms_median"] and run["learner_ms_median"] is not None:
            run["learner_ms_vs_unilab_default"] = run["learner_ms_median"] / ref["learner_ms_median"]


CACHE = {True: "warm", False: "cold", None: "unknown"}


def markdown(runs: list[dict]) -> str:
    """The summary as a markdown table, to be included verbatim: a run stopped by its time limit
    says so next to its iteration count, one that ended early without it says it crashed, and
    the Inductor cache column is the one benchmark_flashsac_training.py recorded at launch
    ("unknown" for reports written before it recorded one)."""
    fmt = lambda v, spec: "" if v is None else format(v, spec)  # noqa: E731
    lines = [
        "| updates | batch | learner | mode | seed | GPUs | iterations | Inductor cache at launch | first update after launch (s) "
        "| learner ms median (p90) | learner vs UniLab default | iteration ms | collector ms | last reward | ranks bit-identical |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in runs:
        its = f"{r['iterations_logged']}" + (" (time limit)" if r["stopped_by_time_limit"] else "")
        its += "" if r["completed"] else " (ended early: crashed)"
        lines.append(
            f"| {r['updates_per_step']} | {r['batch_size']} | {r['learner']} | {r['mode']} | {r['seed']} | {r['gpus']} | {its} "
            f"| {CACHE[r['inductor_cache_warm_at_launch']]} | {fmt(r['first_learner_iteration_s'], '.0f')} "
            f"| {fmt(r['learner_ms_median'], '.2f')} ({fmt(r['learner_ms_p90'], '.2f')}) "
            f"| {fmt(r.get('learner_ms_vs_unilab_default'), '.2f')} | {fmt(r['iter_ms_median'], '.1f')} "
            f"| {fmt(r['collector_ms_median'], '.1f')} | {fmt(r['reward_last'], '.2f')} "
            f"| {'' if r['ranks_bit_identical'] is None else 'yes' if r['ranks_bit_identical'] else 'NO'} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("reports", nargs="+", type=Path, help="benchmark_flashsac_training.py JSON files")
    parser.add_argument("--output", type=Path, required=True)
    parser.add_argument("--markdown", type=Path)
    args = parser.parse_args(argv)
    runs = []
    for path in args.reports:
        try:
            runs.append(summarize_run(path))
        except (OSError, ValueError, KeyError) as exc:
            parser.error(f"{path}: {exc}" if not str(exc).startswith(str(path)) else str(exc))
    runs.sort(key=lambda r: (r["updates_per_step"], r["batch_size"], r["seed"], r["learner"] != "unilab", r["mode"]))
    add_ratios(runs)
    table = markdown(runs)
    write_report({"experiment": "summarize_trainings", "reference": "/".join(REFERENCE), "runs": runs}, args.output)
    if args.markdown:
        args.markdown.write_text(table)
    print(table, end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
