"""Time to reward in real G1 training: stock UniLab 1.5.2 against UniLab patched with flashsac_opt.

What a UniLab user waits for is the wall clock from `train` to a policy that walks. Per run
(a JSON that experiments/benchmark_flashsac_training.py wrote): launch -> first learner update,
learner and iteration ms (median, p90) over the last N logged iterations, and the seconds from
launch to the first iteration whose 20-iteration moving mean of Train/mean_reward reaches each
threshold (null: not within the run; the run's iteration count and whether its time limit cut it
say how far it got). Runs are grouped by configuration (learner, mode, updates per step, batch,
envs), seeds inside; per group the median over seeds. A time-to-reward claim needs at least
MIN_SEEDS seeds: a group with fewer says so.

    python experiments/time_to_reward.py summarize results/trainings/ \\
        --output results/time_to_reward/time_to_reward.json --plot results/time_to_reward/time_to_reward.png

The run matrix (stock vs patched, seeds 1-3, updates per step 8/32/64/128 at 256 envs and
batch 256, plus UniLab's G1 default 4096 envs / batch 2048 x 8 updates; 1500 iterations at most)
is a set of entries of experiments/device/runs.toml, one training per job, each job on one GPU
and its own physical cores. `plan` prints the device calls in the order to spend device time
(64 updates per step first); `plan --toml` prints the entries runs.toml holds.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))  # experiments/: common, report
from common import REWARD_WINDOW, moving_mean, percentile, read_json, training_reports, write_report  # noqa: E402
from device.trainings import run_tag  # noqa: E402
from report import plotting  # noqa: E402
from report.plot_time_reward import TAG, band  # noqa: E402
from report.summarize_startup import phases as startup_phases  # noqa: E402
from report.summarize_trainings import summarize_run  # noqa: E402

WINDOW = REWARD_WINDOW  # iterations in the moving mean of Train/mean_reward
THRESHOLDS = (20.0, 30.0)
MIN_SEEDS = 3
SPLIT_KEYS = ("inference_ms", "inference_forward_ms", "collector_update_state_ms", "collector_reset_done_ms", "collector_cycle_ms")
# the learner's other phases and the collector's side, recorded since 2026-12-01 (session 14):
# in split_ms only where a run has them
SPLIT_KEYS_IF_LOGGED = ("collector_wait_ms", "collector_release_ms", "replay_batch_wait_ms", "replay_sample_ms",
                        "inference_h2d_ms", "inference_d2h_ms", "collector_action_wait_ms", "collector_env_step_ms")
GROUP_KEY = ("learner", "mode", "updates_per_step", "batch_size", "num_envs", "replay_buffer_n", "carrier", "gpu_sharing")

# Replay (replay_buffer_n, learning_starts): FlashSAC's defaults (UniLab's conf/flashsac/config.yaml)
# at 256 envs, where every U64 seed reached reward 30 in ~950 iterations (seed 001's 32 and 8 reached
# no 20 in 1405); UniLab's G1 default is the G1 task's own configuration, its replay included.
FLASHSAC_REPLAY, G1_TASK_REPLAY = (512, 98), (256, 49)
# The matrix: (name, updates per step, batch, envs, replay), in the order device time goes to them.
CONFIGS = (("u64", 64, 256, 256, FLASHSAC_REPLAY), ("u8", 8, 256, 256, FLASHSAC_REPLAY), ("u32", 32, 256, 256, FLASHSAC_REPLAY),
           ("u128", 128, 256, 256, FLASHSAC_REPLAY), ("g1_default", 8, 2048, 4096, G1_TASK_REPLAY))
LEARNERS = (("unilab", "graph"), ("flashsac_opt", "graph"))  # stock UniLab's default learner vs the patched one
SEEDS = (1, 2, 3)
ITERATIONS = 1500
ENTRY_LIMIT_S = 555  # one training: cold start-up (<= ~250 s) + 1500 iterations (<= ~240 s at U128)
JOBS_LIMIT_S = 570
TOML_BEGIN = "# time_to_reward.py plan --toml: begin (generated; edit the matrix there, then paste it again)"
TOML_END = "# time_to_reward.py plan --toml: end"


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


def carrier(report: dict) -> str:
    """UniLab's collector tensor carrier the run asked for (`training.collector_tensor_device`):
    "default" (UniLab's auto: the learner's CUDA device) unless an override named one."""
    found = re.findall(r"training\.collector_tensor_device=(\w+)", report.get("unilab_command") or "")
    return found[-1] if found and found[-1] != "auto" else "default"


def gpu_sharing(report: dict, path: Path) -> str:
    """"mps" for a run whose CUDA contexts an MPS daemon served (its environment names the pipe
    folder; runs before that field: with_mps.py's name tag "mps" in the file name), else
    "time-slicing" (the GPU's default between the learner's and the collector's contexts)."""
    if report.get("environment", {}).get("cuda_mps_pipe_directory") or "_mps_" in path.name:
        return "mps"
    return "time-slicing"


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
        "stopped_at_reward": report.get("stopped_at_reward", False),
        "first_update_s": base["first_learner_iteration_s"],
        # launch -> first update by phase, from the patched learner's milestones (None for stock)
        "startup_phases_s": startup_phases(report["startup_timeline"]) if report.get("startup_timeline") else None,
        "rows_with_wall_s": len(rows),
        "wall_s_last": rows[-1]["wall_s"] if rows else None,
        "tail_iterations": last,
        "learner_ms": tail_stats(report.get("rows_all", []), "learner_train_ms", last),
        "iteration_ms": tail_stats(report.get("rows_all", []), "iter_ms", last),
        # where the iteration beyond the learner goes (issue 17's contention): the learner serving
        # the collector's actions, and the collector's GPU phases (None where a run lacks them)
        "split_ms": {key: tail_stats(report.get("rows_all", []), key, last) for key in SPLIT_KEYS}
        | {key: stats for key in SPLIT_KEYS_IF_LOGGED if (stats := tail_stats(report.get("rows_all", []), key, last)) is not None},
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
        groups.setdefault(tuple(run[k] for k in GROUP_KEY), []).append(run)
    out = []
    for key, members in sorted(groups.items(), key=lambda kv: (kv[0][2], kv[0][3], kv[0][4], kv[0][5], kv[0][0] != "unilab", kv[0][1])):
        members.sort(key=lambda r: r["seed"])
        seeds = [r["seed"] for r in members]
        repeated = sorted({s for s in seeds if seeds.count(s) > 1})
        if repeated:  # a median over seeds would count that seed twice
            files = [r["file"] for r in members if r["seed"] in repeated]
            raise ValueError(f"{label(dict(zip(GROUP_KEY, key)))}: seed(s) {repeated} more than once ({', '.join(files)}); "
                             "summarize one run per seed")
        stat = lambda get: median_or_none([get(r) for r in members])  # noqa: E731
        out.append({
            **dict(zip(GROUP_KEY, key)),
            "label": label(dict(zip(GROUP_KEY, key))),
            "seeds": seeds, "count": len(members), "enough_seeds": len(set(seeds)) >= MIN_SEEDS,
            "note": "" if len(set(seeds)) >= MIN_SEEDS else f"fewer than {MIN_SEEDS} seeds: no time-to-reward claim",
            "median": {
                "first_update_s": stat(lambda r: r["first_update_s"]),
                "learner_ms": stat(lambda r: (r["learner_ms"] or {}).get("median")),
                "iteration_ms": stat(lambda r: (r["iteration_ms"] or {}).get("median")),
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
    shared = ", MPS" if g.get("gpu_sharing") == "mps" else ""
    return f"{who} {g['mode']}, U{g['updates_per_step']} B{g['batch_size']} E{g['num_envs']} R{g['replay_buffer_n']}{carried}{shared}"


def plot(report: dict, path: Path) -> None:
    """Reward (moving mean) against the wall clock, one colour per training setting (updates,
    batch, envs, replay, carrier, GPU sharing), stock dashed and patched solid. Left: since
    launch, each seed its own line (start-up included; cold and warm starts differ by a minute,
    so seeds hardly overlap there and a band would be one run). Right: since each run's first
    update, the mean where all seeds run and the min-max band over them (plot_time_reward's
    band): the spread of the training itself."""
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
    """The groups as a Markdown table (a results README's matrix): per configuration the medians
    over seeds, how many seeds reached each threshold, the range of the seeds' best moving means
    and the seeds a time limit cut short of the highest threshold (their "not reached" is a bound)."""
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


def summarize_main(args, parser) -> int:
    files = training_files(args.inputs)
    if not files:
        parser.error("no training JSON among the inputs")
    runs, skipped = [], []
    for path in files:
        try:
            run = summarize_file(path, args.last)
        except (OSError, ValueError, KeyError) as exc:
            parser.error(f"{path}: {exc}")
        if not run["rows_with_wall_s"] and run["iterations_logged"]:
            skipped.append({"file": path.name, "why": "its rows have no seconds from launch (a report from before wall_s)"})
            continue
        runs.append(run)
    try:
        groups = group_runs(runs)
    except ValueError as exc:
        parser.error(str(exc))
    report = {
        "experiment": "time_to_reward",
        "summarizes": [str(p) for p in files],
        "what": ("a summary of the training JSON in 'summarizes' (written on the GPUs their provenance names); "
                 "nothing here was measured by this command"),
        "tag": TAG, "window": WINDOW, "thresholds": list(THRESHOLDS), "min_seeds": MIN_SEEDS, "tail_iterations": args.last,
        "time_to_reward_definition": (f"seconds from launching UniLab's train to the first logged iteration whose {WINDOW}-iteration "
                                      "moving mean of Train/mean_reward reaches the threshold; null: not within the run"),
        "groups": groups, "runs": runs, "skipped": skipped,
    }
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


# ---- plan: the device runs -------------------------------------------------------------------

def training_file(cfg: tuple, learner: str, mode: str, seed: int) -> str:
    """The JSON name experiments/device/trainings.py gives the run."""
    _, u, batch, envs, (replay_n, _) = cfg
    return f"training_{run_tag(u, batch, envs, replay_n)}_{learner}_{mode}_s{seed}.json"


def entry_name(cfg: tuple, learner: str, seed: int) -> str:
    return f"ttr_{cfg[0]}_{learner}_s{seed}"


def job_groups(cfg: tuple) -> list[tuple[str, str, list[str]]]:
    """(run name, device kind, jobs): stock and patched of seeds 1 and 2 on a 4-GPU host, seed 3
    on a 2-GPU host; every job one GPU and an equal share of the host's whole physical cores
    (run.py's physical_core_groups), which each training's JSON records in its run_note."""
    pair = lambda s: [entry_name(cfg, learner, s) for learner, _ in LEARNERS]  # noqa: E731
    return [(f"ttr_{cfg[0]}_s1_s2_x4", "nvidia-h200-x4", pair(1) + pair(2)),
            (f"ttr_{cfg[0]}_s3_x2", "nvidia-h200-x2", pair(3))]


# The one-GPU kind: one training per entry, so that a call listing a configuration's three seeds
# gives each what the one before left, and seed 1 compiles into a named cache (emptied first) that
# seeds 2 and 3 start from on the same warm machine (run.py's `cache`). Where the three-seed calls
# could not finish them: UniLab's G1 default (never timed at 4096 envs here) and stock's U32 and
# U128 seeds (its cold compile takes 187-238 s of a share; U64 has ttr_u64_1gpu_stock_s{1,2,3}).
ONE_GPU_SEEDED = (("g1_default", ("flashsac_opt", "unilab")), ("u32", ("unilab",)), ("u128", ("unilab",)))
WARM_STARTUP_S = {"unilab": "85,85", "flashsac_opt": "45,45"}  # trainings.py --startup-s for a seed on a warm cache
# run.py's min_limit per entry, (seed 1 on an emptied cache, seeds 2-3 warm): a share too short for
# the seed to finish is skipped for the next call instead of cutting the seed. G1 default: the runs
# of 2026-12-02 (patched 286.3 / 214.3 s, stock 435.0 / 235.3 s, the cold ones with both UniLab
# copies to make); stock U32 / U128, never finished: its first update (cold ~233 s, warm ~80 s)
# plus 1500 iterations of 58 / 151 ms.
ONE_GPU_MIN_LIMIT_S = {("g1_default", "flashsac_opt"): (290, 220), ("g1_default", "unilab"): (440, 240),
                       ("u32", "unilab"): (330, 170), ("u128", "unilab"): (470, 310)}
ONE_GPU_LIMIT_S = 580


def side(learner: str) -> str:
    return "patched" if learner == "flashsac_opt" else "stock"


def one_gpu_entry_name(cfg: tuple, learner: str, seed: int) -> str:
    return f"ttr_{cfg[0]}_1gpu_{side(learner)}_s{seed}"


def one_gpu_entries() -> list[str]:
    q = json.dumps
    configs = {cfg[0]: cfg for cfg in CONFIGS}
    lines = ["", "# One GPU, one training per entry on a named cache (ONE_GPU_SEEDED): list a configuration's",
             "# three seeds in one call and the ones it skipped (min_limit: too little left) in the next, e.g.",
             f"#   python3 experiments/device/run.py {' '.join(one_gpu_entry_name(configs['g1_default'], 'flashsac_opt', s) for s in SEEDS)}"]
    for name, learners in ONE_GPU_SEEDED:
        cfg = configs[name]
        _, u, batch, envs, (replay_n, learning_starts) = cfg
        for learner in learners:
            cache = f"{name}_{side(learner)}"
            who = "patched" if learner == "flashsac_opt" else "stock UniLab"
            # stock's compile on the host's CPUs, as in its three-seed calls
            extra = ["--override=training.torch_threads.compile_threads=16"] if learner == "unilab" else []
            for seed in SEEDS:
                cold = seed == SEEDS[0]
                args = ["--updates", str(u), "--batch", str(batch), "--envs", str(envs), "--iterations", str(ITERATIONS),
                        "--replay-buffer-n", str(replay_n), "--learning-starts", str(learning_starts), "--stop-at-reward", "30",
                        "--no-eval", "--time-limit", "{limit}", "--out", "{out}", "--work", "{work}", *extra,
                        *([] if cold else ["--startup-s", WARM_STARTUP_S[learner]]), f"{learner}:graph:{seed}"]
                where = f"on an emptied named cache ({cache})" if cold else "on the named cache seed 1 filled (warm on the same machine)"
                lines += ["", f"[runs.{one_gpu_entry_name(cfg, learner, seed)}]",
                          f"help = {q(f'time to reward 30, U{u} B{batch} E{envs}, one GPU: {who} graph seed {seed} alone, {where}, {ITERATIONS} iterations at most')}",
                          'script = "experiments/device/trainings.py"',
                          f"args = [{', '.join(q(a) for a in args)}]",
                          f"limit = {ONE_GPU_LIMIT_S}", f"min_limit = {ONE_GPU_MIN_LIMIT_S[name, learner][0 if cold else 1]}",
                          'wheels = "training"', f"cache = {q(cache)}", *(["cold_cache = true"] if cold else []),
                          'env = { TORCHINDUCTOR_MAX_AUTOTUNE_GEMM_BACKENDS = "ATEN", WANDB_MODE = "disabled", HYDRA_FULL_ERROR = "1" }',
                          f"outputs = [{q(training_file(cfg, learner, 'graph', seed))}]", "pack = true"]
    return lines


def toml_entries() -> str:
    q = json.dumps
    lines = [TOML_BEGIN,
             "# Time to reward (experiments/time_to_reward.py): one training per job, cold Inductor cache,",
             f"# {ITERATIONS} iterations at most, no stock eval; the jobs runs put them side by side, one GPU each.",
             "# No log file comes back (a call returns at most 8 files: four JSON and runs.json fill an x4 call);",
             "# trainings.py prints each training's last lines, and a failed one's traceback, to the console."]
    for cfg in CONFIGS:
        name, u, batch, envs, (replay_n, learning_starts) = cfg
        for seed in SEEDS:
            for learner, mode in LEARNERS:
                who = "stock UniLab" if learner == "unilab" else "flashsac_opt"
                args = ["--updates", str(u), "--batch", str(batch), "--envs", str(envs), "--iterations", str(ITERATIONS),
                        "--replay-buffer-n", str(replay_n), "--learning-starts", str(learning_starts), "--no-eval",
                        "--time-limit", "{limit}", "--out", "{out}", "--work", "{work}", f"{learner}:{mode}:{seed}"]
                lines += ["", f"[runs.{entry_name(cfg, learner, seed)}]",
                          f"help = {q(f'time to reward: {who} {mode}, {u} updates per step, batch {batch}, {envs} envs, seed {seed}, {ITERATIONS} iterations')}",
                          'script = "experiments/device/trainings.py"',
                          f"args = [{', '.join(q(a) for a in args)}]",
                          f"limit = {ENTRY_LIMIT_S}", 'wheels = "training"', "cold_cache = true",
                          'env = { TORCHINDUCTOR_MAX_AUTOTUNE_GEMM_BACKENDS = "ATEN", WANDB_MODE = "disabled", HYDRA_FULL_ERROR = "1" }',
                          f"outputs = [{q(training_file(cfg, learner, mode, seed))}]", "log = false"]
        for run, kind, jobs in job_groups(cfg):
            lines += ["", f"[runs.{run}]", f"help = {q(f'time to reward, {name}: {len(jobs)} trainings side by side on {kind}')}",
                      f"jobs = [{', '.join(q(j) for j in jobs)}]", f"limit = {JOBS_LIMIT_S}"]
    return "\n".join(lines + one_gpu_entries() + [TOML_END]) + "\n"


def plan_main(args) -> int:
    if args.toml:
        print(toml_entries(), end="")
        return 0
    print(f"Time-to-reward matrix: {len(CONFIGS)} configurations x {len(LEARNERS)} learners x {len(SEEDS)} seeds, "
          f"{ITERATIONS} iterations at most; device calls in order (one command each, at most {JOBS_LIMIT_S} s):")
    for cfg in CONFIGS:
        _, u, batch, envs, _ = cfg
        for run, kind, jobs in job_groups(cfg):
            print(f"  [{kind}] python3 experiments/device/run.py {run}    # U{u} B{batch} E{envs}: {', '.join(jobs)}")
    print("Check one first: python experiments/device/run.py --dry-run RUN; then summarize the returned JSON:")
    print("  python experiments/time_to_reward.py summarize DIR... --output results/time_to_reward/NAME.json --plot results/time_to_reward/NAME.png")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    s = sub.add_parser("summarize", help="per run and per configuration: start-up, timings, time to reward; JSON and figure")
    s.add_argument("inputs", nargs="+", type=Path, help="training JSON files (.json or .json.gz), or folders of them (training_*.json[.gz])")
    s.add_argument("--last", type=int, default=500, help="iterations at the end of each run the timings are taken over")
    s.add_argument("--output", type=Path, required=True)
    s.add_argument("--plot", type=Path)
    s.add_argument("--markdown", type=Path, help="also write the groups as a Markdown table (medians over seeds, seeds reached, runs cut)")
    p = sub.add_parser("plan", help="the device calls of the run matrix, in order")
    p.add_argument("--toml", action="store_true", help="print the runs.toml entries instead")
    args = parser.parse_args(argv)
    if args.command == "plan":
        return plan_main(args)
    return summarize_main(args, parser)


if __name__ == "__main__":
    sys.exit(main())
