"""flashsac_opt's learner behind the interface UniLab 1.5.2's off-policy runtime drives.

``build_unilab_learner`` is what patches/0001 calls in place of UniLab's
``FlashSACLearner(device=device, **learner_kwargs)``. The runtime then uses:

- the whole-cycle path: ``use_update_cycle`` -> ``update_cycle(...)`` +
  ``read_deferred_cycle_metrics()`` (one device-to-host copy per iteration);
- or the per-update path: ``update_critic`` / ``update_actor`` / ``soft_update_target`` +
  ``read_deferred_actor_metrics()``;
- ``actor.explore(obs, dones, deterministic)`` for learner-served collection;
- ``update_reward_stats`` / ``reward_normalizer``, ``update_count``;
- ``get_state_dict`` / ``load_state_dict`` in UniLab's ``model_N.pt`` layout, so stock
  UniLab's play/eval (which rebuilds its own actor) loads flashsac_opt checkpoints;
- ``prepare_for_collection`` to compile/capture before collection starts (or, while the
  compile-ahead child still compiles, to let collection start; compile_ahead.py), and
  ``use_startup_idle_time`` (patches/0004) to do that compile while the runner waits for its
  collector to start.

Metric names are UniLab's registered tags only: UniLab's logger rejects any other name.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch

from flashsac_opt import compile_cache
from flashsac_opt.compile_ahead import OFF_VALUES, ON_VALUES, CompileAhead, compile_time_totals, parallel_compile
from flashsac_opt.compile_ahead import mode as compile_ahead_mode
from flashsac_opt.config import UNILAB_RUN_DEFAULTS, FlashSACConfig
from flashsac_opt.learner import FlashSACLearner
from flashsac_opt.metrics import unilab_metrics
from flashsac_opt.unilab import run_ahead
from flashsac_opt.unilab.compat import from_unilab_state_dict, to_unilab_state_dict

# Set to "PATH:N" to save the first N large batches the runtime hands to update_cycle (real
# replay samples, moved to CPU) to PATH: the input of experiments/validate_replay_stability.py.
RECORD_REPLAY_ENV = "FLASHSAC_OPT_RECORD_REPLAY"
# Set to a file path to have the learner append its start-up milestones there, one JSON line
# each (event, unix time, pid): the training benchmark's start-up timeline, which tells UniLab's
# own start from the compile and capture in a run's launch -> first update.
STARTUP_EVENTS_ENV = "FLASHSAC_OPT_STARTUP_EVENTS"
# The sections of a checkpoint that stock UniLab's eval and resume load: the networks.
CHECKPOINT_NETWORKS = ("actor", "critic", "target_critic", "temperature")
UNILAB_CYCLE_METRICS = ("Loss/critic", "Train/reward_scale_std", "Loss/actor", "Loss/entropy", "Policy/temperature", "Loss/temperature")
# UniLab learner kwargs that flashsac_opt has no use for (its own compile/graph flags).
_IGNORED = {"actor_lr", "critic_lr", "use_compile", "compile_full_objectives", "use_whole_cycle_cuda_graph", "dp_whole_cycle_cuda_graph"}


def unilab_compile_cache_file(value: Any) -> str | None:
    """The compile-cache file for a UniLab run: the keyed default file (compile_cache.AUTO)
    unless the config names a path, or "off" / "none" for no file (algo_params.compile_cache_file;
    patch 0001 passes null when the key is absent)."""
    if value is None:
        return compile_cache.AUTO
    text = str(value).strip()
    return None if text.lower() in ("off", "none", "null", "false", "") else text


PRECOMPILED_STEPS_ENV = "FLASHSAC_OPT_PRECOMPILED_STEPS"


def unilab_precompiled_steps(value: Any, device: str | torch.device) -> bool:
    """Whether a UniLab run keeps its fused steps precompiled (precompiled.py): the config's
    algo_params.precompiled_steps where it sets one, else FLASHSAC_OPT_PRECOMPILED_STEPS (1/0);
    unset, on for a learner on CUDA and off elsewhere. On CUDA it is what the cold-first protocol
    measured (results/time_to_reward/protocol_u64_mps_precompiled_h100_2026-12-06: every seed
    loaded both steps); on the CPU the aot_compile and save cost more than the torch.compile they
    replace on a cold cache and nobody trains there. Inherited by the compile-ahead children,
    which write the files the training process then loads."""
    if value is None:
        value = os.environ.get(PRECOMPILED_STEPS_ENV)
    if value is None:
        return torch.device(device).type == "cuda"
    text = str(value).strip().lower()
    if text in ON_VALUES:  # the compile-ahead switches' spellings
        return True
    if text in OFF_VALUES:
        return False
    raise ValueError(f"precompiled_steps / {PRECOMPILED_STEPS_ENV}={value!r}: expected 1/on or 0/off")


def startup_event(event: str, at: float | None = None, **extra: Any) -> None:
    """Append one start-up milestone (now, or at the ``time.time()`` value ``at``) to the file
    FLASHSAC_OPT_STARTUP_EVENTS names (nothing without it)."""
    path = os.environ.get(STARTUP_EVENTS_ENV)
    if path:
        with open(path, "a") as f:
            f.write(json.dumps({"event": event, "time": time.time() if at is None else at, "pid": os.getpid(), **extra}) + "\n")


def compile_cache_counters(since: dict[str, int] | None = None) -> dict[str, int]:
    """Inductor's FX-graph and AOTAutograd cache hits and misses in this process (minus ``since``)."""
    from torch._dynamo.utils import counters

    now = {"fxgraph_hit": counters["inductor"]["fxgraph_cache_hit"], "fxgraph_miss": counters["inductor"]["fxgraph_cache_miss"],
           "aot_autograd_hit": counters["aot_autograd"]["autograd_cache_hit"],
           "aot_autograd_miss": counters["aot_autograd"]["autograd_cache_miss"]}
    return {k: v - (since or {}).get(k, 0) for k, v in now.items()}


