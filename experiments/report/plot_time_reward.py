"""Time-reward smoke figure: reward vs training wall time, mean over seeds with a min/max band.

Each group is one configuration (e.g. "UniLab default" or "flashsac_opt graph") run with several
seeds; pass the JSON files benchmark_flashsac_training.py wrote or TensorBoard run
directories. The reward is UniLab's Train/mean_reward. From a JSON, time runs from the launch
of UniLab's train (start-up and compile count: users wait for them too; its rows' wall_s);
from a run directory, from the run's first logged scalar. A group may not mix the two.

    python experiments/report/plot_time_reward.py \\
        --group "UniLab 1.5.2 default" results/trainings/training_u2_b256_unilab_graph_s{1,2,3}.json \\
        --group "flashsac_opt graph" results/trainings/training_u2_b256_flashsac_opt_graph_s{1,2,3}.json \\
        --output results/trainings/time_reward_u2_b256_s1_s2_s3.json --plot results/trainings/time_reward_u2_b256_s1_s2_s3.png
"""

from __future__ import annotations

import argparse
import sys
import warnings
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # experiments/: common, report.plotting
from common import read_json, write_report  # noqa: E402
from report import plotting  # noqa: E402

TAG = "Train/mean_reward"


def reward_curve(source: Path) -> tuple[np.ndarray, np.ndarray, str]:
    """(seconds, reward, where the seconds start) for a training JSON or a run directory."""
    if source.is_dir():
        return (*events_curve(source), "first logged scalar")
    report = read_json(source)
    rows = [r for r in report.get("rows_all", []) if "wall_s" in r and "reward" in r]
    if rows:
        return np.array([r["wall_s"] for r in rows]), np.array([r["reward"] for r in rows]), "launch"
    if report.get("iterations_logged") == 0:
        raise ValueError(f"{source}: no learner iteration logged (stopped before its first update): no curve to draw")
    return (*events_curve(Path(report["run_dir"])), "first logged scalar")  # JSON from before wall_s


