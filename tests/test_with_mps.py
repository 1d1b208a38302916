"""experiments/device/with_mps.py against a stand-in nvidia-cuda-mps-control (CPU): the command
runs with the daemon's private pipe folder, the daemon is always stopped, and without a daemon
the command does not run."""

import json
import os
import stat
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "experiments" / "device" / "with_mps.py"
# Stand-in daemon: `-d` makes the control pipe (a plain file here) and returns; a client call
# reads one request from stdin and logs it beside the pipe.
FAKE_CONTROL = """#!/bin/sh
if [ "$1" = "-d" ]; then
  touch "$CUDA_MPS_PIPE_DIRECTORY/control"; echo started > "$CUDA_MPS_LOG_DIRECTORY/control.log"; exit 0
fi
read request
echo "$request" >> "$CALLS"
case "$request" in
  get_server_list) echo 4242 ;;
  quit) rm -f "$CUDA_MPS_PIPE_DIRECTORY/control" ;;
esac
"""


def run(tmp_path, *command, fake=True, via=()):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    if fake:
        tool = bin_dir / "nvidia-cuda-mps-control"
        tool.write_text(FAKE_CONTROL)
        tool.chmod(tool.stat().st_mode | stat.S_IEXEC)
    env = dict(os.environ, PATH=f"{bin_dir}{os.pathsep}/usr/bin{os.pathsep}/bin", CALLS=str(tmp_path / "calls.txt"))
    report = tmp_path / "mps.json"
    done = subprocess.run([sys.executable, str(SCRIPT), "--report", str(report), *via, "--", *command], env=env,
                          capture_output=True, text=True, timeout=60)
    return done, json.loads(report.read_text())


def test_the_command_runs_under_the_daemon_which_is_always_stopped(tmp_path):
    seen = tmp_path / "seen.txt"
    done, report = run(tmp_path, sys.executable, "-c",
                       f"import os; open({str(seen)!r}, 'w').write(os.environ['CUDA_MPS_PIPE_DIRECTORY'])")
    assert done.returncode == 0, done.stderr
    pipe = Path(seen.read_text())
    assert report["daemon_started"] and report["pipe_directory"] == str(pipe) and report["servers"] == "4242"
    assert report["command_status"] == 0 and report["daemon_log"].strip() == "started"
    # by default UniLab's uni-cumps was asked first; without nvidia-smi it refused, and the script
    # started the daemon itself, saying why
    assert report["via"] == "direct" and report["uni_cumps_error"].startswith("uni-cumps start exited")
    assert (tmp_path / "calls.txt").read_text().split() == ["get_server_list", "quit"]
    assert not pipe.exists()  # the private folders are removed
    # a failing command: its status comes back, and the daemon is still stopped
    (tmp_path / "calls.txt").unlink()
    done, report = run(tmp_path, sys.executable, "-c", "raise SystemExit(7)")
    assert done.returncode == 7 and report["command_status"] == 7
    assert (tmp_path / "calls.txt").read_text().split()[-1] == "quit"


def test_without_a_daemon_the_command_is_not_run(tmp_path):
    marker = tmp_path / "ran.txt"
    done, report = run(tmp_path, sys.executable, "-c", f"open({str(marker)!r}, 'w')", fake=False)
    assert done.returncode == 3 and not report["daemon_started"] and "not on the PATH" in report["why_not"]
    assert not marker.exists() and "was not run" in done.stderr


def test_a_dry_run_starts_no_daemon_and_writes_no_report(tmp_path):
    report = tmp_path / "mps.json"
    done = subprocess.run([sys.executable, str(SCRIPT), "--report", str(report), "--", sys.executable, "-c",
                           "import sys; print('inner', sys.argv[1:])", "--dry-run"], capture_output=True, text=True, timeout=60,
                          env=dict(os.environ, PATH="/usr/bin:/bin"))
    assert done.returncode == 0 and "would start" in done.stdout and "inner ['--dry-run']" in done.stdout
    assert not report.exists()


def test_via_direct_does_not_ask_uni_cumps(tmp_path):
    done, report = run(tmp_path, sys.executable, "-c", "pass", via=("--via", "direct"))
    assert done.returncode == 0 and report["via"] == "direct" and "uni_cumps_error" not in report
    assert report["daemon_started"] and report["servers"] == "4242"
