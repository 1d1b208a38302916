"""Compile ahead: a child process compiles the learner while UniLab starts up.

UniLab's runner compiles and captures the learner in ``prepare_for_collection``, before the
collector process exists: the compile (40-150 s cold, depending on the host) and UniLab's own
start-up (collector process, MuJoCo environments, ``learning_starts`` of random collection)
run one after the other. ``CompileAhead`` starts a child process as soon as the learner is
constructed (by default two, one per network: ``SPLIT_SHARES``). The child builds a learner
with the same configuration and dimensions on the same device and runs one update on a
synthetic batch of the same shape: that fills Inductor's
on-disk caches (and the keyed compile-cache file, when the learner uses one). Meanwhile the
parent returns from ``prepare_for_collection`` without compiling, so the collector starts; at
its first update it waits for the child and compiles from the warm caches (seconds).

A child, not a thread: Dynamo and Inductor's lowering are Python that would share the GIL with
the learner serving the collector's inference requests, and a CUDA graph captured beside
other threads' CUDA work is fragile. The child shares nothing with the parent but the cache
directories; torch's cache keys (graph, inputs, Inductor config, versions) decide whether the
parent's compile uses what it wrote, so a child that compiled something else costs the parent
a cold compile, never wrong code.

No process is left behind: the child is in the parent's process group (Ctrl-C reaches both),
is stopped at the parent's interpreter exit, and ends itself within a second when its parent
dies without one (killed).
A child that fails or is stopped leaves one warning; the parent then compiles by itself.

``FLASHSAC_OPT_COMPILE_AHEAD`` picks the mode. ``background`` (the default): the training does
not wait at all, its iterations run uncompiled (in graph mode captured as they are) until the
child is done, and then it compiles from the child's caches (seconds) and goes on compiled
(``Engine.defer_compile``), with UniLab's one compile worker: every kernel is in the caches
(the adapter's ``_compile_workers``), in the runner's wait for its collector when the child is
done by then (patches/0004). With this configuration's compile-cache file already there, no
child at all (``WarmCache``): this process compiles from it in that wait. On the H200, U64 G1
training, one call (results/startup/warm_cache_file_2026-12-01/): first update 41.75 s from
launch on a cold cache, 42.86 s warm (no child; the first update compiled nothing), stock UniLab
eager 42.13 s; compile ahead off 101.9 s (results/startup/idle_compile_2026-12-01/).
``1``/``wait``: the first update waits for the child
(in an earlier U64 run UniLab left only 6-29 s to overlap). ``0``/``off``: the start-up compile
runs in ``prepare_for_collection`` on every CPU (``parallel_compile``). The child copies the
parent's matmul settings one by one (MATMUL_SETTINGS): ``torch.set_float32_matmul_precision``
would change ``matmul.fp32_precision``, part of Inductor's FX-graph cache key, and the parent
would reuse none of the child's graphs (as in that earlier run).

    python -m flashsac_opt.compile_ahead SPEC.json    # the child (CompileAhead starts it)
    python -m flashsac_opt.compile_ahead --wait SPEC.json PARENT_PID    # prespawned (Prespawned)
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import warnings
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping, Sequence

import torch

ENV_SWITCH = "FLASHSAC_OPT_COMPILE_AHEAD"
SPLIT_ENV = "FLASHSAC_OPT_COMPILE_AHEAD_SPLIT"
# One child per network (the default): Dynamo, AOTAutograd and Inductor's lowering run serially
# in the process that compiles, so two children compile the critic's and the actor's update side
# by side, each with its own workers. The protocol's cold seed on the H200 (U64, MPS, one call,
# results/startup/compile_ahead_split_2026-12-05/): one child 62.1 s; split, critic 35.9 s and
# actor 37.4 s at once; compiled training from 75.3 s after launch instead of 100.8 s.
SPLIT_SHARES = (("critic",), ("actor",))
OFF_VALUES = ("", "0", "false", "no", "off")  # what both switches read as off, and as on
ON_VALUES = ("1", "true", "yes", "on")
STOP_GRACE_S = 5.0
PRESPAWN_ENV = "FLASHSAC_OPT_COMPILE_AHEAD_PRESPAWN"  # "1": the children start at launch (prespawn())
PRESPAWN_WAIT_S = 900.0  # a prespawned child given no spec in this time exits by itself
DIMS = ("obs_dim", "critic_obs_dim", "action_dim")


def available_cpus() -> int:
    """The CPUs this process may run on (its affinity mask, e.g. a taskset share of a host)."""
    getaffinity = getattr(os, "sched_getaffinity", None)
    return len(getaffinity(0)) if getaffinity is not None else (os.cpu_count() or 1)


@contextlib.contextmanager
def parallel_compile(threads: int | None = None) -> Iterator[None]:
    """Inductor compiles with ``threads`` workers (default: every CPU this process may use)
    inside, and with the previous setting after.

    UniLab's thread budget (training.torch_threads.compile_threads: auto, i.e. 1 below 64
    CPUs, exported as TORCHINDUCTOR_COMPILE_THREADS) keeps compiles during training off the
    collector's cores. The start-up compile runs before the collector exists, where one worker
    only serializes the Triton compiles: on the H200 host with 16 cores the patched U64 start-up
    compile took ~115 s with one worker against ~40 s for the same graphs with 16 (the
    learner benchmark's cold start)."""
    from torch._inductor import config

    previous = config.compile_threads
    config.compile_threads = max(1, int(threads or available_cpus()))
    try:
        yield
    finally:
        config.compile_threads = previous


def mode() -> str:
    """FLASHSAC_OPT_COMPILE_AHEAD: "background" (default: the training runs uncompiled until the
    child is done, then compiles from its caches: Engine.defer_compile); "wait" (1/true/yes/on:
    the first update waits for the child); "off" (0/false/no/off/empty). Anything else is refused."""
    value = os.environ.get(ENV_SWITCH, "background").strip().lower()
    if value in OFF_VALUES:
        return "off"
    if value in (*ON_VALUES, "wait"):
        return "wait"
    if value == "background":
        return "background"
    raise ValueError(f"{ENV_SWITCH}={value!r}: expected 0/off, 1/wait or background")


def split_shares() -> tuple[tuple[str, ...], ...] | None:
    """FLASHSAC_OPT_COMPILE_AHEAD_SPLIT: "1" (the default; 1/true/yes/on): one child per network
    (SPLIT_SHARES); "0" (0/false/no/off/empty): one child for the whole learner, which also
    writes the compile-cache file (split, the training process writes it after its switch).
    Anything else is refused."""
    return SPLIT_SHARES if on_off_switch(SPLIT_ENV, "1") else None


def on_off_switch(name: str, default: str) -> bool:
    """The environment variable ``name`` (``default`` when unset) as on (ON_VALUES) or off
    (OFF_VALUES); anything else is refused."""
    value = os.environ.get(name, default).strip().lower()
    if value in ON_VALUES:
        return True
    if value in OFF_VALUES:
        return False
    raise ValueError(f"{name}={value!r}: expected 0/off or 1/on")


def enabled() -> bool:
    return mode() != "off"


# Where a compile's time goes, from torch's own compile timers (torch._dynamo.utils'
# compilation_time_metrics: seconds per timed phase; the phases nest). Only async_compile.wait
# runs on the worker pool (Triton or C++ kernels built in parallel); the rest is serial Python
# in the compiling process, so more CPUs cannot shorten it.
COMPILE_PHASES = {
    "dynamo_total": "_compile.compile_inner",  # all of it, per compiled frame
    "dynamo_bytecode_tracing": "bytecode_tracing",
    "aot_autograd_and_inductor": "create_aot_dispatcher_function",
    "inductor_compile_fx_inner": "compile_fx_inner",
    "inductor_lowering": "GraphLowering.run",
    "inductor_scheduler_init": "Scheduler.__init__",
    "inductor_scheduler_codegen": "Scheduler.codegen",
    "inductor_wait_for_kernel_compiles": "async_compile.wait",
}


def compile_time_totals() -> dict[str, float]:
    """Seconds per COMPILE_PHASES entry so far in this process ({} where torch lacks the timers)."""
    try:
        from torch._dynamo.utils import compilation_time_metrics
    except ImportError:
        return {}
    return {name: float(sum(compilation_time_metrics.get(key, ()))) for name, key in COMPILE_PHASES.items()}


def precompile(learner: Any) -> dict[str, Any]:
    """Run one update of ``learner`` (a fresh FlashSACLearner) on a synthetic batch of
    ``batch_size x updates_per_step`` rows: every compile the first real update would do, done
    now. Returns what it did (seconds, where torch's compile spent them, compile-cache file and
    whether it was loaded or written).
    ``flashsac-opt precompile`` and the compile-ahead child both run this."""
    from flashsac_opt.testing.oracle import synthetic_batch

    start, before = time.perf_counter(), compile_time_totals()
    cfg = learner.cfg
    rows = cfg.batch_size * cfg.updates_per_step
    batch = synthetic_batch(
        rows, learner.obs_dim, learner.critic_obs_dim, learner.action_dim, torch.Generator().manual_seed(0), device=learner.device
    )
    learner.update(batch)
    if learner.device.type == "cuda":
        torch.cuda.synchronize(learner.device)
    engine = learner.engine
    after = compile_time_totals()
    return {
        "seconds": time.perf_counter() - start,
        "compile_phases_s": {name: after[name] - before.get(name, 0.0) for name in after},
        "compiled": engine.compiled,
        "device": str(learner.device),
        "rows": rows,
        "compile_cache_file": engine.compile_cache_file,
        "compile_cache_loaded": engine.compile_cache_loaded,
        "compile_cache_saved": engine.compile_cache_saved,
        "precompiled_steps": engine.precompiled_report(),
    }


def _exit_when_orphaned(parent: int, period_s: float = 1.0) -> None:
    """In the child: a daemon thread that ends the process once its parent is gone (a killed
    parent runs no atexit; then the child is re-parented and getppid() changes)."""

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(period_s)
        print(f"compile-ahead: parent {parent} is gone; exiting", file=sys.stderr, flush=True)
        os._exit(3)

    threading.Thread(target=watch, name="compile-ahead-orphan-watch", daemon=True).start()


# torch.backends settings that Inductor's FX-graph cache key reads (codecache.FxGraphHashDetails).
# Copied attribute by attribute: torch.set_float32_matmul_precision("highest") would also turn
# matmul.fp32_precision from "none" into "ieee", a different key for the same code, and the
# parent would find none of the child's graphs.
MATMUL_SETTINGS = (
    ("cuda.matmul", "fp32_precision"),
    ("cuda.matmul", "allow_fp16_reduced_precision_reduction"),
    ("cuda.matmul", "allow_bf16_reduced_precision_reduction"),
    ("cudnn", "fp32_precision"),
)


def _backend(path: str) -> Any:
    module = torch.backends
    for part in path.split("."):
        module = getattr(module, part)
    return module


def matmul_settings() -> dict[str, Any]:
    """This process's MATMUL_SETTINGS (those this torch has)."""
    out = {}
    for path, name in MATMUL_SETTINGS:
        backend = _backend(path)
        if hasattr(backend, name):
            out[f"{path}.{name}"] = getattr(backend, name)
    return out


def apply_matmul_settings(settings: Mapping[str, Any]) -> None:
    for key, value in settings.items():
        path, name = key.rsplit(".", 1)
        backend = _backend(path)
        if getattr(backend, name) != value:  # an untouched setting stays untouched
            setattr(backend, name, value)


class WarmCache:
    """What stands in for the child when this configuration's compile-cache file is there and
    loaded (``Engine.open_compile_cache``): every graph and kernel is in torch's caches, so a
    child would only repeat, beside the collector, a compile from them that this process does
    anyway. The compile happens in this process while UniLab's runner waits for its collector
    to start (the adapter's ``use_startup_idle_time``), else at the first update. Done from the
    start; the CompileAhead interface."""

    in_this_process = True  # the adapter compiles in the runner's wait, not at prepare_for_collection
    running = False
    done = True

    def __init__(self, file: str):
        self.report: dict[str, Any] = {"seconds": 0.0, "compile_cache_file": file, "child": False}
        self.waited_s: float | None = None

    def wait(self, timeout: float | None = None) -> bool:
        self.waited_s = 0.0
        return True

    def stop(self) -> None:
        pass


class CompileAhead:
    """Child processes compiling ``cfg`` for ``dims`` on ``device`` (see the module doc): one for
    the whole learner, or one per share of its networks (``shares``, e.g. SPLIT_SHARES)."""

    def __init__(self, cfg: Any, dims: Mapping[str, int], device: str | torch.device,
                 shares: Sequence[Sequence[str]] | None = None):
        self.device = torch.device(device)
        self.shares: list[list[str] | None] = [list(share) for share in shares] if shares else [None]
        ready = _take_prespawned(len(self.shares))
        self.prespawned = ready is not None
        self.folder = ready.folder if ready else Path(tempfile.mkdtemp(prefix="flashsac_opt_compile_ahead_"))
        self.logs = [self.folder / f"child_{i}.log" for i in range(len(self.shares))]
        self.report_files = [self.folder / f"report_{i}.json" for i in range(len(self.shares))]
        self.processes: list[subprocess.Popen] = ready.processes if ready else []
        for i, (share, log_file, report_file) in enumerate(zip(self.shares, self.logs, self.report_files)):
            spec = {
                "config": dataclasses.asdict(cfg),
                "dims": {k: int(dims[k]) for k in DIMS},
                "device": str(self.device),
                "networks": share,  # None: every network
                # Global settings in Inductor's FX-graph cache key: the child takes the parent's.
                "matmul_settings": matmul_settings(),
                # and the thread count, in Dynamo's global-state guard (a precompiled step saved
                # under another count is refused): UniLab sets the learner's after launch, after a
                # prespawned child imported torch with the launch's
                "torch_threads": torch.get_num_threads(),
                "report": str(report_file),
                "parent": os.getpid(),
            }
            spec_file = self.folder / f"spec_{i}.json"
            if ready:  # the child waits for this file: written whole, then renamed into place
                spec["environ"] = dict(os.environ)  # this process's, as a child started now would have it
                tmp = spec_file.with_suffix(".tmp")
                tmp.write_text(json.dumps(spec))
                os.replace(tmp, spec_file)
                continue
            spec_file.write_text(json.dumps(spec))
            with open(log_file, "wb") as log:
                self.processes.append(subprocess.Popen(
                    [sys.executable, "-m", "flashsac_opt.compile_ahead", str(spec_file)],
                    stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                ))
        self.report: dict[str, Any] | None = None
        self.waited_s: float | None = None
        self.failed = False  # wait() warned naming a log: the folder stays for it
        atexit.register(self.stop)

    in_this_process = False

    @classmethod
    def start_if_useful(
        cls, cfg: Any, dims: Mapping[str, int], device: torch.device, *, compiled: bool, warm_cache: "Callable[[], str | None] | None" = None
    ) -> "CompileAhead | WarmCache | None":
        """Children for a compiled learner on CUDA when turned on; None otherwise (eager has
        nothing to compile, and on CPU the compile would take the cores the collector needs).
        In the background mode, ``warm_cache`` (the loaded compile-cache file, or None) is asked
        first: with one, no child (``WarmCache``). FLASHSAC_OPT_COMPILE_AHEAD_SPLIT picks one
        child per network share (``split_shares``)."""
        if not compiled or torch.device(device).type != "cuda" or not torch.cuda.is_available() or not enabled():
            release_prespawned()
            return None
        if mode() == "background" and warm_cache is not None:
            file = warm_cache()
            if file is not None:
                release_prespawned()
                return WarmCache(file)
        return cls(cfg, dims, device, shares=split_shares())

    @property
    def process(self) -> subprocess.Popen:
        """The first child (the only one without shares)."""
        return self.processes[0]

    @property
    def running(self) -> bool:
        return any(process.poll() is None for process in self.processes)

    @property
    def done(self) -> bool:
        """Every child exited, or wrote its report: it writes the report after everything it
        compiled is in the caches, and what is left then is its interpreter's teardown (the
        compile workers' shutdown among it), for which no update should wait."""
        return all(process.poll() is not None or report.is_file() for process, report in zip(self.processes, self.report_files))

    def wait(self, timeout: float | None = None) -> bool:
        """Wait for the children; True when every one compiled, else one warning (the caller
        compiles what is missing)."""
        start = time.perf_counter()
        codes = [_wait_child(process, report, None if timeout is None else max(0.0, timeout - (time.perf_counter() - start)))
                 for process, report in zip(self.processes, self.report_files)]
        self.waited_s = time.perf_counter() - start
        failed = [i for i, rc in enumerate(codes) if rc != 0 or not self.report_files[i].is_file()]
        if not failed:
            self.report = merged_report([json.loads(report.read_text()) for report in self.report_files])
            shutil.rmtree(self.folder, ignore_errors=True)  # kept only when it failed: the log says why
            return True
        log, rc = self.logs[failed[0]], codes[failed[0]]
        tail = log.read_text(errors="replace").strip().splitlines()[-1:] if log.is_file() else []
        why = "timed out" if rc is None else f"exit status {rc}"
        self.failed = True
        warnings.warn(
            f"flashsac_opt compile-ahead child failed ({why}{': ' + tail[0][:200] if tail else ''}; log {log}); "
            "compiling in the training process instead",
            stacklevel=2,
        )
        return False

    def stop(self) -> None:
        """Stop the children that still run and remove their folder, unless a failure's warning
        named a log in it (also at exit: nothing is left behind in the temporary directory)."""
        for process in self.processes:
            _terminate(process)
        if not self.failed:
            shutil.rmtree(self.folder, ignore_errors=True)


class Prespawned:
    """Compile-ahead children started at launch (``prespawn``), before the learner exists: each
    imports torch, Dynamo, Inductor and the learner while UniLab starts, then waits for its spec
    file, which ``CompileAhead`` writes once the dimensions are known. On the H200 a child started
    at the learner's construction began compiling 10-11 s later, most of it imports
    (results/time_to_reward/protocol_u64_mps_short_h200_2026-12-06, the cold seed's stack samples):
    on a cold start that is on the path to the first compiled update."""

    def __init__(self, count: int):
        self.folder = Path(tempfile.mkdtemp(prefix="flashsac_opt_compile_ahead_"))
        self.processes: list[subprocess.Popen] = []
        for i in range(count):
            with open(self.folder / f"child_{i}.log", "wb") as log:
                self.processes.append(subprocess.Popen(
                    [sys.executable, "-m", "flashsac_opt.compile_ahead", "--wait", str(self.folder / f"spec_{i}.json"), str(os.getpid())],
                    stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                ))
        atexit.register(self.release)

    def release(self) -> None:
        """Stop the children (none was given a spec) and remove their folder."""
        for process in self.processes:
            _terminate(process)
        shutil.rmtree(self.folder, ignore_errors=True)


_prespawned: Prespawned | None = None


def prespawn_wanted() -> bool:
    """FLASHSAC_OPT_COMPILE_AHEAD_PRESPAWN: "1" (1/true/yes/on) starts the children at launch,
    "0" (the default, until measured on the GPU) at the learner's construction. Anything else is
    refused."""
    return on_off_switch(PRESPAWN_ENV, "0")


def prespawn(*, cuda_required: bool = True) -> Prespawned | None:
    """At launch (the UniLab patch's launch hook): start the compile-ahead children now when
    asked (``prespawn_wanted``), compile ahead is on, the machine has an NVIDIA device (checked
    by its device files: no CUDA call in the launching process) and the compile-cache folder
    holds no compile-cache file at all (a fresh machine; a warm start needs no child, and a
    machine that has compiled before takes the usual path). ``CompileAhead`` adopts them;
    ``start_if_useful`` stops them when it starts none."""
    global _prespawned
    from flashsac_opt import compile_cache

    if _prespawned is not None or not prespawn_wanted() or not enabled():
        return _prespawned
    if cuda_required and not any(Path("/dev").glob("nvidia[0-9]*")):
        return None
    folder = compile_cache.default_dir()
    if folder.is_dir() and any(folder.glob("*.bin")):
        return None
    _prespawned = Prespawned(len(split_shares() or (None,)))
    return _prespawned


def _take_prespawned(count: int) -> Prespawned | None:
    """The prespawned children for ``count`` shares, now owned by the caller; None when there
    are none, or another number (those are stopped)."""
    global _prespawned
    ready, _prespawned = _prespawned, None
    if ready is not None and len(ready.processes) != count:
        ready.release()
        return None
    if ready is not None:
        atexit.unregister(ready.release)  # the CompileAhead's stop() owns them now
    return ready


def release_prespawned() -> None:
    """Stop prespawned children nobody will give a spec to."""
    global _prespawned
    ready, _prespawned = _prespawned, None
    if ready is not None:
        atexit.unregister(ready.release)
        ready.release()


def _wait_for_spec(spec_file: Path, timeout_s: float = PRESPAWN_WAIT_S) -> dict[str, Any] | None:
    """In a prespawned child: the spec once its file appears (the parent renames it into place
    whole), None after ``timeout_s``."""
    end = time.monotonic() + timeout_s
    while not spec_file.is_file():
        if time.monotonic() > end:
            return None
        time.sleep(0.02)
    return json.loads(spec_file.read_text())


def _wait_child(process: subprocess.Popen, report: Path, timeout: float | None) -> int | None:
    """A child's exit status (0 once its report is written: only its teardown is left, which is
    stopped), None when it timed out (then stopped)."""
    if process.poll() is None and report.is_file():
        _terminate(process)
        return 0
    try:
        return process.wait(timeout)
    except subprocess.TimeoutExpired:
        _terminate(process)
        return None


def _terminate(process: subprocess.Popen) -> None:
    """SIGTERM, then SIGKILL after a grace period."""
    if process.poll() is not None:
        return
    process.terminate()
    try:
        process.wait(STOP_GRACE_S)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


def merged_report(reports: list[dict[str, Any]]) -> dict[str, Any]:
    """One child's report as it is; several children's as one: the longest one's seconds (they
    ran side by side), each child's report under ``children``."""
    if len(reports) == 1:
        return reports[0]
    return {"seconds": max(r["seconds"] for r in reports), "compiled": all(r.get("compiled") for r in reports),
            "device": reports[0].get("device"), "rows": reports[0].get("rows"), "compile_cache_file": None,
            "children": reports}


def main(argv: list[str] | None = None) -> int:
    from flashsac_opt.config import FlashSACConfig
    from flashsac_opt.learner import FlashSACLearner

    args = sys.argv[1:] if argv is None else argv
    if len(args) == 3 and args[0] == "--wait":  # prespawned: the imports above are done, the spec comes later
        _exit_when_orphaned(int(args[2]))
        from torch._inductor import compile_fx  # noqa: F401 - the compile's own imports, before the spec too

        spec = _wait_for_spec(Path(args[1]))
        if spec is None:
            print(f"compile-ahead: no spec in {PRESPAWN_WAIT_S:.0f} s; exiting", file=sys.stderr)
            return 4
        # the parent's environment now (UniLab's thread budget, CUDA and MPS variables set after launch)
        os.environ.clear()
        os.environ.update(spec.pop("environ"))
    elif len(args) == 1:
        spec = json.loads(Path(args[0]).read_text())
        _exit_when_orphaned(spec["parent"])
    else:
        print("usage: python -m flashsac_opt.compile_ahead SPEC.json | --wait SPEC.json PARENT_PID", file=sys.stderr)
        return 2
    apply_matmul_settings(spec["matmul_settings"])
    if spec.get("torch_threads") and torch.get_num_threads() != spec["torch_threads"]:
        torch.set_num_threads(spec["torch_threads"])
    cfg, dims = FlashSACConfig(**spec["config"]), spec["dims"]
    with parallel_compile():  # the parent's TORCHINDUCTOR_COMPILE_THREADS (UniLab's budget) is inherited
        learner = FlashSACLearner(cfg, dims["obs_dim"], dims["critic_obs_dim"], dims["action_dim"], device=spec["device"])
        if spec.get("networks"):
            learner.engine.compile_only(spec["networks"])
        report = {**precompile(learner), "networks": spec.get("networks"), "torch_threads": torch.get_num_threads()}
    tmp = Path(spec["report"] + ".tmp")
    tmp.write_text(json.dumps(report))
    os.replace(tmp, spec["report"])
    print(json.dumps(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
