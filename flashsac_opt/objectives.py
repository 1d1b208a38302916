"""FlashSAC objectives: critic (C51 cross-entropy), actor, temperature, schedules.

The critic and actor objectives are pure functions of flat tensors (no module state is
written), which is the boundary ``torch.compile`` sees. They return the new BatchNorm
statistics so the learner commits them only when the step is finite.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch

from flashsac_opt.networks import FlashSACActor, FlashSACCritic


def target_entropy(action_dim: int, sigma: float, override: float | None = None) -> float:
    """Entropy of a diagonal Gaussian with std ``sigma`` per action dim (or ``override``)."""
    if override is not None:
        return float(override)
    sigma = max(float(sigma), 1e-6)
    return float(action_dim) * 0.5 * math.log(2.0 * math.pi * math.e * sigma * sigma)


class CosineSchedule:
    """LR multiplier: linear warm-up init->peak, then cosine peak->end over decay_steps.

    ``__call__`` is the host (float) form used for checkpoints; ``on_device`` evaluates
    the same curve from a device step counter so no host value enters a compiled or
    captured update (the LR changes every step without recompiling or recapturing).
    """

    def __init__(self, init_lr: float, peak_lr: float, end_lr: float, warmup_steps: int, decay_steps: int):
        self.peak = float(peak_lr)
        self.init_ratio = init_lr / peak_lr if peak_lr > 0 else 1.0
        self.end_ratio = end_lr / peak_lr if peak_lr > 0 else 1.0
        self.warmup = max(int(warmup_steps), 0)
        self.decay = max(int(decay_steps), self.warmup + 1)

    def __call__(self, step: int) -> float:
        if self.warmup > 0 and step < self.warmup:
            return self.init_ratio + (1.0 - self.init_ratio) * (float(step) / float(self.warmup))
        progress = min(max((step - self.warmup) / float(self.decay - self.warmup), 0.0), 1.0)
        return self.end_ratio + (1.0 - self.end_ratio) * (0.5 * (1.0 + math.cos(math.pi * progress)))

    def on_device(self, step: torch.Tensor) -> torch.Tensor:
        """LR (float64) for a float64 step counter of shape (1,)."""
        progress = ((step - self.warmup) / float(self.decay - self.warmup)).clamp(0.0, 1.0)
        cosine = self.end_ratio + (1.0 - self.end_ratio) * (0.5 * (1.0 + torch.cos(math.pi * progress)))
        if self.warmup > 0:
            ramp = self.init_ratio + (1.0 - self.init_ratio) * (step / float(self.warmup))
            cosine = torch.where(step < self.warmup, ramp, cosine)
        return self.peak * cosine


def categorical_projection(
    support: torch.Tensor,
    next_probs: torch.Tensor,
    rewards: torch.Tensor,
    bootstrap: torch.Tensor,
    entropy_term: torch.Tensor,
    discount: float,
) -> torch.Tensor:
    """C51 projection of r + bootstrap * discount * (z - alpha*logpi) onto the fixed support.

    Each shifted atom's mass is split between its two neighbouring atoms in proportion to
    distance. Shapes: support (K,), next_probs (B, K), rewards/bootstrap/entropy_term (B,).
    """
    num_atoms = support.shape[0]
    lo, hi = support[:1], support[-1:]
    shifted = rewards[:, None] + bootstrap[:, None] * discount * (support[None, :] - entropy_term[:, None])
    shifted = torch.maximum(torch.minimum(shifted, hi), lo)
    position = (shifted - lo) / (support[1:2] - lo).clamp_min(1e-8)
    below = position.floor().long().clamp(0, num_atoms - 1)
    above = position.ceil().long().clamp(0, num_atoms - 1)
    frac_above = position - below.float()
    projected = torch.zeros_like(next_probs)
    projected.scatter_add_(1, below, next_probs * (1.0 - frac_above))
    projected.scatter_add_(1, above, next_probs * frac_above)
    return projected


def _autocast(like: torch.Tensor, dtype: torch.dtype | None) -> torch.autocast:
    return torch.autocast(device_type=like.device.type, dtype=dtype, enabled=dtype is not None)


class CriticOutputs(NamedTuple):
    loss: torch.Tensor
    critic_stats: torch.Tensor  # new BN statistics of the online critic
    target_stats: torch.Tensor  # new BN statistics of the target critic


class BootstrapInputs(NamedTuple):
    """What both critics' forwards start from (no gradient flows through any of it)."""

    obs_all: torch.Tensor  # critic observations [s, s'] (2B rows)
    act_all: torch.Tensor  # actions [a, a'], a' ~ pi(s') (2B rows)
    entropy_term: torch.Tensor  # alpha * log pi(a'|s') (B,)