def switch_details(before: tuple[dict, dict], engine: Any, child_report: dict | None) -> dict[str, Any]:
    """The background switch's start-up event: how much of it the child's caches served (a miss
    compiles here, on one worker), where its compile time went since ``before`` (counters,
    compile_time_totals), and the keyed compile-cache files (Triton's kernels among their
    artifacts): the child's, this process's, and whether this process loaded one."""
    counters, totals = before
    return {"caches": compile_cache_counters(since=counters),
            "compile_phases_s": {k: round(v - totals.get(k, 0.0), 3) for k, v in compile_time_totals().items()},
            "child_compile_cache_file": (child_report or {}).get("compile_cache_file"),
            "compile_cache_file": engine.compile_cache_file, "compile_cache_loaded": engine.compile_cache_loaded,
            "precompiled_steps": engine.precompiled_report()}


def nccl_transport_notice(device_type: str, environ: dict[str, str]) -> str | None:
    """What a data-parallel CUDA run should be told when NCCL's peer-to-peer and shared-memory
    transports are off, as UniLab 1.5.2's DpParameterSync turns them off unless exported (it found
    them broken on some hosts): every all-reduce then crosses TCP loopback. On two H200s that made
    the U64 learner ~280 ms an iteration for stock and patched alike (results/data_parallel/)."""
    off = [name for name in ("NCCL_P2P_DISABLE", "NCCL_SHM_DISABLE") if environ.get(name) == "1"]
    if device_type != "cuda" or not off:
        return None
    return (f"flashsac_opt: {' and '.join(off)}=1 (UniLab's default unless exported): NCCL's all-reduces go over TCP "
            "loopback, which bounds data-parallel learning at high updates per step. Where the GPUs reach each other "
            "(NVLink, PCIe P2P), export NCCL_P2P_DISABLE=0 NCCL_SHM_DISABLE=0 before `train` (docs/multi_gpu.md).")


