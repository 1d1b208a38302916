"""Real UniLab FlashSAC training (MuJoCo or Motrix) with UniLab's or flashsac_opt's learner.

Runs UniLab's own `train --algo flashsac` (its live Rich panel stays on the terminal), then reads
the run's TensorBoard events and writes JSON: rows_all (every iteration's wall_s since launch,
learner_train_ms = UniLab's Perf/learning_time, collector_cycle_ms = its cycle phases summed as
its panel does, iter_ms = Perf/iteration_time, reward); rows, the summarized tail (--summary-last
N, or all after --skip-first N), with mean / median / p90 / p95 of each timing; training_config;
environment; command; for flashsac_opt's learner startup_timeline (seconds from launch to its
construction, start-up compile, first update); with --stack-samples S startup_stacks (where each
Python process of the training spent its time until the first update); host_load (Linux: the
CPU each process of the training used from its first update on, and what ran outside it).

    python experiments/benchmark_flashsac_training.py --learner flashsac_opt --mode graph \\
        --num-envs 256 --batch-size 256 --updates-per-step 8 --iterations 1000 --summary-last 500 \\
        --output results/trainings/training_u8_b256_flashsac_opt_graph_s1.json

--time-limit S interrupts the training as Ctrl-C would (UniLab shuts down cleanly and keeps its
events) and summarizes what was logged within the limit, at most its second half
(`stopped_by_time_limit`; a run stopped before its first update writes its JSON with no rows and
exits 2); --save-interval N
checkpoints so a stopped run still leaves one. --stop-at-reward R stops it the same way once the
20-iteration moving mean of Train/mean_reward reaches R (`stopped_at_reward`; events are polled
every few seconds, so it runs a few iterations past the crossing).

`--learner flashsac_opt` needs a patched UniLab (`flashsac-opt unilab apply [--root PATH]`).
`--compile` (default) runs each learner's best mode (UniLab: its whole-cycle graph; flashsac_opt:
graph); `--no-compile` the deferred-eager baseline; `--mode` picks exactly. Without CUDA the run
uses the CPU (needs `flashsac-opt unilab apply --with-cpu-smoke`).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable

from common import REWARD_WINDOW, moving_mean, percentile, run_environment, sigint_default_in_child
from report import startup_stacks
from report.host_load import HostLoad

REPO = Path(__file__).resolve().parents[1]
# UniLab's collector cycle phases (rl/logging/offpolicy.py, role "cycle_phase"); used when
# that private table cannot be imported.
FALLBACK_CYCLE_KEYS = ("inference_request_ms", "learner_action_wait_ms", "env_step_ms", "transition_extract_ms", "replay_write_ms", "metrics_publish_ms")


def fail(message: str) -> None:
    print(f"benchmark_flashsac_training: error: {message}", file=sys.stderr)
    raise SystemExit(2)


def summarize(values: list[float]) -> dict[str, float] | None:
    if not values:
        return None
    return {
        "mean": statistics.fmean(values), "median": statistics.median(values),
        "p90": percentile(values, 0.9), "p95": percentile(values, 0.95), "count": len(values),
    }


def overrides_for(args: argparse.Namespace, log_root: Path, scene: str | None) -> list[str]:
    out = [
        f"algo.num_envs={args.num_envs}",
        f"algo.batch_size={args.batch_size}",
        f"algo.replay_buffer_n={args.replay_buffer_n}",
        f"algo.learning_starts={args.learning_starts}",
        f"algo.updates_per_step={args.updates_per_step}",
        f"algo.policy_frequency={args.policy_frequency}",
        f"algo.max_iterations={args.iterations}",
        f"algo.save_interval={args.save_interval or args.iterations}",
        f"algo.seed={args.seed}",
        "training.no_play=true",
        "training.log_interval=1",
        f"training.log_root={log_root}",
    ]
    if args.learner == "unilab":
        flags = {
            "eager": ("false", "false", "false"),
            "compile": ("true", "true", "false"),
            "graph": ("true", "true", "true"),
        }[args.mode]
        out += [
            f"algo.algo_params.use_compile={flags[0]}",
            f"algo.algo_params.compile_full_objectives={flags[1]}",
            f"algo.algo_params.use_whole_cycle_cuda_graph={flags[2]}",
        ]
    else:
        out += ["algo.algo_params.learner_impl=flashsac_opt", f"algo.algo_params.learner_mode={args.mode}"]
    if scene:
        out.append(f"env.scene.model_file={scene}")
    return out + list(args.override)


def inductor_cache_at_launch() -> dict:
    """Inductor's on-disk cache as the training will find it: with files in it, compile time
    (hence the first update's time from launch) is a warm start, not a cold one. The training
    inherits this process's environment, so TORCHINDUCTOR_CACHE_DIR resolves the same."""
    try:
        from torch._inductor.runtime.cache_dir_utils import cache_dir
        directory = Path(cache_dir())
    except ImportError:  # (moved in some torch; this is its documented default)
        import getpass
        directory = Path(os.environ.get("TORCHINDUCTOR_CACHE_DIR") or Path(tempfile.gettempdir()) / f"torchinductor_{getpass.getuser()}")
    files = sum(1 for f in directory.rglob("*") if f.is_file()) if directory.is_dir() else 0
    return {"dir": str(directory), "files": files, "warm": files > 0}


class RewardWatch:
    """Reads a training's TensorBoard events as they are written and says whether the moving
    mean of Train/mean_reward has reached a threshold. UniLab's writer appends each event to
    the file as it logs it, so the events lag the training by a few iterations at most."""

    TAG = "Train/mean_reward"

    def __init__(self, log_root: Path, threshold: float, window: int = REWARD_WINDOW):
        self.log_root, self.threshold, self.window = log_root, threshold, window
        self.events = None  # one accumulator: each Reload reads only what was appended since the last

    def reached(self) -> bool:
        from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

        if self.events is None:
            found = sorted(self.log_root.glob("*/*/events.out.tfevents.*"))
            if not found:
                return False  # UniLab has not made its run directory yet
            self.events = EventAccumulator(str(found[-1].parent), size_guidance={"scalars": 0})
        self.events.Reload()
        if self.TAG not in self.events.Tags()["scalars"]:
            return False
        rewards = [e.value for e in sorted(self.events.Scalars(self.TAG), key=lambda e: e.step)]
        means = moving_mean(rewards[-self.window:], self.window)
        return bool(means) and means[-1] >= self.threshold


STARTUP_EVENTS = "startup_events.jsonl"  # under --log-root; flashsac_opt's learner writes it (adapter.STARTUP_EVENTS_ENV)


def startup_timeline(path: Path, launched: float) -> dict | None:
    """Seconds from launch to each start-up milestone flashsac_opt's learner logged (its first
    occurrence; with data parallel, the first rank's), with what the milestone carried (e.g.
    the compile-ahead child's seconds and the first update's wait for it). None for a run that
    logged none (stock UniLab's learner)."""
    if not path.exists():
        return None
    timeline: dict = {}
    for line in path.read_text().splitlines():
        try:
            event = json.loads(line)
        except json.JSONDecodeError:  # a line cut by a killed process
            continue
        name = event.pop("event", None)
        if not name or name == RANK_END_EVENT or f"{name}_s" in timeline:
            continue
        timeline[f"{name}_s"] = round(event.pop("time") - launched, 3)
        event.pop("pid", None)
        if event:
            timeline[name] = event
    return timeline


RANK_END_EVENT = "rank_end_state"  # a data-parallel rank's state digests at shutdown (the adapter)


def data_parallel_end(path: Path) -> dict | None:
    """The ranks' end-state digests a data-parallel flashsac_opt run logged at shutdown:
    {world_size, ranks: [{rank, state_digest, networks_digest}], ranks_equal}; ranks_equal is
    True only when every rank of the world logged one and all agree. None without any."""
    if not path.exists():
        return None
    ranks: dict[int, dict] = {}
    for line in path.read_text().splitlines():
        try:
            event = json.loads(line)
        except json.JSONDecodeError:
            continue
        if event.get("event") == RANK_END_EVENT:
            ranks[event["rank"]] = {k: event[k] for k in ("rank", "world_size", "state_digest", "networks_digest")}
    if not ranks:
        return None
    world = max(r["world_size"] for r in ranks.values())
    ends = [ranks[r] for r in sorted(ranks)]
    same = {(r["state_digest"], r["networks_digest"]) for r in ends}
    return {"world_size": world, "ranks": ends, "ranks_equal": len(ends) == world and len(same) == 1}


def describe_timeline(timeline: dict | None) -> str:
    if not timeline:
        return "no start-up milestones logged"
    return ", ".join(f"{k[:-2].replace('_', ' ')} {v:.1f} s" for k, v in timeline.items() if k.endswith("_s"))


def run_training(command: list[str], env: dict, cwd: Path, time_limit: float | None,
                 watch: RewardWatch | None = None, poll_s: float = 5.0,
                 on_start: Callable[[int], object] | None = None) -> tuple[int, str | None]:
    """Run UniLab's train; past time_limit, or once ``watch`` sees its reward, interrupt it as
    Ctrl-C would; on_start gets the training's process id. -> (exit status, None or why it was
    stopped: "time_limit" or "reward")."""
    # Own process group: the interrupt reaches UniLab's collector processes too, as a
    # terminal's Ctrl-C does, and UniLab's cooperative shutdown closes its event writers.
    proc = subprocess.Popen(command, env=env, cwd=cwd, start_new_session=True, preexec_fn=sigint_default_in_child())
    if on_start is not None:
        on_start(proc.pid)
    deadline = None if time_limit is None else time.monotonic() + time_limit
    while True:
        left = None if deadline is None else max(deadline - time.monotonic(), 0.0)
        wait = left if watch is None else poll_s if left is None else min(poll_s, left)
        try:
            return proc.wait(timeout=wait), None
        except subprocess.TimeoutExpired:
            pass
        if deadline is not None and time.monotonic() >= deadline:
            reason = "time_limit"
            print(f"benchmark_flashsac_training: --time-limit {time_limit:g} s reached: interrupting the training", file=sys.stderr, flush=True)
            break
        if watch is not None and watch.reached():
            reason = "reward"
            print(f"benchmark_flashsac_training: the {watch.window}-iteration mean of {watch.TAG} reached {watch.threshold:g}:"
                  " interrupting the training", file=sys.stderr, flush=True)
            break
    for sig, grace in ((signal.SIGINT, 60), (signal.SIGKILL, 10)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            break
        try:
            return proc.wait(timeout=grace), reason
        except subprocess.TimeoutExpired:
            continue
    return proc.wait(), reason


# Where the iteration goes beside the learning, per row where UniLab logged it: the learner
# process serving the collector's inference (serial with the learning), and the collector's
# environment phases (UniLab's Perf tags; values in ms).
DETAIL_TAGS = {
    # the learner's phases beside the learning (UniLab's SAC-family profile: mutually exclusive,
    # with the learning they make up the iteration), so the iteration's gap can be read whole
    "collector_wait_ms": "Perf/learner_collector_wait_ms",
    "inference_ms": "Perf/learner_inference_ms",
    "collector_release_ms": "Perf/learner_collector_release_ms",
    "replay_batch_wait_ms": "Perf/learner_replay_batch_wait_ms",
    "replay_sample_ms": "Perf/learner_replay_sample_ms",
    "inference_forward_ms": "Perf/learner_inference_forward_ms",
    "inference_h2d_ms": "Perf/learner_inference_h2d_ms",  # the inference's other two parts: observations in,
    "inference_d2h_ms": "Perf/learner_inference_d2h_ms",  # actions out (this one waits for the forward)
    # the collector's side: waiting for the learner's actions, and its whole environment step
    "collector_action_wait_ms": "Perf/collector_learner_action_wait_ms",
    "collector_env_step_ms": "Perf/collector_env_step_ms",
    "collector_update_state_ms": "Perf/collector_env_step_update_state_ms",
    "collector_reset_done_ms": "Perf/collector_env_step_reset_done_ms",
    # stock UniLab data parallel: its gradient all-reduces' GPU time per rank (its own events)
    "dp_gradient_sync_ms": "Perf/dp_gradient_sync_ms_per_rank",
}


def read_rows(run_dir: Path, launched: float | None = None) -> list[dict]:
    """One row per learner iteration; wall_s = seconds from the training's launch (start-up
    and compile included) to that iteration's Perf/learning_time event."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    try:
        from unilab.rl.logging.offpolicy import _OFFPOLICY_COLLECTOR_CYCLE_KEYS as cycle_keys  # noqa: PLC2701
    except ImportError:
        cycle_keys = FALLBACK_CYCLE_KEYS
    events = EventAccumulator(str(run_dir), size_guidance={"scalars": 0})
    events.Reload()
    tags = set(events.Tags()["scalars"])

    def series(tag: str) -> dict[int, float]:
        return {e.step: e.value for e in events.Scalars(tag)} if tag in tags else {}

    learn, iteration = series("Perf/learning_time"), series("Perf/iteration_time")
    learn_wall = {e.step: e.wall_time for e in events.Scalars("Perf/learning_time")} if "Perf/learning_time" in tags else {}
    reward, it_index = series("Train/mean_reward"), series("Train/iteration")
    cycle_parts = [series(f"Perf/collector_{k}") for k in cycle_keys]
    details = {key: series(tag) for key, tag in DETAIL_TAGS.items()}
    rows = []
    for step in sorted(learn):
        row = {"env_steps": step, "learner_train_ms": learn[step] * 1e3}
        if launched is not None:
            row["wall_s"] = learn_wall[step] - launched
        if step in it_index:
            row["iteration"] = int(it_index[step])
        if step in iteration:
            row["iter_ms"] = iteration[step] * 1e3
        if cycle_parts and all(step in part for part in cycle_parts):
            row["collector_cycle_ms"] = sum(part[step] for part in cycle_parts)
        if step in reward:
            row["reward"] = reward[step]
        row.update({key: values[step] for key, values in details.items() if step in values})
        rows.append(row)
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--unilab-root", help="UniLab checkout or package dir (default: the installed unilab)")
    parser.add_argument("--backend", choices=["mujoco", "motrix"], default="mujoco")
    parser.add_argument("--task", default="g1_walk_flat")
    parser.add_argument("--iterations", type=int, default=1000)
    tail = parser.add_mutually_exclusive_group()
    tail.add_argument("--summary-last", type=int, default=500, help="summarize the last N iterations")
    tail.add_argument("--skip-first", type=int, help="summarize everything after the first N iterations")
    parser.add_argument("--num-envs", type=int, default=256)
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--replay-buffer-n", type=int, default=32)
    parser.add_argument("--learning-starts", type=int, default=8)
    parser.add_argument("--updates-per-step", type=int, default=2)
    parser.add_argument("--policy-frequency", type=int, default=2)
    parser.add_argument("--compile", dest="compile", action="store_true", default=True, help="best mode of the learner (default)")
    parser.add_argument("--no-compile", dest="compile", action="store_false", help="deferred-eager baseline (--mode eager)")
    parser.add_argument("--learner", choices=["unilab", "flashsac_opt"], default="unilab")
    parser.add_argument("--mode", choices=["eager", "compile", "graph"], help="learner mode (default: graph with --compile, eager with --no-compile)")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--model-file", help="override env.scene.model_file (needed with an installed UniLab: the absolute path of scene_flat.xml)")
    parser.add_argument("--log-root", type=Path, help="where UniLab writes the run (default: a temp dir)")
    parser.add_argument("--override", action="append", default=[], help="extra Hydra override (repeatable)")
    parser.add_argument("--save-interval", type=int, help="checkpoint every N iterations (default: once, at the end)")
    parser.add_argument("--time-limit", type=float, metavar="SECONDS",
                        help="stop the training after this long (Ctrl-C semantics, as UniLab handles it) and summarize what it logged")
    parser.add_argument("--stop-at-reward", type=float, metavar="R",
                        help=f"interrupt the training once the {REWARD_WINDOW}-iteration moving mean of Train/mean_reward reaches R")
    parser.add_argument("--stack-samples", type=float, metavar="SECONDS",
                        help="sample the Python stacks of train and every process it starts every SECONDS for their first "
                             "--stack-samples-for seconds (report/startup_stacks.py): where the start-up goes (startup_stacks)")
    parser.add_argument("--stack-samples-for", type=float, default=300.0, metavar="SECONDS")
    parser.add_argument("--host-load", type=float, default=1.0, metavar="SECONDS",
                        help="sample /proc every SECONDS (0: off) for the CPU the training's processes and everything else "
                             "on the host used (report/host_load.py; host_load in the JSON)")
    parser.add_argument("--output", type=Path, required=True)
    args = parser.parse_args(argv)
    if args.time_limit is not None and args.time_limit <= 0:
        parser.error("--time-limit must be > 0")
    for name in ("iterations", "num_envs", "batch_size", "updates_per_step", "policy_frequency", "replay_buffer_n", "save_interval"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1")
    args.mode = args.mode or ("graph" if args.compile else "eager")

    from flashsac_opt.unilab import patch as unilab_patch

    try:
        base = unilab_patch.locate_unilab(args.unilab_root)
        report = unilab_patch.status(args.unilab_root)
    except unilab_patch.PatchError as exc:
        fail(str(exc))
    states = {p["name"]: p["state"] for p in report["patches"]}
    import torch

    device = "cuda" if torch.cuda.is_available() else "cpu"
    root_hint = f" --root {args.unilab_root}" if args.unilab_root else ""
    if args.learner == "flashsac_opt" and states.get("0001-flashsac-opt-learner") != "applied":
        fail(f"UniLab at {report['unilab_dir']} is not patched for flashsac_opt: run `flashsac-opt unilab apply{root_hint}`")
    if device == "cpu":
        if states.get("0002-cpu-offpolicy-smoke") != "applied":
            fail(f"no CUDA device, and UniLab refuses CPU off-policy runs: run `flashsac-opt unilab apply --with-cpu-smoke{root_hint}`")
        if args.mode == "graph":
            fail("no CUDA device: --mode graph needs one (use --mode eager or compile)")

    log_root = (args.log_root or Path(tempfile.mkdtemp(prefix="flashsac_training_"))).resolve()
    log_root.mkdir(parents=True, exist_ok=True)
    scene = args.model_file
    if scene is None and args.task.startswith("g1"):
        # The task config's model_file is relative to a source checkout's root; an absolute
        # path works for a checkout and for an installed package alike.
        scene = str(base / "unilab" / "assets" / "robots" / "g1" / "scene_flat.xml")
    overrides = overrides_for(args, log_root, scene)
    env = dict(os.environ, WANDB_MODE="disabled", PYTHONPATH=os.pathsep.join([str(base), str(REPO), os.environ.get("PYTHONPATH", "")]))
    if device == "cpu":
        env["CUDA_VISIBLE_DEVICES"] = ""
    code = "import sys; from unilab.cli import train_main; sys.argv = ['train'] + sys.argv[1:]; train_main()"
    command = [sys.executable, "-c", code, "--algo", "flashsac", "--task", args.task, "--sim", args.backend, *overrides]
    # UniLab's Rich panel goes straight to this terminal: the run's progress display.
    # cwd: Hydra writes train_flashsac.log into the working directory; keep it with the run.
    events = log_root / STARTUP_EVENTS
    events.unlink(missing_ok=True)
    env["FLASHSAC_OPT_STARTUP_EVENTS"] = str(events)
    stacks = log_root / "stack_samples"
    if args.stack_samples:
        startup_stacks.enable(env, stacks, args.stack_samples, args.stack_samples_for)
    cache = inductor_cache_at_launch()
    launched = time.time()
    watch = None if args.stop_at_reward is None else RewardWatch(log_root, args.stop_at_reward)
    load = HostLoad(interval_s=args.host_load) if args.host_load > 0 and HostLoad.available() else None
    returncode, stop_reason = run_training(command, env, log_root, args.time_limit, watch,
                                           on_start=None if load is None else load.start)
    stopped = stop_reason == "time_limit"
    runs = sorted(log_root.glob("*/*/events.out.tfevents.*"))
    if (returncode != 0 and stop_reason is None) or (not runs and not stopped):
        fail(f"UniLab training did not produce TensorBoard events under {log_root} (exit status {returncode})")
    # no events yet: the time limit came during UniLab's own start (reported below as no rows)
    run_dir = runs[-1].parent if runs else None
    rows_all = read_rows(run_dir, launched) if run_dir is not None else []
    past_limit = 0
    if stopped:
        # Only what the training did within its limit is its run: a Ctrl-C that Python swallowed
        # ("Exception ignored in" a weakref callback, as one CI run printed) leaves it learning
        # until the SIGKILL 60 s later, and those iterations would count as if within the limit.
        within = [r for r in rows_all if r["wall_s"] <= args.time_limit]
        past_limit, rows_all = len(rows_all) - len(within), within
    timeline = startup_timeline(events, launched)
    # the host from the first update on (the start-up's own CPU use is in startup_stacks)
    host_load = None if load is None else load.stop(launched, since_s=rows_all[0]["wall_s"] if rows_all else 0.0,
                                                   until_s=rows_all[-1]["wall_s"] if rows_all else None)
    stack_report = switch_stacks = None
    if args.stack_samples:  # where each process was until the first update (all of it when there was none)
        until = (timeline or {}).get("first_update_start_s") or (rows_all[0]["wall_s"] if rows_all else None)
        stack_report = startup_stacks.summarize(stacks, launched, until)
        if {"compile_ahead_done_s", "background_compile_switched_s"} <= (timeline or {}).keys():
            # the background switch (compile from the child's caches while training waits), frames inside torch
            switch_stacks = startup_stacks.summarize(stacks, launched, timeline["background_compile_switched_s"],
                                                     since_s=timeline["compile_ahead_done_s"], namer=startup_stacks.name_in_library)
        if not rows_all:
            for proc in stack_report:
                print(f"stack samples, process started at {proc['started_s']} s ({proc['cmd'][:80]}): "
                      + "; ".join(f"{w} {s} s" for w, s in proc["seconds_by_where"][:6]), file=sys.stderr)
    no_update = f"UniLab training logged no learner iteration under {run_dir or log_root} (stopped by the time limit: {stopped}); " \
                f"start-up since launch: {describe_timeline(timeline)}"
    if not rows_all and not stopped:
        fail(no_update)
    last = None
    if not rows_all:
        # The time limit came before the first update (a cold compile that took the whole
        # share): the report is still written, with no rows, so that a seed which never got
        # to learn counts as one that reached nothing instead of vanishing; the script fails.
        rows = []
    elif args.skip_first is not None:
        rows = rows_all[args.skip_first :]
    else:
        last = args.summary_last
        if stopped and last > len(rows_all) // 2:
            # A run cut short would otherwise summarize its compile/capture iterations too:
            # keep the summary to the second half of what it logged.
            last = max(len(rows_all) // 2, 1)
        rows = rows_all[-last:] if last > 0 else rows_all
    # A run that neither reached its last iteration nor was stopped by --time-limit ended
    # early (UniLab exits 0 after some learner-side failures): its JSON says so and the
    # script fails, so that a crash is never summarized as a finished run.
    last_iteration = rows_all[-1].get("iteration", len(rows_all)) if rows_all else 0
    completed = stop_reason is not None or last_iteration >= args.iterations  # (stopped, not crashed)
    u, pf = args.updates_per_step, args.policy_frequency
    actor_updates = len(range(0, u, pf))
    result = {
        "experiment": "benchmark_flashsac_training",
        "learner": args.learner,
        "mode": args.mode,
        "backend": args.backend,
        "task": args.task,
        "run_dir": str(run_dir) if run_dir is not None else None,
        "training_config": {
            "num_envs": args.num_envs,
            "batch_size": args.batch_size,
            "iterations": args.iterations,
            "updates_per_step": u,
            "policy_frequency": pf,
            "critic_updates_per_iteration": u,
            "actor_updates_per_iteration": actor_updates,
            "temperature_updates_per_iteration": actor_updates,
            "replay_buffer_n": args.replay_buffer_n,
            "learning_starts": args.learning_starts,
            "seed": args.seed,
        },
        "summary": {"skip_first": args.skip_first, "summary_last": last},
        # A run the time limit stopped is summarized over the iterations it logged.
        "time_limit_s": args.time_limit,
        "stopped_by_time_limit": stopped,
        "stop_at_reward": args.stop_at_reward,
        "stopped_at_reward": stop_reason == "reward",
        "iterations_logged": len(rows_all),
        "iterations_logged_past_time_limit": past_limit,  # logged after the limit: not in rows_all
        "completed": completed,
        "unilab_exit_status": returncode,
        # warm: an earlier compile left Inductor's cache non-empty, so the first update's
        # wall_s is a warm start (28-30 s on the H200 against 100-140 s cold for graph mode)
        "inductor_cache_at_launch": cache,
        # seconds from launch to flashsac_opt's start-up milestones (learner constructed, the
        # start-up compile in prepare_for_collection, the first update's start and end): UniLab's
        # own start against the compile and capture; None for stock UniLab
        "startup_timeline": timeline,
        # --stack-samples: per process, where its main thread was until the first update
        "startup_stacks": stack_report,
        # --stack-samples with compile ahead in the background: the switch, frames inside torch
        "switch_stacks": switch_stacks,
        "host_load": host_load,
        # data-parallel flashsac_opt: every rank's end-state digest (equal = bit-identical ranks)
        "data_parallel": data_parallel_end(events),
        # NCCL settings exported to the training (UniLab 1.5.2 sets NCCL_P2P_DISABLE and
        # NCCL_SHM_DISABLE to 1 where these do not name them: all-reduces over TCP loopback)
        "nccl_exported": {k: v for k, v in sorted(os.environ.items()) if k.startswith("NCCL_")},
        "timed": {
            "learner_train_ms": "UniLab Perf/learning_time: update phase + metrics read + stream synchronize",
            "collector_cycle_ms": "sum of the collector's cycle-phase timings (Perf/collector_*), as UniLab's panel",
            "iter_ms": "UniLab Perf/iteration_time: runner iteration wall time",
            "wall_s": "per row: seconds from launching UniLab's train to that iteration's learner event (start-up and compile included)",
        },
        "learner_train_ms": summarize([r["learner_train_ms"] for r in rows]),
        "collector_cycle_ms": summarize([r["collector_cycle_ms"] for r in rows if "collector_cycle_ms" in r]),
        "iter_ms": summarize([r["iter_ms"] for r in rows if "iter_ms" in r]),
        # beside the learning (DETAIL_TAGS): None where UniLab did not log it
        **{key: summarize([r[key] for r in rows if key in r]) for key in DETAIL_TAGS},
        "rows_all": rows_all,
        "rows": rows,
        "environment": run_environment(device, packages=("unilab", "flashsac-opt", "mujoco")),
        "unilab_patches": states,
        "command": " ".join(["python", *sys.argv]),
        "unilab_command": " ".join(command[3:]),
    }
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(result, indent=1))
    if not rows_all:
        fail(f"{no_update}; its report (no rows): {args.output}")
    lt = result["learner_train_ms"] or {}
    print(f"{args.learner}/{args.mode}: learner {lt.get('median', float('nan')):.2f} ms median over {len(rows)} iterations -> {args.output}")
    if not completed:
        print(
            f"benchmark_flashsac_training: error: UniLab's training ended at iteration {last_iteration} of {args.iterations}"
            f" without reaching --time-limit (exit status {returncode}); see its output above",
            file=sys.stderr,
        )
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
