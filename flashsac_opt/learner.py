"""The FlashSAC learner: one call runs a whole iteration of updates on one large batch.

Schedule (UniLab's, per iteration): the large batch of ``updates_per_step * B`` rows is
sliced into ``updates_per_step`` consecutive batches; update u runs the critic step, the
actor + temperature step when ``u % policy_frequency == 0`` (before the critic when
``policy_before_critic``), and the Polyak target update when ``u % target_frequency == 0``.

Host synchronization: none inside ``update``. Metrics go to a preallocated device buffer
(one row per update plus one row of running totals); ``read_metrics`` is the single
device-to-host copy per iteration. A non-finite loss or gradient skips that optimizer
step (and the BN statistics and target update that depend on it) on the device.

The learner is state (networks, optimizer moments, reward statistics), the pieces of one
update (pure loss functions and guarded steps), one iteration function, metrics and
checkpoints. How the iteration runs (eager, compiled, captured) is ``engine.Engine``'s.
"""

from __future__ import annotations

import copy
import functools
from dataclasses import asdict
from typing import TYPE_CHECKING, Callable

import torch

from flashsac_opt import explore_graph
from flashsac_opt.config import FlashSACConfig
from flashsac_opt.networks import FlashSACActor, FlashSACCritic, FlashSACTemperature
from flashsac_opt.objectives import (
    CosineSchedule,
    CriticOutputs,
    actor_objective,
    critic_bootstrap_inputs,
    critic_cross_entropy,
    critic_objective,
    critic_online_log_probs,
    critic_target_distribution,
    target_entropy,
    temperature_loss_and_grad,
)
from flashsac_opt.devices import resolve_device
from flashsac_opt.engine import Engine, NetworkUpdate, Schedule, mark_static
from flashsac_opt.optim import FlatAdam, GatedStep
from flashsac_opt.reward_norm import RewardNormalizer

if TYPE_CHECKING:
    from flashsac_opt.data_parallel import RankAverager