DEFAULT_MPS_PIPE_DIRECTORY = Path("/tmp/nvidia-mps")  # where CUDA looks without CUDA_MPS_PIPE_DIRECTORY


def mps_notice(device_type: str, data_parallel: bool, environ: dict[str, str], default_pipe: Path = DEFAULT_MPS_PIPE_DIRECTORY) -> str | None:
    """What a one-GPU CUDA run should be told when no MPS daemon serves it: UniLab's collector is
    a process of its own, and its many small CUDA ops wait for GPU time-slices while the learner's
    iteration runs (one H200, 64 updates: the iteration 22.84 ms above the learner, 4.90 ms under
    MPS; results/contention/mps_2026-12-01/). UniLab's `uni-cumps` runs a daemon for one GPU."""
    if device_type != "cuda" or data_parallel:
        return None
    pipe = environ.get("CUDA_MPS_PIPE_DIRECTORY")
    if pipe or (default_pipe / "control").exists():
        return None
    return ("flashsac_opt: no CUDA MPS daemon serves this run, so UniLab's collector and this learner time-slice the GPU "
            "(at 64 updates per iteration that cost ~20 ms of a ~60-ms iteration on an H200). On a GPU of your own: "
            "`uni-cumps start && eval \"$(uni-cumps env)\"` before `train`, `uni-cumps stop` after (README).")


def build_unilab_learner(*, device: str | torch.device, **learner_kwargs: Any) -> "UniLabFlashSACLearner":
    return UniLabFlashSACLearner(device=device, **learner_kwargs)


class _PerUpdatePath:
    """UniLab's per-update path (``update_critic`` / ``update_actor`` / ``soft_update_target``),
    which its runner takes for a learner without the whole-cycle path. flashsac_opt's learner
    always offers that path (``use_update_cycle``); these keep the interface whole."""

    learner: FlashSACLearner
    reward_normalizer: Any

    def update_critic(self, batch: dict[str, torch.Tensor], *, read_metrics: bool = True) -> dict[str, float]:
        with self._first_update():
            self._finish_compile_ahead()
            self.learner.step_critic(batch)
        if not read_metrics:
            return {}
        m = self.learner.single_update_metrics()
        out = {"Loss/critic": m["critic_loss"]}
        if self.reward_normalizer is not None:
            out["Train/reward_scale_std"] = m["reward_scale_std"]
        return out

    def update_actor(self, batch: dict[str, torch.Tensor], *, read_metrics: bool = True) -> dict[str, float]:
        with self._first_update():
            self._finish_compile_ahead()
            self.learner.step_actor(batch)
        return self.read_deferred_actor_metrics() if read_metrics else {}

    def read_deferred_actor_metrics(self) -> dict[str, float]:
        m = self.learner.single_update_metrics()
        if not m:
            return {}
        return {
            "Loss/actor": m["actor_loss"],
            "Loss/entropy": m["entropy"],
            "Policy/temperature": m["temperature"],
            "Loss/temperature": m["temperature_loss"],
        }

    def soft_update_target(self) -> None:
        self.learner.step_target()


