"""The pieces of one FlashSAC update, bound to a learner's tensors.

Each network update comes as pure pieces: a *loss* function (forward + loss, its backward runs
through autograd), an *apply* function (finite guard, Adam, renormalization, BN-statistics
commit, Polyak, metric values), and a fused *step* that is both with the gradient taken by
torch.func. The engine compiles either the steps or the loss/apply pairs
(engine.NetworkUpdate); the learner's iteration loop between them only slices the batch and
draws the actor's noise (``critic_update`` / ``actor_update``).

The pieces read and write the learner's tensors in place (parameters, BN statistics, Adam
state, temperature, reward statistics): they keep references to them, never copies, so a
checkpoint load (which copies into the same tensors) is seen by every compiled or captured
function.
"""

from __future__ import annotations

import functools
from typing import Callable, Mapping

import torch

from flashsac_opt.metrics import COL
from flashsac_opt.objectives import (
    CriticOutputs,
    actor_objective,
    critic_bootstrap_inputs,
    critic_cross_entropy,
    critic_objective,
    critic_online_log_probs,
    critic_target_distribution,
    temperature_loss_and_grad,
)



class UpdateFunctions:
    """The critic's and the actor's update pieces of one learner (see the module docstring).

    The pieces the engine compiles keep the names and attribute paths they had as the learner's
    own methods (``_critic_step``, ``self.critic_step`` for the guarded Adam step, ...): Dynamo
    names a traced tensor by its attribute path, so the compiled graphs, and with them Inductor's
    caches and compile-cache files written before, stay the same."""

    def __init__(self, learner):
        self.actor, self.critic, self.target_critic = learner.actor, learner.critic, learner.target_critic
        self.temperature = learner.temperature
        self.critic_step, self.actor_step = learner.critic_step, learner.actor_step
        self.temperature_step = learner.temperature_step
        self.reward_normalizer = learner.reward_normalizer
        self.tau, self.discount, self.target_entropy = learner.tau, learner.discount, learner.target_entropy
        self.action_dim, self.device = learner.action_dim, learner.device
        self.amp_dtype = learner.cfg.autocast_dtype(learner.device)  # the learner's amp_dtype (settable there)
        self.actor_bc_alpha = learner.cfg.actor_bc_alpha
        self.stack_target_critic = learner.cfg.stack_target_critic

    def _noise(self, rows: int) -> torch.Tensor:
        # Same draw, shape and dtype as torch.distributions.Normal.rsample in the actor
        # head, so a run with the same RNG state sees the same exploration noise.
        dtype = self.amp_dtype or torch.float32
        return torch.empty(rows, self.action_dim, device=self.device, dtype=dtype).normal_()

    def prepare_batch(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Scalar columns flattened to (N,), rewards divided by the current reward scale."""
        with torch.no_grad():
            rewards = batch["rewards"].reshape(-1)
            if self.reward_normalizer is not None:
                rewards = rewards / self.reward_normalizer.scale()
        return dict(batch, rewards=rewards, dones=batch["dones"].reshape(-1), truncated=batch["truncated"].reshape(-1))

    # ------------------------------------------------------------------ critic
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
            stack_target=self.stack_target_critic,
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
            # A skipped critic step also skips the target update that would follow it.
            ok = self.critic_step(grad, loss, critic_stats, polyak=(self.target_critic.params, self.tau) if polyak else None)
            tgt = self.target_critic.bn_stats
            tgt.copy_(torch.where(ok, target_stats, tgt))
            if self.reward_normalizer is not None:
                reward_std = torch.sqrt(self.reward_normalizer.var)[0]
            else:
                reward_std = torch.ones((), device=self.device)
            return torch.stack([loss.detach().float(), reward_std, ok.float()])

    def _critic_step(self, b: dict[str, torch.Tensor], noise: torch.Tensor, polyak: bool) -> torch.Tensor:
        """The fused critic update: loss, gradient (torch.func), guarded step, Polyak."""

        def loss_and_stats(critic_params: torch.Tensor):
            out = self._critic_loss(b, noise, critic_params)
            return out.loss, (out.critic_stats, out.target_stats)

        grad, (loss, (critic_stats, target_stats)) = torch.func.grad_and_value(loss_and_stats, has_aux=True)(
            self.critic.params
        )
        return self._critic_apply(grad, loss, critic_stats, target_stats, polyak)

    # ------------------------------------------------------------------- actor
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
            self.actor_bc_alpha,
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

    def _actor_step(self, b: dict[str, torch.Tensor], noise: torch.Tensor) -> torch.Tensor:
        """The fused actor update: loss, gradient w.r.t. the actor only, guarded steps."""

        def loss_and_aux(actor_params: torch.Tensor):
            out = self._actor_loss(b, noise, actor_params)
            return out.loss, (out.entropy, out.actor_stats)

        grad, (loss, (entropy, actor_stats)) = torch.func.grad_and_value(loss_and_aux, has_aux=True)(self.actor.params)
        return self._actor_apply(grad, loss, entropy, actor_stats)

    # ------------------------------------------- one update inside the iteration loop
    def critic_update(self, updates: Mapping[str, Callable], b: dict[str, torch.Tensor], row: torch.Tensor, polyak: bool) -> None:
        """One critic update with ``updates["critic"]`` (the engine's form), its values into ``row``."""
        noise = self._noise(b["actions"].shape[0])
        row[: COL["critic_applied"] + 1].copy_(updates["critic"](b, noise, polyak))

    def actor_update(self, updates: Mapping[str, Callable], b: dict[str, torch.Tensor], row: torch.Tensor) -> None:
        """One actor + temperature update with ``updates["actor"]``, its values into ``row``."""
        noise = self._noise(2 * b["obs"].shape[0])
        row[COL["actor_loss"] :].copy_(updates["actor"](b, noise))
