"""The FlashSAC learner: one call runs a whole iteration of updates on one large batch.

Schedule (UniLab's, per iteration): the large batch of ``updates_per_step * B`` rows is
sliced into ``updates_per_step`` consecutive batches; update u runs the critic step, the
actor + temperature step when ``u % policy_frequency == 0`` (before the critic when
``policy_before_critic``), and the Polyak target update when ``u % target_frequency == 0``.

Host synchronization: none inside ``update``. Metrics go to a preallocated device buffer
(one row per update plus one row of running totals); ``read_metrics`` is the single
device-to-host copy per iteration. A non-finite loss or gradient skips that optimizer
step (and the BN statistics and target update that depend on it) on the device.

The learner is state (networks, optimizer moments, reward statistics), the update API and
one iteration function. The pieces of one update are ``updates.UpdateFunctions``, the metrics
buffer's layout ``metrics``, the checkpoint ``checkpoint``, the ranks' collectives
``data_parallel``; how the iteration runs (eager, compiled, captured) is ``engine.Engine``'s.
"""

from __future__ import annotations

import copy
from dataclasses import asdict
from typing import TYPE_CHECKING

import torch

from flashsac_opt import explore_graph, fused_step, gemm_stats, kernels
from flashsac_opt.config import FlashSACConfig
from flashsac_opt.networks import FlashSACActor, FlashSACCritic, FlashSACTemperature
from flashsac_opt.batch import check_batch
from flashsac_opt.checkpoint import learner_state_dict, load_learner_state
from flashsac_opt.devices import resolve_device
from flashsac_opt.engine import Engine, NetworkUpdate, Schedule, mark_static
from flashsac_opt.metrics import COL, METRIC_COLUMNS, TOTAL_COLUMNS, unilab_metrics
from flashsac_opt.objectives import CosineSchedule, target_entropy
from flashsac_opt.optim import FlatAdam, GatedStep
from flashsac_opt.reward_norm import RewardNormalizer
from flashsac_opt.updates import UpdateFunctions

if TYPE_CHECKING:
    from flashsac_opt.data_parallel import RankAverager

# COL re-exported: tests and experiments index the metrics table (update_metrics_table) by it.
__all__ = ["COL", "FlashSACLearner"]


def _gated_step(net, adam: FlatAdam, lr, fused: bool) -> GatedStep:
    """A network's post-backward step; ``fused``: as fused_step's one Triton launch over its units."""
    units = fused_step.renorm_units(net.layout, net.renorm_groups).to(adam.exp_avg.device) if fused else None
    return GatedStep(net.params, net.bn_stats, adam, net.renormalized, lr, units)