class UniLabFlashSACLearner(_PerUpdatePath):
    supports_deferred_update_metrics = True

    def __init__(
        self,
        *,
        device: str | torch.device,
        obs_dim: int,
        action_dim: int,
        critic_obs_dim: int,
        actor_config: Any = None,
        actor_normalize_parameters: bool = True,
        critic_normalize_parameters: bool = True,
        **kwargs: Any,
    ):
        if actor_config is not None:
            raise ValueError("flashsac_opt supports the built-in FlashSAC actor only (algo.algo_params.actor_config must be null)")
        if not (actor_normalize_parameters and critic_normalize_parameters):
            raise ValueError("flashsac_opt always renormalizes parameters (actor/critic_normalize_parameters must be true)")
        known = {f.name for f in dataclasses.fields(FlashSACConfig)}
        unknown = set(kwargs) - known - _IGNORED
        if unknown:
            raise ValueError(f"flashsac_opt does not know the UniLab learner option(s) {sorted(unknown)}")
        values = {k: v for k, v in kwargs.items() if k in known}
        if values.get("amp_dtype") is not None:
            values["amp_dtype"] = str(values["amp_dtype"])
        values["compile_cache_file"] = unilab_compile_cache_file(values.get("compile_cache_file"))
        values["precompiled_steps"] = unilab_precompiled_steps(values.get("precompiled_steps"), device)
        self.cfg = FlashSACConfig(**{**UNILAB_RUN_DEFAULTS, **values})
        self.learner = FlashSACLearner(self.cfg, obs_dim, critic_obs_dim, action_dim, device=device)
        # A compiled learner on CUDA compiles in a child process from here on, while UniLab starts
        # the collector and collects learning_starts (compile_ahead.py; FLASHSAC_OPT_COMPILE_AHEAD:
        # background by default, wait, or off).
        # With this configuration's compile-cache file there (warm), no child: this process
        # compiles from it while the runner waits for its collector (compile_ahead.WarmCache).
        self._compile_ahead = CompileAhead.start_if_useful(
            self.cfg, {"obs_dim": obs_dim, "critic_obs_dim": critic_obs_dim, "action_dim": action_dim},
            self.learner.device, compiled=self.learner.engine.compiled, warm_cache=self._load_compile_cache,
        )
        # =background: no update waits for the child; until it is done they run uncompiled (the
        # engine's compile_deferred says so from here on)
        if self._compile_ahead is not None and compile_ahead_mode() == "background":
            self.learner.engine.defer_compile()
        self.compile_ahead_report: dict[str, Any] | None = None
        self._collection_warmup: Any = None  # prepare_for_collection's context while its compile waits for the child
        self._gradient_sync: Any = None  # UniLab's, when the run is data parallel
        self.device = self.learner.device
        self.obs_dim, self.critic_obs_dim, self.action_dim = obs_dim, critic_obs_dim, action_dim
        self.actor = self.learner.actor
        self.reward_normalizer = self.learner.reward_normalizer
        self.update_count = 0
        self.use_compile = self.learner.engine.compiled
        self.compile_backend = self.cfg.compile_backend if self.use_compile else "eager"
        self.amp_policy = {"enabled": self.learner.amp_dtype is not None, "dtype": str(self.learner.amp_dtype or torch.float32)}
        self._recorder = ReplayRecorder.from_env()
        # the runner leaves out its synchronize after the update phase (patches/0007) and the
        # metrics come one iteration late (run_ahead.py; FLASHSAC_OPT_UPDATE_RUNS_AHEAD=0: not)
        self._run_ahead = run_ahead.RunAhead(self.device) if run_ahead.wanted() else None
        self._first_update_seen = False
        self._idle_polls, self._last_idle_poll = 0, 0.0  # use_startup_idle_time's calls: the start-up timeline
        startup_event("learner_constructed", compile_ahead=self._compile_ahead is not None, learner_mode=self.learner.engine.mode)

    def _load_compile_cache(self) -> str | None:
        """The learner's compile-cache file, loaded now (the compile-ahead decision); how long
        the load took goes into the start-up timeline: it delays the collector's start."""
        start = time.perf_counter()
        file = self.learner.load_compile_cache()
        startup_event("compile_cache_checked", loaded=file is not None, seconds=round(time.perf_counter() - start, 3),
                      precompiled_steps_ready=file is not None and not self.learner.engine.compile_cache_loaded)
        return file

    @contextlib.contextmanager
    def _first_update(self):
        """Marks the first learner update's start and end (compile-ahead wait, compile and capture
        included) for the start-up timeline; every later update passes straight through."""
        if self._first_update_seen:
            yield
            return
        self._first_update_seen = True
        if self._idle_polls:  # the runner's last wait for its collector's start: ready within 0.1 s after it
            startup_event("collector_start_wait_end", at=self._last_idle_poll, polls=self._idle_polls)
        startup_event("first_update_start")
        yield
        self._device_work_done("first_update_end")

    def _device_work_done(self, event: str, **extra: Any) -> None:
        """The start-up milestone ``event`` once the device work queued so far is done: a
        synchronize, only when the timeline is asked for (at most twice a run)."""
        if os.environ.get(STARTUP_EVENTS_ENV) and self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        startup_event(event, **extra)

    # ------------------------------------------------------------ whole cycle
    @property
    def use_update_cycle(self) -> bool:
        return True

    def _set_schedule(self, target_frequency: int, policy_before_critic: bool) -> None:
        # Part of graph mode's capture key: a change recaptures.
        self.cfg.target_frequency = int(target_frequency)
        self.cfg.policy_before_critic = bool(policy_before_critic)

    def update_cycle(
        self,
        large_batch: dict[str, torch.Tensor],
        *,
        updates_per_step: int,
        policy_frequency: int,
        target_frequency: int,
        policy_before_critic: bool,
        read_metrics: bool = False,
    ) -> None:
        del read_metrics  # metrics are always deferred to read_deferred_cycle_metrics
        with self._first_update():
            switching = self._finish_compile_ahead()
            if self._recorder is not None:
                self._recorder.add(large_batch)
            self._set_schedule(target_frequency, policy_before_critic)
            # the background mode's switch compiles here, from the child's caches; should the
            # child have failed, cold: then on every CPU rather than UniLab's one worker
            before = (compile_cache_counters(), compile_time_totals()) if switching else None
            ahead = self._run_ahead
            if ahead is not None:
                ahead.begin()
            with self._compile_workers() if switching else contextlib.nullcontext():
                inputs_read = self.learner.update(large_batch, updates_per_step=updates_per_step, policy_frequency=policy_frequency)
            if ahead is not None:
                ahead.end(self.learner.metrics, self.learner.last_schedule, inputs_read)
            if switching:
                self._device_work_done("background_compile_switched", **switch_details(before, self.learner.engine, self.compile_ahead_report))

    def _compile_workers(self) -> contextlib.AbstractContextManager:
        """Inductor's workers for a compile in this process: every CPU for a cold compile; none
        when the compile-ahead child compiled the same graphs (every kernel is in the caches).
        Inductor starts its pool of worker processes at a compile's start whenever it may use
        more than one, and loads even cached kernels through it: 16 interpreters importing torch
        beside the collector, for kernels the main process loads from the cache itself."""
        if self.compile_ahead_report is not None and self.compile_ahead_report.get("ok"):
            return contextlib.nullcontext()
        return parallel_compile()

    def _finish_compile_ahead(self, before_training: bool = False) -> bool:
        """Once, before the first compile in this process: wait for the compile-ahead child. In
        the background mode only once the child is done (the update runs uncompiled until then);
        the update that follows compiles from its caches: True then."""
        if self._compile_ahead is None:
            return False
        background = self.learner.engine.compile_deferred
        if background and not self._compile_ahead.done:
            return False
        ahead, self._compile_ahead = self._compile_ahead, None
        compiled = ahead.wait()
        self.compile_ahead_report = {**(ahead.report or {}), "ok": compiled, "waited_s": ahead.waited_s}
        report = ahead.report or {}
        # where the child's time went (torch's compile timers), per child when split
        phases = [{"networks": c.get("networks"), "seconds": c.get("seconds"), "compile_phases_s": c.get("compile_phases_s")}
                  for c in report.get("children", [report] if report.get("compile_phases_s") else [])]
        startup_event("compile_ahead_done", ok=compiled, waited_s=ahead.waited_s, child_s=report.get("seconds"),
                      background=background, child=not ahead.in_this_process, children=phases, prespawned=getattr(ahead, "prespawned", False))
        if background:
            self.learner.engine.compile_now()  # this update compiles (from the child's caches when it compiled)
            if compiled:
                if before_training:
                    what = "the training compiles from its caches before its first update"
                elif self.learner.iterations:
                    what = f"the training ran {self.learner.iterations} iterations uncompiled and compiles from its caches now"
                else:
                    what = "the first update compiles from its caches"
                found = (f"compile cache {ahead.report['compile_cache_file']} loaded, no compile-ahead child"
                         if ahead.in_this_process else f"compile-ahead child done in {ahead.report['seconds']:.1f} s")
                print(f"flashsac_opt: {found}; {what}", flush=True)
            return True
        if compiled:
            print(f"flashsac_opt: compile-ahead child done in {ahead.report['seconds']:.1f} s; the first update "
                  f"waited {ahead.waited_s:.1f} s for it", flush=True)
        return False

    @property
    def update_phase_runs_ahead(self) -> bool:
        """patches/0007: the runner does not synchronize after the update phase and takes its
        Perf/learning_time from ``update_phase_seconds``."""
        return self._run_ahead is not None

    def update_phase_seconds(self) -> float | None:
        """Running ahead: the device time of the update phase before the last one."""
        return self._run_ahead.previous_seconds() if self._run_ahead is not None else None

    def read_deferred_cycle_metrics(self) -> dict[str, float]:
        if self._run_ahead is None:
            metrics = self.learner.read_metrics()
        else:  # the phase before the last one: the last may still run
            previous = self._run_ahead.previous_metrics()
            if previous is None:
                return {}
            rows, schedule = previous
            metrics = unilab_metrics(rows, schedule.updates_per_step, schedule.policy_frequency,
                                     reward_normalized=self.reward_normalizer is not None)
        return {k: v for k, v in metrics.items() if k in UNILAB_CYCLE_METRICS}

    # ------------------------------------------------------------ runtime hooks
    def update_reward_stats(self, rewards: torch.Tensor, dones: torch.Tensor) -> None:
        self.learner.update_reward_stats(rewards, dones)

    def inference_startup_memory_categories(self, batch_size: int) -> dict[str, int]:
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size <= 0:
            raise ValueError("FlashSAC inference batch size must be a positive integer")
        # Held noise (float32) plus two int32 hold counters per environment.
        return {"persistent_exploration_scratch": batch_size * (self.action_dim * 4 + 2 * 4)}

    def prepare_for_collection(self, warmup_context: Any) -> None:
        """Compile (and in graph mode capture) before collection; training state is unchanged.
        While the compile-ahead child still compiles, nothing: collection starts at once, and the
        compile from the caches it filled happens once it is done, while the runner waits for its
        collector to start (``use_startup_idle_time``) or else at the first update that finds it
        done (in the background mode the updates before run uncompiled). A child already done
        (its report written, only its teardown left) is not waited out: the compile happens here.
        With a warm compile-cache file there is no child (``WarmCache``): that compile waits for
        the runner's wait too, so the collector starts first."""
        notice = mps_notice(self.device.type, self._gradient_sync is not None, dict(os.environ))
        if notice:  # the runner calls this once, after its data-parallel set-up
            print(notice, flush=True)
        if not self.learner.engine.compiled:
            return
        ahead = self._compile_ahead
        if ahead is not None and (not ahead.done or ahead.in_this_process):
            self._set_schedule(warmup_context.target_frequency, warmup_context.policy_before_critic)
            self._collection_warmup = warmup_context
            startup_event("prepare_for_collection_deferred")
            return
        self._compile_for_collection(warmup_context, "prepare_for_collection")

    def use_startup_idle_time(self) -> None:
        """UniLab's runner calls this (patches/0004) every 0.1 s while it waits for its collector
        process to start, before the collector's ready signal: nothing reads or updates the
        learner then. Once the compile-ahead child is done, the compile from its caches (and the
        capture) runs here, in time the training waits anyway, and not at the first update (a
        warm start spent 6.4-6.8 s there at 64 updates per step while this process had waited
        ~17 s for its collector: results/time_to_reward/u64_one_gpu_mps_explore_graph_2026-12-01/)."""
        now = time.time()
        if not self._idle_polls:
            startup_event("collector_start_wait", at=now)
        self._idle_polls, self._last_idle_poll = self._idle_polls + 1, now
        if self._collection_warmup is None or self._compile_ahead is None or not self._compile_ahead.done:
            return
        context, self._collection_warmup = self._collection_warmup, None
        self._compile_for_collection(context, "startup_idle_compile")

    def _compile_for_collection(self, warmup_context: Any, event: str) -> None:
        """One iteration on UniLab's warm-up batch, undone: it compiles (from the child's caches
        when there is one) and, in graph mode, captures the iteration the training will replay."""
        self._finish_compile_ahead(before_training=True)
        batch = getattr(warmup_context, "replay_batch", None)
        if batch is None:
            from unilab.rl.runtime.offpolicy.warmup import build_offpolicy_warmup_batch

            batch = build_offpolicy_warmup_batch(
                warmup_context, obs_dim=self.obs_dim, critic_obs_dim=self.critic_obs_dim, action_dim=self.action_dim, device=self.device
            )
        self._set_schedule(warmup_context.target_frequency, warmup_context.policy_before_critic)
        iterations = self.learner.iterations
        startup_event(f"{event}_start")
        with self.learner.engine.preserved(), self._compile_workers():  # the collector is not collecting yet
            self.learner.update(batch, updates_per_step=warmup_context.updates_per_step, policy_frequency=warmup_context.policy_frequency)
        self.learner.iterations = iterations
        startup_event(f"{event}_end", precompiled_steps=self.learner.engine.precompiled_report())

    # ------------------------------------------------------------ data parallel (training.devices=[...])
    def set_gradient_sync(self, sync: Any) -> None:
        """UniLab's runner hands its flat-gradient all-reduce here from its constructor, before
        its process group exists. flashsac_opt averages with its own one-bucket all-reduce in
        that group instead (gradient, loss, BN statistics; captured with the iteration in graph
        mode), so the callable only marks the run as data parallel; ``dp_initial_sync`` switches
        the learner over once the group is up. ``None`` (the runner's shutdown) releases captured
        graphs, which hold collectives, before the group is destroyed (pytorch/pytorch#115388)."""
        if sync is None:
            self.learner.release_graphs()
            self._gradient_sync = None
            # The ranks' end states, comparable across the run's logs; not when a finalizer closes
            # the runner (a run that failed, e.g. a rank died): building tensors there, during
            # garbage collection, aborted the interpreter (torch's THPVariable_clear assert).
            if self.learner.averager is not None and not _inside_finalizer():
                import torch.distributed as dist

                from flashsac_opt.data_parallel import state_digest

                # the whole learner state, and the networks of the checkpoint this rank would write
                # (only rank 0 writes one): a test compares the latter with rank 0's file
                networks = {k: v for k, v in self.get_state_dict().items() if k in CHECKPOINT_NETWORKS}
                digests = {"state_digest": state_digest(self.learner.state_dict()), "networks_digest": state_digest(networks)}
                print(f"flashsac_opt: rank {dist.get_rank()} state digest {digests['state_digest']}"
                      f" checkpoint networks digest {digests['networks_digest']}", flush=True)
                startup_event("rank_end_state", rank=dist.get_rank(), world_size=dist.get_world_size(), **digests)
            return
        if not callable(sync):
            raise TypeError(f"set_gradient_sync expects UniLab's gradient all-reduce (a callable) or None, got {type(sync).__name__}")
        self._gradient_sync = sync
        self._run_ahead = None  # the collectives' ordering across ranks is not what run_ahead.py reasons about
        # UniLab's training.dp_gradient_wire_dtype, as its DpParameterSync holds it (the callable is
        # that object's bound allreduce_gradients): flashsac_opt's averager sends the gradient so too
        self._gradient_wire_dtype = str(getattr(getattr(sync, "__self__", None), "gradient_wire_dtype", "float32"))
        if self._compile_ahead is not None:  # it compiles the single-process update form: of no use here
            if self._compile_ahead.in_this_process:  # so is the file loaded for it: the first compile keys its own
                self.learner.engine.forget_compile_cache()
            self._compile_ahead.stop()
            self._compile_ahead = None
            self.learner.engine.compile_now()  # a deferred compile has nothing to wait for now: as usual

    def dp_initial_sync(self) -> dict[str, torch.Tensor]:
        """Called by UniLab's runner once its process group is up, before collection: the learner
        becomes one rank of a data-parallel learner in that group (ranks with another learner
        configuration fail here, naming the fields), then the live tensors rank 0 broadcasts."""
        if self._gradient_sync is None:
            raise RuntimeError("dp_initial_sync() needs set_gradient_sync() first (UniLab's runner calls both)")
        if self.learner.averager is None:
            notice = nccl_transport_notice(self.device.type, dict(os.environ))
            if notice and torch.distributed.get_rank() == 0:  # once per run (the group is up here)
                print(notice, file=sys.stderr, flush=True)
            self.learner.enable_data_parallel(True, gradient_wire_dtype=self._gradient_wire_dtype)
        return self.learner.network_tensors()

    # ------------------------------------------------------------ checkpoints
    def get_state_dict(self) -> dict[str, Any]:
        self.learner.unilab_update_count = self.update_count
        state = to_unilab_state_dict(self.learner)
        # flashsac_opt's own counters ride along; UniLab ignores unknown keys.
        state["flashsac_opt"] = {
            "iterations": self.learner.iterations,
            "skipped_totals": self.learner.totals.detach().cpu().clone(),
            # provenance: how this learner was configured through UniLab's config
            "learner_mode": self.learner.engine.mode,
            "fused_update": self.cfg.fused_update,
            "batch_size": self.cfg.batch_size,  # the runner's (patch 0001 passes it)
            "fused_update_used": self.learner.fused_update,  # decided by the first batch's shape
            "compile_cache_file": self.cfg.compile_cache_file,
        }
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        from_unilab_state_dict(self.learner, state)
        self.update_count = int(state.get("update_count", 0))
        extra = state.get("flashsac_opt")
        if extra:
            self.learner.iterations = int(extra["iterations"])
            self.learner.totals.copy_(extra["skipped_totals"])


