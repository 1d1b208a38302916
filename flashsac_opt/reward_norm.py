"""Reward scaling by running statistics of the per-env discounted return.

For every env, G <- gamma * (1 - done) * G + r after each transition; the scale is
max(sqrt(Var[G] + eps), max|G| / g_max). The statistics are fed from newly collected
transitions (not from sampled batches) and live on the learner device; all updates are
in place so captured graphs that read them stay valid.

Data parallel: UniLab hands each rank its own envs' new transitions whenever its collector
committed some, so how often and how many differ between ranks and no collective can sit
there. A rank then ``accumulate``s them into a pending partial (count, mean, variance of its G
values, max |G|) with no communication, and the learner, at the start of each iteration
(which every rank runs in lockstep), gathers the ranks' partials and ``fold``s them in rank
order: one global scale, the same bits on every rank. G itself stays per rank (its own envs).
"""

from __future__ import annotations

import torch


class RewardNormalizer:
    def __init__(self, gamma: float, g_max: float, device: torch.device, eps: float = 1e-8):
        self.gamma, self.g_max, self.eps, self.device = gamma, g_max, eps, device
        self.mean = torch.zeros(1, device=device)
        self.var = torch.ones(1, device=device)
        self.count = torch.tensor(1e-4, device=device)
        self.returns = torch.zeros(0, device=device)  # per-env discounted return G
        self.abs_max = torch.tensor(0.0, device=device)  # running max |G|
        # data parallel: this rank's statistics not yet folded in: count, mean, var, max |G|
        self.pending = torch.zeros(4, device=device)
        self._env_count, self._env_count_of = torch.zeros((), device=device), 0  # len(returns) as a device scalar

    def update(self, rewards: torch.Tensor, dones: torch.Tensor) -> None:
        """Fold in transitions shaped (steps, num_envs) or (num_envs,), in time order."""
        self._steps(rewards, dones, (self.mean, self.var, self.count, self.abs_max))

    def accumulate(self, rewards: torch.Tensor, dones: torch.Tensor) -> None:
        """As ``update``, into this rank's pending statistics instead of the running ones."""
        p = self.pending
        self._steps(rewards, dones, (p[1:2], p[2:3], p[0], p[3]))

    def take_pending(self) -> torch.Tensor:
        """This rank's pending [count, mean, var, max |G|] since the last call (then reset)."""
        out = self.pending.clone()
        self.pending.zero_()
        return out

    def fold(self, partials: torch.Tensor) -> None:
        """Merge the ranks' ``take_pending`` rows, in rank order, into the running statistics;
        a row with count 0 changes nothing."""
        stats = (self.mean, self.var, self.count, self.abs_max)
        for count, mean, var, abs_max in partials.to(self.device, torch.float32):
            _chan_merge(stats, count, mean, var)
            self.abs_max.copy_(torch.maximum(self.abs_max, abs_max))

    def _steps(self, rewards: torch.Tensor, dones: torch.Tensor, stats: tuple) -> None:
        if rewards.shape != dones.shape:
            raise ValueError(
                f"reward statistics: rewards {tuple(rewards.shape)} and dones {tuple(dones.shape)} differ"
            )
        if not rewards.is_floating_point():
            raise ValueError(f"reward statistics: rewards must be floating point, got {rewards.dtype}")
        rewards = rewards.to(self.device, torch.float32)
        dones = dones.to(self.device, torch.float32)
        if rewards.ndim == 1:
            rewards, dones = rewards[None], dones[None]
        if rewards.numel() == 0:
            return
        if self.returns.shape != rewards.shape[-1:]:
            self.returns = torch.zeros(rewards.shape[-1], device=self.device)
        if self._env_count_of != self.returns.numel():
            # made once per env count, not per step: a host scalar copied to the GPU is a copy
            # the host waits for, and UniLab calls this between every two learner iterations
            self._env_count = torch.tensor(float(self.returns.numel()), device=self.device)
            self._env_count_of = self.returns.numel()
        keep = 1.0 - torch.clamp(dones, 0.0, 1.0)
        abs_max = stats[3]
        for t in range(rewards.shape[0]):
            self.returns.mul_(self.gamma * keep[t]).add_(rewards[t])
            abs_max.copy_(torch.maximum(abs_max, self.returns.abs().max()))
            x = self.returns
            _chan_merge(stats, self._env_count, x.mean(), x.var(unbiased=False))

    def scale(self) -> torch.Tensor:
        return torch.maximum(torch.sqrt(self.var + self.eps), self.abs_max / max(self.g_max, self.eps))

    def state_tensors(self) -> dict[str, torch.Tensor]:
        return {"mean": self.mean, "var": self.var, "count": self.count, "returns": self.returns, "abs_max": self.abs_max}

    def load_state_tensors(self, state: dict[str, torch.Tensor]) -> None:
        if self.returns.shape != state["returns"].shape:
            self.returns = torch.zeros_like(state["returns"], device=self.device)
        for name, value in state.items():
            getattr(self, name).copy_(value)


def _chan_merge(stats: tuple, n: torch.Tensor, batch_mean: torch.Tensor, batch_var: torch.Tensor) -> None:
    """Chan et al. parallel merge of a batch's count/mean/variance into ``stats`` = (mean,
    var, count, ...) in place. With a running count of 0 it takes the batch's; a batch of
    count 0 (a rank with nothing new) leaves every bit as it was (selected on the device: no
    host sync). The running count starts at 1e-4, so the division never sees 0/0."""
    mean, var, count = stats[0], stats[1], stats[2]
    delta = batch_mean - mean
    total = count + n
    merged_m2 = var * count + batch_var * n + delta.pow(2) * count * n / total
    some = n > 0
    mean.copy_(torch.where(some, mean + delta * n / total, mean))
    var.copy_(torch.where(some, merged_m2 / total, var))
    count.copy_(torch.where(some, total, count))
