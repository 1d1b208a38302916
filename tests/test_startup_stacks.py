"""experiments/report/startup_stacks.py: stack samples of a process and its children, named by
where the main thread was (CPU)."""

import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "experiments"))
from report import startup_stacks  # noqa: E402

# A stand-in start-up: a parent that waits in one function, then spawns a child that computes in
# another, while a background thread sleeps (it must not be taken for the main thread).
PROGRAM = """
import subprocess, sys, threading, time
def wait_for_assets():
    time.sleep(1.6)
def child_work():
    end = time.time() + 1.2
    while time.time() < end:
        sum(range(1000))
if sys.argv[1:] == ["child"]:
    child_work()
else:
    threading.Thread(target=lambda: time.sleep(30), daemon=True).start()
    wait_for_assets()
    subprocess.run([sys.executable, __file__, "child"], check=True)
"""


def _sampled_run(tmp_path, name: str, program: str) -> tuple[list[dict], float]:
    """Run ``program`` with sampling on (every 0.2 s); its processes' summaries and the launch time."""
    script = tmp_path / name
    script.write_text(program)
    env = dict(os.environ)
    startup_stacks.enable(env, tmp_path / "samples", interval_s=0.2, for_s=20)
    launched = time.time()
    subprocess.run([sys.executable, "-W", "ignore", str(script)], env=env, check=True, timeout=60)
    return startup_stacks.summarize(tmp_path / "samples", launched), launched


def test_samples_name_where_each_process_spent_its_start_up(tmp_path):
    (parent, child), launched = _sampled_run(tmp_path, "startup.py", PROGRAM)
    assert "startup.py" in parent["cmd"] and parent["cmd"].endswith("child") is False and child["cmd"].endswith("child")
    assert parent["started_s"] < child["started_s"]
    def seconds_in(proc, func):  # (the parent's wait for the child is a place of its own, as long as the child runs)
        return sum(s for where, s in proc["seconds_by_where"] if where.endswith(f"startup.py:{func}"))

    assert 1.0 <= seconds_in(parent, "wait_for_assets") <= 2.0 and seconds_in(parent, "child_work") == 0
    assert 0.8 <= seconds_in(child, "child_work") <= 2.0 and seconds_in(child, "wait_for_assets") == 0
    (segment,) = [s for s in parent["segments"] if s["where"].endswith(":wait_for_assets")]
    assert 0.0 <= segment["start_s"] <= 1.0 and 1.0 <= segment["seconds"] <= 2.0
    # cut at a time: only the samples before it count
    early = startup_stacks.summarize(tmp_path / "samples", launched, until_s=parent["started_s"] + 0.7)
    assert 1 <= early[0]["samples"] <= 3 and early[1]["samples"] == 0  # (a loaded machine delays a sample)
    # a window: only the child's part (the background switch's window in the training benchmark)
    late = startup_stacks.summarize(tmp_path / "samples", launched, since_s=child["started_s"])
    assert seconds_in(late[0], "wait_for_assets") == 0 and 0.8 <= seconds_in(late[1], "child_work") <= 2.0


def test_names_take_the_innermost_application_frame_and_the_library_below_it():
    stack = [("/x/site-packages/torch/_inductor/codecache.py", "compile"), ("/x/site-packages/torch/_dynamo/eval.py", "run"),
             ("/x/site-packages/unilab/envs/mdp/events.py", "_bind_root_reset"), ("/x/site-packages/unilab/cli.py", "train_main")]
    assert startup_stacks.name_of(stack) == "unilab/envs/mdp/events.py:_bind_root_reset > torch/_dynamo"
    assert startup_stacks.name_of(stack[2:]) == "unilab/envs/mdp/events.py:_bind_root_reset"
    assert startup_stacks.name_of([("/usr/lib/python3.12/selectors.py", "select")]) == "selectors.py:select"
    # flashsac_opt's own unilab subpackage, and a UniLab copy in a folder named unilab
    assert startup_stacks.name_of([("/repo/flashsac_opt/unilab/adapter.py", "f")]) == "flashsac_opt/unilab/adapter.py:f"
    assert startup_stacks.name_of([("/w/unilab/patched/unilab/base/env.py", "g")]) == "unilab/base/env.py:g"
    # inside a library: the innermost frames, outermost first
    assert startup_stacks.name_in_library(stack, depth=2) == "torch/_dynamo/eval.py:run < torch/_inductor/codecache.py:compile"


# A forked child (UniLab's collector is forked from patch 0005's server) keeps no thread of its
# parent: it is sampled only if the sampler starts again after the fork.
FORKING_PROGRAM = """
import os, time
def forked_work():
    end = time.time() + 1.2
    while time.time() < end:
        sum(range(1000))
time.sleep(0.5)
pid = os.fork()
if pid == 0:
    forked_work()
    os._exit(0)
os.waitpid(pid, 0)
"""


def test_a_forked_child_is_sampled_and_named_as_forked(tmp_path):
    (parent, child), _ = _sampled_run(tmp_path, "forking.py", FORKING_PROGRAM)
    assert child["cmd"].startswith(f"(forked from {parent['pid']}) ") and "forking.py" in child["cmd"]
    assert not parent["cmd"].startswith("(forked")
    work = sum(s for where, s in child["seconds_by_where"] if where.endswith("forking.py:forked_work"))
    assert 0.8 <= work <= 2.0
    assert not any(where.endswith(":forked_work") for where, _ in parent["seconds_by_where"])
