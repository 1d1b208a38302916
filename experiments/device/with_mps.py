"""Run a command under a CUDA MPS control daemon of its own (issue 17's contention remedy).

UniLab's collector is a process with its own CUDA context; without MPS the GPU time-slices between
it and the learner's, and the collector's small ops wait while the learner's captured iteration
runs. Under MPS the contexts share the GPU through one server. UniLab 1.5.2's own switch
(`training.cuda_process_sharing=mps`) accepts only its mjwarp backend, but it works under an
*ambient* daemon reachable through CUDA_MPS_PIPE_DIRECTORY: this script provides one.

It starts the daemon as README's recipe does, through UniLab's `uni-cumps start` / `env` / `stop`
(`python -m unilab.training.cuda_mps_cli`: the device has no console scripts); where that fails
(the report's `uni_cumps_error`) or with `--via direct`, with `nvidia-cuda-mps-control -d`. Either
way with private pipe and log folders (nothing system-wide, the GPU's settings untouched); it runs
the command with CUDA_MPS_PIPE_DIRECTORY / CUDA_MPS_LOG_DIRECTORY set, asks which servers the
daemon started (`get_server_list`: a server means the command's contexts went through MPS) and
always stops it. Where no daemon can start, the command does not run: the report says why, exit 3.

    python3 experiments/device/with_mps.py --report OUT/mps.json -- python3 experiments/device/trainings.py ...

A command starting with `python` or `python3` runs with this script's interpreter; one ending in
--dry-run (run.py's dry run) runs as it is, without a daemon or a report.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

CONTROL = "nvidia-cuda-mps-control"
NO_MPS = 3  # exit status when no daemon could be started
UNI_CUMPS = [sys.executable, "-m", "unilab.training.cuda_mps_cli"]  # UniLab's `uni-cumps`


def uni_cumps(*args: str, timeout: float = 60.0) -> subprocess.CompletedProcess:
    return subprocess.run([*UNI_CUMPS, *args], capture_output=True, text=True, timeout=timeout)


def start_with_uni_cumps(work: Path, name: str) -> dict[str, str]:
    """UniLab's user-owned daemon for the one visible GPU, its folders under ``work``: the
    environment `uni-cumps env` gives a launcher. Raises RuntimeError with UniLab's message."""
    started = uni_cumps("start", "--name", name, "--pipe-dir", str(work / "pipe"), "--log-dir", str(work / "log"))
    if started.returncode != 0:
        raise RuntimeError(f"uni-cumps start exited {started.returncode}: {(started.stdout + started.stderr).strip()[-500:]}")
    told = uni_cumps("env", "--name", name, "--json")
    if told.returncode != 0:
        uni_cumps("stop", "--name", name)
        raise RuntimeError(f"uni-cumps env exited {told.returncode}: {(told.stdout + told.stderr).strip()[-500:]}")
    return dict(json.loads(told.stdout)["env"])


def control(command: str, env: dict, timeout: float = 10.0) -> str:
    """One request to the running daemon (as `echo COMMAND | nvidia-cuda-mps-control`)."""
    done = subprocess.run([CONTROL], input=command + "\n", env=env, capture_output=True, text=True, timeout=timeout)
    return (done.stdout + done.stderr).strip()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--report", type=Path, required=True, help="JSON: whether the daemon ran, its servers, the command's status")
    parser.add_argument("--via", choices=("uni-cumps", "direct"), default="uni-cumps",
                        help="start the daemon through UniLab's uni-cumps (default; falls back to direct) or directly")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- COMMAND ...")
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("no command given (put it after --)")
    if command[0] in ("python", "python3"):  # this interpreter (the device's torch environment), not the PATH's
        command[0] = sys.executable
    if command[-1] == "--dry-run":  # run.py's dry run appends it: say what would run, start nothing
        how = "UniLab's `uni-cumps start` (else `" + CONTROL + " -d`)" if args.via == "uni-cumps" else f"`{CONTROL} -d`"
        print(f"would start {how} with private pipe and log folders, run the command under it, "
              f"then ask get_server_list and stop it; the command's own dry run:")
        return subprocess.run(command).returncode
    report: dict = {"experiment": "with_mps", "command": command, "daemon_started": False}
    args.report.parent.mkdir(parents=True, exist_ok=True)

    def save() -> None:
        args.report.write_text(json.dumps(report, indent=1))

    work = Path(tempfile.mkdtemp(prefix="fso_mps_"))  # short: the control socket's path is limited
    env = dict(os.environ, CUDA_MPS_PIPE_DIRECTORY=str(work / "pipe"), CUDA_MPS_LOG_DIRECTORY=str(work / "log"))
    (work / "pipe").mkdir()
    (work / "log").mkdir()
    name = f"flashsac-opt-{os.getpid()}"
    report["via"] = "direct"
    try:
        if args.via == "uni-cumps":
            try:
                (work / "uc").mkdir()  # its own folders: a failed start leaves nothing in the direct path's
                env = dict(os.environ, **start_with_uni_cumps(work / "uc", name))
                report.update(via="uni-cumps", daemon_started=True, cuda_visible_devices=env.get("CUDA_VISIBLE_DEVICES"))
            except (RuntimeError, OSError, ValueError, KeyError, subprocess.TimeoutExpired) as exc:
                report["uni_cumps_error"] = str(exc)[:1000]
                print(f"with_mps: uni-cumps did not start a daemon ({exc}); starting {CONTROL} directly", file=sys.stderr)
        if not report["daemon_started"]:
            if shutil.which(CONTROL) is None:
                report["why_not"] = f"{CONTROL} is not on the PATH"
                save()
                print(f"with_mps: {report['why_not']}; the command was not run", file=sys.stderr)
                return NO_MPS
            started = subprocess.run([CONTROL, "-d"], env=env, capture_output=True, text=True, timeout=30)
            time.sleep(1.0)  # the daemon creates its control pipe after forking
            if started.returncode != 0 or not (work / "pipe" / "control").exists():
                report["why_not"] = f"`{CONTROL} -d` exited {started.returncode}: {(started.stdout + started.stderr).strip()[:500]}"
                report["daemon_log"] = _read(work / "log" / "control.log")
                save()
                print(f"with_mps: no MPS daemon ({report['why_not']}); the command was not run", file=sys.stderr)
                return NO_MPS
            report["daemon_started"] = True
        report["pipe_directory"] = env["CUDA_MPS_PIPE_DIRECTORY"]
        save()
        began = time.time()
        status = subprocess.run(command, env=env).returncode
        report.update(command_status=status, command_seconds=round(time.time() - began, 1))
        report["servers"] = control("get_server_list", env)  # server PIDs: the command's contexts went through MPS
        return status
    finally:
        if report["daemon_started"]:
            if report["via"] == "uni-cumps":
                stopped = uni_cumps("stop", "--name", name)
                report["quit"] = (stopped.stdout + stopped.stderr).strip()[-1000:]
            else:
                report["quit"] = control("quit", env)
            time.sleep(1.0)
            logs = Path(env["CUDA_MPS_LOG_DIRECTORY"])
            report["daemon_log"] = _read(logs / "control.log")
            report["server_log"] = _read(logs / "server.log")
        save()
        shutil.rmtree(work, ignore_errors=True)


def _read(path: Path, limit: int = 4000) -> str | None:
    return path.read_text(errors="replace")[-limit:] if path.exists() else None


if __name__ == "__main__":
    sys.exit(main())
