"""Launch -> first learner update of real UniLab trainings, one JSON: each run's first-update
time (``rows_all[0].wall_s`` of benchmark_flashsac_training's JSON), learner and iteration
medians, the Inductor cache at launch, and what the compile-ahead child reported in the
training's log. A run that logged no iteration (NAME=-:ARCHIVE:MEMBER) keeps what its log says.
Where the JSON has flashsac_opt's `startup_timeline`, the launch -> first update is split into
PHASES (`phases_s`); with `startup_stacks` each process's five largest places; `--plot` draws the phases.

    python experiments/report/summarize_startup.py --run NAME=TRAINING.json[:LOG_ARCHIVE:MEMBER] ... \\
        --output results/startup/startup_summary.json
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import tarfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # experiments/: common, report.plotting
from common import read_json  # noqa: E402

CHILD = re.compile(r"compile-ahead child done in (?P<child>[\d.]+) s; the first update waited (?P<waited>[\d.]+) s")
STOPPED = re.compile(r"--time-limit (?P<limit>[\d.]+) s reached")


def log_text(archive: Path, member: str) -> str:
    with tarfile.open(archive) as tar:
        return tar.extractfile(member).read().decode(errors="replace")


# (phase, from milestone, to milestone): seconds since launch from the training's startup_timeline
PHASES = (
    ("UniLab start to the learner", None, "learner_constructed_s"),
    ("learner to start-up compile", "learner_constructed_s", ("prepare_for_collection_start_s", "prepare_for_collection_deferred_s")),
    ("start-up compile and capture", "prepare_for_collection_start_s", "prepare_for_collection_end_s"),
    # compile ahead, warm: the child is done (or, with the cache file found, none runs) while
    # the collector still starts; this process compiles in that wait (patches/0004)
    ("collector starting, before the compile from the caches", "prepare_for_collection_deferred_s", "startup_idle_compile_start_s"),
    ("compile from the caches while the collector starts", "startup_idle_compile_start_s", "startup_idle_compile_end_s"),
    ("collector start, learning_starts", ("startup_idle_compile_end_s", "prepare_for_collection_end_s", "prepare_for_collection_deferred_s"),
     "first_update_start_s"),
    ("first update (compile-ahead wait, compile)", "first_update_start_s", "first_update_end_s"),
    # compile ahead in the background: the training runs uncompiled from its first update until
    # the child is done, then compiles from its caches (after the first update: the bar goes on)
    ("uncompiled training until the compiled switch", "first_update_end_s", "background_compile_switched_s"),
)


def phases(timeline: dict) -> dict[str, float]:
    """The PHASES a timeline has both ends of (a phase absent from the run is left out)."""
    def at(key):
        if key is None:
            return 0.0
        for k in (key if isinstance(key, tuple) else (key,)):
            if k in timeline:
                return timeline[k]
        return None

    out = {}
    for name, start, end in PHASES:
        a, b = at(start), at(end)
        if a is not None and b is not None:
            out[name] = round(b - a, 2) or 0.0  # -0.0 (milestones 1 ms apart, in that order) reads as 0
    return out


def summarize_run(training: str, archive: str | None, member: str | None) -> dict:
    row: dict = {"training_json": None if training == "-" else training}
    if training != "-":
        data = read_json(training)
        first = data["rows_all"][0]
        row.update(
            first_update_s=first["wall_s"],
            learner_ms_median=data["learner_train_ms"]["median"],
            learner_ms_p90=data["learner_train_ms"]["p90"],
            iteration_ms_median=data["iter_ms"]["median"],
            iterations_logged=data["iterations_logged"],
            inductor_cache_at_launch=data["inductor_cache_at_launch"],
            environment={k: data["environment"].get(k) for k in ("gpu", "torch", "date", "cpu_cores_usable", "run_note")},
        )
        if data.get("startup_timeline"):
            row["startup_timeline"] = data["startup_timeline"]
            row["phases_s"] = phases(data["startup_timeline"])
        if data.get("startup_stacks"):
            row["startup_stacks_top"] = [{"cmd": p["cmd"][:120], "started_s": p["started_s"], "top": p["seconds_by_where"][:5]}
                                         for p in data["startup_stacks"] if p["samples"]]
    if archive:
        text = log_text(Path(archive), member)
        row["log"] = f"{archive}:{member}"
        child = CHILD.search(text)
        if child:
            row["compile_ahead_child_s"] = float(child["child"])
            row["compile_ahead_waited_s"] = float(child["waited"])
        stopped = STOPPED.search(text)
        row["stopped_by_time_limit_s"] = float(stopped["limit"]) if stopped else None
        row["logged_an_iteration"] = training != "-"
    return row


def plot(runs: dict, path: Path) -> None:
    """One bar per run that logged a first update: its phases stacked where the timeline has
    them, else one grey bar (a stock run: no milestones)."""
    from report import plotting

    shown = {n: r for n, r in runs.items() if r.get("first_update_s") is not None}
    fig, ax = plotting.subplots(figsize=(11, 2.8 + 0.6 * len(shown)))
    names = list(shown)
    left = [0.0] * len(names)
    for phase, _, _ in PHASES:
        widths = [shown[n].get("phases_s", {}).get(phase, 0.0) for n in names]
        ax.barh(names, widths, left=left, label=phase)
        left = [a + b for a, b in zip(left, widths)]
    rest = [max(shown[n]["first_update_s"] - x, 0.0) for n, x in zip(names, left)]
    ax.barh(names, rest, left=left, color="lightgrey", label="no milestones (stock UniLab) / after the first update's end")
    plotting.finish_axis(ax, "seconds since UniLab's train was launched", "", "Launch -> first learner update, by phase", legend=False)
    ax.invert_yaxis()
    # under the bars, so it never hides one; the figure's width, not the axes' (long run names push
    # the axes right, and an axes-centred legend ran off the figure's edge)
    fig.legend(*ax.get_legend_handles_labels(), fontsize=7, loc="lower center", ncol=2, frameon=False)
    plotting.save(fig, path, rect=(0, 0.2, 1, 1))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--run", action="append", required=True, metavar="NAME=JSON[:ARCHIVE:MEMBER]")
    parser.add_argument("--note", default="", help="how the runs were made (host, order, caches)")
    parser.add_argument("--output", type=Path, required=True)
    parser.add_argument("--plot", type=Path, help="figure: each run's launch -> first update, by phase where known")
    args = parser.parse_args(argv)
    runs = {}
    for spec in args.run:
        name, _, rest = spec.partition("=")
        parts = rest.split(":")
        if not name or len(parts) not in (1, 3):
            parser.error(f"--run {spec!r}: expected NAME=JSON or NAME=JSON:ARCHIVE:MEMBER")
        runs[name] = summarize_run(parts[0], *(parts[1:] if len(parts) == 3 else (None, None)))
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps({"experiment": "startup", "note": args.note, "runs": runs}, indent=1) + "\n")
    if args.plot:
        plot(runs, args.plot)
    print(f"{len(runs)} runs -> {args.output}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
