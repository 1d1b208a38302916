"""One driver for the device (GPU machine) runs declared in runs.toml beside this file.

On the device, one call (its command line is limited to 2000 characters):
    python3 experiments/device/run.py env gpu_tests_parallel6
Here, on the CPU machine:
    python experiments/device/run.py --list
    python experiments/device/run.py --dry-run RUN...       # the exact commands and what to carry
    python experiments/device/run.py --fetch-wheels learner|training   # cp312 wheels into .whl/
    python experiments/device/run.py --prepare-baseline COMMIT         # that commit's code into .baseline/

On the device every run gets: the carried wheels installed once into .device_work/site (where
the run needs them), NVLink multicast off (it can take a shared host's GPUs out of service),
unbuffered Python, an Inductor cache under .device_work/ (or a fresh empty one), a time
limit after which it is stopped and what it wrote still comes back. $OUT gets runs.json
(each run's command, environment, limit, exit status, seconds, outputs), each run's
declared outputs, and its log (<run>.log, or <run>.tgz with the log and its raw files).

Why it is ~500 lines and not a shell one-liner: the device is lent, has no network, runs one
command of at most 10 minutes and returns at most 8 files, so what a run needs must travel
with the call (wheels installed offline, a baseline commit's tree) and what it measured must come
back even when its time runs out (SIGINT first, so the scripts save, then the log and raw files
packed). Every one of those limits is also checked here, on the CPU, before device time is
spent. Read it by its sections: the matrix (parse and check runs.toml), wheels, baseline,
running (environment, a run's process group and limit, the call's budget and record), and
here (list, dry run).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tarfile
import threading
import time
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # experiments/: common
from common import BYTECODE_PACKAGES, bytecode_cached, compile_bytecode, package_dir, sigint_default_in_child  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
MATRIX = Path(__file__).with_name("runs.toml")
WORK = REPO / ".device_work"  # scratch and the shared Inductor cache (git-ignored)
WHEELS = REPO / ".whl"
BASELINE = REPO / ".baseline"
IGNORED = ("/.whl/", "/.baseline/", "/.device_work/")
# Set for every run and not overridable: NVLink multicast off in NCCL, PyTorch and NVSHMEM.
FIXED_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1", "PYTHONUNBUFFERED": "1"}
MAX_FILES = 8  # files the device returns from $OUT
MAX_CARRY_MIB = 64  # working tree + carried paths per call
STOP_GRACE_S = 15  # SIGINT, then SIGTERM, then SIGKILL, within this
MIN_LIMIT_S = 30  # a run the call's budget leaves less than this (and less than its own limit) is skipped
PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64", "manylinux1_x86_64")
FILE_NAME = re.compile(r"^[A-Za-z0-9._-]+$")


@dataclass
class Run:
    name: str
    help: str = ""
    script: str | None = None
    module: str | None = None  # python -m MODULE ARGS (a package's command line, e.g. flashsac_opt.cli)
    args: list[str] = field(default_factory=list)
    pytest: list[str] | None = None
    limit: int = 570
    # skipped (for the next call) when the call leaves fewer seconds than this (0: MIN_LIMIT_S): a run
    # started on a short share measures nothing (2026-12-02: two time-to-reward seeds cut at 47 and 113 s)
    min_limit: int = 0
    wheels: str = "none"
    env: dict[str, str] = field(default_factory=dict)
    cold_cache: bool = False
    gpus: int = 1
    outputs: list[str] = field(default_factory=list)
    pack: bool = False
    log: bool = True
    carry: list[str] = field(default_factory=list)

    def returned(self) -> list[str]:
        """The files this run leaves in its output folder."""
        extra = [f"{self.name}.tgz"] if self.pack else [f"{self.name}.log"] if self.log else []
        return [*self.outputs, *extra]


@dataclass
class Matrix:
    runs: dict[str, Run]
    wheels: dict[str, dict]
    baseline: dict


def load_matrix(path: Path = MATRIX) -> Matrix:
    """Parse and check runs.toml; a ValueError names the run and what is wrong."""
    data = tomllib.loads(path.read_text())
    wheels = data.get("wheels", {})
    runs = {}
    for name, spec in data.get("runs", {}).items():
        unknown = set(spec) - (set(Run.__dataclass_fields__) - {"name"})
        if unknown:
            raise ValueError(f"run {name}: unknown keys {sorted(unknown)}")
        run = Run(name=name, **spec)
        kinds = [k for k in ("script", "module", "pytest") if getattr(run, k) is not None]
        if len(kinds) != 1:
            raise ValueError(f"run {name}: needs exactly one of script, module, pytest (has {kinds or 'none'})")
        if not 0 <= run.min_limit <= run.limit:
            raise ValueError(f"run {name}: min_limit {run.min_limit} is not within 0..limit ({run.limit})")
        if run.wheels != "none" and run.wheels not in wheels:
            raise ValueError(f"run {name}: wheels {run.wheels!r} is not a [wheels.*] set")
        if set(run.env) & set(FIXED_ENV):
            raise ValueError(f"run {name}: env may not override {sorted(set(run.env) & set(FIXED_ENV))}")
        for out in run.returned():
            if not FILE_NAME.match(out):
                raise ValueError(f"run {name}: output {out!r} is not a plain file name (letters, digits, . _ -)")
        runs[name] = run
    return Matrix(runs, wheels, data.get("baseline", {}))


def returned_files(matrix: Matrix, names: list[str]) -> list[str]:
    """Every file a call running ``names`` returns, as paths under $OUT."""
    return ["runs.json", *(f for name in names for f in matrix.runs[name].returned())]


def wheel_sets(matrix: Matrix, names: list[str]) -> list[str]:
    return list(dict.fromkeys(matrix.runs[n].wheels for n in names if matrix.runs[n].wheels != "none"))


def carried(matrix: Matrix, names: list[str]) -> list[str]:
    paths = [".whl"] if wheel_sets(matrix, names) else []
    return list(dict.fromkeys(paths + [p for n in names for p in matrix.runs[n].carry]))


# ---- wheels ---------------------------------------------------------------------------------

def _normal(name: str) -> str:
    return re.sub(r"[-_.]+", "_", name).lower()


def missing_wheels(matrix: Matrix, sets: list[str], folder: Path = WHEELS) -> list[str]:
    """Pins of these sets with no wheel of that name (and version, where pinned) in folder."""
    have = [w.name.split("-")[:2] for w in folder.glob("*.whl")]
    missing = []
    for s in sets:
        wanted = matrix.wheels[s].get("pins", []) + matrix.wheels[s].get("build", [])
        for pin in wanted:
            name, _, version = pin.partition("==")
            if not any(_normal(n) == _normal(name) and (not version or v == version) for n, v in have):
                missing.append(pin)
    return missing


def install_wheels(matrix: Matrix, sets: list[str], site: Path) -> None:
    """Install every carried wheel into site, once per machine."""
    if not sets:
        return
    missing = missing_wheels(matrix, sets)
    if missing:
        sys.exit(f"run.py: .whl/ lacks {', '.join(missing)}: run `python experiments/device/run.py --fetch-wheels "
                 f"{sets[-1]}` here and carry .whl")
    wheels = sorted(str(w) for w in WHEELS.glob("*.whl"))
    marker = site / ".flashsac_wheels"
    listing = "\n".join(Path(w).name for w in wheels)
    if marker.is_file() and marker.read_text() == listing:
        return
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile", "--no-cache-dir",
                    "--upgrade", "--target", str(site), *wheels], check=True)
    print(f"run.py: bytecode of the installed wheels written in {compile_bytecode(site):.1f} s (pip's step, on every CPU)", flush=True)
    marker.write_text(listing)


def write_missing_bytecode(threshold: float = 0.9) -> dict:
    """Compile the start-up's packages (BYTECODE_PACKAGES: the image's torch, this checkout's
    flashsac_opt, ...) where fewer than ``threshold`` of their modules have bytecode: the machine
    sets PYTHONDONTWRITEBYTECODE=1, so nothing would ever write it, and each training process
    would compile them from source at launch. -> what it found and did, for the call's record."""
    found = bytecode_cached()
    done = {}
    for name, share in found.items():
        folder = package_dir(name) if share is not None and share < threshold else None
        if folder is not None and os.access(folder, os.W_OK):
            done[name] = round(compile_bytecode(folder), 1)
    if done:
        print(f"run.py: bytecode written for {done} (seconds; shares before: {found})", flush=True)
    return {"before": found, "compiled_s": done, "packages": list(BYTECODE_PACKAGES)}


