"""The compile-ahead child (flashsac_opt/compile_ahead.py): it compiles, its failure is one
warning, it never outlives its parent, and the UniLab adapter lets collection start while it
runs and waits for it at the first update.

The lifecycle tests compile with the aot_eager backend (an Inductor compile of the learner
takes minutes on two cores); whether the parent's Inductor compile then finds every graph in
the child's cache is tested with small networks on CPU and at W1 on the GPU."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from flashsac_opt import compile_ahead, compile_cache
from flashsac_opt.compile_ahead import CompileAhead
from flashsac_opt.config import FlashSACConfig

DIMS = {"obs_dim": 6, "critic_obs_dim": 7, "action_dim": 3}
SMALL = dict(batch_size=16, updates_per_step=2, actor_hidden_dim=16, critic_hidden_dim=16, num_atoms=11, use_amp=False)


def small_cfg(**overrides) -> FlashSACConfig:
    return FlashSACConfig(**{**SMALL, "learner_mode": "compile", "compile_backend": "aot_eager", **overrides})


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a zombie (exited, not yet reaped by its parent) counts as gone
    status = Path(f"/proc/{pid}/status")
    return not (status.is_file() and "\nState:\tZ" in status.read_text())


def test_child_compiles_the_configured_shapes_and_cleans_up():
    ahead = CompileAhead(small_cfg(), DIMS, "cpu")
    assert ahead.wait(timeout=300)
    assert ahead.report["compiled"] and ahead.report["rows"] == 16 * 2 and ahead.report["device"] == "cpu"
    # exit status 0, or SIGTERM where wait() found the report written and stopped the teardown
    assert ahead.process.returncode in (0, -signal.SIGTERM) and not ahead.folder.exists()


def test_a_failing_child_is_one_warning_naming_its_log():
    # graph mode needs CUDA: the child's learner refuses it, the child exits non-zero
    ahead = CompileAhead(small_cfg(learner_mode="graph"), DIMS, "cpu")
    with pytest.warns(UserWarning, match=r"compile-ahead child failed \(exit status 1: ValueError: learner_mode=graph needs a CUDA device"):
        assert not ahead.wait(timeout=300)
    assert ahead.logs[0].is_file() and "Traceback" in ahead.logs[0].read_text()
    ahead.stop()  # as at exit: the log the warning named stays
    assert ahead.logs[0].is_file()
    shutil.rmtree(ahead.folder)


def test_stop_ends_a_running_child():
    ahead = CompileAhead(small_cfg(), DIMS, "cpu")
    assert ahead.running
    ahead.stop()
    assert not ahead.running and not alive(ahead.process.pid)
    assert not ahead.folder.exists()  # stopped, not failed: nothing left in the temporary directory


def test_a_child_that_wrote_its_report_is_done_and_not_waited_for_through_its_teardown():
    """The report comes after the caches are written: a child still tearing down (here: a
    process that only sleeps) is done, and wait() stops it instead of waiting it out."""
    ahead = CompileAhead(small_cfg(), DIMS, "cpu")
    ahead.process.kill()
    ahead.process.wait()
    ahead.processes[0] = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    assert ahead.running and not ahead.done
    ahead.report_files[0].write_text(json.dumps({"seconds": 2.5, "compiled": True}))
    assert ahead.done
    start = time.monotonic()
    assert ahead.wait()
    assert time.monotonic() - start < 30 and not alive(ahead.process.pid)
    assert ahead.report == {"seconds": 2.5, "compiled": True} and not ahead.folder.exists()


_ORPHANING_PARENT = """
import os, signal, sys
from flashsac_opt.compile_ahead import CompileAhead
from flashsac_opt.config import FlashSACConfig
cfg = FlashSACConfig(**{SMALL!r}, learner_mode="compile", compile_backend="aot_eager")
ahead = CompileAhead(cfg, {DIMS!r}, "cpu")
print(ahead.process.pid, ahead.folder, flush=True)
os.kill(os.getpid(), signal.SIGKILL)  # no atexit, no cleanup: only the child's watch is left
"""


def test_child_ends_itself_when_its_parent_is_killed():
    done = subprocess.run([sys.executable, "-c", _ORPHANING_PARENT.format(SMALL=SMALL, DIMS=DIMS)],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == -9, done.stderr
    pid, folder = done.stdout.split()
    deadline = time.monotonic() + 60  # the watch looks once a second; torch's import may come first
    while alive(int(pid)) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not alive(int(pid))
    # it was the watch, not the end of a compile: no report, and the log says why
    assert not (Path(folder) / "report_0.json").exists()
    assert "parent" in (Path(folder) / "child_0.log").read_text() and "is gone; exiting" in (Path(folder) / "child_0.log").read_text()
    shutil.rmtree(folder)


def test_switch_and_devices_that_start_no_child(monkeypatch):
    cfg = small_cfg()
    monkeypatch.delenv(compile_ahead.ENV_SWITCH, raising=False)
    assert compile_ahead.mode() == "background"  # the default (measured: the module doc)
    if not torch.cuda.is_available():  # a CUDA learner on a machine without CUDA: nothing to start
        assert CompileAhead.start_if_useful(cfg, DIMS, torch.device("cuda", 0), compiled=True) is None
    monkeypatch.setenv(compile_ahead.ENV_SWITCH, "0")
    assert CompileAhead.start_if_useful(cfg, DIMS, torch.device("cuda", 0), compiled=True) is None  # off
    monkeypatch.setenv(compile_ahead.ENV_SWITCH, "1")
    assert compile_ahead.enabled()
    assert CompileAhead.start_if_useful(cfg, DIMS, torch.device("cpu"), compiled=True) is None  # CPU: collector's cores
    assert CompileAhead.start_if_useful(cfg, DIMS, torch.device("cuda", 0), compiled=False) is None  # eager
    monkeypatch.setenv(compile_ahead.ENV_SWITCH, "0")
    assert not compile_ahead.enabled()


def test_the_switch_names_its_modes_and_refuses_others(monkeypatch):
    for value, expected in (("0", "off"), ("", "off"), ("1", "wait"), ("on", "wait"), ("background", "background")):
        monkeypatch.setenv(compile_ahead.ENV_SWITCH, value)
        assert compile_ahead.mode() == expected and compile_ahead.enabled() == (expected != "off")
    monkeypatch.setenv(compile_ahead.ENV_SWITCH, "later")
    with pytest.raises(ValueError, match="expected 0/off, 1/wait or background"):
        compile_ahead.mode()


def test_the_split_switch_names_its_values_and_refuses_others(monkeypatch):
    monkeypatch.delenv(compile_ahead.SPLIT_ENV, raising=False)
    assert compile_ahead.split_shares() == compile_ahead.SPLIT_SHARES  # the default: one child per network (measured: the module)
    for value, expected in (("0", None), ("off", None), ("1", compile_ahead.SPLIT_SHARES), ("yes", compile_ahead.SPLIT_SHARES)):
        monkeypatch.setenv(compile_ahead.SPLIT_ENV, value)
        assert compile_ahead.split_shares() == expected
    monkeypatch.setenv(compile_ahead.SPLIT_ENV, "3")
    with pytest.raises(ValueError, match="expected 0/off or 1/on"):
        compile_ahead.split_shares()


def test_compile_only_compiles_the_named_networks_and_runs_the_others_uncompiled(tmp_path):
    from torch._dynamo.utils import counters

    from flashsac_opt.learner import FlashSACLearner
    from flashsac_opt.testing.oracle import synthetic_batch

    def one_update(only):
        torch._dynamo.reset()
        counters.clear()
        cache_file = tmp_path / f"artifacts_{only}.bin"
        learner = FlashSACLearner(small_cfg(compile_backend="eager", compile_cache_file=str(cache_file)), *DIMS.values(), device="cpu")
        if only:
            learner.engine.compile_only(only)
        learner.update(synthetic_batch(32, *DIMS.values(), torch.Generator().manual_seed(0)))
        return learner, counters["stats"]["unique_graphs"], cache_file

    learner, graphs, cache_file = one_update(["actor"])
    assert learner.engine.compiled_names() == ["actor_step"] and graphs == 1
    assert not cache_file.exists()  # one share's artifacts under the whole learner's key: never written
    with pytest.raises(RuntimeError, match="before the first iteration"):
        learner.engine.compile_only(["critic"])
    whole, graphs, _ = one_update(None)
    assert whole.engine.compiled_names() == ["critic_step", "actor_step"] and graphs == 2
    fresh = FlashSACLearner(small_cfg(compile_backend="eager"), *DIMS.values(), device="cpu")
    with pytest.raises(ValueError, match=r"networks are \['actor', 'critic'\]"):
        fresh.engine.compile_only(["value"])
    with pytest.raises(ValueError, match="eager compiles nothing"):
        FlashSACLearner(small_cfg(learner_mode="eager"), *DIMS.values(), device="cpu").engine.compile_only(["actor"])


def test_split_children_compile_a_share_each_and_report_as_one():
    ahead = CompileAhead(small_cfg(), DIMS, "cpu", shares=compile_ahead.SPLIT_SHARES)
    assert len(ahead.processes) == 2
    assert ahead.wait(timeout=300)
    children = ahead.report["children"]
    assert [c["networks"] for c in children] == [["critic"], ["actor"]] and all(c["compiled"] for c in children)
    assert ahead.report["seconds"] == max(c["seconds"] for c in children) and ahead.report["compile_cache_file"] is None
    # every child has ended: exit status 0, or SIGTERM where wait() found its report written and
    # stopped its teardown (_wait_child; which of the two depends on timing, CI saw both)
    assert all(p.returncode in (0, -signal.SIGTERM) for p in ahead.processes) and not ahead.folder.exists()


def test_background_mode_trains_uncompiled_until_the_child_is_done_then_compiles(require_unilab, monkeypatch, tmp_path, capsys):
    from torch._dynamo.utils import counters

    from test_unilab_integration import _unilab_kwargs

    from flashsac_opt.unilab import adapter

    class Gate:  # a compile-ahead child whose end the test decides
        in_this_process = False

        def __init__(self):
            # two children's report as CompileAhead.wait merges it
            children = [{"networks": [n], "seconds": t, "compile_phases_s": {"dynamo_total": t}} for n, t in (("critic", 1.5), ("actor", 0.8))]
            self.running, self.report, self.waited_s = True, {"seconds": 1.5, "rows": 64, "children": children}, None

        def wait(self, timeout=None):
            self.waited_s = 0.0
            return True

        def stop(self):
            self.running = False

        @property
        def done(self):
            return not self.running

    gate = Gate()
    learner, batch, events = deferred_adapter(monkeypatch, tmp_path, gate)  # collection starts; nothing compiles
    step = dict(updates_per_step=2, policy_frequency=2, target_frequency=1, policy_before_critic=False)
    graphs = counters["stats"].get("unique_graphs", 0)
    for _ in range(2):  # the child still compiles: no update waits, none is compiled
        learner.update_cycle(batch, **step)
    engine = learner.learner.engine
    assert engine.compile_deferred and engine.compiled_names() == [] and counters["stats"].get("unique_graphs", 0) == graphs
    assert learner.learner.iterations == 2 and learner.compile_ahead_report is None
    gate.running = False  # the child is done: the next update compiles, and the training goes on compiled
    learner.update_cycle(batch, **step)
    assert not engine.compile_deferred and engine.compiled_names() == ["critic_step", "actor_step"]
    assert counters["stats"].get("unique_graphs", 0) > graphs and learner.compile_ahead_report["ok"]
    learner.update_cycle(batch, **step)
    assert learner.learner.iterations == 4 and torch.isfinite(learner.learner.critic.params).all()
    logged = [json.loads(line) for line in events.read_text().splitlines()]
    assert [e["event"] for e in logged] == ["learner_constructed", "prepare_for_collection_deferred", "first_update_start",
                                            "first_update_end", "compile_ahead_done", "background_compile_switched"]
    assert logged[4]["background"] and logged[4]["child_s"] == 1.5
    assert [(c["networks"], c["compile_phases_s"]["dynamo_total"]) for c in logged[4]["children"]] == [(["critic"], 1.5), (["actor"], 0.8)]
    assert "the training ran 2 iterations uncompiled and compiles from its caches now" in capsys.readouterr().out
    # a data-parallel run stops the child (it compiles the single-process form): nothing is left deferred
    gate = Gate()
    monkeypatch.setattr(adapter.CompileAhead, "start_if_useful", staticmethod(lambda cfg, dims, device, *, compiled, warm_cache=None: gate))
    ranked = adapter.build_unilab_learner(device="cpu", learner_mode="compile", compile_backend="aot_eager",
                                          **_unilab_kwargs(actor_hidden_dim=16, critic_hidden_dim=16, batch_size=32, updates_per_step=2))
    assert ranked.learner.engine.compile_deferred
    ranked.set_gradient_sync(lambda params: None)
    assert not gate.running and not ranked.learner.engine.compile_deferred


def deferred_adapter(monkeypatch, tmp_path, ahead):
    """UniLab's adapter (compile mode, aot_eager, CPU) whose compile ahead is ``ahead``, in the
    background mode, its start-up events in tmp_path, after prepare_for_collection on a context
    with a ready batch: (learner, that batch, the events file)."""
    from test_unilab_integration import _unilab_kwargs

    from flashsac_opt.testing.oracle import synthetic_batch
    from flashsac_opt.unilab import adapter

    monkeypatch.setattr(adapter.CompileAhead, "start_if_useful", staticmethod(lambda cfg, dims, device, *, compiled, warm_cache=None: ahead))
    monkeypatch.setenv(compile_ahead.ENV_SWITCH, "background")
    events = tmp_path / "startup_events.jsonl"
    monkeypatch.setenv(adapter.STARTUP_EVENTS_ENV, str(events))
    torch._dynamo.reset()
    learner = adapter.build_unilab_learner(device="cpu", learner_mode="compile", compile_backend="aot_eager",
                                           **_unilab_kwargs(actor_hidden_dim=16, critic_hidden_dim=16, batch_size=32, updates_per_step=2))
    batch = synthetic_batch(64, 98, 101, 29, torch.Generator().manual_seed(0))

    class Context:
        target_frequency, policy_before_critic, updates_per_step, policy_frequency = 1, False, 2, 2
        replay_batch = batch

    learner.prepare_for_collection(Context())
    return learner, batch, events


def logged_compile_end(events: Path) -> float:
    return next(e["time"] for e in map(json.loads, events.read_text().splitlines()) if e["event"] == "startup_idle_compile_end")


def test_the_compile_from_the_childs_caches_uses_the_runners_wait_for_its_collector(require_unilab, monkeypatch, tmp_path, capsys):
    # patches/0004: UniLab's runner calls use_startup_idle_time while its collector starts; once
    # the child is done the compile and its warm-up happen there, state untouched, and the first
    # update compiles nothing
    from torch._dynamo.utils import counters

    class Gate:
        running, report, waited_s, in_this_process = True, {"seconds": 2.5, "rows": 64}, None, False

        def wait(self, timeout=None):
            self.running, self.waited_s = False, 0.0
            return True

        @property
        def done(self):
            return not self.running

    gate = Gate()
    learner, batch, events = deferred_adapter(monkeypatch, tmp_path, gate)
    engine = learner.learner.engine
    learner.use_startup_idle_time()  # the child still compiles: nothing
    assert engine.compile_deferred and engine.compiled_names() == []
    before = {k: v.clone() for k, v in learner.learner.network_tensors().items()}
    gate.running = False
    learner.use_startup_idle_time()
    assert not engine.compile_deferred and engine.compiled_names() == ["critic_step", "actor_step"]
    assert "done in 2.5 s; the training compiles from its caches before its first update" in capsys.readouterr().out
    after = learner.learner.network_tensors()
    assert all(torch.equal(before[k], after[k]) for k in before) and learner.learner.iterations == 0
    graphs = counters["stats"].get("unique_graphs", 0)
    learner.use_startup_idle_time()  # once only
    learner.update_cycle(batch, updates_per_step=2, policy_frequency=2, target_frequency=1, policy_before_critic=False)
    assert counters["stats"].get("unique_graphs", 0) == graphs and learner.learner.iterations == 1
    assert not all(torch.equal(before[k], learner.learner.network_tensors()[k]) for k in before)  # it trained
    assert [json.loads(line)["event"] for line in events.read_text().splitlines()] == [
        "learner_constructed", "prepare_for_collection_deferred", "collector_start_wait", "compile_ahead_done",
        "startup_idle_compile_start", "startup_idle_compile_end", "collector_start_wait_end", "first_update_start", "first_update_end"]
    wait_end = [json.loads(line) for line in events.read_text().splitlines()][6]
    assert wait_end["polls"] == 3 and wait_end["time"] >= logged_compile_end(events)  # the last poll came after the compile


def test_with_a_loaded_cache_file_no_child_starts_and_the_compile_waits_for_the_runners_wait(require_unilab, monkeypatch, tmp_path, capsys):
    # compile_ahead.WarmCache: done from the start, yet prepare_for_collection does not compile
    # (the collector would wait for it); the runner's first wait for its collector does.
    # A cache folder of its own: the session's is shared, and an earlier test's training may have
    # left a file under this learner's key, which the load below must not find.
    monkeypatch.setenv("FLASHSAC_OPT_CACHE_DIR", str(tmp_path / "flashsac_opt_cache"))
    learner, _, events = deferred_adapter(monkeypatch, tmp_path, compile_ahead.WarmCache("/c/key.bin"))
    engine = learner.learner.engine
    assert engine.compile_deferred and engine.compiled_names() == []  # the collector starts first
    learner.use_startup_idle_time()
    assert not engine.compile_deferred and engine.compiled_names() == ["critic_step", "actor_step"]
    assert "compile cache /c/key.bin loaded, no compile-ahead child; the training compiles from its caches before its first update" in capsys.readouterr().out
    logged = [json.loads(line) for line in events.read_text().splitlines()]
    assert [e["event"] for e in logged] == ["learner_constructed", "prepare_for_collection_deferred", "collector_start_wait",
                                            "compile_ahead_done", "startup_idle_compile_start", "startup_idle_compile_end"]
    assert logged[3]["child"] is False and logged[3]["ok"]
    # the decision's load is timed for the timeline (it runs before the collector starts)
    assert learner._load_compile_cache() is None  # no file was loaded (aot_eager leaves none)
    checked = json.loads(events.read_text().splitlines()[-1])
    assert checked["event"] == "compile_cache_checked" and checked["loaded"] is False and checked["seconds"] >= 0


def test_adapter_lets_collection_start_while_the_child_compiles_and_waits_at_the_first_update(require_unilab, monkeypatch, tmp_path):
    from test_unilab_integration import _unilab_kwargs

    from flashsac_opt.testing.oracle import synthetic_batch
    from flashsac_opt.unilab import adapter

    started = []

    def start_on_cpu(cfg, dims, device, *, compiled, warm_cache=None):  # start_if_useful skips CPU; this test wants the child
        started.append(CompileAhead(cfg, dims, device))
        return started[-1]

    monkeypatch.setattr(adapter.CompileAhead, "start_if_useful", staticmethod(start_on_cpu))
    events = tmp_path / "startup_events.jsonl"  # the start-up timeline the training benchmark reads
    monkeypatch.setenv(adapter.STARTUP_EVENTS_ENV, str(events))
    kwargs = _unilab_kwargs(actor_hidden_dim=16, critic_hidden_dim=16, batch_size=32, updates_per_step=2)
    learner = adapter.build_unilab_learner(device="cpu", learner_mode="compile", compile_backend="aot_eager", **kwargs)
    (child,) = started
    assert child.running

    class Context:  # what UniLab's runner hands prepare_for_collection (no batch needed here)
        target_frequency, policy_before_critic = 1, False

    learner.prepare_for_collection(Context())
    assert learner.learner.engine.fused_update is None  # nothing compiled in this process yet
    batch = synthetic_batch(64, 98, 101, 29, torch.Generator().manual_seed(0))
    learner.update_cycle(batch, updates_per_step=2, policy_frequency=2, target_frequency=1, policy_before_critic=False)
    assert not child.running and learner.compile_ahead_report["ok"]
    assert learner.compile_ahead_report["rows"] == 64
    assert learner.learner.engine.fused_update is not None and learner.learner.iterations == 1
    assert torch.isfinite(learner.learner.critic.params).all()
    learner.update_cycle(batch, updates_per_step=2, policy_frequency=2, target_frequency=1, policy_before_critic=False)
    logged = [json.loads(line) for line in events.read_text().splitlines()]
    assert [e["event"] for e in logged] == ["learner_constructed", "prepare_for_collection_deferred", "first_update_start",
                                            "compile_ahead_done", "first_update_end"]  # the second update adds nothing
    assert logged[0]["compile_ahead"] and logged[3]["ok"] and logged[3]["child_s"] > 0
    assert [e["time"] for e in logged] == sorted(e["time"] for e in logged)


def test_prepare_for_collection_compiles_at_once_when_the_child_is_done_but_still_tearing_down(require_unilab, monkeypatch, tmp_path):
    # the child writes its report after its caches; its interpreter's teardown can take seconds
    # more: the start-up compile must not defer to the first update for that (the warm run of 2026-12-01 that led to commit 12b27d5)
    from test_unilab_integration import _unilab_kwargs

    from flashsac_opt.unilab import adapter

    class TearingDown:  # alive, report written: done
        running, done, report, waited_s, in_this_process = True, True, {"seconds": 8.7}, None, False

        def wait(self, timeout=None):
            self.running, self.waited_s = False, 0.0
            return True

        def stop(self):
            self.running = False

    child = TearingDown()
    monkeypatch.setattr(adapter.CompileAhead, "start_if_useful", staticmethod(lambda cfg, dims, device, *, compiled, warm_cache=None: child))
    monkeypatch.setenv(compile_ahead.ENV_SWITCH, "background")
    events = tmp_path / "startup_events.jsonl"
    monkeypatch.setenv(adapter.STARTUP_EVENTS_ENV, str(events))
    learner = adapter.build_unilab_learner(device="cpu", learner_mode="compile", compile_backend="aot_eager",
                                           **_unilab_kwargs(actor_hidden_dim=16, critic_hidden_dim=16, batch_size=32, updates_per_step=2))
    assert learner.learner.engine.compile_deferred
    from torch._inductor import config

    updates = []
    monkeypatch.setattr(learner.learner, "update", lambda *a, **k: updates.append((learner.learner.engine.compile_deferred, config.compile_threads)))

    class Context:
        target_frequency, policy_before_critic, updates_per_step, policy_frequency = 1, False, 2, 2
        replay_batch = {"unused": torch.zeros(1)}

    with config.patch(compile_threads=1):  # UniLab's budget
        learner.prepare_for_collection(Context())
    # compiled here, not deferred; the teardown stopped; from the child's caches with UniLab's one
    # worker: no pool of worker processes is started for kernels that are all in the caches
    assert updates == [(False, 1)] and not child.running
    assert learner.compile_ahead_report["ok"] and learner.compile_ahead_report["seconds"] == 8.7
    assert [json.loads(line)["event"] for line in events.read_text().splitlines()] == [
        "learner_constructed", "compile_ahead_done", "prepare_for_collection_start", "prepare_for_collection_end"]


def test_a_compile_from_the_childs_caches_uses_unilabs_budget_a_cold_one_every_cpu(require_unilab):
    from torch._inductor import config

    from test_unilab_integration import _unilab_kwargs

    from flashsac_opt.unilab import adapter

    learner = adapter.build_unilab_learner(device="cpu", learner_mode="compile", compile_backend="aot_eager",
                                           **_unilab_kwargs(actor_hidden_dim=16, critic_hidden_dim=16, batch_size=32, updates_per_step=2))
    seen = {}
    for name, report in (("no child", None), ("child failed", {"ok": False}), ("child compiled", {"ok": True, "seconds": 9.0})):
        learner.compile_ahead_report = report
        with config.patch(compile_threads=1), learner._compile_workers():
            seen[name] = config.compile_threads
    assert seen == {"no child": compile_ahead.available_cpus(), "child failed": compile_ahead.available_cpus(), "child compiled": 1}


def test_unilab_runs_use_the_keyed_compile_cache_file_unless_turned_off():
    from flashsac_opt.compile_cache import AUTO
    from flashsac_opt.unilab.adapter import unilab_compile_cache_file

    assert unilab_compile_cache_file(None) == AUTO  # patch 0001 passes null for an absent key
    for off in ("off", "None", "null", "false", ""):
        assert unilab_compile_cache_file(off) is None
    assert unilab_compile_cache_file("/data/cc.bin") == "/data/cc.bin"


_CACHE_HIT_SCRIPT = """
import json, sys, torch
from pathlib import Path
from torch._dynamo.utils import counters
from flashsac_opt.compile_ahead import SPLIT_SHARES, CompileAhead, precompile
from flashsac_opt.config import FlashSACConfig
from flashsac_opt.learner import FlashSACLearner