def critic_bootstrap_inputs(
    actor: FlashSACActor,
    actor_params: torch.Tensor,
    log_temp: torch.Tensor,
    obs_next: torch.Tensor,
    critic_obs: torch.Tensor,
    critic_obs_next: torch.Tensor,
    actions: torch.Tensor,
    next_noise: torch.Tensor,
    amp_dtype: torch.dtype | None,
) -> BootstrapInputs:
    """The joint [s, s'] x [a, a'] rows and the entropy term of the bootstrap."""
    obs_all = torch.cat([critic_obs, critic_obs_next], dim=0)
    with torch.no_grad(), _autocast(actions, amp_dtype):
        next_actions, next_log_prob, _ = actor(obs_next, next_noise, training=False, params=actor_params.detach())
        entropy_term = torch.exp(log_temp).detach() * next_log_prob
        act_all = torch.cat([actions, next_actions], dim=0)
    return BootstrapInputs(obs_all, act_all, entropy_term.reshape(-1))


def bootstrap_distribution(
    support: torch.Tensor,
    q_all: torch.Tensor,
    log_probs_all: torch.Tensor,
    rewards: torch.Tensor,
    dones: torch.Tensor,
    truncated: torch.Tensor,
    entropy_term: torch.Tensor,
    discount: float,
) -> torch.Tensor:
    """The projected target distribution from the target critic's [s', a'] rows (its second
    half), per sample from the ensemble member with the smaller Q."""
    batch = rewards.shape[0]
    next_q, next_log_probs = q_all[:, batch:], log_probs_all[:, batch:]
    member = next_q.argmin(dim=0)
    chosen = torch.gather(next_log_probs, 0, member[None, :, None].expand(1, -1, next_log_probs.shape[-1]))[0]
    bootstrap = torch.clamp(1.0 - dones + truncated, 0.0, 1.0)
    return categorical_projection(support, chosen.exp(), rewards, bootstrap, entropy_term, discount)


