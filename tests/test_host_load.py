"""experiments/report/host_load.py: the CPU a training's processes used, and what ran outside
its process tree (CPU, Linux /proc)."""

import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "experiments"))
from report.host_load import HostLoad, read_processes, tree  # noqa: E402

pytestmark = pytest.mark.skipif(not HostLoad.available(), reason="needs Linux /proc")

# A stand-in training: a parent that sleeps while a child it started computes. The busy loops count
# their own CPU time, not the wall clock, so a host shared with other tests (CI's two cores, pytest
# -n 2) still gives each its CPU seconds; the share of a core they get then varies.
BUSY = "import time\nend = time.process_time() + {seconds}\nwhile time.process_time() < end:\n    sum(range(1000))\n"
TRAINING = ("import subprocess, sys, time\n"
            "child = subprocess.Popen([sys.executable, '-c', {busy!r}])\n"
            "time.sleep(0.2)\nchild.wait()\n")


def test_tree_is_the_root_and_its_descendants_only():
    processes = {1: (0, 0.0, "init"), 10: (1, 0.0, "train"), 11: (10, 0.0, "collector"), 12: (11, 0.0, "worker"),
                 20: (1, 0.0, "other"), 21: (20, 0.0, "other's child")}
    assert tree(processes, 10) == {10, 11, 12}
    assert tree(processes, 20) == {20, 21}
    assert tree(processes, 99) == set()  # the training has ended


def test_read_processes_sees_this_process_and_its_cpu_time():
    me = read_processes()[__import__("os").getpid()]
    assert "pytest" in me[2] or "python" in me[2]
    assert me[1] > 0  # it has run


def test_the_training_s_child_and_an_outside_process_are_told_apart(tmp_path):
    training = subprocess.Popen([sys.executable, "-c", TRAINING.format(busy=BUSY.format(seconds=1.5))])
    outside = subprocess.Popen([sys.executable, "-c", BUSY.format(seconds=1.5)])
    launched = time.time()
    load = HostLoad(interval_s=0.2).start(training.pid)
    training.wait(timeout=30)
    outside.wait(timeout=30)
    report = load.stop(launched)
    ours = {p["pid"]: p for p in report["training_processes"]}
    busiest = report["training_processes"][0]
    # the child did the training's work: about 1.5 CPU seconds, a good part of a core while it ran
    assert busiest["pid"] != training.pid and not busiest["root"]
    assert busiest["cpu_s"] > 0.8 and busiest["cores"]["p90"] > 0.3
    assert outside.pid not in ours
    top = {p["pid"]: p for p in report["outside_training_top"]}
    assert outside.pid in top and top[outside.pid]["cpu_s"] > 0.8
    assert report["outside_training_cores"]["p90"] > 0.3
    assert report["samples"] >= 5 and report["cpu_count"] >= 1
    # a window after everything ended holds no sample
    assert load.stop(launched, since_s=1e6)["samples"] == 0


def test_a_training_id_is_required():
    with pytest.raises(ValueError, match="process id"):
        HostLoad().start()