device = sys.argv[1]
if device == "cuda":  # W1's shapes, graph mode
    cfg, dims = FlashSACConfig(batch_size=256, updates_per_step=2, learner_mode="graph"), (98, 101, 29)
else:  # small networks, one block each: Inductor's CPU compile (C++ per kernel) takes minutes on two cores otherwise
    cfg = FlashSACConfig(batch_size=16, updates_per_step=2, actor_hidden_dim=16, critic_hidden_dim=16, num_atoms=11,
                         actor_num_blocks=1, critic_num_blocks=1, learner_mode="compile")
    dims = (6, 7, 3)
cfg.compile_cache_file = sys.argv[3]  # the training's keyed file: written by the child, or (split) by this process
cfg.precompiled_steps = sys.argv[2] == "split_precompiled"  # the children save the fused steps, this process loads them
ok, child_s, prespawned = True, None, None
if sys.argv[2] == "prespawned":  # children started "at launch" with another Inductor cache: the spec's environment must win
    import os
    from flashsac_opt import compile_ahead
    real = os.environ["TORCHINDUCTOR_CACHE_DIR"]
    os.environ.update({"TORCHINDUCTOR_CACHE_DIR": real + "_at_launch", compile_ahead.PRESPAWN_ENV: "1", compile_ahead.ENV_SWITCH: "background"})
    assert compile_ahead.prespawn(cuda_required=False) is not None
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = real
    torch.set_num_threads(1)  # as UniLab's thread budget sets the learner's after launch: the children take it
