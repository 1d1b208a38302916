"""experiments/report/runner_timeline.py: an iteration of UniLab's runner split by the slices of
its Perfetto timeline (CPU)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "experiments" / "report" / "runner_timeline.py"
sys.path.insert(0, str(REPO / "experiments"))
from report.runner_timeline import breakdown  # noqa: E402

LEARNER, COLLECTOR = (1, 10), (2, 20)


def x(name, ts_ms, dur_ms, who=LEARNER, **args):
    return {"name": name, "ph": "X", "ts": ts_ms * 1000.0, "dur": dur_ms * 1000.0, "pid": who[0], "tid": who[1], "args": args}


def iteration(t, update_ms, wait_ms, inference_ms, logging_ms, env_step_ms, n):
    """One iteration of the learner thread as UniLab's runner lays it out, from its update phase's
    start at t: the phase, then (logging, outside any slice) then the wait for the collector's
    request holding the inference it serves, reward statistics and the replay sample."""
    w0 = t + update_ms + logging_ms
    return [
        x("learner/update_phase", t, update_ms, iteration=n),
        x("learner/wait_for_data", w0, wait_ms),
        x("learner/inference", w0 + wait_ms - inference_ms - 0.1, inference_ms),
        x("learner/inference_response", w0 + wait_ms - 0.1, 0.05),
        x("learner/update_reward_stats", w0 + wait_ms, 0.3),
        x("learner/replay_sample", w0 + wait_ms + 0.3, 0.1),
        x("collector/env_step", t + 1.0, env_step_ms, COLLECTOR),
        x("collector/wait_for_learner_action", t + 1.0 + env_step_ms, 2.0, COLLECTOR),
    ]


def test_the_period_splits_into_the_learner_s_slices_and_what_is_outside_them():
    events, t = [], 0.0
    for n in range(1, 6):
        update, wait, inference, logging = 30.0, 4.0 + n, 0.6, 1.5
        events += iteration(t, update, wait, inference, logging, env_step_ms=25.0, n=n)
        t += update + logging + wait + 0.3 + 0.1
    events += [x("learner/update_phase", t, 30.0, iteration=6),
               x("learner/training_e2e", 0.0, t + 30.0),  # spans the run: in no period
               {"name": "replay_size", "ph": "C", "ts": 5.0, "pid": 1, "tid": 10}]
    summary = breakdown({"traceEvents": events}, last=300)
    ms = summary["ms"]
    assert summary["iterations"] == 5 and (summary["first_iteration"], summary["last_iteration"]) == (1, 5)
    assert ms["period"]["median"] == pytest.approx(30.0 + 1.5 + 7.0 + 0.4)
    assert ms["learner/update_phase"]["median"] == pytest.approx(30.0)
    assert ms["learner/wait_for_data"]["median"] == pytest.approx(7.0) and ms["learner/wait_for_data"]["p90"] == pytest.approx(9.0)
    assert ms["learner/inference"]["median"] == pytest.approx(0.6)  # inside the wait, not counted twice
    assert ms["learner, outside UniLab's slices"]["median"] == pytest.approx(1.5)
    assert ms["collector/env_step"]["median"] == pytest.approx(25.0)
    # the last N periods only
    assert breakdown({"traceEvents": events}, last=2)["ms"]["learner/wait_for_data"]["median"] == pytest.approx(8.5)


def test_a_timeline_without_two_update_phases_is_refused_by_the_command(tmp_path):
    trace = tmp_path / "perfetto_offpolicy_timeline.json"
    trace.write_text(json.dumps([x("learner/update_phase", 0.0, 30.0)]))
    done = subprocess.run([sys.executable, str(SCRIPT), str(trace)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "at least two are needed" in done.stderr
    trace.write_text(json.dumps(iteration(0.0, 30.0, 5.0, 0.6, 1.0, 25.0, 1) + [x("learner/update_phase", 40.0, 30.0)]))
    out = tmp_path / "summary.json"
    done = subprocess.run([sys.executable, str(SCRIPT), str(trace), "--output", str(out)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert json.loads(out.read_text())["ms"]["period"]["median"] == pytest.approx(40.0)