class FlashSACLearner:
    def __init__(
        self,
        cfg: FlashSACConfig,
        obs_dim: int,
        critic_obs_dim: int,
        action_dim: int,
        device: str | torch.device = "cpu",
        process_group: "torch.distributed.ProcessGroup | bool | None" = None,
    ):
        """``process_group``: a torch.distributed group (or True for the default group) makes
        this learner one rank of a data-parallel learner (``flashsac_opt.data_parallel``)."""
        self.cfg = cfg
        self.obs_dim, self.critic_obs_dim, self.action_dim = obs_dim, critic_obs_dim, action_dim
        self.dims = {"obs": obs_dim, "critic_obs": critic_obs_dim, "action": action_dim}
        self.device = resolve_device(device)

        self.actor = FlashSACActor(
            obs_dim, action_dim, cfg.actor_hidden_dim, cfg.actor_num_blocks,
            noise_zeta_mu=cfg.actor_noise_zeta_mu, noise_zeta_max=cfg.actor_noise_zeta_max,
        ).to(self.device)
        self.critic = FlashSACCritic(
            critic_obs_dim, action_dim, cfg.critic_hidden_dim, cfg.critic_num_blocks, cfg.num_atoms, cfg.critic_min_v, cfg.critic_max_v,
        ).to(self.device)
        self.target_critic = copy.deepcopy(self.critic)
        self.target_critic.params.requires_grad_(False)
        for net in (self.actor, self.critic, self.target_critic):
            net.cast_gemm_weights_once = cfg.cast_gemm_weights_once
            net.fused_linear_bn_relu, net.gemm_stats_block = cfg.fused_linear_bn_relu, cfg.gemm_stats_block
        critic_options = cfg.critic_network_options()
        for triton_switch, module in ((cfg.fused_linear_bn_relu, kernels), (cfg.gemm_stats_block, gemm_stats), (cfg.fused_gated_step, fused_step)):
            if triton_switch:  # registers the custom ops before anything is traced; a clear error without Triton
                module.require(self.device)
        for net in (self.critic, self.target_critic):
            net.input_bn_chunk_rows = cfg.input_bn_chunk_rows
            for name, value in critic_options.items():
                setattr(net, name, value)
        self.temperature = FlashSACTemperature(cfg.temp_initial_value).to(self.device)

        self.schedule = CosineSchedule(
            cfg.learning_rate_init, cfg.peak_lr, cfg.learning_rate_end, cfg.learning_rate_warmup_steps, cfg.learning_rate_decay_steps,
        )
        self.actor_adam = FlatAdam(self.actor.layout.numel, self.device)
        self.critic_adam = FlatAdam(self.critic.layout.numel, self.device)
        self.temperature_adam = FlatAdam(1, self.device)
        lr = self.schedule.on_device
        self.critic_step = _gated_step(self.critic, self.critic_adam, lr, cfg.fused_gated_step)
        self.actor_step = _gated_step(self.actor, self.actor_adam, lr, cfg.fused_gated_step)
        self.temperature_step = GatedStep(self.temperature.log_temp, None, self.temperature_adam, None, lr)

        self.reward_normalizer = (
            RewardNormalizer(cfg.gamma, cfg.normalized_g_max, self.device) if cfg.normalize_reward else None
        )
        self.discount = cfg.gamma**cfg.n_step
        self.target_entropy = target_entropy(action_dim, cfg.temp_target_sigma, cfg.temp_target_entropy)
        self.tau = torch.tensor(cfg.tau, device=self.device)
        self.metrics: torch.Tensor | None = None
        self.totals = torch.zeros(len(TOTAL_COLUMNS), device=self.device)
        self.iterations = 0
        # UniLab's checkpoint field update_count, carried through conversions (UniLab's own
        # learner never advances it; its runner keeps the count in the adapter).
        self.unilab_update_count = 0
        self._last_schedule: Schedule | None = None
        self._single_metrics: torch.Tensor | None = None
        self.averager = None
        self.broadcast_params = False
        self.update_functions = UpdateFunctions(self)
        self.engine = self.build_engine()
        if self.engine.graph is not None and explore_graph.wanted():
            # graph mode (CUDA): UniLab serves collection from the learner's thread, between
            # iterations: one replay instead of ~40 launches per collection step (explore_graph.py)
            self.actor.captured_explore = explore_graph.CapturedExplore(self.actor)
        if process_group is not None and process_group is not False:
            self.enable_data_parallel(process_group)

    @property
    def amp_dtype(self) -> torch.dtype | None:
        """The updates' autocast dtype (``FlashSACConfig.autocast_dtype``). Settable before the
        first update: tests run the CUDA learner's bf16 autocast on CPU."""
        return self.update_functions.amp_dtype

    @amp_dtype.setter
    def amp_dtype(self, dtype: torch.dtype | None) -> None:
        self.update_functions.amp_dtype = dtype

    def build_engine(self) -> Engine:
        """The engine for this learner's configuration (again when it becomes data parallel)."""
        cfg, fns = self.cfg, self.update_functions
        return Engine(
            device=self.device,
            **cfg.engine_arguments(),
            updates={
                "critic": NetworkUpdate(
                    self.critic.params, fns._critic_step, fns._critic_loss, fns._critic_apply,
                    compose_loss=fns._critic_branched_loss if cfg.critic_target_stream else None,
                ),
                "actor": NetworkUpdate(self.actor.params, fns._actor_step, fns._actor_loss, fns._actor_apply),
            },
            iteration=self._iteration,
            state=self._state_tensors(),
            # member_linear is a custom autograd.Function: without this every launch re-traced
            # the options' graphs (their warm start doubled beside UniLab, 2026-12-02)
            cache_custom_autograd_functions=self.critic.contiguous_weight_grads or cfg.fused_linear_bn_relu or cfg.gemm_stats_block,
            reduce=self.averager.average if self.averager is not None else None,
            # what names the default ("auto") cache file, with what the engine adds
            compile_cache_key={"dims": dict(self.dims), "config": asdict(cfg)},
        )

    def enable_data_parallel(self, process_group: "torch.distributed.ProcessGroup | bool" = True, averager: "RankAverager | None" = None,
                             gradient_wire_dtype: str = "float32") -> None:
        """Make this learner one rank of a data-parallel learner over ``process_group`` (True:
        the default group), before its first update (``data_parallel.join``)."""
        from flashsac_opt.data_parallel import join

        join(self, process_group, averager, gradient_wire_dtype)

    def network_tensors(self) -> dict[str, torch.Tensor]:
        """The live network tensors (parameters, BN statistics, temperature) by name: what every
        data-parallel rank takes from rank 0 at the start."""
        return {
            "actor.params": self.actor.params.data,
            "actor.bn_stats": self.actor.bn_stats,
            "critic.params": self.critic.params.data,
            "critic.bn_stats": self.critic.bn_stats,
            "target_critic.params": self.target_critic.params.data,
            "target_critic.bn_stats": self.target_critic.bn_stats,
            "temperature.log_temp": self.temperature.log_temp.data,
        }

    def _state_tensors(self) -> list[torch.Tensor]:
        """Every tensor an iteration changes in place (all with fixed addresses)."""
        tensors = [
            self.actor.params,
            self.actor.bn_stats,
            self.critic.params,
            self.critic.bn_stats,
            self.target_critic.params,
            self.target_critic.bn_stats,
            self.temperature.log_temp,
            self.totals,
            self.tau,
        ]
        for adam in (self.actor_adam, self.critic_adam, self.temperature_adam):
            tensors += [*adam.tensors().values(), adam.coefficients]
        if self.reward_normalizer is not None:
            rn = self.reward_normalizer
            tensors += [rn.mean, rn.var, rn.count, rn.abs_max]
        return tensors

    def load_compile_cache(self) -> str | None:
        """Load this configuration's compile-cache file now (the schedule and rows of the
        config); the file when it loaded, else None. The compile-ahead decision asks this."""
        return self.engine.open_compile_cache(self.cfg.batch_size, self._schedule(None, None))

    @property
    def fused_update(self) -> bool | None:
        """Whether each network update is one compiled function (None until the first batch)."""
        return self.engine.fused_update

    @property
    def compile_cache_loaded(self) -> bool:
        return self.engine.compile_cache_loaded

    # ----------------------------------------------------------------- boundary
    def validate_batch(self, batch: dict[str, torch.Tensor], updates_per_step: int) -> int:
        """Check a large batch at the learner boundary (``batch.check_batch``); return the
        per-update batch size. Raises ValueError naming the field and what was expected."""
        return check_batch(batch, updates_per_step, self.dims, self.device)

    def update_reward_stats(self, rewards: torch.Tensor, dones: torch.Tensor) -> None:
        """Fold newly collected transitions (steps, num_envs) into the reward scale."""
        if self.reward_normalizer is not None:
            if self.averager is not None:
                # UniLab calls this per rank whenever that rank's collector committed rows: a
                # collective here deadlocked (ranks call it unequally often). Folded into one
                # global scale at the next iteration's start instead (_begin_iteration).
                self.reward_normalizer.accumulate(rewards, dones)
            else:
                self.reward_normalizer.update(rewards, dones)

    def _iteration(self, batch: dict[str, torch.Tensor], schedule: Schedule, updates) -> None:
        """The whole iteration's device work (what graph mode captures)."""
        metrics = self.metrics
        u_count, pf = schedule.updates_per_step, schedule.policy_frequency
        bsz = batch["actions"].shape[0] // u_count
        metrics[:u_count].zero_()
        fns = self.update_functions
        batch = fns.prepare_batch(batch)
        for u in range(u_count):
            b = {k: v[u * bsz : (u + 1) * bsz] for k, v in batch.items()}
            do_actor = u % pf == 0
            if do_actor and schedule.policy_before_critic:
                fns.actor_update(updates, b, metrics[u])
            fns.critic_update(updates, b, metrics[u], polyak=u % schedule.target_frequency == 0)
            if do_actor and not schedule.policy_before_critic:
                fns.actor_update(updates, b, metrics[u])
        with torch.no_grad():
            skipped_critic = (1.0 - metrics[:u_count, COL["critic_applied"]]).sum()
            actor_rows = metrics[:u_count:pf]
            skipped_actor = (1.0 - actor_rows[:, COL["actor_applied"]]).sum()
            skipped_temp = (1.0 - actor_rows[:, COL["temperature_applied"]]).sum()
            self.totals.add_(torch.stack([skipped_critic, skipped_actor, skipped_temp]))
            metrics[u_count, : len(TOTAL_COLUMNS)].copy_(self.totals)
        if self.broadcast_params:
            self.averager.broadcast_([self.actor.params.data, self.critic.params.data, self.target_critic.params.data])

    def _schedule(self, updates_per_step: int | None, policy_frequency: int | None) -> Schedule:
        """This iteration's schedule: the arguments, else the config's values."""
        for name, value in (("updates_per_step", updates_per_step), ("policy_frequency", policy_frequency)):
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ValueError(f"{name} must be a positive integer (or None for the config's value), got {value!r}")
        cfg = self.cfg
        return Schedule(
            updates_per_step if updates_per_step is not None else cfg.updates_per_step,
            policy_frequency if policy_frequency is not None else cfg.policy_frequency,
            cfg.target_frequency,
            cfg.policy_before_critic,
        )

    def update(
        self,
        batch: dict[str, torch.Tensor],
        updates_per_step: int | None = None,
        policy_frequency: int | None = None,
    ) -> "torch.cuda.Event | None":
        """Run one iteration (all updates) on a large batch. Does not synchronize.

        The batch is checked whole before anything runs: a bad one raises ValueError and
        leaves the learner as it was. Returns Engine.run's event (graph mode: the batch has
        been copied into the captured graph's inputs once it has happened), else None."""
        schedule = self._schedule(updates_per_step, policy_frequency)
        self.validate_batch(batch, schedule.updates_per_step)
        self._begin_iteration(schedule)
        inputs_read = self.engine.run(batch, schedule)
        self.iterations += 1
        return inputs_read

    def update_from_replay(self, replay, updates_per_step: int | None = None, policy_frequency: int | None = None) -> None:
        """One iteration on ``cfg.batch_size`` rows per update sampled from a ``flashsac_opt.replay.GPUReplay``.

        In graph mode the sampling is part of the captured iteration: one replay of the
        graph draws new indices, gathers the rows and runs every update. Elsewhere the
        batch is sampled on the device just before the updates.
        """
        schedule = self._schedule(updates_per_step, policy_frequency)
        if replay.count == 0:
            raise ValueError("cannot update from an empty replay")
        if replay.device != self.device:
            raise ValueError(f"replay lives on {replay.device}, the learner on {self.device}")
        layout = replay.layout
        replay_dims = (layout.obs_dim, layout.critic_obs_dim, layout.action_dim)
        if replay_dims != (self.obs_dim, self.critic_obs_dim, self.action_dim):
            raise ValueError(
                f"replay rows have (obs, critic_obs, action) dims {replay_dims}, "
                f"the learner {(self.obs_dim, self.critic_obs_dim, self.action_dim)}"
            )
        bsz = self.cfg.batch_size
        rows = schedule.updates_per_step * bsz
        self._begin_iteration(schedule)
        self.engine.run_sampled(
            lambda: replay.sample(rows), bsz, schedule, source=(id(replay), replay.capacity, bsz), generator=replay.generator
        )
        self.iterations += 1

    def _begin_iteration(self, schedule: Schedule) -> None:
        """Record the iteration's schedule (read_metrics uses it) and size the metrics buffer."""
        self._fold_rank_reward_stats()
        self._last_schedule = schedule
        if self.metrics is None or self.metrics.shape[0] != schedule.updates_per_step + 1:
            self.metrics = torch.zeros(schedule.updates_per_step + 1, len(METRIC_COLUMNS), device=self.device)
            mark_static(self.metrics)

    def _fold_rank_reward_stats(self) -> None:
        """Data parallel: every rank's reward statistics since the last call, folded into the one
        global scale in rank order. Called where every rank is in lockstep (an iteration's or a
        critic step's start), so the ranks' gathers match; eager, outside any captured graph,
        and without a host sync."""
        if self.averager is not None and self.reward_normalizer is not None:
            rn = self.reward_normalizer
            rn.fold(self.averager.gather(rn.take_pending()))

    # ------------------------------------------------- single updates (UniLab per-update path)
    def _single_batch(self, batch: dict[str, torch.Tensor]):
        rows = self.validate_batch(batch, 1)
        if self._single_metrics is None:
            self._single_metrics = torch.zeros(len(METRIC_COLUMNS), device=self.device)
            mark_static(self._single_metrics)
        return self.engine.update_functions(rows), self.update_functions.prepare_batch(batch)

    def step_critic(self, batch: dict[str, torch.Tensor]) -> None:
        """One critic update (no target update) on a single batch."""
        self._fold_rank_reward_stats()
        updates, b = self._single_batch(batch)
        self.update_functions.critic_update(updates, b, self._single_metrics, polyak=False)

    def step_actor(self, batch: dict[str, torch.Tensor]) -> None:
        """One actor + temperature update on a single batch."""
        updates, b = self._single_batch(batch)
        self.update_functions.actor_update(updates, b, self._single_metrics)

    def step_target(self) -> None:
        """Polyak update, skipped on the device if the last critic step was skipped."""
        if self._single_metrics is None:
            return
        with torch.no_grad():
            ok = self._single_metrics[COL["critic_applied"]]
            self.target_critic.params.lerp_(self.critic.params, self.tau * ok)

    def single_update_metrics(self) -> dict[str, float]:
        """Metrics of the last single critic/actor updates (one device-to-host copy)."""
        if self._single_metrics is None:
            return {}
        return dict(zip(METRIC_COLUMNS, self._single_metrics.cpu().tolist()))

    def release_graphs(self) -> None:
        """Free the captured whole-iteration graph (graph mode; a no-op otherwise). Needed
        before ``torch.distributed.destroy_process_group()``: a live graph that captured NCCL
        collectives makes it hang. The learner stays usable: the next update recaptures."""
        self.engine.release()

    @property
    def last_schedule(self) -> Schedule | None:
        """The schedule of the last iteration (its metrics buffer's layout)."""
        return self._last_schedule

    def read_metrics(self) -> dict[str, float]:
        """The iteration's metrics: the one device-to-host copy per iteration.

        Names follow UniLab's TensorBoard tags; like UniLab, the losses are those of the
        last critic update and the last actor update of the iteration.
        """
        if self.metrics is None or self._last_schedule is None:
            return {}
        schedule = self._last_schedule
        return unilab_metrics(self.metrics.cpu().tolist(), schedule.updates_per_step, schedule.policy_frequency,
                              reward_normalized=self.reward_normalizer is not None)

    def update_metrics_table(self) -> torch.Tensor:
        """Per-update metrics of the last iteration (host copy; for tests and experiments)."""
        assert self.metrics is not None
        return self.metrics.cpu()

    # ------------------------------------------------------------- checkpoint
    def state_dict(self) -> dict:
        """Every tensor of the learner's state, copied (``flashsac_opt.checkpoint``)."""
        return learner_state_dict(self)

    def load_state_dict(self, state: dict) -> None:
        """Load a ``state_dict()`` into the live tensors, in place: compiled and captured functions stay valid."""
        load_learner_state(self, state)