if sys.argv[2] != "from_file":  # from_file: another machine's first run, with only the file
    shares = SPLIT_SHARES if sys.argv[2].startswith("split") or sys.argv[2] == "prespawned" else None
    ahead = CompileAhead(cfg, dict(zip(("obs_dim", "critic_obs_dim", "action_dim"), dims)), device, shares=shares)
    ok, child_s, prespawned = ahead.wait(), ahead.report and ahead.report["seconds"], ahead.prespawned
learner = FlashSACLearner(cfg, *dims, device=device)
report = precompile(learner)
child_threads = sorted({c.get("torch_threads") for c in (ahead.report or {}).get("children", [ahead.report or {}])}) if sys.argv[2] != "from_file" else []
print(json.dumps({"child_threads": child_threads, "threads": torch.get_num_threads(),
                  "precompiled_steps": learner.engine.precompiled_report(), "ok": ok, "prespawned": prespawned, "child_s": child_s, "parent_s": report["seconds"], "loaded": report["compile_cache_loaded"],
                  "saved": report["compile_cache_saved"],
                  "hits": counters["inductor"]["fxgraph_cache_hit"], "misses": counters["inductor"]["fxgraph_cache_miss"],
                  "keyed_dir_files": sorted(str(p.relative_to(sys.argv[4])) for p in Path(sys.argv[4]).rglob("*.bin"))}))
