"""patches/0005: UniLab's collector forked from a server that imported its modules at launch
(flashsac_opt.unilab.collector_start), driven through UniLab's own collector entry wrapper."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from flashsac_opt.unilab import collector_start

REPO = Path(__file__).resolve().parents[1]

# A stand-in for UniLab's learner process: starts the server as the patched train script does,
# changes its environment afterwards (as UniLab's thread budget and MPS set-up do), then starts a
# "collector" as the patched AsyncRunner._start_collector does, through UniLab's entry wrapper.
_LEARNER = """
import json, multiprocessing, os, sys, time
from flashsac_opt.unilab import collector_start
started = collector_start.start_preload()
os.environ["FLASHSAC_OPT_TEST_LATE"] = "set after launch"
from unilab.rl.runtime.async_runner import _SPAWN_CTX, _collector_entry_wrapper
import collector_probe
stop_event = _SPAWN_CTX.Event()
recv, send = multiprocessing.Pipe(duplex=False)
kwargs = {"stop_event": stop_event, "report": sys.argv[1], "_parent_pid": os.getpid(),
          "_parent_watchdog_poll_interval": 0.1, "_parent_watchdog_grace_period": 5.0}
if os.environ.get("FLASHSAC_OPT_TEST_TENSOR_DEVICE"):  # where UniLab routes its collector's tensor device
    kwargs["env_cfg_override"] = {"collector_tensor_device": os.environ["FLASHSAC_OPT_TEST_TENSOR_DEVICE"]}
context, target, args = collector_start.process_args(_SPAWN_CTX, _collector_entry_wrapper, collector_probe.collect,
                                                     send, kwargs)
process = context.Process(target=target, args=args, daemon=True)
process.start()
server = getattr(__import__("multiprocessing.forkserver").forkserver._forkserver, "_forkserver_pid", None)
print(json.dumps({"started": started, "context": context.get_start_method(), "pid": process.pid,
                  "server_pid": server}), flush=True)
time.sleep(600)  # until the test kills it
"""

_PROBE = """
import json, os, sys, time
def collect(stop_event, report, env_cfg_override=None):
    state = {"late": os.environ.get("FLASHSAC_OPT_TEST_LATE"), "ppid": os.getppid(),
             "worker_preloaded": "unilab.rl.runtime.offpolicy.worker" in sys.modules,
             "dynamo_preloaded": "torch._dynamo" in sys.modules,
             "compiler_preloaded": "torch._inductor.compile_fx" in sys.modules,
             "server_flag": os.environ.get("FLASHSAC_OPT_COLLECTOR_PRELOAD_SERVER"),
             "nvml_check": os.environ.get("PYTORCH_NVML_BASED_CUDA_CHECK"),
             "affinity": sorted(os.sched_getaffinity(0))}
    if os.environ.get("FLASHSAC_OPT_TEST_CUDA") == "1":  # what UniLab's collector does with its CUDA ring
        try:
            import torch
            state["cuda"] = float(torch.ones(2, device="cuda").sum())
        except Exception as exc:
            state["cuda"] = repr(exc)
    if os.environ.get("FLASHSAC_OPT_TEST_COMPILE") == "1":  # does a torch.compile'd function compile here?
        import torch
        graphs = []
        def counting(gm, inputs):
            graphs.append(gm)
            return gm.forward
        state["value"] = float(torch.compile(lambda x: x * 2 + 1, backend=counting)(torch.ones(3)).sum())
        state["compiled_graphs"] = len(graphs)
    with open(report + ".tmp", "w") as f:
        json.dump(state, f)
    os.replace(report + ".tmp", report)
    while not stop_event.is_set():  # UniLab's parent watchdog sets it when the learner is gone
        time.sleep(0.05)
