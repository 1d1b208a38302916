"""UniLab's collector process, started from an interpreter that imported its modules at launch
(patches/0005-startup-collector-preload).

UniLab 1.5.2 starts its MuJoCo collector with multiprocessing's "spawn" once the learner process
has finished its own start: a fresh interpreter that then imports torch, Dynamo, Inductor and
UniLab's env stack before it builds its 256 envs. On the H200 those imports were about 15 s of the
collector's 19 s start, all of it after the learner process's own 19 s
(results/startup/warm_cache_file_2026-12-01/startup_summary.json, stock and patched alike).

`start_preload()`, called at the top of UniLab's train script, starts a multiprocessing forkserver
at launch whose server imports those modules while the learner process starts (on other cores).
`process_args()` then gives UniLab's `_start_collector` the forkserver context: the collector is
forked from the server, already past its imports, and first takes the learner process's
environment as it is at that moment (what spawn would have given it: the thread budget, CUDA and
MPS variables UniLab sets after launch). Everything after that is UniLab's own collector code.

The server never initializes CUDA (a forked child could not use it otherwise): importing torch,
Dynamo and Inductor does not. FLASHSAC_OPT_COLLECTOR_PRELOAD=0 keeps UniLab's spawn.

Being the patch's launch hook, `start_preload()` also fixes Triton's assembler for the whole
training before anything compiles (flashsac_opt.toolchain), preload or not, and then starts the
compile-ahead children where FLASHSAC_OPT_COMPILE_AHEAD_PRESPAWN=1 asks for it (compile_ahead.prespawn).
The host-CPU switches of host_cpus.py act here too: blocking sync in the hook, the collector's CPUs
in the forked collector; so does FLASHSAC_OPT_COLLECTOR_EAGER (a forked collector that compiles nothing).
"""

from __future__ import annotations

import importlib
import multiprocessing
import os
import sys

from flashsac_opt import toolchain
from flashsac_opt.unilab import host_cpus

DISABLE_ENV = "FLASHSAC_OPT_COLLECTOR_PRELOAD"  # "0": UniLab's spawn, nothing preloaded
_SERVER_ENV = "FLASHSAC_OPT_COLLECTOR_PRELOAD_SERVER"  # set only while the server starts
_NVML_CHECK_ENV = "PYTORCH_NVML_BASED_CUDA_CHECK"
# What a spawned collector imported before its envs existed (its stack samples in the JSON above):
# UniLab's training stack, its env modules and MuJoCo, and Dynamo and Inductor's config, which
# UniLab's compiled reset (envs/mdp/events.py) and its thread budget import. Not Inductor's
# compile_fx: in torch 2.11 it imports runtime/benchmarking.py, which asks torch.cuda.is_available()
# at import, and that CUDA driver query marks the process so that a forked child refuses CUDA
# (results/startup/collector_preload_2026-12-04/fork_safety.json).
PRELOAD_MODULES = (
    "torch",
    "torch._dynamo",
    "torch._inductor.config",
    "mujoco",
    "unilab.scripts.train_offpolicy",
    "unilab.rl.runtime.offpolicy.worker",
    "unilab.envs.mdp.events",
)

# "1": the server imports Inductor's compile_fx as well (off until measured on the GPU). A warm
# collector otherwise imports it inside UniLab's first torch.compile(): 0.9 s of its 4.5-s start on
# the CPU (results/startup/collector_start_cpu_2026-12-07). Its import asks torch.cuda.is_available()
# (torch 2.11), which is fork-safe only where NVML answers; elsewhere the server leaves it out.
COMPILER_ENV = "FLASHSAC_OPT_COLLECTOR_PRELOAD_COMPILER"
COMPILER_MODULE = "torch._inductor.compile_fx"

# The forked collector runs every torch.compile'd function eagerly (torch.compiler.set_stance
# "force_eager") with "1", never with "0", and by default ("auto", or unset) when its tensors live on
# the CPU (UniLab's opt-in CPU carrier, training.collector_tensor_device=cpu; on a CPU-only machine
# always). UniLab compiles one thing there, the G1 root reset (envs/mdp/events.py, dynamic=True), at
# the collector's first reset. On the CPU carrier Inductor builds it in C++: on the 2-core development
# machine (results/startup/collector_eager_cpu_2026-12-07) its first reset took 15.05 s on an empty
# cache, 4.10 s on a warm one and 0.84 s eager, and it saved nothing per step (6.24 against 6.16 ms);
# on one H100 a warm protocol seed's first update came at 27.0 s compiled and 16.6 s eager
# (results/time_to_reward/protocol_carriers_h100_2026-12-07.json). On the CUDA carrier the compiled
# reset stays: eager changed nothing there (results/time_to_reward/collector_eager_warm_s2_h100_2026-12-07).
EAGER_ENV = "FLASHSAC_OPT_COLLECTOR_EAGER"

_context: multiprocessing.context.BaseContext | None = None


