"""Side-by-side comparison with UniLab 1.5.2's own FlashSAC learner (the oracle).

Builds UniLab's ``FlashSACLearner`` with compile and graphs off, copies its weights into a
flashsac_opt learner, drives both with the same batches, reward statistics and RNG state
(so the actor draws the same noise), and reports per-update loss differences and
per-tensor state differences. Used by the tests and by experiments/validate_numerics.py.

On CPU in fp32 the two learners are bit-identical: ``Comparison.mismatches()`` lists every
loss value and every state tensor that is not (dtype, shape and every element equal; a NaN
never matches), and is what the tests assert empty. The magnitudes of any difference are
reported too, for reading a failure or a run elsewhere:
relative difference of a tensor = max|ours - theirs| / max|theirs| (the norm-relative
error; element-wise ratios are meaningless for entries that are ~0, e.g. Adam moments).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch

from flashsac_opt.config import FlashSACConfig
from flashsac_opt.learner import COL, FlashSACLearner
from flashsac_opt.unilab.compat import from_unilab_state_dict, to_unilab_state_dict

G1_DIMS = {"obs_dim": 98, "critic_obs_dim": 101, "action_dim": 29}


def unilab_learner(cfg: FlashSACConfig, obs_dim: int, critic_obs_dim: int, action_dim: int, device: str = "cpu"):
    """UniLab 1.5.2's learner in its per-update ("deferred eager") form, compile off."""
    from unilab.rl.algos.flash_sac.learner import FlashSACLearner as UniLabLearner

    return UniLabLearner(
        obs_dim=obs_dim,
        action_dim=action_dim,
        critic_obs_dim=critic_obs_dim,
        device=device,
        gamma=cfg.gamma,
        tau=cfg.tau,
        actor_lr=cfg.actor_lr,
        critic_lr=cfg.critic_lr,
        actor_hidden_dim=cfg.actor_hidden_dim,
        critic_hidden_dim=cfg.critic_hidden_dim,
        actor_num_blocks=cfg.actor_num_blocks,
        critic_num_blocks=cfg.critic_num_blocks,
        num_atoms=cfg.num_atoms,
        critic_min_v=cfg.critic_min_v,
        critic_max_v=cfg.critic_max_v,
        temp_initial_value=cfg.temp_initial_value,
        temp_target_sigma=cfg.temp_target_sigma,
        temp_target_entropy=cfg.temp_target_entropy,
        actor_bc_alpha=cfg.actor_bc_alpha,
        actor_noise_zeta_mu=cfg.actor_noise_zeta_mu,
        actor_noise_zeta_max=cfg.actor_noise_zeta_max,
        learning_rate_init=cfg.learning_rate_init,
        learning_rate_peak=cfg.learning_rate_peak,
        learning_rate_end=cfg.learning_rate_end,
        learning_rate_warmup_steps=cfg.learning_rate_warmup_steps,
        learning_rate_decay_steps=cfg.learning_rate_decay_steps,
        normalize_reward=cfg.normalize_reward,
        normalized_g_max=cfg.normalized_g_max,
        n_step=cfg.n_step,
        use_amp=cfg.use_amp,
        amp_dtype=cfg.amp_dtype,
        use_compile=False,
        compile_full_objectives=False,
        use_whole_cycle_cuda_graph=False,
    )


def unilab_learner_kwargs(**overrides: Any) -> dict[str, Any]:
    """The keyword arguments UniLab 1.5.2's runner gives its FlashSAC learner (what patch 0001
    forwards to flashsac_opt's adapter), G1's dims, small networks (32 / 64 hidden) for CPU
    tests; ``overrides`` replace or add entries."""
    kwargs = dict(
        obs_dim=98, action_dim=29, critic_obs_dim=101, gamma=0.97, tau=0.05, actor_lr=3e-4, critic_lr=3e-4,
        actor_hidden_dim=32, critic_hidden_dim=64, num_atoms=101, obs_normalization=False, actor_num_blocks=2,
        critic_num_blocks=2, critic_min_v=-5.0, critic_max_v=5.0, temp_initial_value=0.01, temp_target_sigma=0.15,
        temp_target_entropy=None, actor_bc_alpha=0.0, actor_noise_zeta_mu=2.0, actor_noise_zeta_max=16,
        learning_rate_init=3e-4, learning_rate_peak=3e-4, learning_rate_end=1.5e-4, learning_rate_warmup_steps=0,
        learning_rate_decay_steps=500000, normalize_reward=True, normalized_g_max=5.0, n_step=1, use_amp=True,
        amp_dtype="auto", use_compile=True, compile_full_objectives=None, use_whole_cycle_cuda_graph=None,
        dp_whole_cycle_cuda_graph=False, actor_normalize_parameters=True, critic_normalize_parameters=True,
    )
    kwargs.update(overrides)
    return kwargs