"""


def _exited(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")  # a zombie nobody reaps yet
    except FileNotFoundError:
        return True


def _stop(learner: subprocess.Popen, started: dict) -> None:
    """Kill the learner stand-in, then the collector and the server if they outlived it."""
    learner.kill()
    learner.wait(timeout=30)
    for pid in (started.get("pid"), started.get("server_pid")):
        if pid and not _exited(pid):
            os.kill(pid, signal.SIGKILL)


def _start_learner(tmp_path: Path, preload: str, cuda: bool = False, compiler: str | None = None,
                   **extra_env: str) -> tuple[subprocess.Popen, dict, Path]:
    (tmp_path / "collector_probe.py").write_text(_PROBE)
    report = tmp_path / "collector.json"
    env = dict(os.environ, PYTHONPATH=f"{tmp_path}{os.pathsep}{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
               FLASHSAC_OPT_COLLECTOR_PRELOAD=preload, FLASHSAC_OPT_TEST_CUDA="1" if cuda else "0")
    env.pop(collector_start.COMPILER_ENV, None)
    env.pop("FLASHSAC_OPT_COLLECTOR_SPARE_CPUS", None)
    env.pop(collector_start.EAGER_ENV, None)
    env.update(extra_env)
    if compiler is not None:
        env[collector_start.COMPILER_ENV] = compiler
    if not cuda:
        env["CUDA_VISIBLE_DEVICES"] = ""
    learner = subprocess.Popen([sys.executable, "-c", _LEARNER, str(report)], env=env, stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True, start_new_session=True)
    line = learner.stdout.readline()
    if not line:
        learner.kill()
        pytest.fail(f"the learner stand-in did not start: {learner.stderr.read()[-3000:]}")
    started = json.loads(line)
    deadline = time.monotonic() + 240
    while not report.exists() and time.monotonic() < deadline and learner.poll() is None:
        time.sleep(0.1)
    assert report.exists(), "the collector never reported"
    return learner, started, report


@pytest.mark.skipif(not collector_start.enabled(), reason="no forkserver start method here")
def test_the_collector_forks_preloaded_with_the_learners_environment_and_stops_when_the_learner_dies(tmp_path, require_unilab):
    learner, started, report = _start_learner(tmp_path, "1")
    try:
        state = json.loads(report.read_text())
        assert started["started"] and started["context"] == "forkserver"
        assert state["worker_preloaded"] and state["dynamo_preloaded"]  # imported by the server, before the fork
        assert not state["compiler_preloaded"]  # Inductor's compile_fx only when asked (below)
        assert state["late"] == "set after launch"  # the learner's environment when it started the collector
        assert state["server_flag"] is None and state["nvml_check"] is None  # the server's variables stay in the server
        assert state["ppid"] == started["server_pid"] != learner.pid
        assert state["affinity"] == sorted(os.sched_getaffinity(learner.pid))  # no CPUs spared unless asked (below)
        # SIGKILL, no Python exit path: the server sees its pipe close and exits, UniLab's watchdog
        # (told the server's pid) sees the collector reparented and stops it
        os.kill(learner.pid, signal.SIGKILL)
        learner.wait(timeout=30)
        deadline = time.monotonic() + 30
        while not _exited(started["pid"]) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert _exited(started["pid"]), "the collector outlived its learner"
        assert _exited(started["server_pid"])
    finally:
        if learner.poll() is None:
            learner.kill()
        for pid in (started.get("pid"), started.get("server_pid")):
            if pid and not _exited(pid):
                os.kill(pid, signal.SIGKILL)


@pytest.mark.skipif(not collector_start.enabled() or len(os.sched_getaffinity(0)) < 2, reason="no forkserver, or one CPU")
def test_the_forked_collector_leaves_the_spared_cpus_to_the_learner_process(tmp_path, require_unilab):
    from flashsac_opt.unilab import host_cpus

    learner, started, report = _start_learner(tmp_path, "1", FLASHSAC_OPT_COLLECTOR_SPARE_CPUS="1")
    try:
        state = json.loads(report.read_text())
        everything = os.sched_getaffinity(learner.pid)
        mine, spared = host_cpus.collector_cpus(set(everything), 1)
        assert spared and state["affinity"] == sorted(mine)  # whole cores off the collector (MuJoCo sizes its pool to it)
        assert sorted(everything) == sorted(os.sched_getaffinity(0))  # the learner process keeps every CPU
    finally:
        _stop(learner, started)


def test_preload_off_keeps_unilabs_spawn(tmp_path, require_unilab):
    learner, started, report = _start_learner(tmp_path, "0")
    try:
        state = json.loads(report.read_text())
        assert started == {"started": False, "context": "spawn", "pid": started["pid"], "server_pid": None}
        assert state["ppid"] == learner.pid and state["late"] == "set after launch"
    finally:
        learner.kill()
        learner.wait(timeout=30)
        deadline = time.monotonic() + 30  # the spawn collector's own watchdog stops it
        while not _exited(started["pid"]) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert _exited(started["pid"])


def test_without_a_started_server_the_process_arguments_are_unilabs():
    sentinel = object()
    kwargs = {"_parent_pid": 7}
    assert collector_start.process_args(sentinel, print, len, None, kwargs) == (sentinel, print, (len, None, kwargs))


@pytest.mark.gpu
@pytest.mark.skipif(not collector_start.enabled(), reason="no forkserver start method here")
@pytest.mark.parametrize("compiler", [None, "1"])
def test_a_preloaded_collector_can_use_cuda(tmp_path, require_unilab, compiler):
    # torch 2.11's Inductor asks torch.cuda.is_available() at import (runtime/benchmarking.py); a
    # CUDA driver query in the server would leave every forked collector unable to use CUDA.
    # With compile_fx asked for, the server imports it only after its fork probe said it is safe.
    if not __import__("torch").cuda.is_available():
        pytest.skip("needs CUDA")
    learner, started, report = _start_learner(tmp_path, "1", cuda=True, compiler=compiler)
    try:
        state = json.loads(report.read_text())
        assert started["context"] == "forkserver" and state["worker_preloaded"]
        assert state["cuda"] == 2.0, state["cuda"]
        if compiler:  # on a GPU machine with NVML the probe passes and the import happened in the server
            assert state["compiler_preloaded"]
    finally:
        learner.kill()
        learner.wait(timeout=30)


def test_the_launch_hook_imports_no_torch_for_the_compile_ahead_children_unless_asked():
    # the hook runs at the top of UniLab's train script: with prespawn unset it must leave torch's
    # import to UniLab's own order; set, it starts the children (through compile_ahead, torch and all)
    script = ("import sys; from flashsac_opt.unilab import collector_start; collector_start._prespawn_compile_ahead();"
              "print('torch' in sys.modules)")
    env = {k: v for k, v in os.environ.items() if k != "FLASHSAC_OPT_COMPILE_AHEAD_PRESPAWN"}
    unset = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120)
    assert unset.returncode == 0 and unset.stdout.strip() == "False", unset.stderr
    off = subprocess.run([sys.executable, "-c", script], env={**env, "FLASHSAC_OPT_COMPILE_AHEAD_PRESPAWN": "0"},
                         capture_output=True, text=True, timeout=120)
    assert off.returncode == 0 and off.stdout.strip() == "True", off.stderr  # asked about, so compile_ahead decided


@pytest.mark.skipif(not collector_start.enabled(), reason="no forkserver start method here")
def test_asked_to_the_server_imports_inductors_compile_fx_before_the_fork(tmp_path, require_unilab):
    learner, started, report = _start_learner(tmp_path, "1", compiler="1")
    try:
        state = json.loads(report.read_text())
        assert started["context"] == "forkserver" and state["ppid"] == started["server_pid"]
        assert state["compiler_preloaded"] and state["worker_preloaded"]
    finally:
        learner.kill()
        learner.wait(timeout=30)
        for pid in (started.get("pid"), started.get("server_pid")):
            deadline = time.monotonic() + 30
            while pid and not _exited(pid) and time.monotonic() < deadline:
                time.sleep(0.1)
            if pid and not _exited(pid):
                os.kill(pid, signal.SIGKILL)


class _FakeCuda:
    def __init__(self, compiled: bool, nvml_env: bool, nvml_count: int):
        self.compiled, self.nvml_env, self.nvml_count = compiled, nvml_env, nvml_count

    def _is_compiled(self):
        return self.compiled

    def _nvml_based_avail(self):
        return self.nvml_env

    def _device_count_nvml(self):
        return self.nvml_count


@pytest.mark.parametrize("compiled, nvml_env, nvml_count, safe", [
    (False, False, -1, True),  # a CPU torch asks no driver
    (True, True, 1, True),  # NVML counts: is_available() does not touch the driver
    (True, True, 0, True),
    (True, True, -1, False),  # NVML failed: is_available() would fall back to cudaGetDeviceCount
    (True, False, 1, False),  # without the NVML check is_available() asks the driver
])
def test_compile_fx_is_preloaded_only_where_its_cuda_query_cannot_poison_the_fork(compiled, nvml_env, nvml_count, safe):
    fake_torch = type("FakeTorch", (), {"cuda": _FakeCuda(compiled, nvml_env, nvml_count)})
    assert collector_start.compiler_import_is_fork_safe(fake_torch) is safe


def test_a_torch_without_the_nvml_helpers_gets_no_compile_fx_preload():
    class _OtherCuda:
        def _is_compiled(self):
            return True

    assert collector_start.compiler_import_is_fork_safe(type("OtherTorch", (), {"cuda": _OtherCuda()})) is False


@pytest.mark.parametrize("body, verdict", [
    ("import torch\n", None),
    # stands in for an import that asks the CUDA driver: a child forked afterwards is "in a bad fork"
    ("import torch\ntorch.cuda._is_in_bad_fork = lambda: True\n", "asked the CUDA driver"),
    ("raise ImportError('missing')\n", "its import failed"),
])
def test_the_fork_probe_imports_in_a_throwaway_child_and_reports_a_poisoned_fork(tmp_path, monkeypatch, body, verdict):
    import torch

    name = f"flashsac_opt_probe_{abs(hash(body))}"
    (tmp_path / f"{name}.py").write_text(body)
    monkeypatch.syspath_prepend(str(tmp_path))
    before = torch.cuda._is_in_bad_fork
    why = collector_start._import_poisons_fork(name)
    assert (why is None) if verdict is None else (verdict in why)
    assert name not in sys.modules and torch.cuda._is_in_bad_fork is before  # only the child imported it


@pytest.mark.skipif(not collector_start.enabled(), reason="no forkserver start method here")
@pytest.mark.parametrize("eager,device,graphs", [("1", "cuda:0", 0), ("0", "cpu", 1), (None, "cpu", 0), (None, "cuda:0", 1)])
def test_the_eager_switch_keeps_the_forked_collector_from_compiling(tmp_path, require_unilab, eager, device, graphs):
    """On with 1, off with 0; unset ("auto") on for a collector whose tensors are on the CPU only."""
    switch = {} if eager is None else {collector_start.EAGER_ENV: eager}
    learner, started, report = _start_learner(tmp_path, "1", FLASHSAC_OPT_TEST_COMPILE="1", FLASHSAC_OPT_TEST_TENSOR_DEVICE=device, **switch)
    try:
        state = json.loads(report.read_text())
        assert state["value"] == 9.0 and state["compiled_graphs"] == graphs  # same result; compiled only without the switch
    finally:
        _stop(learner, started)


def test_a_malformed_eager_switch_stops_the_launch_hook(monkeypatch):
    monkeypatch.setenv(collector_start.EAGER_ENV, "yes")
    with pytest.raises(ValueError, match="FLASHSAC_OPT_COLLECTOR_EAGER must be 0, 1 or auto"):
        collector_start.start_preload()


@pytest.mark.parametrize("value,device,eager", [(None, "cpu", True), ("auto", "cpu", True), ("auto", "cuda:0", False),
                                                (None, None, False), ("0", "cpu", False), ("1", "cuda:0", True)])
def test_the_collector_is_eager_by_default_only_on_the_cpu_carrier(monkeypatch, value, device, eager):
    if value is None:
        monkeypatch.delenv(collector_start.EAGER_ENV, raising=False)
    else:
        monkeypatch.setenv(collector_start.EAGER_ENV, value)
    assert collector_start.collector_eager_wanted(device) is eager
