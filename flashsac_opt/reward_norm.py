"""Reward scaling by running statistics of the per-env discounted return.

For every env, G <- gamma * (1 - done) * G + r after each transition; the scale is
max(sqrt(Var[G] + eps), max|G| / g_max). The statistics are fed from newly collected
transitions (not from sampled batches) and live on the learner device; all updates are
in place so captured graphs that read them stay valid.
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

    def update(self, rewards: torch.Tensor, dones: torch.Tensor) -> None:
        """Fold in transitions shaped (steps, num_envs) or (num_envs,), in time order."""
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
        keep = 1.0 - torch.clamp(dones, 0.0, 1.0)
        for t in range(rewards.shape[0]):
            self.returns.mul_(self.gamma * keep[t]).add_(rewards[t])
            self.abs_max.copy_(torch.maximum(self.abs_max, self.returns.abs().max()))
            self._merge(self.returns)

    def _merge(self, x: torch.Tensor) -> None:
        """Chan et al. parallel merge of a batch's mean/variance into the running ones."""
        n = torch.tensor(float(x.numel()), device=self.device)
        batch_mean, batch_var = x.mean(), x.var(unbiased=False)
        delta = batch_mean - self.mean
        total = self.count + n
        merged_m2 = self.var * self.count + batch_var * n + delta.pow(2) * self.count * n / total
        self.mean.copy_(self.mean + delta * n / total)
        self.var.copy_(merged_m2 / total)
        self.count.copy_(total)

    def scale(self) -> torch.Tensor:
        return torch.maximum(torch.sqrt(self.var + self.eps), self.abs_max / max(self.g_max, self.eps))

    def state_tensors(self) -> dict[str, torch.Tensor]:
        return {"mean": self.mean, "var": self.var, "count": self.count, "returns": self.returns, "abs_max": self.abs_max}

    def load_state_tensors(self, state: dict[str, torch.Tensor]) -> None:
        if self.returns.shape != state["returns"].shape:
            self.returns = torch.zeros_like(state["returns"], device=self.device)
        for name, value in state.items():
            getattr(self, name).copy_(value)