def _inside_finalizer() -> bool:
    """Whether a ``__del__`` is on the call stack (UniLab's runner closes itself from one)."""
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code.co_name == "__del__":
            return True
        frame = frame.f_back
    return False


class ReplayRecorder:
    """Saves the first N large batches of a real run (see RECORD_REPLAY_ENV)."""

    def __init__(self, path: Path, count: int):
        self.path, self.count = path, count
        self.batches: list[dict[str, torch.Tensor]] = []

    @classmethod
    def from_env(cls) -> "ReplayRecorder | None":
        spec = os.environ.get(RECORD_REPLAY_ENV)
        if not spec:
            return None
        path, _, count = spec.rpartition(":")
        if not path or not count.isdigit():
            raise ValueError(f"{RECORD_REPLAY_ENV} must be PATH:N, got {spec!r}")
        return cls(Path(path), int(count))

    def add(self, batch: dict[str, torch.Tensor]) -> None:
        if len(self.batches) >= self.count:
            return
        # The runtime reuses these buffers next tick: copy now.
        self.batches.append({k: v.detach().to("cpu", copy=True) for k, v in batch.items()})
        if len(self.batches) == self.count:
            rows = {k: torch.cat([b[k] for b in self.batches]) for k in self.batches[0]}
            self.path.parent.mkdir(parents=True, exist_ok=True)
            torch.save({"format": "flashsac_opt.replay/1", "batches": self.count, "rows": rows}, self.path)
