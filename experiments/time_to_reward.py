"""Time to reward in real G1 training: stock UniLab 1.5.2 against UniLab patched with flashsac_opt.

What a UniLab user waits for is the wall clock from `train` to a policy that walks. Per run (a
benchmark_flashsac_training.py JSON): launch -> first learner update, learner and iteration ms
(median, p90) over the last N logged iterations, and the seconds from launch to the first
iteration whose 20-iteration moving mean of Train/mean_reward reaches each threshold (null: not
within the run; its iteration count and whether its time limit cut it say how far it got). Runs
are grouped by configuration (GROUP_KEY), seeds inside, with the median over seeds; a group with
fewer than MIN_SEEDS seeds says it supports no claim. The trainings come from
experiments/device/trainings.py (on the GPU: runs.toml's ttr_* runs); the matrix of 2026-12-01/02
(results/time_to_reward/) was planned by this script's `plan` command, in git up to 2f362b4.

    python experiments/time_to_reward.py summarize results/trainings/ \\
        --output results/time_to_reward/time_to_reward.json --plot results/time_to_reward/time_to_reward.png
"""

from __future__ import annotations

import argparse
import os
import re
import shlex
import shutil
import statistics
import subprocess
import sys
import time
import warnings
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))  # experiments/: common, report
from common import REWARD_WINDOW, collector_start_wait_s, moving_mean, percentile, read_json, training_reports, write_report  # noqa: E402
from device.trainings import run_tag as trainings_run_tag  # noqa: E402
from report import plotting  # noqa: E402
from report.summarize_startup import phases as startup_phases  # noqa: E402
from report.summarize_trainings import summarize_run  # noqa: E402

from flashsac_opt.unilab import collector_start  # noqa: E402  (light: no torch)

TAG = "Train/mean_reward"
WINDOW = REWARD_WINDOW  # iterations in the moving mean of TAG
THRESHOLDS = (20.0, 30.0)
MIN_SEEDS = 3
SPLIT_KEYS = ("inference_ms", "inference_forward_ms", "collector_update_state_ms", "collector_reset_done_ms", "collector_cycle_ms")
# the learner's other phases and the collector's side, recorded since 2026-12-01 (commit
# be16bef): in split_ms only where a run has them
SPLIT_KEYS_IF_LOGGED = ("collector_wait_ms", "collector_release_ms", "replay_batch_wait_ms", "replay_sample_ms",
                        "inference_h2d_ms", "inference_d2h_ms", "collector_action_wait_ms", "collector_env_step_ms")
GROUP_KEY = ("learner", "mode", "updates_per_step", "batch_size", "num_envs", "replay_buffer_n", "carrier", "gpu_sharing")

# ---- summarize -------------------------------------------------------------------------------

def first_crossing(rows: list[dict], threshold: float, window: int = WINDOW) -> dict | None:
    """The first logged iteration whose moving mean over the ``window`` rows ending there
    reaches ``threshold``: {iteration, seconds from launch, seconds after the first logged
    iteration, the moving mean}; None if none does."""
    means = moving_mean([r["reward"] for r in rows], window)
    for k, m in enumerate(means):
        if m >= threshold:
            row = rows[k + window - 1]
            # after the first update: the learning part alone, whatever the start-up cost
            return {"iteration": row.get("iteration"), "seconds": row["wall_s"],
                    "seconds_after_first_update": row["wall_s"] - rows[0]["wall_s"], "moving_mean": m}
    return None


def reward_rows(report: dict) -> list[dict]:
    """The rows with a reward and seconds from launch (reports from before wall_s have none)."""
    return [r for r in report.get("rows_all", []) if "reward" in r and "wall_s" in r]


def tail_stats(rows: list[dict], key: str, last: int) -> dict | None:
    values = [r[key] for r in rows[-last:] if key in r]
    if not values:
        return None
    return {"median": percentile(values, 0.5), "p90": percentile(values, 0.9), "count": len(values)}


def compiled_iteration_wall_ms(rows: list[dict], first_compiled_update_s: float | None) -> float | None:
    """Wall clock per iteration from the first compiled iteration to the last logged one: what an
    iteration costs the run, beyond UniLab's iteration timer (which leaves out its logging)."""
    if first_compiled_update_s is None:
        return None
    compiled = [r for r in rows if r["wall_s"] >= first_compiled_update_s and "iteration" in r]
    if len(compiled) < 2 or compiled[-1]["iteration"] == compiled[0]["iteration"]:
        return None
    return 1000.0 * (compiled[-1]["wall_s"] - compiled[0]["wall_s"]) / (compiled[-1]["iteration"] - compiled[0]["iteration"])