def fetch_wheels(matrix: Matrix, which: str) -> int:
    """Download the cp312 manylinux wheels of a set into .whl/ (emptied first: one version each)."""
    spec = matrix.wheels[which]
    WHEELS.mkdir(exist_ok=True)
    for old in WHEELS.glob("*.whl"):
        old.unlink()
    platforms = [a for p in PLATFORMS for a in ("--platform", p)]
    subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:", "--python-version", "3.12",
                    "--implementation", "cp", *platforms, "-d", str(WHEELS), *spec.get("pins", [])], check=True)
    for pin in spec.get("build", []):
        subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(WHEELS), pin], check=True)
    for w in sorted(WHEELS.glob("*.whl")):
        print(f"{w.stat().st_size / 2**20:7.2f} MiB  {w.name}")
    return 0


# ---- baseline -------------------------------------------------------------------------------

def exclude_from_git() -> None:
    """List the driver's git-ignored folders in .git/info/exclude (once)."""
    exclude = REPO / ".git" / "info" / "exclude"
    if not (REPO / ".git").is_dir():
        return
    exclude.parent.mkdir(exist_ok=True)
    lines = exclude.read_text().splitlines() if exclude.is_file() else []
    with exclude.open("a") as f:
        for path in IGNORED:
            if path not in lines:
                f.write(path + "\n")