BATCH_FIELDS = ("obs", "actions", "rewards", "next_obs", "dones", "truncated", "critic", "next_critic")
# Columns of a per-update metrics row.
METRIC_COLUMNS = (
    "critic_loss",
    "reward_scale_std",
    "critic_applied",
    "actor_loss",
    "entropy",
    "temperature",
    "temperature_loss",
    "actor_applied",
    "temperature_applied",
)
COL = {name: i for i, name in enumerate(METRIC_COLUMNS)}
# Columns of the running-totals row (last row of the buffer).
TOTAL_COLUMNS = ("critic_skipped", "actor_skipped", "temperature_skipped")
STATE_FORMAT = "flashsac_opt/1"


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
        self.device = resolve_device(device)
        if cfg.use_amp and self.device.type == "cuda":
            if cfg.amp_dtype.lower() == "fp16":
                raise ValueError("flashsac_opt supports bf16 autocast only (fp16 needs loss scaling); set amp_dtype=bf16")
            self.amp_dtype: torch.dtype | None = torch.bfloat16
        else:
            self.amp_dtype = None  # UniLab runs fp32 off CUDA as well

        self.actor = FlashSACActor(
            obs_dim,
            action_dim,
            cfg.actor_hidden_dim,
            cfg.actor_num_blocks,
            noise_zeta_mu=cfg.actor_noise_zeta_mu,
            noise_zeta_max=cfg.actor_noise_zeta_max,
        ).to(self.device)
        self.critic = FlashSACCritic(
            critic_obs_dim,
            action_dim,
            cfg.critic_hidden_dim,
            cfg.critic_num_blocks,
            cfg.num_atoms,
            cfg.critic_min_v,
            cfg.critic_max_v,
        ).to(self.device)
        self.target_critic = copy.deepcopy(self.critic)
        self.target_critic.params.requires_grad_(False)
        for net in (self.actor, self.critic, self.target_critic):
            net.cast_gemm_weights_once = cfg.cast_gemm_weights_once
        critic_options = cfg.critic_network_options()
        for net in (self.critic, self.target_critic):
            net.input_bn_chunk_rows = cfg.input_bn_chunk_rows
            for name, value in critic_options.items():
                setattr(net, name, value)
        self.temperature = FlashSACTemperature(cfg.temp_initial_value).to(self.device)

        self.schedule = CosineSchedule(
            cfg.learning_rate_init,
            cfg.peak_lr,
            cfg.learning_rate_end,
            cfg.learning_rate_warmup_steps,
            cfg.learning_rate_decay_steps,
        )
        self.actor_adam = FlatAdam(self.actor.layout.numel, self.device)
        self.critic_adam = FlatAdam(self.critic.layout.numel, self.device)
        self.temperature_adam = FlatAdam(1, self.device)
        lr = self.schedule.on_device
        self.critic_step = GatedStep(self.critic.params, self.critic.bn_stats, self.critic_adam, self.critic.renormalized, lr)
        self.actor_step = GatedStep(self.actor.params, self.actor.bn_stats, self.actor_adam, self.actor.renormalized, lr)
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
        self._dims = {"obs": obs_dim, "critic_obs": critic_obs_dim, "action": action_dim}
        self.engine = self._make_engine()
        if self.engine.graph is not None and explore_graph.wanted():
            # graph mode (CUDA): UniLab serves collection from the learner's thread, between
            # iterations: one replay instead of ~40 launches per collection step (explore_graph.py)
            self.actor.captured_explore = explore_graph.CapturedExplore(self.actor)
        if process_group is not None and process_group is not False:
            self.enable_data_parallel(process_group)

    def _make_engine(self) -> Engine:
        cfg = self.cfg
        return Engine(
            cfg.learner_mode,
            self.device,
            updates={
                "critic": NetworkUpdate(
                    self.critic.params, self._critic_step, self._critic_loss, self._critic_apply,
                    compose_loss=self._critic_branched_loss if cfg.critic_target_stream else None,
                ),
                "actor": NetworkUpdate(self.actor.params, self._actor_step, self._actor_loss, self._actor_apply),
            },
            iteration=self._iteration,
            state=self._state_tensors(),
            backend=cfg.compile_backend,
            inductor_options=cfg.inductor_options,
            fused_update=cfg.fused_update,
            activation_memory_budget=cfg.activation_memory_budget,
            # member_linear is a custom autograd.Function: without this every launch re-traced
            # the options' graphs (their warm start doubled beside UniLab, 2026-12-02)
            cache_custom_autograd_functions=self.critic.contiguous_weight_grads,
            reduce=self.averager.average if self.averager is not None else None,
            compile_cache_file=cfg.compile_cache_file,
            # what names the default ("auto") cache file, with what the engine adds
            compile_cache_key={"dims": dict(self._dims), "config": asdict(cfg)},
        )

    def enable_data_parallel(self, process_group: "torch.distributed.ProcessGroup | bool" = True, averager: "RankAverager | None" = None,
                             gradient_wire_dtype: str = "float32") -> None:
        """Make this learner one rank of a data-parallel learner over ``process_group`` (True:
        the default group), before its first update: rank 0's networks are broadcast to every
        rank and the engine is rebuilt with the all-reduce between loss and step. The state
        (a loaded checkpoint included) is kept. Every rank must run the same configuration:
        a mismatch raises ValueError on every rank (one all-gather of the config as JSON)."""
        from flashsac_opt.data_parallel import RankAverager, broadcasts_params, check_same_config

        if self.averager is not None:
            raise ValueError("this learner is data parallel already")
        if self.engine.fused_update is not None:
            raise ValueError("enable_data_parallel() must come before the first update (the update functions are built)")
        # ``averager``: other collectives with RankAverager's interface (benchmark_multigpu's
        # comparison with UniLab's gradient all-reduce); by default RankAverager's bucket, the
        # gradient at ``gradient_wire_dtype`` (UniLab's training.dp_gradient_wire_dtype)
        averager = averager or RankAverager(None if process_group is True else process_group, gradient_wire_dtype)
        # the compile-cache file may be a per-rank path; everything else must agree
        config = {k: v for k, v in asdict(self.cfg).items() if k != "compile_cache_file"}
        check_same_config(averager, {"config": config, "dims": self._dims})
        self.averager = averager
        # Every rank starts from rank 0's networks, whatever its seed.
        averager.broadcast_(list(self.network_tensors().values()))
        self.engine = self._make_engine()
        self.broadcast_params = broadcasts_params(self.cfg.dp_broadcast_params, self.engine.compiled, self.device)

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
        """Check a large batch at the learner boundary; return the per-update batch size.

        Raises ValueError naming the field, the expected and the actual shape/dtype/device.
        """
        if not isinstance(batch, dict):
            raise ValueError(f"batch must be a dict of tensors, got {type(batch).__name__}")
        missing = [k for k in BATCH_FIELDS if k not in batch]
        if missing:
            raise ValueError(f"batch is missing field(s) {missing}; expected fields {list(BATCH_FIELDS)}")
        for name in BATCH_FIELDS:
            if not isinstance(batch[name], torch.Tensor):
                raise ValueError(f"batch[{name!r}]: expected a torch.Tensor, got {type(batch[name]).__name__}")
        rows = batch["actions"].shape[0] if batch["actions"].ndim else 0
        if rows == 0 or rows % updates_per_step:
            raise ValueError(
                f"batch['actions']: expected rows = updates_per_step ({updates_per_step}) x batch_size, "
                f"got shape {tuple(batch['actions'].shape)}"
            )
        widths = {
            "obs": self.obs_dim,
            "next_obs": self.obs_dim,
            "actions": self.action_dim,
            "critic": self.critic_obs_dim,
            "next_critic": self.critic_obs_dim,
        }
        for name in BATCH_FIELDS:
            t = batch[name]
            if name in widths:
                expected: tuple[tuple[int, ...], ...] = ((rows, widths[name]),)
            else:
                expected = ((rows,), (rows, 1))
            if tuple(t.shape) not in expected:
                raise ValueError(
                    f"batch[{name!r}]: expected shape {' or '.join(str(e) for e in expected)}, got {tuple(t.shape)}"
                )
            # float32 only, checked before any state changes: another dtype would fail (float64
            # in batch_norm) or round silently (bfloat16) in the middle of an iteration.
            if t.dtype != torch.float32:
                raise ValueError(f"batch[{name!r}]: expected dtype torch.float32, got {t.dtype} (convert with .float())")
            if t.device != self.device:
                raise ValueError(f"batch[{name!r}]: expected device {self.device}, got {t.device}")
        return rows // updates_per_step

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

    # ---------------------------------------------------------------- updates
    # Each network update comes as pure pieces: a *loss* function (forward + loss, its
    # backward runs through autograd), an *apply* function (finite guard, Adam,
    # renormalization, BN-statistics commit, Polyak, metric values), and a fused *step* that
    # is both with the gradient taken by torch.func. The engine compiles either the steps or
    # the loss/apply pairs (engine.NetworkUpdate); the Python loop of ``_iteration`` between
    # them only slices the batch and draws the actor's noise.
    def _noise(self, rows: int) -> torch.Tensor:
        # Same draw, shape and dtype as torch.distributions.Normal.rsample in the actor
        # head, so a run with the same RNG state sees the same exploration noise.
        dtype = self.amp_dtype or torch.float32
        return torch.empty(rows, self.action_dim, device=self.device, dtype=dtype).normal_()

    def _critic_loss(self, b: dict[str, torch.Tensor], noise: torch.Tensor, critic_params: torch.Tensor | None = None):
        return critic_objective(
            self.actor,
            self.critic,
            self.target_critic,
            self.actor.params,
            self.critic.params if critic_params is None else critic_params,
            self.target_critic.params,
            self.temperature.log_temp,
            b["next_obs"],
            b["critic"],
            b["next_critic"],
            b["actions"],
            b["rewards"],
            b["dones"],
            b["truncated"],
            noise,
            self.discount,
            self.amp_dtype,
            stack_target=self.cfg.stack_target_critic,
        )

    def _critic_branched_loss(
        self, compile: Callable[[Callable], Callable], side: torch.cuda.Stream | None
    ) -> Callable[[dict, torch.Tensor], CriticOutputs]:
        """The critic loss of ``_critic_loss`` as four compile boundaries. Given a second stream
        (the engine gives one where the iteration is captured: its graph keeps both chains'
        kernels as parallel branches), the target branch (the target critic's forward and the
        projection) runs on it while the online critic's forward runs on the current one
        (EngineOptions.critic_target_stream); without, they run in order."""
        amp, discount = self.amp_dtype, self.discount

        def bootstrap_inputs(b, noise):
            return critic_bootstrap_inputs(
                self.actor, self.actor.params, self.temperature.log_temp, b["next_obs"], b["critic"], b["next_critic"],
                b["actions"], noise, amp,
            )

        def target_branch(b, inputs):
            return critic_target_distribution(
                self.target_critic, self.target_critic.params, inputs, b["rewards"], b["dones"], b["truncated"], discount, amp
            )

        def online_branch(critic_params, inputs):
            return critic_online_log_probs(self.critic, critic_params, inputs, amp)

        inputs_fn, target_fn, online_fn = compile(bootstrap_inputs), compile(target_branch), compile(online_branch)
        cross_entropy_fn = compile(functools.partial(critic_cross_entropy, amp_dtype=amp))

        def loss(b: dict[str, torch.Tensor], noise: torch.Tensor) -> CriticOutputs:
            inputs = inputs_fn(b, noise)
            if side is None:
                target_probs, target_stats = target_fn(b, inputs)
                pred_log_probs_all, critic_stats = online_fn(self.critic.params, inputs)
            else:
                # Fork and join: everything the side stream reads was written before the fork,
                # and the current stream reads its outputs only after the join. Its outputs come
                # from its own allocator pool and are next reused by side-stream work, which is
                # ordered after the next fork, i.e. after their last reader: no record_stream.
                main = torch.cuda.current_stream(self.device)
                side.wait_stream(main)
                with torch.cuda.stream(side):
                    target_probs, target_stats = target_fn(b, inputs)
                pred_log_probs_all, critic_stats = online_fn(self.critic.params, inputs)
                main.wait_stream(side)
            return CriticOutputs(cross_entropy_fn(target_probs, pred_log_probs_all), critic_stats, target_stats)

        return loss

    def _critic_apply(self, grad, loss, critic_stats, target_stats, polyak: bool) -> torch.Tensor:
        """Guarded critic step, target BN stats, Polyak; returns [loss, reward std, applied]."""
        with torch.no_grad():
            ok = self.critic_step(grad, loss, critic_stats)
            tgt = self.target_critic.bn_stats
            tgt.copy_(torch.where(ok, target_stats, tgt))
            if polyak:
                # A skipped critic step also skips the target update that would follow it.
                self.target_critic.params.lerp_(self.critic.params, self.tau * ok)
            if self.reward_normalizer is not None:
                reward_std = torch.sqrt(self.reward_normalizer.var)[0]
            else:
                reward_std = torch.ones((), device=self.device)
            return torch.stack([loss.detach().float(), reward_std, ok.float()])

    def _actor_loss(self, b: dict[str, torch.Tensor], noise: torch.Tensor, actor_params: torch.Tensor | None = None):
        return actor_objective(
            self.actor,
            self.critic,
            self.actor.params if actor_params is None else actor_params,
            self.critic.params,
            self.temperature.log_temp,
            b["obs"],
            b["next_obs"],
            b["critic"],
            b["actions"],
            noise,
            self.cfg.actor_bc_alpha,
            self.amp_dtype,
        )

    def _actor_apply(self, grad, loss, entropy, actor_stats) -> torch.Tensor:
        """Guarded actor step, then the temperature step; returns the actor metric values."""
        with torch.no_grad():
            actor_ok = self.actor_step(grad, loss, actor_stats)
            log_temp = self.temperature.log_temp
            temp_loss, temp_grad = temperature_loss_and_grad(log_temp, entropy.float(), self.target_entropy)
            temp_ok = self.temperature_step(temp_grad, temp_loss)
            values = [loss.detach().float(), entropy.float(), torch.exp(log_temp)[0], temp_loss[0]]
            return torch.stack(values + [actor_ok.float(), temp_ok.float()])

    def _critic_step(self, b: dict[str, torch.Tensor], noise: torch.Tensor, polyak: bool) -> torch.Tensor:
        """The fused critic update: loss, gradient (torch.func), guarded step, Polyak."""

        def loss_and_stats(critic_params: torch.Tensor):
            out = self._critic_loss(b, noise, critic_params)
            return out.loss, (out.critic_stats, out.target_stats)

        grad, (loss, (critic_stats, target_stats)) = torch.func.grad_and_value(loss_and_stats, has_aux=True)(
            self.critic.params
        )
        return self._critic_apply(grad, loss, critic_stats, target_stats, polyak)

    def _actor_step(self, b: dict[str, torch.Tensor], noise: torch.Tensor) -> torch.Tensor:
        """The fused actor update: loss, gradient w.r.t. the actor only, guarded steps."""

        def loss_and_aux(actor_params: torch.Tensor):
            out = self._actor_loss(b, noise, actor_params)
            return out.loss, (out.entropy, out.actor_stats)

        grad, (loss, (entropy, actor_stats)) = torch.func.grad_and_value(loss_and_aux, has_aux=True)(self.actor.params)
        return self._actor_apply(grad, loss, entropy, actor_stats)

    def _critic_update(self, updates, b: dict[str, torch.Tensor], row: torch.Tensor, polyak: bool) -> None:
        noise = self._noise(b["actions"].shape[0])
        row[: COL["critic_applied"] + 1].copy_(updates["critic"](b, noise, polyak))

    def _actor_update(self, updates, b: dict[str, torch.Tensor], row: torch.Tensor) -> None:
        noise = self._noise(2 * b["obs"].shape[0])
        row[COL["actor_loss"] :].copy_(updates["actor"](b, noise))

    def _prepare_batch(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Scalar columns flattened to (N,), rewards divided by the current reward scale."""
        with torch.no_grad():
            rewards = batch["rewards"].reshape(-1)
            if self.reward_normalizer is not None:
                rewards = rewards / self.reward_normalizer.scale()
        return dict(batch, rewards=rewards, dones=batch["dones"].reshape(-1), truncated=batch["truncated"].reshape(-1))

    def _iteration(self, batch: dict[str, torch.Tensor], schedule: Schedule, updates) -> None:
        """The whole iteration's device work (what graph mode captures)."""
        metrics = self.metrics
        u_count, pf = schedule.updates_per_step, schedule.policy_frequency
        bsz = batch["actions"].shape[0] // u_count
        metrics[:u_count].zero_()
        batch = self._prepare_batch(batch)
        for u in range(u_count):
            b = {k: v[u * bsz : (u + 1) * bsz] for k, v in batch.items()}
            do_actor = u % pf == 0
            if do_actor and schedule.policy_before_critic:
                self._actor_update(updates, b, metrics[u])
            self._critic_update(updates, b, metrics[u], polyak=u % schedule.target_frequency == 0)
            if do_actor and not schedule.policy_before_critic:
                self._actor_update(updates, b, metrics[u])
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
    ) -> None:
        """Run one iteration (all updates) on a large batch. Does not synchronize.

        The batch is checked whole before anything runs: a bad one raises ValueError and
        leaves the learner as it was."""
        schedule = self._schedule(updates_per_step, policy_frequency)
        self.validate_batch(batch, schedule.updates_per_step)
        self._begin_iteration(schedule)
        self.engine.run(batch, schedule)
        self.iterations += 1

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
        return self.engine.update_functions(rows), self._prepare_batch(batch)

    def step_critic(self, batch: dict[str, torch.Tensor]) -> None:
        """One critic update (no target update) on a single batch."""
        self._fold_rank_reward_stats()
        updates, b = self._single_batch(batch)
        self._critic_update(updates, b, self._single_metrics, polyak=False)

    def step_actor(self, batch: dict[str, torch.Tensor]) -> None:
        """One actor + temperature update on a single batch."""
        updates, b = self._single_batch(batch)
        self._actor_update(updates, b, self._single_metrics)

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

    def read_metrics(self) -> dict[str, float]:
        """The iteration's metrics: the one device-to-host copy per iteration.

        Names follow UniLab's TensorBoard tags; like UniLab, the losses are those of the
        last critic update and the last actor update of the iteration.
        """
        if self.metrics is None or self._last_schedule is None:
            return {}
        u_count, pf = self._last_schedule.updates_per_step, self._last_schedule.policy_frequency
        values = self.metrics.cpu().tolist()
        rows, totals = values[:u_count], values[u_count]
        last_critic = rows[-1]
        last_actor = rows[((u_count - 1) // pf) * pf]
        out = {"Loss/critic": last_critic[COL["critic_loss"]]}
        if self.reward_normalizer is not None:
            out["Train/reward_scale_std"] = last_critic[COL["reward_scale_std"]]
        out.update(
            {
                "Loss/actor": last_actor[COL["actor_loss"]],
                "Loss/entropy": last_actor[COL["entropy"]],
                "Policy/temperature": last_actor[COL["temperature"]],
                "Loss/temperature": last_actor[COL["temperature_loss"]],
                "Learner/critic_updates_skipped": float(sum(1.0 - r[COL["critic_applied"]] for r in rows)),
                "Learner/actor_updates_skipped": float(sum(1.0 - rows[i][COL["actor_applied"]] for i in range(0, u_count, pf))),
                "Learner/skipped_total": float(sum(totals[: len(TOTAL_COLUMNS)])),
            }
        )
        return out

    def update_metrics_table(self) -> torch.Tensor:
        """Per-update metrics of the last iteration (host copy; for tests and experiments)."""
        assert self.metrics is not None
        return self.metrics.cpu()

    # ------------------------------------------------------------- checkpoint
    def state_dict(self) -> dict:
        def plain(d: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
            return {k: v.detach().clone() for k, v in d.items()}

        return {
            "format": STATE_FORMAT,
            "dims": {"obs": self.obs_dim, "critic_obs": self.critic_obs_dim, "action": self.action_dim},
            "config": asdict(self.cfg),
            "actor": plain(self.actor.state_dict()),
            "critic": plain(self.critic.state_dict()),
            "target_critic": plain(self.target_critic.state_dict()),
            "temperature": plain(self.temperature.state_dict()),
            "optim": {
                "actor": plain(self.actor_adam.tensors()),
                "critic": plain(self.critic_adam.tensors()),
                "temperature": plain(self.temperature_adam.tensors()),
            },
            "reward_normalizer": plain(self.reward_normalizer.state_tensors()) if self.reward_normalizer else None,
            "skipped_totals": self.totals.clone(),
            "iterations": self.iterations,
        }

    def load_state_dict(self, state: dict) -> None:
        if state.get("format") != STATE_FORMAT:
            raise ValueError(
                f"not a flashsac_opt learner state (format {state.get('format')!r}); "
                "convert UniLab checkpoints with flashsac_opt.unilab.compat.from_unilab_state_dict"
            )
        dims = {"obs": self.obs_dim, "critic_obs": self.critic_obs_dim, "action": self.action_dim}
        if state["dims"] != dims:
            raise ValueError(f"checkpoint dims {state['dims']} do not match this learner's {dims}")
        with torch.no_grad():
            self.actor.load_state_dict(state["actor"])
            self.critic.load_state_dict(state["critic"])
            self.target_critic.load_state_dict(state["target_critic"])
            self.temperature.load_state_dict(state["temperature"])
            for adam, key in ((self.actor_adam, "actor"), (self.critic_adam, "critic"), (self.temperature_adam, "temperature")):
                for name, tensor in adam.tensors().items():
                    tensor.copy_(state["optim"][key][name])
            for step in (self.actor_step, self.critic_step, self.temperature_step):
                step.refresh()  # the next step's Adam coefficients, from the loaded counters
            if self.reward_normalizer is not None and state.get("reward_normalizer") is not None:
                self.reward_normalizer.load_state_tensors(state["reward_normalizer"])
            if "skipped_totals" in state:
                self.totals.copy_(state["skipped_totals"])
        self.iterations = int(state.get("iterations", 0))