def enabled() -> bool:
    return os.environ.get(DISABLE_ENV, "1") != "0" and "forkserver" in multiprocessing.get_all_start_methods()


def start_preload() -> bool:
    """Start the preloading server (once per process); False when disabled or unavailable.
    First, in either case, one Triton assembler for this process and every process it starts
    (toolchain.py): this is the launch hook, and it runs before anything has compiled."""
    global _context
    toolchain.align_triton_toolchain()
    if _context is not None:
        return True
    host_cpus.spare_cpus_from_env()  # a malformed switch stops the training here, not in its collector
    collector_eager_wanted()
    if host_cpus.blocking_sync_wanted():  # before torch creates a CUDA context (host_cpus.py)
        print(f"flashsac_opt: {host_cpus.BLOCKING_SYNC_ENV}=1: {host_cpus.set_blocking_sync()}", file=sys.stderr, flush=True)
    if not enabled():
        _prespawn_compile_ahead()
        return False
    from multiprocessing import forkserver

    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload([__name__])
    # The server inherits both and imports PRELOAD_MODULES; nothing else does. With NVML's count,
    # torch.cuda.is_available() in an import does not query the CUDA driver (a driver query would
    # leave every forked child unable to use CUDA); a collector gets the learner's own environment.
    saved = {key: os.environ.get(key) for key in (_SERVER_ENV, _NVML_CHECK_ENV)}
    os.environ.update({_SERVER_ENV: "1", _NVML_CHECK_ENV: "1"})
    try:
        forkserver.ensure_running()  # returns at once: the server imports on its own
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
    _context = context
    _prespawn_compile_ahead()
    return True


def _prespawn_compile_ahead() -> None:
    """The compile-ahead children at launch where FLASHSAC_OPT_COMPILE_AHEAD_PRESPAWN asks for them
    (compile_ahead.prespawn): the launch hook is the earliest point of a UniLab training. After the
    server has started: both import torch side by side. Unset (off), not even compile_ahead is
    imported: it imports torch, which this hook otherwise leaves to UniLab's own order."""
    if os.environ.get("FLASHSAC_OPT_COMPILE_AHEAD_PRESPAWN") is None:
        return
    from flashsac_opt import compile_ahead

    compile_ahead.prespawn()


def process_args(context, target, target_fn, error_conn, kwargs: dict):
    """UniLab's collector Process(context, target, args) from its spawn context, its entry
    wrapper and that wrapper's (target_fn, error_conn, kwargs): through the preloaded server when
    start_preload() ran in this process, UniLab's own otherwise.

    A forked collector's parent is the server, not the learner process: UniLab's parent-death
    watchdog (it polls os.getppid() against kwargs["_parent_pid"]) watches the server instead,
    which exits as soon as the learner process is gone (its end of a pipe closes, SIGKILL too),
    so the collector is reparented and stops as before."""
    if _context is None:
        return context, target, (target_fn, error_conn, kwargs)
    from multiprocessing import forkserver

    server_pid = forkserver._forkserver._forkserver_pid  # set by ensure_running(); private, 3.8-3.13
    if server_pid is None:
        raise RuntimeError("flashsac_opt collector preload: the forkserver is not running")
    kwargs = {**kwargs, "_parent_pid": server_pid}
    return _context, run_in_environ, (dict(os.environ), target, (target_fn, error_conn, kwargs))


def run_in_environ(environ: dict, target, args: tuple):
    """The collector's entry in the forked child: the learner process's environment of the moment
    it was started, then UniLab's own entry."""
    os.environ.clear()
    os.environ.update(environ)
    # multiprocessing hands each forked child the write end of the pipe whose closing tells the
    # server its starter is gone (so a child could start processes of its own through it); while
    # the collector held it, the server, and so the collector, outlived a killed learner process
    from multiprocessing import forkserver

    if forkserver._forkserver._forkserver_alive_fd is not None:
        os.close(forkserver._forkserver._forkserver_alive_fd)
        forkserver._forkserver._forkserver_alive_fd = None
    confined = host_cpus.confine_collector()  # before UniLab sizes MuJoCo's pool to this process's CPUs
    if confined is not None:
        print(f"flashsac_opt: {host_cpus.SPARE_ENV}: the collector runs on CPUs {confined['collector_cpus']}, "
              f"leaving {confined['spared_cpus']} to the learner process", file=sys.stderr, flush=True)
    _target_fn, _error_conn, collector_kwargs = args  # as process_args built them
    tensor_device = (collector_kwargs.get("env_cfg_override") or {}).get("collector_tensor_device")  # UniLab routes it there
    if collector_eager_wanted(tensor_device):
        import torch as eager_torch

        eager_torch.compiler.set_stance("force_eager")  # the whole process: UniLab's compiled reset runs eagerly
        print(f"flashsac_opt: the collector compiles nothing ({EAGER_ENV}={os.environ.get(EAGER_ENV, 'auto')}, "
              f"its tensors on {tensor_device})", file=sys.stderr, flush=True)
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda._is_in_bad_fork():
        raise RuntimeError("flashsac_opt collector preload: a preloaded import queried the CUDA driver in the server, so this "
                           "forked collector cannot use CUDA; run with FLASHSAC_OPT_COLLECTOR_PRELOAD=0 (UniLab's spawn) "
                           "and report the torch version")
    return target(*args)