def iteration_bound(learner_ms: dict | None, split: dict) -> str | None:
    """Which side an iteration waits for (medians of the tail): "collector" where the collector's
    env step is longer than the update phase, "update phase" otherwise; None without both."""
    env_step = (split.get("collector_env_step_ms") or {}).get("median")
    learner = (learner_ms or {}).get("median")
    if env_step is None or learner is None:
        return None
    return "collector" if env_step > learner else "update phase"


def carrier(report: dict) -> str:
    """UniLab's collector tensor carrier the run asked for (`training.collector_tensor_device`):
    "default" (UniLab's auto: the learner's CUDA device) unless an override named one."""
    found = re.findall(r"training\.collector_tensor_device=(\w+)", report.get("unilab_command") or "")
    return found[-1] if found and found[-1] != "auto" else "default"


def collector_eager(report: dict, carrier_name: str) -> bool:
    """Whether the run's collector ran UniLab's compiled reset eagerly: FLASHSAC_OPT_COLLECTOR_EAGER=1,
    or "auto" (recorded for unset since 2026-12-07; unset before meant off) on the CPU carrier."""
    value = (report.get("environment", {}).get("flashsac_opt_switches") or {}).get("FLASHSAC_OPT_COLLECTOR_EAGER")
    return collector_start.eager_for(value or "0", carrier_name)


def gpu_sharing(report: dict, path: Path) -> str:
    """"mps" for a run whose CUDA contexts an MPS daemon served (its environment names the pipe
    folder; runs before that field: with_mps.py's name tag "mps" in the file name), else
    "time-slicing" (the GPU's default between the learner's and the collector's contexts)."""
    if report.get("environment", {}).get("cuda_mps_pipe_directory") or "_mps_" in path.name:
        return "mps"
    return "time-slicing"


def first_compiled_update(timeline: dict, first_update_s: float | None) -> float | None:
    """Seconds from launch to compiled training: the switch after a compile-ahead child (None if
    a run with a child never switched), else the first update (a warm start; a child done before
    the runner's wait ended, whose compiled steps the first update used; stock UniLab, which
    compiles in its first update)."""
    if "background_compile_switched_s" in timeline:
        return timeline["background_compile_switched_s"]
    if "startup_idle_compile_end_s" in timeline:
        return first_update_s
    child_done = (timeline.get("compile_ahead_done") or {}).get("child")
    child_running = (timeline.get("learner_constructed") or {}).get("compile_ahead") and "compile_ahead_done" not in timeline
    if child_done or child_running:
        return None
    return first_update_s


def precompiled_steps(timeline: dict) -> dict | None:
    """What the run's compile did with precompiled steps (loaded, saved, compiled otherwise): the
    switch's, else the compile in the runner's wait, else prepare_for_collection's; None without."""
    for event in ("background_compile_switched", "startup_idle_compile_end", "prepare_for_collection_end"):
        if (timeline.get(event) or {}).get("precompiled_steps") is not None:
            return timeline[event]["precompiled_steps"]
    return None


def host_load_brief(load: dict) -> dict:
    """A training's host load in a line: the cores used outside its process tree and by its
    busiest processes (medians over its iterations), and the host's busy share."""
    return {"outside_training_cores": load["outside_training_cores"], "host_busy_share": load["host_busy_share"],
            "load1": load["load1"], "outside_training_top": load["outside_training_top"][:3],
            "busiest_training_processes": [{"cmd": p["cmd"][:100], "cores_median": p["cores"]["median"]}
                                           for p in load["training_processes"][:4]]}