def prepare_baseline(matrix: Matrix, commit: str, dest: Path = BASELINE) -> Path:
    """Extract the baseline's paths that ``commit`` has into dest (emptied first) with `git archive`."""
    full = subprocess.run(["git", "rev-parse", "--verify", f"{commit}^{{commit}}"], cwd=REPO, check=True,
                          capture_output=True, text=True).stdout.strip()
    if dest.exists():
        shutil.rmtree(dest)
    dest.mkdir(parents=True)
    # the paths that commit has (the benchmark moved to experiments/bench/ in between)
    paths = [p for p in matrix.baseline["paths"]
             if subprocess.run(["git", "cat-file", "-e", f"{full}:{p}"], cwd=REPO, capture_output=True).returncode == 0]
    archive = subprocess.run(["git", "archive", "--format=tar", full, *paths], cwd=REPO, check=True,
                             capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(dest)], input=archive, check=True)
    # links that lead out of the tree or nowhere (the package's link to patches/) stay behind
    for link in [p for p in dest.rglob("*") if p.is_symlink()]:
        target = link.resolve()
        if not target.exists() or not target.is_relative_to(dest.resolve()):
            link.unlink()
    (dest / "BASELINE_COMMIT").write_text(full + "\n")
    size = sum(p.stat().st_size for p in dest.rglob("*") if p.is_file())
    print(f"{dest.relative_to(REPO) if dest.is_relative_to(REPO) else dest}: {full} ({size / 2**20:.2f} MiB); carry it with the call")
    return dest


# ---- running --------------------------------------------------------------------------------

def substitute(arg: str, out: Path, work: Path, limit: int) -> str:
    return arg.replace("{out}", str(out)).replace("{work}", str(work)).replace("{limit}", str(limit))


def command(run: Run, out: Path, work: Path, limit: int) -> list[str]:
    if run.pytest is not None:
        return [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *(substitute(a, out, work, limit) for a in run.pytest)]
    head = ["-m", run.module] if run.module is not None else [run.script]
    return [sys.executable, *head, *(substitute(a, out, work, limit) for a in run.args)]


