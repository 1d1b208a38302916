"""Shared command-line and JSON plumbing of the experiments (imported by every script)."""

from __future__ import annotations

import argparse
import gzip
import json
import signal
from pathlib import Path
from typing import Callable


def percentile(values: list[float], q: float) -> float:
    """The q-quantile (0..1) of ``values``, linearly interpolated between order statistics."""
    ordered = sorted(values)
    k = (len(ordered) - 1) * q
    lo, hi = int(k), min(int(k) + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (k - lo)


# A training's JSON report holds every iteration's row (0.4-1.8 MB): results/ keeps them gzip-compressed
# (`gzip -9n`), as the working tree travels to the GPU machine with every call. Readers take either
# form; a report is named by its .json name either way.
TRAINING_REPORTS = ("training_*.json", "training_*.json.gz")


def read_json(path: Path | str):
    """A JSON file, plain or gzip-compressed (``.gz``)."""
    path = Path(path)
    if path.suffix == ".gz":
        with gzip.open(path, "rt", encoding="utf-8") as f:
            return json.load(f)
    return json.loads(path.read_text())


def report_name(path: Path | str) -> str:
    """A report's file name as summaries record it: without a compression suffix."""
    return Path(path).name.removesuffix(".gz")


def training_reports(folder: Path) -> list[Path]:
    """The training JSON reports in ``folder``, plain or compressed, in name order (one per name)."""
    found = {report_name(f): f for pattern in TRAINING_REPORTS for f in folder.glob(pattern)}
    return [found[name] for name in sorted(found)]


# Time to reward's window: a threshold counts as reached when the mean of Train/mean_reward over
# this many consecutive logged iterations reaches it (time_to_reward.py, and the training's stop
# at a reward in benchmark_flashsac_training.py).
REWARD_WINDOW = 20


def moving_mean(values: list[float], window: int = REWARD_WINDOW) -> list[float]:
    """The mean of each full window of ``window`` consecutive values (len(values) - window + 1
    of them; none for a shorter series): entry k ends at values[k + window - 1]."""
    import numpy as np

    if len(values) < window:
        return []
    sums = np.cumsum(np.concatenate([[0.0], np.asarray(values, dtype=float)]))
    return ((sums[window:] - sums[:-window]) / window).tolist()


def cuda_event_ms(fn: Callable[[], object], warmup: int, repeat: int) -> list[float]:
    """Milliseconds of each of ``repeat`` calls of ``fn`` on the current CUDA stream, timed with
    device events after ``warmup`` untimed ones."""
    import torch

    times = []
    for i in range(warmup + repeat):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        if i >= warmup:
            times.append(start.elapsed_time(end))
    return times


def run_environment(device: str, packages: tuple[str, ...] = ()) -> dict:
    """Where and when a result was measured (stored in every experiment's JSON), with the
    installed versions of ``packages`` (None: not installed)."""
    import datetime
    import importlib.metadata as md
    import platform

    import torch

    def version(name: str) -> str | None:
        try:
            return md.version(name)
        except md.PackageNotFoundError:
            return None

    return {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "device": device,
        "gpu": torch.cuda.get_device_name(0) if device == "cuda" else None,
        "torch": torch.__version__,
        "python": platform.python_version(),
        **host_share(),
        **{name: version(name) for name in packages},
        "bytecode_cached": bytecode_cached(),
    }


# The packages a training's processes import at start-up (their bytecode state goes into each report)
BYTECODE_PACKAGES = ("torch", "unilab", "flashsac_opt", "hydra", "omegaconf", "mujoco", "numpy")


def bytecode_cached(packages: tuple[str, ...] = BYTECODE_PACKAGES) -> dict[str, float | None]:
    """Per package, the share of its modules with a cached .pyc no older than the source, where
    this interpreter looks for it (None: not installed). pip writes them at install; wheels
    installed with --no-compile under PYTHONDONTWRITEBYTECODE=1 (the device machines set it)
    have none, and then every process compiles every module it imports at every launch, which
    no user's pip install does."""
    import importlib.util
    import os

    shares: dict[str, float | None] = {}
    for name in packages:
        folder = package_dir(name)
        if folder is None:
            shares[name] = None
            continue
        total = cached = 0
        for root, _, files in os.walk(folder):
            for file in files:
                if file.endswith(".py"):
                    source = os.path.join(root, file)
                    total += 1
                    pyc = importlib.util.cache_from_source(source)
                    cached += os.path.exists(pyc) and os.path.getmtime(pyc) >= os.path.getmtime(source)
        shares[name] = round(cached / total, 3) if total else None
    return shares


def package_dir(name: str) -> Path | None:
    """The folder of the installed package ``name`` (None: not installed, or a single module)."""
    import importlib.util

    spec = importlib.util.find_spec(name)
    return Path(next(iter(spec.submodule_search_locations))) if spec is not None and spec.submodule_search_locations else None


def compile_bytecode(*paths: Path) -> float:
    """Write the .pyc of every module under ``paths``, as pip does at install (all CPUs); ->
    seconds. A run's start-up then reads bytecode as on a user's machine."""
    import subprocess
    import sys
    import time

    start = time.perf_counter()
    # not checked: compileall exits 1 for any file that does not compile (templates, py2 leftovers)
    subprocess.run([sys.executable, "-m", "compileall", "-q", "-j", "0", *map(str, paths)], stdout=subprocess.DEVNULL)
    return time.perf_counter() - start


def collector_start_wait_s(timeline: dict) -> float | None:
    """The runner's wait for its collector's ready signal, from a training's start-up timeline
    (patches/0004's polls: the start-up compile runs inside it); None where it was not recorded."""
    if {"collector_start_wait_s", "collector_start_wait_end_s"} <= timeline.keys():
        return timeline["collector_start_wait_end_s"] - timeline["collector_start_wait_s"]
    return None


def host_share() -> dict:
    """What of the host this process had (cores, GPUs, MPS), and FLASHSAC_RUN_NOTE, a note
    whoever started it left (the device driver's side-by-side jobs did, up to commit 2f362b4)."""
    import os

    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return {
        "cpu_cores": os.cpu_count(),
        "cpu_cores_usable": usable,
        "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
        "run_note": os.environ.get("FLASHSAC_RUN_NOTE", ""),
        # set where a CUDA MPS daemon serves this process's contexts (experiments/device/with_mps.py)
        "cuda_mps_pipe_directory": os.environ.get("CUDA_MPS_PIPE_DIRECTORY"),
        # flashsac_opt's environment switches as the run had them (unset: the default)
        "flashsac_opt_switches": {k: os.environ.get(k) for k in ("FLASHSAC_OPT_COMPILE_AHEAD", "FLASHSAC_OPT_COMPILE_AHEAD_SPLIT", "FLASHSAC_OPT_CAPTURE_EXPLORE",
                                                                "FLASHSAC_OPT_PRECOMPILED_STEPS", "FLASHSAC_OPT_COMPILE_AHEAD_PRESPAWN",
                                                                "FLASHSAC_OPT_COLLECTOR_PRELOAD_COMPILER", "FLASHSAC_OPT_UPDATE_RUNS_AHEAD",
                                                                "FLASHSAC_OPT_COLLECTOR_SPARE_CPUS", "FLASHSAC_OPT_BLOCKING_SYNC")}
        | {"FLASHSAC_OPT_COLLECTOR_EAGER": os.environ.get("FLASHSAC_OPT_COLLECTOR_EAGER", "auto")},  # unset is "auto" since 2026-12-07
    }


def add_output_arguments(parser: argparse.ArgumentParser) -> None:
    """--output JSON, --plot figure and --plot-only (redraw a figure from an existing JSON)."""
    parser.add_argument("--output", type=Path)
    parser.add_argument("--plot", type=Path)
    parser.add_argument("--plot-only", type=Path, help="redraw --plot from an existing JSON and exit")


def plot_only(parser: argparse.ArgumentParser, args: argparse.Namespace, plot: Callable) -> bool:
    """Handle --plot-only: redraw --plot from an existing JSON (returns True: done)."""
    if not args.plot_only:
        return False
    if not args.plot:
        parser.error("--plot-only needs --plot PATH")
    plot(json.loads(args.plot_only.read_text()), args.plot)
    return True


def plot_only_or_require_cuda(parser: argparse.ArgumentParser, args: argparse.Namespace, plot: Callable) -> bool:
    """Handle --plot-only (returns True: done) or fail cleanly without a CUDA device."""
    if plot_only(parser, args, plot):
        return True
    import torch

    if not torch.cuda.is_available():
        parser.error("this benchmark needs a CUDA device")
    return False


def write_report(report: dict, output, plot: Callable | None = None, plot_path=None) -> None:
    """The experiment's JSON (with the command line that made it) and, if asked, its figure."""
    import sys

    report.setdefault("command", " ".join(["python", *sys.argv]))
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(json.dumps(report, indent=1))
    if plot is not None and plot_path:
        plot(report, plot_path)


def load_replay_file(parser: argparse.ArgumentParser, path) -> dict:
    """A recorded replay file (FLASHSAC_OPT_RECORD_REPLAY), or a one-line parser error."""
    import torch

    if not path.is_file():
        parser.error(f"replay file {path} not found (record one: FLASHSAC_OPT_RECORD_REPLAY=PATH:N)")
    recorded = torch.load(path, weights_only=True)
    if not isinstance(recorded, dict) or recorded.get("format") != "flashsac_opt.replay/1":
        parser.error(f"{path} is not a flashsac_opt replay file")
    return recorded


def sigint_default_in_child() -> Callable[[], None] | None:
    """A preexec_fn giving a child SIGINT's default disposition, or None when this process's SIGINT
    is not ignored (a background job of a non-interactive shell has it ignored, and so would its
    children: the stop at a limit, SIGINT first so a script saves, would fall through)."""
    if signal.getsignal(signal.SIGINT) != signal.SIG_IGN:
        return None
    return lambda: signal.signal(signal.SIGINT, signal.SIG_DFL)