def collector_eager_wanted(tensor_device: object = None) -> bool:
    """FLASHSAC_OPT_COLLECTOR_EAGER: "1" on, "0" off, "auto" or unset: on for a collector whose
    tensors live on the CPU (the ``collector_tensor_device`` UniLab routes into the collector's env
    override: "cpu", "cuda:0", ...); anything else a clear error. The launch hook asks first, with
    no device, so that a malformed value stops the training before it starts."""
    value = os.environ.get(EAGER_ENV, "auto")
    if value not in ("0", "1", "auto"):
        raise ValueError(f"{EAGER_ENV} must be 0, 1 or auto, got {value!r}")
    return eager_for(value, tensor_device)


def eager_for(value: str, tensor_device: object) -> bool:
    """The switch's rule, for a checked value: "1" on, "0" off, "auto" on where the collector's tensors
    live on the CPU (a device "cpu", "cuda:0", ..., or None when unknown). time_to_reward.py reads the
    value a training report recorded through it."""
    if value == "auto":
        return tensor_device is not None and str(tensor_device).split(":")[0] == "cpu"
    return value == "1"


def _import_collector_modules() -> None:
    """In the server: import what the collector needs. A module that fails is reported and
    skipped (the collector then imports it itself, as under spawn); the server must not die."""
    for name in PRELOAD_MODULES:
        _preload(name)
    try:
        from unilab.training.common import ensure_registries  # the env modules the registry names

        ensure_registries()
    except Exception as exc:  # noqa: BLE001
        print(f"flashsac_opt collector preload: UniLab's env registry not preloaded: {exc!r}", file=sys.stderr)
    torch = sys.modules.get("torch")
    if os.environ.get(COMPILER_ENV, "0") == "1" and torch is not None:
        why = (_import_poisons_fork(COMPILER_MODULE) if compiler_import_is_fork_safe(torch)
               else "NVML does not count the GPUs here")
        if why is None:
            _preload(COMPILER_MODULE)
        else:
            print(f"flashsac_opt collector preload: {COMPILER_MODULE} not preloaded: {why}", file=sys.stderr)
    if torch is not None and torch.cuda.is_initialized():  # a forked child could not use CUDA
        raise RuntimeError("flashsac_opt collector preload: CUDA was initialized in the forkserver")


def _preload(name: str) -> None:
    """Import ``name`` in the server; a failure is reported and skipped (the collector then imports
    it itself, as under spawn): the server must not die."""
    try:
        importlib.import_module(name)
    except Exception as exc:  # noqa: BLE001 - any failure only costs the collector its import
        print(f"flashsac_opt collector preload: {name} not preloaded: {exc!r}", file=sys.stderr)


def _import_poisons_fork(module: str) -> str | None:
    """Import ``module`` in a throw-away child of the server and fork a grandchild there that tells
    whether it could still use CUDA: None when it could, else why not. The server's own import
    follows only then, so a CUDA query this reasoning missed costs the preload, never a collector."""
    pid = os.fork()
    if pid == 0:  # the child: exit codes 0 clean, 3 poisoned, 4 the import failed
        code = 4
        try:
            importlib.import_module(module)
            probe = os.fork()
            if probe == 0:
                os._exit(3 if sys.modules["torch"].cuda._is_in_bad_fork() else 0)
            code = os.waitstatus_to_exitcode(os.waitpid(probe, 0)[1])
        finally:
            os._exit(code)
    code = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
    return {0: None, 3: "its import asked the CUDA driver (a forked child could not use CUDA)",
            4: "its import failed"}.get(code, f"the probe ended with {code}")


def compiler_import_is_fork_safe(torch) -> bool:
    """Whether importing Inductor's compile_fx leaves a forked child able to use CUDA: its
    torch.cuda.is_available() (torch 2.11's runtime/benchmarking.py) counts through NVML under
    PYTORCH_NVML_BASED_CUDA_CHECK=1 (the server has it) and falls back to the CUDA driver only where
    NVML fails. A torch without CUDA asks nothing."""
    cuda = torch.cuda
    if not cuda._is_compiled():
        return True
    nvml_check, nvml_count = getattr(cuda, "_nvml_based_avail", None), getattr(cuda, "_device_count_nvml", None)
    if nvml_check is None or nvml_count is None:  # private helpers of torch 2.x; another torch: not preloaded
        return False
    return bool(nvml_check()) and nvml_count() >= 0


if os.environ.get(_SERVER_ENV) == "1":  # this interpreter is the server start_preload() started
    os.environ.pop(_SERVER_ENV, None)
    _import_collector_modules()