def run_env(run: Run, work: Path) -> dict[str, str]:
    """The variables a run gets on top of the inherited environment (work: its scratch folder,
    beside the shared Inductor cache and the installed wheels)."""
    cache = work / "inductor_cache" if run.cold_cache else work.parent / "inductor_cache"
    path = ([str(work.parent / "site")] if run.wheels != "none" else []) + [str(REPO)]
    return {
        **FIXED_ENV,
        "PYTHONPATH": os.pathsep.join(path),
        "TORCHINDUCTOR_CACHE_DIR": str(cache),
        "TRITON_CACHE_DIR": str(cache / "triton"),
        # flashsac_opt's keyed compile-cache files (UniLab runs use one by default): with the
        # Inductor cache, so a cold run finds neither
        "FLASHSAC_OPT_CACHE_DIR": str(cache / "flashsac_opt"),
        **run.env,
    }


def gpu_list() -> list[str]:
    """'index, name, driver' of each GPU nvidia-smi sees (none without a driver)."""
    try:
        listing = subprocess.run(["nvidia-smi", "--query-gpu=index,name,driver_version", "--format=csv,noheader"],
                                 capture_output=True, text=True, timeout=60).stdout
    except (OSError, subprocess.TimeoutExpired):
        return []
    return [line.strip() for line in listing.splitlines() if line.strip()]


def _pump(stream, sinks) -> None:
    for line in stream:
        for sink in sinks:
            sink.write(line)
            sink.flush()


def execute(cmd: list[str], env: dict[str, str], limit: float, log: Path | None) -> tuple[int, bool]:
    """Run cmd in its own process group, output to the console (and log); at the limit stop the
    whole group: SIGINT (scripts save what they have), then SIGTERM, then SIGKILL."""
    sinks = [sys.stdout]
    log_file = log.open("w") if log else None
    if log_file:
        sinks.append(log_file)
    proc = subprocess.Popen(cmd, cwd=REPO, env={**os.environ, **env}, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, errors="replace", start_new_session=True, preexec_fn=sigint_default_in_child())
    pump = threading.Thread(target=_pump, args=(proc.stdout, sinks), daemon=True)
    pump.start()
    timed_out = False
    try:
        rc = proc.wait(timeout=limit)
    except subprocess.TimeoutExpired:
        timed_out = True
        print(f"run.py: limit of {limit:.0f} s reached: stopping", flush=True)
        rc = None
        for sig, grace in ((signal.SIGINT, 10), (signal.SIGTERM, 3), (signal.SIGKILL, 2)):
            try:
                os.killpg(proc.pid, sig)
            except ProcessLookupError:
                break
            try:
                rc = proc.wait(timeout=grace)
                break
            except subprocess.TimeoutExpired:
                continue
        rc = proc.wait() if rc is None else rc
    pump.join(timeout=10)
    if log_file:
        log_file.close()
    return rc, timed_out


def pack(run: Run, out: Path, work: Path, log: Path) -> None:
    with tarfile.open(out / f"{run.name}.tgz", "w:gz") as tar:
        if log.is_file():
            tar.add(log, arcname=log.name)
        raw = work / "raw"
        if raw.is_dir():
            tar.add(raw, arcname="raw")