def critic_target_distribution(
    target: FlashSACCritic,
    target_params: torch.Tensor,
    inputs: BootstrapInputs,
    rewards: torch.Tensor,
    dones: torch.Tensor,
    truncated: torch.Tensor,
    discount: float,
    amp_dtype: torch.dtype | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The target critic's training-mode forward on the joint rows and the projected
    bootstrap distribution: (target probs (B, atoms), the target's new BN statistics)."""
    with torch.no_grad(), _autocast(rewards, amp_dtype):
        q_all, log_probs_all, target_stats = target(inputs.obs_all, inputs.act_all, training=True, params=target_params)
        probs = bootstrap_distribution(target.support, q_all, log_probs_all, rewards, dones, truncated, inputs.entropy_term, discount)
    assert target_stats is not None
    return probs, target_stats


def critic_online_log_probs(
    critic: FlashSACCritic, critic_params: torch.Tensor, inputs: BootstrapInputs, amp_dtype: torch.dtype | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """The online critic's training-mode forward on the joint rows: (atom log-probs
    (members, 2B, atoms), its new BN statistics)."""
    with _autocast(inputs.act_all, amp_dtype):
        _, log_probs_all, critic_stats = critic(inputs.obs_all, inputs.act_all, training=True, params=critic_params)
    assert critic_stats is not None
    return log_probs_all, critic_stats


def critic_cross_entropy(target_probs: torch.Tensor, pred_log_probs_all: torch.Tensor, amp_dtype: torch.dtype | None) -> torch.Tensor:
    """Cross-entropy of every member's [s, a] prediction (the first half of the joint rows)
    against the target distribution, averaged over members and samples."""
    batch = target_probs.shape[0]
    with _autocast(target_probs, amp_dtype):
        return -(target_probs.unsqueeze(0) * pred_log_probs_all[:, :batch]).sum(dim=-1).mean()


def critic_objective(
    actor: FlashSACActor,
    critic: FlashSACCritic,
    target: FlashSACCritic,
    actor_params: torch.Tensor,
    critic_params: torch.Tensor,
    target_params: torch.Tensor,
    log_temp: torch.Tensor,
    obs_next: torch.Tensor,
    critic_obs: torch.Tensor,
    critic_obs_next: torch.Tensor,
    actions: torch.Tensor,
    rewards: torch.Tensor,
    dones: torch.Tensor,
    truncated: torch.Tensor,
    next_noise: torch.Tensor,
    discount: float,
    amp_dtype: torch.dtype | None,
    stack_target: bool = False,
) -> CriticOutputs:
    """Distributional TD loss on the joint batch (CrossQ-style shared BN statistics).

    The target and online critics both run on [s, s'] x [a, a'] (2B rows) in training-mode
    BN; the first half gives the prediction, the second half the bootstrap distribution
    (from the ensemble member with the smaller Q, per sample). ``stack_target``: both critics
    as one ensemble forward (``FlashSACCritic.forward_stacked``), the target half detached.
    The pieces (bootstrap inputs, target distribution, online forward, cross-entropy) are
    separate functions so that the learner can also run them as separate compile boundaries
    (EngineOptions.critic_target_stream).
    """
    inputs = critic_bootstrap_inputs(
        actor, actor_params, log_temp, obs_next, critic_obs, critic_obs_next, actions, next_noise, amp_dtype
    )
    if stack_target:
        n = critic.num_members
        with _autocast(actions, amp_dtype):
            q_both, log_probs_both, (critic_stats, target_stats) = critic.forward_stacked(
                inputs.obs_all, inputs.act_all, (critic_params, target_params.detach()), (critic.bn_stats, target.bn_stats)
            )
        pred_log_probs_all, target_stats = log_probs_both[:n], target_stats.detach()
        with torch.no_grad(), _autocast(actions, amp_dtype):
            target_probs = bootstrap_distribution(
                target.support, q_both[n:].detach(), log_probs_both[n:].detach(), rewards, dones, truncated,
                inputs.entropy_term, discount,
            )
    else:  # UniLab's order: the target's forward and projection, then the online critic's forward
        target_probs, target_stats = critic_target_distribution(
            target, target_params, inputs, rewards, dones, truncated, discount, amp_dtype
        )
        pred_log_probs_all, critic_stats = critic_online_log_probs(critic, critic_params, inputs, amp_dtype)
    loss = critic_cross_entropy(target_probs, pred_log_probs_all, amp_dtype)
    return CriticOutputs(loss, critic_stats, target_stats)


class ActorOutputs(NamedTuple):
    loss: torch.Tensor
    entropy: torch.Tensor
    actor_stats: torch.Tensor


def actor_objective(
    actor: FlashSACActor,
    critic: FlashSACCritic,
    actor_params: torch.Tensor,
    critic_params: torch.Tensor,
    log_temp: torch.Tensor,
    obs: torch.Tensor,
    obs_next: torch.Tensor,
    critic_obs: torch.Tensor,
    expert_actions: torch.Tensor,
    noise: torch.Tensor,
    bc_alpha: float,
    amp_dtype: torch.dtype | None,
    freeze_critic: bool = True,
) -> ActorOutputs:
    """alpha * log pi - min_i Q_i on the joint [s, s'] batch (BN statistics over 2B rows).

    The critic runs on *detached* parameters in eval-mode BN: autograd gets dQ/da but
    records no weight-gradient work for the critic at all. (``freeze_critic=False`` exists
    only to measure the difference: under torch.compile the compiled backward would compute
    critic dW even if the caller asks only for actor gradients.)
    """
    batch = obs.shape[0]
    amp = _autocast(obs, amp_dtype)
    with amp:
        actions_all, log_prob_all, actor_stats = actor(
            torch.cat([obs, obs_next], dim=0), noise, training=True, params=actor_params
        )
        actions, log_prob = actions_all[:batch], log_prob_all[:batch]
        q, _, _ = critic(critic_obs, actions, training=False, params=critic_params.detach() if freeze_critic else critic_params)
        min_q = torch.min(q[0], q[1])
        loss = (torch.exp(log_temp).detach() * log_prob - min_q).mean()
        if bc_alpha > 0:
            loss = loss + bc_alpha * min_q.abs().mean().detach() * torch.mean((actions - expert_actions) ** 2)
        entropy = -log_prob.detach().mean()
    assert actor_stats is not None
    return ActorOutputs(loss, entropy, actor_stats)


def temperature_loss_and_grad(
    log_temp: torch.Tensor, entropy: torch.Tensor, target: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """alpha * (H - H_target) and its gradient w.r.t. log alpha, in closed form.

    d/d(log a) [exp(log a) * c] = c * exp(log a): one multiply instead of an autograd pass.
    """
    gap = entropy - target
    alpha = torch.exp(log_temp)
    return alpha * gap, gap * alpha