def summarize_file(path: Path, last: int) -> dict:
    """One run: its configuration and provenance (summarize_trainings' fields), the tail
    timings over its last ``last`` logged iterations, and the threshold crossings."""
    report = read_json(path)
    base = {**summarize_run(path, report), "replay_buffer_n": report["training_config"].get("replay_buffer_n"), "carrier": carrier(report),
            "gpu_sharing": gpu_sharing(report, path)}
    rows = reward_rows(report)
    env = report.get("environment", {})
    return {
        **{k: base[k] for k in ("file", *GROUP_KEY, "seed", "iterations_planned", "iterations_logged",
                                "stopped_by_time_limit", "completed", "inductor_cache_warm_at_launch")},
        # an eager collector is its own configuration (named only when on: older summaries lack it)
        **({"collector": "eager"} if collector_eager(report, base["carrier"]) else {}),
        "stopped_at_reward": report.get("stopped_at_reward", False),
        "first_update_s": base["first_learner_iteration_s"],
        # a cold patched start trains uncompiled until its compile-ahead child is done: its first
        # update flatters it; this is when compiled training began (stock compiles in its first update)
        "first_compiled_update_s": (first_compiled := first_compiled_update(report.get("startup_timeline") or {}, base["first_learner_iteration_s"])),
        # runs with precompiled steps only (the committed summaries predate them)
        **({"precompiled_steps": steps} if (steps := precompiled_steps(report.get("startup_timeline") or {})) else {}),
        # launch -> first update by phase, from the patched learner's milestones (None for stock)
        "startup_phases_s": startup_phases(report["startup_timeline"]) if report.get("startup_timeline") else None,
        "rows_with_wall_s": len(rows),
        "wall_s_last": rows[-1]["wall_s"] if rows else None,
        "tail_iterations": last,
        "learner_ms": (learner_ms := tail_stats(report.get("rows_all", []), "learner_train_ms", last)),
        "iteration_ms": tail_stats(report.get("rows_all", []), "iter_ms", last),
        # where the iteration beyond the learner goes (issue 17's contention): the learner serving
        # the collector's actions, and the collector's GPU phases (None where a run lacks them)
        "split_ms": (split := {key: tail_stats(report.get("rows_all", []), key, last) for key in SPLIT_KEYS}
                     | {key: stats for key in SPLIT_KEYS_IF_LOGGED if (stats := tail_stats(report.get("rows_all", []), key, last)) is not None}),
        "compiled_iteration_wall_ms": compiled_iteration_wall_ms(rows, first_compiled),
        "iteration_bound": iteration_bound(learner_ms, split),
        # the host while it trained (report/host_load.py; runs from 2026-12-07 on): was the CPU-bound
        # collector sharing its cores with something outside the training?
        **({"host_load": host_load_brief(report["host_load"])} if report.get("host_load") else {}),
        "reward_last": rows[-1]["reward"] if rows else None,
        "reward_moving_mean_last": (moving_mean([r["reward"] for r in rows]) or [None])[-1],
        "reward_moving_mean_max": max(moving_mean([r["reward"] for r in rows]), default=None),
        "time_to_reward": {f"{t:g}": first_crossing(rows, t) for t in THRESHOLDS},
        "provenance": {"gpu": env.get("gpu"), "torch": env.get("torch"), "date": env.get("date"),
                       "cpu_cores": env.get("cpu_cores"), "cpu_cores_usable": env.get("cpu_cores_usable"),
                       "cuda_visible_devices": env.get("cuda_visible_devices"), "run_note": env.get("run_note", ""),
                       "unilab": env.get("unilab"), "command": report.get("command"), "unilab_command": report.get("unilab_command")},
        "curve": {"wall_s": [r["wall_s"] for r in rows][WINDOW - 1:], "reward_moving_mean": moving_mean([r["reward"] for r in rows])},
    }


def median_or_none(values: list[float | None]) -> float | None:
    """The median over seeds, a seed that never got there counting as later than any that did:
    None when half of the seeds or more never did."""
    finite = sorted(v for v in values if v is not None)
    ranked = finite + [float("inf")] * (len(values) - len(finite))
    if not ranked:
        return None
    m = statistics.median(ranked)
    return None if m == float("inf") else m


def group_runs(runs: list[dict]) -> list[dict]:
    """Runs grouped by configuration, seeds inside, with the median over seeds of each
    measure and whether the group has the seeds a time-to-reward claim needs."""
    groups: dict[tuple, list[dict]] = {}
    for run in runs:
        groups.setdefault((*(run[k] for k in GROUP_KEY), run.get("collector")), []).append(run)
    out = []
    for key, members in sorted(groups.items(), key=lambda kv: (kv[0][2], kv[0][3], kv[0][4], kv[0][5], kv[0][0] != "unilab", kv[0][1])):
        config = {**dict(zip(GROUP_KEY, key)), **({"collector": key[-1]} if key[-1] else {})}
        members.sort(key=lambda r: r["seed"])
        seeds = [r["seed"] for r in members]
        repeated = sorted({s for s in seeds if seeds.count(s) > 1})
        if repeated:  # a median over seeds would count that seed twice
            files = [r["file"] for r in members if r["seed"] in repeated]
            raise ValueError(f"{label(config)}: seed(s) {repeated} more than once ({', '.join(files)}); "
                             "summarize one run per seed")
        stat = lambda get: median_or_none([get(r) for r in members])  # noqa: E731
        out.append({
            **config,
            "label": label(config),
            "seeds": seeds, "count": len(members), "enough_seeds": len(set(seeds)) >= MIN_SEEDS,
            "note": "" if len(set(seeds)) >= MIN_SEEDS else f"fewer than {MIN_SEEDS} seeds: no time-to-reward claim",
            "median": {
                "first_update_s": stat(lambda r: r["first_update_s"]),
                "first_compiled_update_s": stat(lambda r: r["first_compiled_update_s"]),
                "learner_ms": stat(lambda r: (r["learner_ms"] or {}).get("median")),
                "iteration_ms": stat(lambda r: (r["iteration_ms"] or {}).get("median")),
                "compiled_iteration_wall_ms": stat(lambda r: r.get("compiled_iteration_wall_ms")),
                **{f"time_to_reward_{t:g}_s": stat(lambda r, t=t: (r["time_to_reward"][f"{t:g}"] or {}).get("seconds"))
                   for t in THRESHOLDS},
                **{f"first_update_to_reward_{t:g}_s": stat(lambda r, t=t: (r["time_to_reward"][f"{t:g}"] or {}).get("seconds_after_first_update"))
                   for t in THRESHOLDS},
            },
            "reached": {f"{t:g}": sum(r["time_to_reward"][f"{t:g}"] is not None for r in members) for t in THRESHOLDS},
            "files": [r["file"] for r in members],
        })
    return out