class Call:
    """One device call: the runs in order, each within its limit and the call's budget."""

    def __init__(self, matrix: Matrix, out: Path, budget: float, work_root: Path = WORK):
        self.matrix, self.out, self.work_root = matrix, out, work_root
        self.deadline = time.monotonic() + budget
        self.record = {"argv": sys.argv, "start": _now(), "budget_s": budget, "python": sys.version.split()[0],
                       "cpus": os.cpu_count(), "runs": []}

    def save(self) -> None:
        self.record["end"] = _now()
        (self.out / "runs.json").write_text(json.dumps(self.record, indent=1))

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def run(self, name: str, gpus: int) -> None:
        run = self.matrix.runs[name]
        limit = int(min(run.limit, self.left() - STOP_GRACE_S))
        entry = {"run": name, "limit_s": limit}
        self.record["runs"].append(entry)
        if run.gpus > gpus:
            entry["skipped"] = f"needs {run.gpus} GPUs, found {gpus}"
        elif limit < max(min(run.limit, MIN_LIMIT_S), run.min_limit):
            entry["skipped"] = f"only {max(limit, 0)} s left in the call" + (f" (it needs {run.min_limit})" if run.min_limit else "")
        if "skipped" in entry:
            print(f"== {name}: skipped: {entry['skipped']}", flush=True)
            self.save()
            return
        print(f"== {name} (limit {limit} s, {self.left():.0f} s left in the call)", flush=True)
        start = time.monotonic()
        work = self.work_root / name
        if work.exists():
            shutil.rmtree(work)
        (work / "raw").mkdir(parents=True)
        env = run_env(run, work)
        cmd = command(run, self.out, work, limit)
        log = (work / f"{name}.log") if run.pack else (self.out / f"{name}.log") if run.log else None
        entry.update(command=cmd, env=env)
        self.save()
        rc, timed_out = execute(cmd, env, limit, log)
        if run.pack:
            pack(run, self.out, work, log)
        entry.update(rc=rc, timed_out=timed_out)
        entry["outputs"] = {f: (self.out / f).stat().st_size if (self.out / f).is_file() else None for f in run.returned()}
        missing = [f for f, size in entry["outputs"].items() if size is None]
        if missing:
            print(f"== {name}: missing outputs {missing}", flush=True)
        entry["seconds"] = round(time.monotonic() - start, 1)
        print(f"== {name}: rc={entry.get('rc')}{' (stopped at its limit)' if entry.get('timed_out') else ''}, "
              f"{entry['seconds']} s", flush=True)
        self.save()


def _now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


# ---- here: list, dry run --------------------------------------------------------------------

def tree_mib() -> float:
    """Size of what a device call sends without carry: tracked and untracked-not-ignored files."""
    listing = subprocess.run(["git", "ls-files", "-z", "-c", "-o", "--exclude-standard"], cwd=REPO, capture_output=True).stdout
    paths = {REPO / p for p in listing.decode().split("\0") if p}
    return sum(p.stat().st_size for p in paths if p.is_file() and not p.is_symlink()) / 2**20


def folder_mib(path: Path) -> float:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file() and not p.is_symlink()) / 2**20 if path.exists() else 0.0