def unilab_iteration(learner: Any, large_batch: dict[str, torch.Tensor], cfg: FlashSACConfig) -> list[dict[str, float]]:
    """One iteration as UniLab's runner drives its per-update path; returns per-update metrics."""
    u_count, pf = cfg.updates_per_step, cfg.policy_frequency
    bsz = large_batch["actions"].shape[0] // u_count
    per_update: list[dict[str, float]] = []
    for u in range(u_count):
        batch = {k: v[u * bsz : (u + 1) * bsz] for k, v in large_batch.items()}
        row: dict[str, float] = {}
        if cfg.policy_before_critic and u % pf == 0:
            row.update(learner.update_actor(batch, read_metrics=True))
        row.update(learner.update_critic(batch, read_metrics=True))
        if not cfg.policy_before_critic and u % pf == 0:
            row.update(learner.update_actor(batch, read_metrics=True))
        if u % cfg.target_frequency == 0:
            learner.soft_update_target()
        per_update.append(row)
    return per_update


def synthetic_batch(rows: int, obs_dim: int, critic_obs_dim: int, action_dim: int, generator: torch.Generator, device="cpu") -> dict[str, torch.Tensor]:
    """A replay-like batch: Gaussian observations, actions in (-1, 1), ~2% terminations."""
    def randn(*shape):
        return torch.randn(*shape, generator=generator).to(device)

    dones = (torch.rand(rows, generator=generator) < 0.02).float()
    truncated = (torch.rand(rows, generator=generator) < 0.01).float() * (1 - dones)
    return {
        "obs": randn(rows, obs_dim),
        "next_obs": randn(rows, obs_dim),
        "actions": torch.tanh(torch.randn(rows, action_dim, generator=generator)).to(device),
        "rewards": (0.5 * torch.randn(rows, generator=generator) + 0.1).to(device),
        "dones": dones.to(device),
        "truncated": truncated.to(device),
        "critic": randn(rows, critic_obs_dim),
        "next_critic": randn(rows, critic_obs_dim),
    }


def tensor_differences(ours: Any, theirs: Any, prefix: str = "") -> dict[str, tuple[float, float]]:
    """{path: (max abs diff, norm-relative diff)} over every tensor in two nested states."""
    out: dict[str, tuple[float, float]] = {}
    if isinstance(theirs, torch.Tensor):
        if not isinstance(ours, torch.Tensor) or ours.shape != theirs.shape:
            raise AssertionError(f"{prefix}: shape/type mismatch {getattr(ours, 'shape', type(ours))} vs {theirs.shape}")
        a, b = ours.detach().double().cpu(), theirs.detach().double().cpu()
        if a.numel() == 0:
            return {prefix: (0.0, 0.0)}
        diff = (a - b).abs().max().item()
        scale = b.abs().max().item()
        out[prefix] = (diff, diff / scale if scale > 0 else diff)
    elif isinstance(theirs, dict):
        if set(ours) != set(theirs):
            raise AssertionError(f"{prefix}: keys differ: only ours {set(ours) - set(theirs)}, only theirs {set(theirs) - set(ours)}")
        for k in theirs:
            out.update(tensor_differences(ours[k], theirs[k], f"{prefix}.{k}" if prefix else str(k)))
    elif isinstance(theirs, (list, tuple)):
        for i, (x, y) in enumerate(zip(ours, theirs, strict=True)):
            out.update(tensor_differences(x, y, f"{prefix}[{i}]"))
    return out