def events_curve(directory: Path) -> tuple[np.ndarray, np.ndarray]:
    """(seconds since the run's first logged scalar, reward) from TensorBoard events."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(directory), size_guidance={"scalars": 0})
    events.Reload()
    if TAG not in events.Tags()["scalars"]:
        raise SystemExit(f"plot_time_reward: error: {directory} has no {TAG} scalars")
    first = min(e.wall_time for tag in events.Tags()["scalars"] for e in events.Scalars(tag))
    points = events.Scalars(TAG)
    return np.array([e.wall_time - first for e in points]), np.array([e.value for e in points])


def band(curves: list[tuple[np.ndarray, np.ndarray]], grid_points: int) -> dict:
    """Common time grid up to the longest run; each run interpolated inside its own span (NaN
    outside); min/max over the runs present at each point, the mean only where all are."""
    end = max(t[-1] for t, _ in curves)
    grid = np.linspace(0.0, end, grid_points)
    stacked = np.stack([np.interp(grid, t, r, left=np.nan, right=np.nan) for t, r in curves])
    present = np.isfinite(stacked).sum(axis=0)
    with warnings.catch_warnings():  # grid points outside every run: NaN, as intended
        warnings.simplefilter("ignore", RuntimeWarning)
        mean, low, high = np.nanmean(stacked, axis=0), np.nanmin(stacked, axis=0), np.nanmax(stacked, axis=0)
    mean[present < len(curves)] = np.nan  # a mean of whichever seeds happen to be running would zigzag
    return {"grid_s": grid.tolist(), "runs_present": present.tolist(), "mean": mean.tolist(), "min": low.tolist(), "max": high.tolist()}


def summarize(groups: dict[str, list[tuple[np.ndarray, np.ndarray]]], grid_points: int = 200) -> dict:
    """Per group: a common time grid up to the longest run; each run's reward interpolated
    inside its own time span (NaN outside); min/max over the runs present at each grid point
    (``runs_present``), the mean where all of them are. Runs start at different times (a seed's start-up differs
    by tens of seconds), so a grid cut at the shortest run or at the latest start would drop
    most of a curve.

    ``since_first_reward``: the same with each run's clock started at its first reward. Start-up
    (UniLab's start, compile, capture; cold or warm Inductor cache) differs by minutes between
    learners and by tens of seconds between seeds, so from the launch the seeds hardly overlap
    and the band is mostly one run; from the first reward they do, and the band shows the
    seed spread of the training itself."""
    out = {}
    for label, curves in groups.items():
        out[label] = {
            "seeds": len(curves),
            "wall_time_s": [float(t[-1]) for t, _ in curves],
            "final_reward": [float(r[-1]) for _, r in curves],
            **band(curves, grid_points),
            "runs": [{"t": t.tolist(), "reward": r.tolist()} for t, r in curves],
            "since_first_reward": {
                "start_s": [float(t[0]) for t, _ in curves],
                **band([(t - t[0], r) for t, r in curves], grid_points),
            },
        }
    return out


def plot(summary: dict, path: Path, title: str) -> None:
    fig, (ax, ax2) = plotting.subplots(2, 1, figsize=(9, 8))
    for label, g in summary.items():
        seeds = f"{g['seeds']} seed" + ("s" if g["seeds"] != 1 else "")
        color = plotting.line_with_band(ax, g["grid_s"], g["mean"], g["min"], g["max"],
                                        f"{label} ({seeds}, {np.mean(g['wall_time_s']):.0f} s; time from {g['time_from']})")
        for run in g["runs"]:  # each seed, thin: where only one seed has data the band is that seed
            ax.plot(run["t"], run["reward"], color=color, linewidth=0.6, alpha=0.5)
        since = g["since_first_reward"]
        starts = ", ".join(f"{s:.0f}" for s in since["start_s"])
        plotting.line_with_band(ax2, since["grid_s"], since["mean"], since["min"], since["max"],
                                f"{label} (first reward at {starts} s)", color=color)
    ax.set_xlim(left=0)  # from the launch: the start-up before the first reward is part of the story
    ax2.set_xlim(left=0)
    plotting.finish_axis(ax, f"wall time since {next(iter(summary.values()))['time_from']} (s): start-up and compile included",
                         TAG, title)
    ax.title.set_fontsize(9)
    plotting.finish_axis(ax2, "wall time since each run's first reward (s): training only, mean and min/max over seeds", TAG)
    plotting.save(fig, path)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--group", nargs="+", action="append", metavar=("LABEL", "RUN"), required=True,
                        help="a label, then the runs (JSON from benchmark_flashsac_training.py or run directories)")
    parser.add_argument("--title", default="G1 walk flat, MuJoCo: reward vs wall time (mean, min/max band over seeds)")
    parser.add_argument("--output", type=Path, required=True)
    parser.add_argument("--plot", type=Path, required=True)
    args = parser.parse_args(argv)
    groups: dict[str, list[tuple[np.ndarray, np.ndarray]]] = {}
    sources: dict[str, list[str]] = {}
    origins: dict[str, set[str]] = {}
    for label, *runs in args.group:
        if not runs:
            parser.error(f"--group {label!r} names no runs")
        for run in runs:
            path = Path(run)
            if not path.exists():
                parser.error(f"{run} does not exist")
            try:
                t, r, origin = reward_curve(path)
            except ValueError as exc:
                parser.error(str(exc))
            groups.setdefault(label, []).append((t, r))
            origins.setdefault(label, set()).add(origin)
            sources.setdefault(label, []).append(run)
        if len(origins[label]) > 1:
            parser.error(f"--group {label!r} mixes training JSON (time from launch) and run directories (time from the first scalar)")
    summary = summarize(groups)
    for label, g in summary.items():
        g["time_from"] = origins[label].pop()
    write_report({"experiment": "time_reward_smoke", "tag": TAG, "sources": sources, "groups": summary}, args.output)
    plot(summary, args.plot, args.title)
    for label, g in summary.items():
        print(f"{label}: {g['seeds']} seed(s), wall {np.mean(g['wall_time_s']):.1f} s, final reward {np.mean(g['final_reward']):.3f} [{min(g['final_reward']):.3f}, {max(g['final_reward']):.3f}]")
    return 0


if __name__ == "__main__":
    sys.exit(main())