def dry_run(matrix: Matrix, names: list[str], budget: float) -> int:
    out = Path("$OUT")
    used = 0  # seconds of the budget the runs before may take at most
    cut, failed_plans = [], []
    for name in names:
        run = matrix.runs[name]
        limit = int(min(run.limit, budget - used - STOP_GRACE_S))
        used += max(limit, 0) + STOP_GRACE_S
        if limit < run.limit:
            cut.append(f"{name} ({max(limit, 0)} of its {run.limit} s{', skipped: it needs ' + str(run.min_limit) if limit < run.min_limit else ''})")
        print(f"== {name}: {run.help}")
        print(f"   limit {limit} s, {run.gpus} GPU(s), wheels: {' '.join(wheel_sets(matrix, [name])) or 'none'}, "
              f"returns: {' '.join(returned_files(matrix, [name])[1:])}")
        env = run_env(run, WORK / name)
        cmd = command(run, out, WORK / name, limit)
        print("   " + " ".join(f"{k}={shlex.quote(v)}" for k, v in env.items()) + " \\")
        print("     " + shlex.join(cmd))
        if run.script and run.script.startswith("experiments/device/"):
            # the driver's own helpers print the processes they would start
            plan = subprocess.run([sys.executable, *cmd[1:], "--dry-run"], cwd=REPO, capture_output=True, text=True)
            for line in (plan.stdout + plan.stderr).splitlines():
                print("     | " + line)
            if plan.returncode:  # a helper that fails here would fail on the device, after its measurements
                failed_plans.append(f"{name} (exit status {plan.returncode})")
    files = returned_files(matrix, names)
    carry = carried(matrix, names)
    size = tree_mib() + sum(folder_mib(REPO / c) for c in carry)
    print(f"== {len(files)} files back (at most {MAX_FILES}): {' '.join(files)}")
    print(f"== limits add up to {used} s of the call's {budget:.0f} s; carry {json.dumps(carry)}: {size:.1f} MiB with the working tree "
          f"(at most {MAX_CARRY_MIB})")
    for c in carry:
        if not (REPO / c).exists():
            hint = "--prepare-baseline COMMIT" if c == ".baseline" else f"--fetch-wheels {(wheel_sets(matrix, names) or ['learner'])[-1]}"
            print(f"!! {c} is missing here: run `python experiments/device/run.py {hint}` first")
    sets = wheel_sets(matrix, names)
    if sets and WHEELS.exists() and missing_wheels(matrix, sets):
        print(f"!! .whl/ lacks {', '.join(missing_wheels(matrix, sets))}")
    if cut:
        print(f"!! if the runs before use their whole limits, the budget cuts {', '.join(cut)}: consider another call")
    print(f"== device call: python3 experiments/device/run.py {' '.join(names)}")
    if failed_plans:
        print(f"!! the helper's own dry run failed: {', '.join(failed_plans)}")
    problems = len(files) > MAX_FILES or size > MAX_CARRY_MIB
    if problems:
        print("!! over the device's limits")
    return 1 if problems or failed_plans else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("runs", nargs="*", metavar="RUN")
    parser.add_argument("--list", action="store_true", help="the runs of the matrix")
    parser.add_argument("--dry-run", action="store_true", help="print the commands, run nothing (works without a GPU)")
    parser.add_argument("--fetch-wheels", metavar="SET", help="download a wheel set into .whl/ (here, where pip works)")
    parser.add_argument("--prepare-baseline", metavar="COMMIT", help="extract COMMIT's code into .baseline/ (here)")
    parser.add_argument("--budget", type=float, default=585.0, help="seconds the whole call may take (default 585)")
    # for CPU rehearsals and tests: another matrix, scratch folder, GPU count
    parser.add_argument("--matrix", type=Path, default=MATRIX, help=argparse.SUPPRESS)
    parser.add_argument("--work-root", type=Path, default=WORK, help=argparse.SUPPRESS)
    parser.add_argument("--assume-gpus", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    matrix = load_matrix(args.matrix)

    if args.list:
        for run in matrix.runs.values():
            print(f"{run.name:36} {run.limit:4d} s  {run.gpus} GPU  {'wheels ' + run.wheels:24} {run.help}")
        return 0
    if args.fetch_wheels:
        if args.fetch_wheels not in matrix.wheels:
            parser.error(f"--fetch-wheels: one of {', '.join(matrix.wheels)}")
        exclude_from_git()
        return fetch_wheels(matrix, args.fetch_wheels)
    if args.prepare_baseline:
        exclude_from_git()
        prepare_baseline(matrix, args.prepare_baseline)
        return 0
    unknown = [r for r in args.runs if r not in matrix.runs]
    if unknown or not args.runs:
        parser.error(f"unknown runs {unknown} (see --list)" if unknown else "name at least one run (see --list)")
    if args.dry_run:
        return dry_run(matrix, args.runs, args.budget)

    out = Path(os.environ.get("OUT", args.work_root / "out"))
    out.mkdir(parents=True, exist_ok=True)
    call = Call(matrix, out, args.budget, args.work_root)
    for c in carried(matrix, args.runs):
        if not (REPO / c).exists():
            sys.exit(f"run.py: {c} was not carried (prepare it here and name it in the call's carry)")
    install_wheels(matrix, wheel_sets(matrix, args.runs), args.work_root / "site")
    call.record["bytecode"] = write_missing_bytecode()
    listing = gpu_list()
    gpus = args.assume_gpus if args.assume_gpus is not None else len(listing)
    call.record.update(gpus=gpus, gpu_list=listing)
    for name in args.runs:
        call.run(name, gpus)
    failed = [r["run"] for r in call.record["runs"] if r.get("rc") or r.get("timed_out") or r.get("skipped")]
    print(f"== done: {len(call.record['runs'])} runs, {'failed, stopped or skipped: ' + ' '.join(failed) if failed else 'all exited 0'}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