def tensor_mismatches(ours: Any, theirs: Any, prefix: str = "") -> dict[str, str]:
    """{path: what differs} for every tensor of two nested states that is not bit-identical.

    Identical means same dtype, same shape and ``torch.equal`` (so a NaN never matches);
    the magnitude of a value difference is included for reading a failure.
    """
    out: dict[str, str] = {}
    if isinstance(theirs, torch.Tensor):
        if not isinstance(ours, torch.Tensor):
            return {prefix: f"ours is {type(ours).__name__}, theirs a tensor"}
        if ours.dtype != theirs.dtype or ours.shape != theirs.shape:
            return {prefix: f"ours {ours.dtype} {tuple(ours.shape)}, theirs {theirs.dtype} {tuple(theirs.shape)}"}
        a, b = ours.detach().cpu(), theirs.detach().cpu()
        if not torch.equal(a, b):
            abs_diff, rel_diff = tensor_differences(a, b, prefix)[prefix]
            out[prefix] = f"max abs difference {abs_diff:.3e}, relative {rel_diff:.3e}"
    elif isinstance(theirs, dict):
        if not isinstance(ours, dict) or set(ours) != set(theirs):
            return {prefix: f"keys differ: only ours {set(ours) - set(theirs)}, only theirs {set(theirs) - set(ours)}"}
        for k in theirs:
            out.update(tensor_mismatches(ours[k], theirs[k], f"{prefix}.{k}" if prefix else str(k)))
    elif isinstance(theirs, (list, tuple)):
        if not isinstance(ours, (list, tuple)) or len(ours) != len(theirs):
            return {prefix: "sequences of different lengths"}
        for i, (x, y) in enumerate(zip(ours, theirs)):
            out.update(tensor_mismatches(x, y, f"{prefix}[{i}]"))
    return out


def _worst_key(value: float) -> float:
    # a NaN difference is the worst kind, not one that every comparison skips
    return math.inf if math.isnan(value) else value


@dataclass
class Comparison:
    loss_rel: list[dict[str, float]] = field(default_factory=list)  # per update: metric -> rel diff
    loss_values: list[dict[str, tuple[float, float]]] = field(default_factory=list)  # per update: metric -> (ours, theirs)
    state_diffs: dict[str, tuple[float, float]] = field(default_factory=dict)  # final state: (max abs, rel)
    state_mismatches: dict[str, str] = field(default_factory=dict)  # final state: tensors not bit-identical

    def loss_mismatches(self) -> list[str]:
        """Every per-update metric whose two values are not equal (a NaN never matches)."""
        return [
            f"update {i}: {name}: ours {mine!r}, theirs {their!r}"
            for i, row in enumerate(self.loss_values)
            for name, (mine, their) in row.items()
            if not mine == their
        ]

    def mismatches(self) -> list[str]:
        """Every loss value and state tensor that differs from UniLab's; empty when bit-identical."""
        return self.loss_mismatches() + [f"{name}: {what}" for name, what in sorted(self.state_mismatches.items())]

    def worst_loss(self) -> tuple[str, float]:
        worst = ("", 0.0)
        for i, row in enumerate(self.loss_rel):
            for k, v in row.items():
                if _worst_key(v) > _worst_key(worst[1]):
                    worst = (f"update {i}: {k}", v)
        return worst

    def worst_state(self) -> tuple[str, float]:
        return max(((k, v[1]) for k, v in self.state_diffs.items()), key=lambda kv: _worst_key(kv[1]), default=("", 0.0))


LOSS_COLUMNS = {
    "Loss/critic": "critic_loss",
    "Loss/actor": "actor_loss",
    "Loss/entropy": "entropy",
    "Policy/temperature": "temperature",
    "Loss/temperature": "temperature_loss",
}


def compare_with_unilab(
    cfg: FlashSACConfig,
    iterations: int,
    dims: dict[str, int] = G1_DIMS,
    device: str = "cpu",
    seed: int = 0,
    num_envs: int = 16,
    on_iteration=None,
) -> Comparison:
    """Run UniLab's learner and flashsac_opt's side by side; return all differences."""
    torch.manual_seed(seed)
    theirs = unilab_learner(cfg, device=device, **dims)
    ours = FlashSACLearner(cfg, dims["obs_dim"], dims["critic_obs_dim"], dims["action_dim"], device=device)
    from_unilab_state_dict(ours, theirs.get_state_dict())
    data = torch.Generator().manual_seed(seed + 1)
    rows = cfg.batch_size * cfg.updates_per_step
    result = Comparison()
    for it in range(iterations):
        rewards = torch.randn(1, num_envs, generator=data).to(device)
        dones = (torch.rand(1, num_envs, generator=data) < 0.05).float().to(device)
        batch = synthetic_batch(rows, generator=data, device=device, **dims)
        theirs.update_reward_stats(rewards, dones)
        ours.update_reward_stats(rewards, dones)
        torch.manual_seed(seed * 100_003 + it)  # same RNG state -> same actor noise
        their_rows = unilab_iteration(theirs, batch, cfg)
        torch.manual_seed(seed * 100_003 + it)
        ours.update(batch)
        table = ours.update_metrics_table()
        for u, their in enumerate(their_rows):
            rel, values = {}, {}
            for name, value in their.items():
                col = LOSS_COLUMNS.get(name) or ("reward_scale_std" if name == "Train/reward_scale_std" else None)
                if col is None:
                    continue
                mine = float(table[u, COL[col]])
                values[name] = (mine, value)
                rel[name] = abs(mine - value) / max(abs(value), 1e-12)
            result.loss_rel.append(rel)
            result.loss_values.append(values)
        if on_iteration is not None:
            on_iteration(it)
    mine, their = _tensors_only(to_unilab_state_dict(ours)), _tensors_only(theirs.get_state_dict())
    result.state_diffs = tensor_differences(mine, their)
    result.state_mismatches = tensor_mismatches(mine, their)
    return result