def label(g: dict) -> str:
    who = "stock UniLab" if g["learner"] == "unilab" else "patched (flashsac_opt)"
    carried = "" if g.get("carrier", "default") == "default" else f", {g['carrier'].upper()} carrier"
    carried += ", eager collector" if g.get("collector") == "eager" else ""
    shared = ", MPS" if g.get("gpu_sharing") == "mps" else ""
    return f"{who} {g['mode']}, U{g['updates_per_step']} B{g['batch_size']} E{g['num_envs']} R{g['replay_buffer_n']}{carried}{shared}"


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


def plot(report: dict, path: Path) -> None:
    """Reward (moving mean) against the wall clock, a colour per setting, stock dashed, patched
    solid. Left: since launch, a line per seed (cold and warm starts differ by a minute: seeds hardly
    overlap). Right: since each run's first update, the seeds' `band`: the training's own spread."""
    import matplotlib

    fig, (launch_ax, update_ax) = plotting.subplots(1, 2, figsize=(16, 7), sharey=True)
    runs = {r["file"]: r for r in report["runs"]}
    colors = matplotlib.colormaps["tab10"].colors
    setting = lambda g: tuple(g[k] for k in GROUP_KEY if k not in ("learner", "mode"))  # noqa: E731
    settings = list(dict.fromkeys(setting(g) for g in report["groups"]))
    for g in report["groups"]:
        curves = [(np.array(runs[f]["curve"]["wall_s"]), np.array(runs[f]["curve"]["reward_moving_mean"])) for f in g["files"]]
        curves = [c for c in curves if len(c[0])]
        if not curves:
            continue
        i = settings.index(setting(g))
        color, style = colors[i % 10], "--" if g["learner"] == "unilab" else "-"
        name = f"{g['label']} ({g['count']} seed{'s' if g['count'] != 1 else ''}{'' if g['enough_seeds'] else ', too few'})"
        for k, (t, r) in enumerate(curves):
            launch_ax.plot(t, r, color=color, linestyle=style, linewidth=1.0, label=name if k == 0 else None)
        since = [(t - t[0], r) for t, r in curves]
        b = band(since, 200)
        plotting.line_with_band(update_ax, b["grid_s"], b["mean"], b["min"], b["max"], name, color=color, linestyle=style)
        for t, r in since:
            update_ax.plot(t, r, color=color, linestyle=style, linewidth=0.6, alpha=0.5)
    for ax in (launch_ax, update_ax):
        for t in THRESHOLDS:
            ax.axhline(t, color="grey", linestyle=":", linewidth=0.8)
        ax.set_xlim(left=0)
    plotting.finish_axis(launch_ax, "wall clock since UniLab's train was launched (s): start-up and compile included",
                         f"{TAG}, {WINDOW}-iteration moving mean", "since launch (each line one seed)", legend=False)
    plotting.finish_axis(update_ax, "wall clock since the run's first learner update (s)", "",
                         "since the first update (line: mean where all seeds run; band: min-max)", legend=False)
    launch_ax.legend(fontsize=7, loc="upper left")
    fig.suptitle("G1 walk flat, MuJoCo: reward vs wall clock")
    plotting.save(fig, path)