"""


@pytest.mark.parametrize("device, children", [
    # on the CPU the prespawned children are the split ones, started at launch: one cold compile covers both
    ("cpu", "one"), ("cpu", "prespawned"),
    *(pytest.param("cuda", children, marks=pytest.mark.gpu) for children in ("one", "split", "split_precompiled", "prespawned")),
])
def test_the_training_process_compiles_from_what_the_child_compiled(tmp_path, device, children):
    # A fresh Inductor cache for both processes: every FX graph the parent needs must come
    # from the child (a miss is a second cold compile of that graph). This failed while the
    # child set its matmul precision through torch.set_float32_matmul_precision, which changes
    # a setting in the cache key.
    env = dict(os.environ)
    if device == "cpu":
        # Scalar C++ kernels for both processes (the same setting in both, so the same cache keys):
        # the child's cold compile of vectorized kernels took 80 s of this test's 95 on two cores,
        # scalar ones 41 s; what is checked is that the parent finds every graph the child compiled.
        env["TORCHINDUCTOR_VEC_ISA_OK"] = "0"
    file = str(tmp_path / "artifacts.bin")

    def run(how: str, cache: str, **extra: str) -> dict:
        cache_env = {"TORCHINDUCTOR_CACHE_DIR": str(tmp_path / cache), "TRITON_CACHE_DIR": str(tmp_path / cache / "triton"),
                     compile_cache.ENV_DIR: str(tmp_path / "keyed"), **extra}
        done = subprocess.run([sys.executable, "-c", _CACHE_HIT_SCRIPT, device, how, file, str(tmp_path / "keyed")], env={**env, **cache_env},
                              capture_output=True, text=True, timeout=900)
        assert done.returncode == 0, done.stderr[-3000:]
        report = json.loads(done.stdout.strip().splitlines()[-1])
        print(report)  # the seconds, for the log
        return report

    report = run(children, "inductor")
    if children == "split_precompiled":
        # each child saved its network's fused step (aot_compile keeps no FX graph in the cache);
        # this process loaded both: nothing traced or compiled here
        assert report["ok"] and report["precompiled_steps"] == {"loaded": ["actor", "critic-True"], "saved": [], "fell_back": [], "stale": []}, report
        assert sorted(Path(f).name for f in report["keyed_dir_files"]) == ["actor.bin", "critic-True.bin"], report
        return
    assert report["ok"] and report["hits"] > 0 and report["misses"] == 0, report
    # prespawned: the children started before the learner existed were the ones that compiled,
    # with the thread count this process had when it wrote their specs
    assert report["prespawned"] is (True if children == "prespawned" else False), report
    assert report["child_threads"] == [report["threads"]], report
    # one child writes the keyed file and this process loads it; split children write none (each
    # holds one share) and this process writes it from what it found in the caches
    assert (report["loaded"], report["saved"]) == ((True, False) if children == "one" else (False, True)), report
    if children in ("split", "prespawned"):  # that file alone serves a fresh cache: nothing compiled again
        # (with the thread count the file was compiled under: prespawned's process set one thread)
        again = run("from_file", "fresh", **({"OMP_NUM_THREADS": "1"} if children == "prespawned" else {}))
        assert again["loaded"] and again["hits"] > 0 and again["misses"] == 0, again


def test_parallel_compile_sets_inductors_workers_inside_and_restores_them():
    from torch._inductor import config

    before = config.compile_threads
    with compile_ahead.parallel_compile(3):
        assert config.compile_threads == 3
    assert config.compile_threads == before
    with compile_ahead.parallel_compile():
        assert config.compile_threads == compile_ahead.available_cpus()
    assert config.compile_threads == before


def test_prepare_for_collection_compiles_with_every_available_cpu(require_unilab, monkeypatch, tmp_path):
    # UniLab's thread budget sets Inductor to one compile worker below 64 CPUs; the start-up
    # compile (before the collector exists) must not be serialized by it.
    from torch._inductor import config

    from test_unilab_integration import _unilab_kwargs

    from flashsac_opt.unilab import adapter

    events = tmp_path / "startup_events.jsonl"
    monkeypatch.setenv(adapter.STARTUP_EVENTS_ENV, str(events))
    learner = adapter.build_unilab_learner(device="cpu", learner_mode="compile", compile_backend="aot_eager",
                                           **_unilab_kwargs(actor_hidden_dim=16, critic_hidden_dim=16, batch_size=32, updates_per_step=2))
    seen = []
    monkeypatch.setattr(learner.learner, "update", lambda *a, **k: seen.append(config.compile_threads))

    class Context:
        target_frequency, policy_before_critic, updates_per_step, policy_frequency = 1, False, 2, 2
        replay_batch = {"unused": torch.zeros(1)}

    # config.patch, not monkeypatch: monkeypatch's undo deletes a torch config entry
    with config.patch(compile_threads=1):  # as UniLab leaves it
        learner.prepare_for_collection(Context())
        assert seen == [compile_ahead.available_cpus()] and config.compile_threads == 1
    # the start-up compile's span is on the timeline
    assert [json.loads(line)["event"] for line in events.read_text().splitlines()] == [
        "learner_constructed", "prepare_for_collection_start", "prepare_for_collection_end"]


def test_compile_cache_counters_are_counted_from_a_given_point():
    # the background switch's start-up event reports how many graphs the child's caches served
    from torch._dynamo.utils import counters

    from flashsac_opt.unilab.adapter import compile_cache_counters

    before = compile_cache_counters()
    counters["inductor"]["fxgraph_cache_hit"] += 3
    counters["aot_autograd"]["autograd_cache_miss"] += 1
    assert compile_cache_counters(since=before) == {"fxgraph_hit": 3, "fxgraph_miss": 0, "aot_autograd_hit": 0, "aot_autograd_miss": 1}


def test_the_switch_event_names_the_compile_cache_files_and_what_the_caches_served():
    import types

    from torch._dynamo.utils import counters

    from flashsac_opt.unilab.adapter import compile_cache_counters, compile_time_totals, switch_details

    before = (compile_cache_counters(), compile_time_totals())
    counters["inductor"]["fxgraph_cache_hit"] += 2
    steps = {"loaded": ["actor", "critic-True"], "saved": [], "fell_back": []}
    engine = types.SimpleNamespace(compile_cache_file="/c/key.bin", compile_cache_loaded=True, precompiled_report=lambda: steps)
    details = switch_details(before, engine, {"compile_cache_file": "/c/child.bin"})
    assert details["precompiled_steps"] == steps  # what the switch loaded instead of tracing
    assert details["caches"]["fxgraph_hit"] == 2 and details["caches"]["fxgraph_miss"] == 0
    assert (details["child_compile_cache_file"], details["compile_cache_file"], details["compile_cache_loaded"]) == ("/c/child.bin", "/c/key.bin", True)
    assert all(v >= 0 for v in details["compile_phases_s"].values())
    assert switch_details(before, engine, None)["child_compile_cache_file"] is None



def _prespawn_env(monkeypatch, tmp_path, value="1"):
    from flashsac_opt import compile_ahead

    monkeypatch.setenv(compile_ahead.PRESPAWN_ENV, value)
    monkeypatch.setenv(compile_cache.ENV_DIR, str(tmp_path / "keyed"))
    monkeypatch.delenv(compile_ahead.ENV_SWITCH, raising=False)


def test_prespawned_children_nobody_needs_are_stopped_and_leave_nothing(monkeypatch, tmp_path):
    from flashsac_opt import compile_ahead

    _prespawn_env(monkeypatch, tmp_path)
    ready = compile_ahead.prespawn(cuda_required=False)
    assert ready is not None and len(ready.processes) == len(compile_ahead.SPLIT_SHARES)
    assert compile_ahead.prespawn(cuda_required=False) is ready  # once per process
    assert all(process.poll() is None for process in ready.processes)  # waiting for a spec
    # a learner on the CPU gets no child: the waiting ones are stopped, their folder removed
    assert CompileAhead.start_if_useful(None, {}, torch.device("cpu"), compiled=True) is None
    assert all(process.poll() is not None for process in ready.processes)
    assert not ready.folder.exists() and compile_ahead._prespawned is None


def test_children_are_prespawned_only_when_asked_and_on_a_fresh_cache(monkeypatch, tmp_path):
    from flashsac_opt import compile_ahead

    _prespawn_env(monkeypatch, tmp_path, "0")
    assert compile_ahead.prespawn(cuda_required=False) is None  # off by default
    _prespawn_env(monkeypatch, tmp_path)
    (tmp_path / "keyed").mkdir()
    (tmp_path / "keyed" / "0123.bin").write_bytes(b"x")  # this machine has compiled before
    assert compile_ahead.prespawn(cuda_required=False) is None
    monkeypatch.setenv(compile_ahead.ENV_SWITCH, "off")
    (tmp_path / "keyed" / "0123.bin").unlink()
    assert compile_ahead.prespawn(cuda_required=False) is None  # compile ahead itself is off
    monkeypatch.setenv(compile_ahead.PRESPAWN_ENV, "maybe")
    monkeypatch.delenv(compile_ahead.ENV_SWITCH)
    with pytest.raises(ValueError, match=compile_ahead.PRESPAWN_ENV):
        compile_ahead.prespawn(cuda_required=False)


def test_a_prespawned_child_ends_when_its_launcher_is_killed(tmp_path):
    # the launcher dies without running atexit (SIGKILL); its waiting children must not stay
    script = ("import os, sys, time; from flashsac_opt import compile_ahead;"
              "ready = compile_ahead.prespawn(cuda_required=False);"
              "print(' '.join(str(p.pid) for p in ready.processes), flush=True); time.sleep(600)")
    env = {**os.environ, "FLASHSAC_OPT_COMPILE_AHEAD_PRESPAWN": "1", compile_cache.ENV_DIR: str(tmp_path / "keyed")}
    env.pop("FLASHSAC_OPT_COMPILE_AHEAD", None)
    launcher = subprocess.Popen([sys.executable, "-c", script], env=env, stdout=subprocess.PIPE, text=True)
    try:
        pids = [int(pid) for pid in launcher.stdout.readline().split()]
        assert len(pids) == 2
    finally:
        launcher.kill()
        launcher.wait()
    deadline = time.monotonic() + 60  # the orphan watch polls every second; the import may still run
    while time.monotonic() < deadline and any(_alive(pid) for pid in pids):
        time.sleep(0.2)
    assert not any(_alive(pid) for pid in pids)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().split(") ")[1][0] != "Z"
    except FileNotFoundError:
        return False