def _tensors_only(sd: dict[str, Any]) -> dict[str, Any]:
    """Drop UniLab's non-tensor bookkeeping (param-group flags, scheduler fields) for diffing."""
    out: dict[str, Any] = {}
    for key, value in sd.items():
        if key.endswith("_optimizer"):
            out[key] = {"state": value["state"]}
        elif isinstance(value, dict) and not key.endswith("_scheduler") and key != "actor_semantics":
            out[key] = value
    return out


def relative_difference(a: torch.Tensor, b: torch.Tensor) -> float:
    """||a - b|| / ||b|| in float64."""
    return float((a.double() - b.double()).norm() / b.double().norm())


@torch.no_grad()
def perturb_for_rounding_floor(learner: FlashSACLearner, seed: int) -> None:
    """Perturb the critic weights by 1e-7 relative, once: a run that differs from its twin
    only by rounding, the floor the drift of any other change is judged against."""
    g = torch.Generator(device=learner.device).manual_seed(seed + 7)
    p = learner.critic.params
    p.mul_(1 + 1e-7 * torch.randn(p.shape, device=learner.device, generator=g))


def compare_modes(
    cfg: FlashSACConfig,
    modes: list[str],
    iterations: int,
    dims: dict[str, int] = G1_DIMS,
    device: str = "cpu",
    seed: int = 0,
    on_iteration=None,
    batch_source=None,
    should_stop=None,
) -> dict[str, dict]:
    """Drift of each learner_mode from eager, iteration by iteration, next to a rounding floor.

    All learners start from the same weights and see the same batches and RNG state. The
    floor is an eager learner whose critic weights were perturbed by 1e-7 relative once:
    how far two runs that differ only by rounding drift apart (Adam turns rounding in
    near-zero gradients into +-lr steps). Returns per mode: per-iteration norm-relative
    differences of the actor/critic/target parameters and of the iteration's losses.

    ``batch_source(iteration) -> large batch`` replaces the synthetic batches (e.g. real
    replay rows); ``on_iteration(iteration, learners)`` sees every learner after each step;
    ``should_stop(iteration) -> bool`` ends the run early (the curves then hold fewer points).
    """
    def build(mode: str) -> FlashSACLearner:
        torch.manual_seed(seed)
        return FlashSACLearner(cfg.replace(learner_mode=mode), dims["obs_dim"], dims["critic_obs_dim"], dims["action_dim"], device=device)

    learners = {"eager": build("eager"), "rounding_floor": build("eager"), **{m: build(m) for m in modes}}
    perturb_for_rounding_floor(learners["rounding_floor"], seed)
    data = torch.Generator().manual_seed(seed + 1)
    rows = cfg.batch_size * cfg.updates_per_step
    curves: dict[str, dict[str, list[float]]] = {
        name: {"actor": [], "critic": [], "target_critic": [], "losses": []} for name in learners if name != "eager"
    }

    for it in range(iterations):
        if batch_source is None:
            batch = synthetic_batch(rows, generator=data, device=device, **dims)
            rewards = torch.randn(1, 16, generator=data).to(device)
            dones = (torch.rand(1, 16, generator=data) < 0.05).float().to(device)
        else:
            batch = batch_source(it)
        tables = {}
        for name, learner in learners.items():
            if batch_source is None:
                learner.update_reward_stats(rewards, dones)
            torch.manual_seed(seed * 100_003 + it)
            learner.update(batch)
            tables[name] = learner.update_metrics_table()[:-1, [COL["critic_loss"], COL["actor_loss"]]]
        ref = learners["eager"]
        for name, curve in curves.items():
            other = learners[name]
            for net in ("actor", "critic", "target_critic"):
                curve[net].append(relative_difference(getattr(other, net).params.detach(), getattr(ref, net).params.detach()))
            curve["losses"].append(relative_difference(tables[name], tables["eager"]))
        if on_iteration is not None:
            on_iteration(it, learners)
        if should_stop is not None and should_stop(it):
            break
    return curves