def markdown_table(report: dict) -> str:
    """The groups as a Markdown table: medians over seeds, seeds that reached each threshold, the
    seeds' best moving means, and the seeds a time limit cut short (their "not reached" is a bound)."""
    fmt = lambda v, spec: "-" if v is None else format(v, spec)  # noqa: E731
    runs = {r["file"]: r for r in report["runs"]}
    head = ["configuration", "seeds", "launch -> first update (s)", "learner (ms)", "iteration (ms)",
            *(f"launch -> reward {t:g} (s)" for t in report["thresholds"]), "best moving mean", "cut by a time limit"]
    lines = [f"Generated by `experiments/time_to_reward.py summarize` from {len(report['runs'])} training reports (the JSON "
             f"beside this table names them and the command). Medians over seeds; launch -> reward: seconds from launching "
             f"UniLab's train to the first iteration whose {report['window']}-iteration moving mean reaches it (-: half of the "
             f"seeds or more did not), with how many seeds did.", "",
             "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for g in report["groups"]:
        m, members = g["median"], [runs[f] for f in g["files"]]
        reach = [f"{fmt(m[f'time_to_reward_{t:g}_s'], '.1f')} ({g['reached'][f'{t:g}']} of {g['count']})" for t in report["thresholds"]]
        best = [r["reward_moving_mean_max"] for r in members if r["reward_moving_mean_max"] is not None]
        # cut before its last planned iteration and before the highest threshold: its "not
        # reached" says only that the call's time ran out
        cut = [f"s{r['seed']} at {r['iterations_logged']} ({fmt(r['wall_s_last'], '.0f')} s)" if r["iterations_logged"]
               else f"s{r['seed']} before its first update" for r in members
               if r["stopped_by_time_limit"] and r["iterations_logged"] < (r["iterations_planned"] or 0)
               and r["time_to_reward"][f"{max(report['thresholds']):g}"] is None]
        cells = [g["label"] + ("" if g["enough_seeds"] else " (too few seeds)"), ", ".join(map(str, g["seeds"])),
                 fmt(m["first_update_s"], ".1f"), fmt(m["learner_ms"], ".2f"), fmt(m["iteration_ms"], ".1f"), *reach,
                 f"{min(best):.1f}-{max(best):.1f}" if best else "-", ", ".join(cut) or "none"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def training_files(paths: list[Path]) -> list[Path]:
    files = []
    for p in paths:
        files += training_reports(p) if p.is_dir() else [p]
    return files


def build_report(files: list[Path], last: int) -> dict:
    """The summary of training reports (ValueError on one it cannot read or a seed twice)."""
    runs, skipped = [], []
    for path in files:
        try:
            run = summarize_file(path, last)
        except (OSError, ValueError, KeyError) as exc:
            raise ValueError(f"{path}: {exc}") from exc
        if not run["rows_with_wall_s"] and run["iterations_logged"]:
            skipped.append({"file": path.name, "why": "its rows have no seconds from launch (a report from before wall_s)"})
            continue
        runs.append(run)
    return {
        "experiment": "time_to_reward",
        "summarizes": [str(p) for p in files],
        "what": ("a summary of the training JSON in 'summarizes' (written on the GPUs their provenance names); "
                 "nothing here was measured by this command"),
        "tag": TAG, "window": WINDOW, "thresholds": list(THRESHOLDS), "min_seeds": MIN_SEEDS, "tail_iterations": last,
        "time_to_reward_definition": (f"seconds from launching UniLab's train to the first logged iteration whose {WINDOW}-iteration "
                                      "moving mean of Train/mean_reward reaches the threshold; null: not within the run"),
        "groups": group_runs(runs), "runs": runs, "skipped": skipped,
    }


def report_of_inputs(args, parser) -> tuple[list[Path], dict]:
    """The training files among ``args.inputs`` and their summary; a usage error when there are none
    or one cannot be read."""
    files = training_files(args.inputs)
    if not files:
        parser.error("no training JSON among the inputs")
    try:
        return files, build_report(files, args.last)
    except ValueError as exc:
        parser.error(str(exc))


def summarize_main(args, parser) -> int:
    files, report = report_of_inputs(args, parser)
    groups, runs, skipped = report["groups"], report["runs"], report["skipped"]
    write_report(report, args.output, plot if args.plot else None, args.plot)
    if args.markdown:
        args.markdown.write_text(markdown_table(report))
    for g in groups:
        m = g["median"]
        reach = ", ".join(
            f"reward {t:g}: " + (f"{m[f'time_to_reward_{t:g}_s']:.0f} s" if m[f"time_to_reward_{t:g}_s"] is not None else "not reached")
            + f" ({g['reached'][f'{t:g}']} of {g['count']})" for t in THRESHOLDS)
        fmt = lambda v, spec: "?" if v is None else format(v, spec)  # noqa: E731
        print(f"{g['label']}: seeds {g['seeds']}{' (fewer than %d: no claim)' % MIN_SEEDS if not g['enough_seeds'] else ''}; "
              f"first update {fmt(m['first_update_s'], '.0f')} s, learner {fmt(m['learner_ms'], '.2f')} ms, "
              f"iteration {fmt(m['iteration_ms'], '.1f')} ms; {reach}")
    for r in runs:
        if all(v is None for v in r["time_to_reward"].values()):
            cut = ", cut by its time limit" if r["stopped_by_time_limit"] else ""
            print(f"  {r['file']}: no threshold reached within {r['iterations_logged']} iterations{cut} "
                  f"(moving mean at most {fmt(r['reward_moving_mean_max'], '.2f')})")
    for s in skipped:
        print(f"  skipped {s['file']}: {s['why']}")
    return 0


# ---- protocol ------------------------------------------------------------------------------------

TARGETS = {"median_time_to_reward_30_s": 60.0, "cold_seed_time_to_reward_30_s": 90.0}  # issue 44
TRAININGS = Path(__file__).resolve().parent / "device" / "trainings.py"
STARTUP_PAIR_S = 80  # one start-up pair member: launch, first update (~30-45 s warm), 120 iterations, shutdown


def cache_env(folder: Path) -> dict[str, str]:
    """The Inductor, Triton and flashsac_opt compile caches at ``folder``."""
    return {"TORCHINDUCTOR_CACHE_DIR": str(folder), "TRITON_CACHE_DIR": str(folder / "triton"),
            "FLASHSAC_OPT_CACHE_DIR": str(folder / "flashsac_opt")}


def empty_cache_env(folder: Path) -> dict[str, str]:
    """``cache_env`` of ``folder``, emptied first."""
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    return cache_env(folder)


def cache_folder(args, learner: str) -> Path:
    """The protocol's compile caches for ``learner``: --cache, or one folder per learner under --work."""
    return args.cache or args.work / f"cache_{learner}"


def trainings_command(args, runs: list[str], seconds: float, *extra: str) -> list[str]:
    return [sys.executable, str(TRAININGS), "--updates", str(args.updates), "--batch", str(args.batch), "--envs", str(args.envs),
            "--replay-buffer-n", str(args.replay_buffer_n), "--learning-starts", str(args.learning_starts), "--no-eval",
            "--time-limit", f"{seconds:.0f}", "--out", str(args.out), "--work", str(args.work),
            *(["--stack-samples", f"{args.stack_samples:g}"] if args.stack_samples else []),
            *[a for o in args.override for a in ("--override", o)], *extra, *runs]


def startup_pair_row(report: dict) -> dict:
    """A start-up pair member: launch -> first update and the runner's wait for its collector."""
    timeline = report.get("startup_timeline") or {}
    rows = report.get("rows_all") or []
    return {"first_update_s": rows[0]["wall_s"] if rows else None, "learner_constructed_s": timeline.get("learner_constructed_s"),
            "collector_start_wait_s": collector_start_wait_s(timeline), "phases_s": startup_phases(timeline) if timeline else None}


def protocol_verdicts(runs: list[dict]) -> dict:
    """Per learner, its seeds in order: times to reward 30, their median, and whether issue 44's
    targets are met. The first seed is the cold one only if its compile cache was empty at launch
    (a protocol continued from an earlier call's cache has none: no cold-seed verdict then)."""
    by_learner: dict = {}
    for run in runs:
        by_learner.setdefault(run["learner"], []).append(run)
    verdicts = {}
    for learner, seeds in by_learner.items():
        seeds = sorted(seeds, key=lambda r: r["seed"])
        ttr = [(r["time_to_reward"]["30"] or {}).get("seconds") for r in seeds]
        median, first = median_or_none(ttr), seeds[0]
        cold = first["inductor_cache_warm_at_launch"] is False
        verdicts[learner] = {
            "seeds": [r["seed"] for r in seeds], "cold_seed": first["seed"] if cold else None,
            "cold_seed_cache_warm_at_launch": first["inductor_cache_warm_at_launch"],
            "time_to_reward_30_s": ttr, "median_time_to_reward_30_s": median,
            "first_update_s": [r["first_update_s"] for r in seeds], "first_compiled_update_s": [r["first_compiled_update_s"] for r in seeds],
            "meets_targets": (cold and len(seeds) >= MIN_SEEDS and median is not None and median <= TARGETS["median_time_to_reward_30_s"]
                              and ttr[0] is not None and ttr[0] <= TARGETS["cold_seed_time_to_reward_30_s"]),
        }
    return verdicts


def protocol_main(args) -> int:
    """The cold-first protocol: per learner, seeds in sequence on an empty compile cache (the first
    seed cold, the next ones on what it left), each stopped at reward 30; then start-up pairs,
    UniLab's spawn against patches/0005's preloaded collector, alternating, on the warm cache."""
    pairs_s = 2 * args.startup_pairs * STARTUP_PAIR_S
    share = (args.time_limit - pairs_s) / len(args.learners)
    if args.dry_run:  # the device driver's dry run: the trainings it would start, at their most
        for learner in args.learners:
            runs = [f"{learner}:graph:{seed}" for seed in args.seeds]
            if args.warm_cache:
                print(f"{learner}, warm seeds on {cache_folder(args, learner)} as an earlier call left it: "
                      + shlex.join(trainings_command(args, runs, share)))
                continue
            cold_s = min(args.cold_seed_limit, share)
            print(f"{learner}, cold seed on emptied caches: " + shlex.join(trainings_command(args, runs[:1], cold_s)))
            if len(runs) > 1:
                print(f"{learner}, warm seeds: " + shlex.join(trainings_command(args, runs[1:], share - cold_s)))
        print(f"then {args.startup_pairs} start-up pair(s) of {STARTUP_PAIR_S:g} s each side")
        return 0
    args.out.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, WANDB_MODE="disabled", HYDRA_FULL_ERROR="1")
    done: list[dict] = []
    for learner in args.learners:
        cache = (cache_env if args.warm_cache else empty_cache_env)(cache_folder(args, learner))
        runs = [f"{learner}:graph:{seed}" for seed in args.seeds]
        extra = ["--iterations", str(args.iterations), "--stop-at-reward", f"{max(THRESHOLDS):g}"]
        if learner == "unilab":  # its compile on every core, as its best configuration
            extra.append(f"--override=training.torch_threads.compile_threads={os.cpu_count()}")
        # The cold seed alone first, with its own limit: in one call trainings.py's share (its start-up
        # estimate plus an equal part) cut a cold seed at 121 s, before it reached 30 (results/time_to_reward/
        # protocol_u64_mps_2026-12-04); the warm seeds then share what is left.
        started = time.monotonic()
        cold = [] if args.warm_cache else runs[:1]  # --warm-cache: an earlier call ran the cold seed on this cache
        cold_s = min(args.cold_seed_limit, share) if cold else None
        code = subprocess.run(trainings_command(args, cold, cold_s, *extra), env={**env, **cache}).returncode if cold else 0
        if runs[len(cold):]:
            left = share - (time.monotonic() - started)
            code = max(code, subprocess.run(trainings_command(args, runs[len(cold):], left, *extra), env={**env, **cache}).returncode)
        done.append({"learner": learner, "cache": cache["TORCHINDUCTOR_CACHE_DIR"], "runs": runs, "cold_seed_limit_s": cold_s,
                     "exit_status": code})
    pairs = []
    cache = {**env, **cache_env(cache_folder(args, "flashsac_opt"))}  # what the patched seeds left
    for k in range(args.startup_pairs):
        for preload, tag in (("0", "startup_spawn"), ("1", "startup_preload")):
            seed = 11 + k
            cmd = trainings_command(args, [f"flashsac_opt:graph:{seed}"], STARTUP_PAIR_S, "--iterations", "120", "--name-tag", tag)
            code = subprocess.run(cmd, env={**cache, "FLASHSAC_OPT_COLLECTOR_PRELOAD": preload}).returncode
            file = training_file(args, "flashsac_opt", seed, tag)
            row = startup_pair_row(read_json(file)) if file.is_file() else {}
            pairs.append({"pair": k, "collector": "preloaded (patches/0005)" if preload == "1" else "UniLab's spawn",
                          "file": file.name, "exit_status": code, **row})
    files = [f for learner in args.learners for seed in args.seeds if (f := training_file(args, learner, seed)).is_file()]
    report = build_report(files, args.last) if files else {"groups": [], "runs": []}
    verdicts = protocol_verdicts(report["runs"])
    report["protocol"] = {
        "what": ("cold-first time to reward: per learner, seeds in sequence on a compile cache emptied before the first "
                 "(Inductor, Triton, flashsac_opt's compile-cache files), each stopped at a 20-iteration mean reward of 30; "
                 "then start-up pairs on the warm cache, UniLab's spawned collector against the preloaded one"),
        "targets": TARGETS, "learners": done, "verdicts": verdicts, "startup_pairs": pairs,
        "warm_cache_from_an_earlier_call": args.warm_cache,
        "configuration": {k: getattr(args, k) for k in ("updates", "batch", "envs", "replay_buffer_n", "learning_starts", "iterations", "seeds", "override")},
        "cuda_mps_pipe_directory": os.environ.get("CUDA_MPS_PIPE_DIRECTORY"),
    }
    figures = args.figures or args.out
    figures.mkdir(parents=True, exist_ok=True)
    write_report(report, args.out / "time_to_reward_protocol.json", plot if files else None, figures / "time_to_reward_protocol.png")
    with_phases = {r["file"]: {"first_update_s": r["first_update_s"], "phases_s": r["startup_phases_s"] or {}} for r in report["runs"]}
    with_phases |= {p["file"]: {"first_update_s": p.get("first_update_s"), "phases_s": p.get("phases_s") or {}} for p in pairs}
    if with_phases:
        from report.summarize_startup import plot as plot_phases

        plot_phases(with_phases, figures / "startup_phases.png")
    for learner, v in verdicts.items():
        print(f"{learner}: time to reward 30 {v['time_to_reward_30_s']} (median {v['median_time_to_reward_30_s']}), "
              f"first update {v['first_update_s']}, first compiled update {v['first_compiled_update_s']}")
    for p in pairs:
        print(f"start-up pair {p['pair']}, {p['collector']}: first update {p.get('first_update_s')}, collector wait {p.get('collector_start_wait_s')}")
    return 0 if all(d["exit_status"] == 0 for d in done) else 1


def verdict_main(args, parser) -> int:
    """The protocol's verdicts over trainings from several device calls: a configuration whose
    cold seed and warm seeds do not fit one 10-minute call (stock UniLab's G1 default) runs the cold
    seed in one call and the warm ones in the next on the cache it left (``protocol --warm-cache``)."""
    files, report = report_of_inputs(args, parser)
    verdicts = protocol_verdicts(report["runs"])
    report["protocol"] = {
        "what": ("cold-first time to reward assembled from trainings of several calls: per learner, the lowest seed "
                 "is the cold one if its compile cache was empty at launch, the others ran on what it left"),
        "targets": TARGETS, "verdicts": verdicts, "calls": sorted({str(p.parent) for p in files}),
    }
    write_report(report, args.output, plot if args.plot else None, args.plot)
    for learner, v in verdicts.items():
        print(f"{learner}: seeds {v['seeds']}, cold seed {v['cold_seed']}, time to reward 30 {v['time_to_reward_30_s']} "
              f"(median {v['median_time_to_reward_30_s']})")
    return 0


def training_file(args, learner: str, seed: int, name_tag: str | None = None) -> Path:
    """Where trainings.py writes a graph-mode training of this configuration (its own naming)."""
    tag = trainings_run_tag(args.updates, args.batch, args.envs, args.replay_buffer_n, name_tag)
    return args.out / f"training_{tag}_{learner}_graph_s{seed}.json"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    s = sub.add_parser("summarize", help="per run and per configuration: start-up, timings, time to reward; JSON and figure")
    s.add_argument("inputs", nargs="+", type=Path, help="training JSON files (.json or .json.gz), or folders of them (training_*.json[.gz])")
    s.add_argument("--last", type=int, default=500, help="iterations at the end of each run the timings are taken over")
    s.add_argument("--output", type=Path, required=True)
    s.add_argument("--plot", type=Path)
    s.add_argument("--markdown", type=Path, help="also write the groups as a Markdown table (medians over seeds, seeds reached, runs cut)")
    p = sub.add_parser("protocol", help="run the cold-first protocol (trainings on this machine's GPU) and summarize it")
    p.add_argument("--out", type=Path, required=True, help="training JSON, time_to_reward_protocol.json and the figures")
    p.add_argument("--work", type=Path, required=True, help="logs, UniLab copies, the emptied compile caches")
    p.add_argument("--learners", nargs="+", choices=("flashsac_opt", "unilab"), default=["flashsac_opt"])
    p.add_argument("--seeds", nargs="+", type=int, default=[1, 2, 3])
    p.add_argument("--updates", type=int, default=64)
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--envs", type=int, default=256)
    p.add_argument("--replay-buffer-n", type=int, default=512)
    p.add_argument("--learning-starts", type=int, default=98)
    p.add_argument("--iterations", type=int, default=1500, help="at most, per seed (each stops at reward 30)")
    p.add_argument("--cold-seed-limit", type=float, default=200.0, help="seconds for the cold seed (its start, compile and run to 30)")
    p.add_argument("--startup-pairs", type=int, default=0, help="then this many pairs of short warm starts, spawn vs preloaded collector")
    p.add_argument("--stack-samples", type=float, metavar="SECONDS")
    p.add_argument("--override", action="append", default=[], metavar="KEY=VALUE",
                   help="extra Hydra override for every training (repeatable; recorded in the JSON's configuration)")
    p.add_argument("--figures", type=Path, help="where the figures go (default: --out)")
    p.add_argument("--time-limit", type=float, default=580.0, help="seconds for everything")
    p.add_argument("--last", type=int, default=500)
    p.add_argument("--dry-run", action="store_true", help="print the trainings it would start, run nothing")
    p.add_argument("--cache", type=Path, help="the compile-cache folder (one learner only; default: --work/cache_LEARNER)")
    p.add_argument("--warm-cache", action="store_true",
                   help="continue on the cache an earlier call of the protocol left (its cold seed ran there): no cold seed, nothing emptied")
    v = sub.add_parser("verdict", help="the protocol's verdicts over trainings of several calls (a cold seed, then warm seeds on its cache)")
    v.add_argument("inputs", nargs="+", type=Path, help="training JSON files (.json or .json.gz), or folders of them")
    v.add_argument("--output", type=Path, required=True)
    v.add_argument("--plot", type=Path)
    v.add_argument("--last", type=int, default=500)
    args = parser.parse_args(argv)
    if args.command == "protocol":
        if args.cache is not None and len(args.learners) != 1:
            parser.error("--cache takes one learner (each learner needs its own cache)")
        if args.warm_cache and args.startup_pairs:
            parser.error("--warm-cache runs seeds only; the start-up pairs belong to a call with the cold seed")
        return protocol_main(args)
    if args.command == "verdict":
        return verdict_main(args, parser)
    return summarize_main(args, parser)


if __name__ == "__main__":
    sys.exit(main())
