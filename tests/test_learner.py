"""Behaviour of the flashsac_opt learner on CPU (no UniLab needed)."""

import math
import warnings

import numpy as np
import pytest
import torch

from flashsac_opt.config import FlashSACConfig
from flashsac_opt.learner import COL, FlashSACLearner
from flashsac_opt.networks import FlashSACActor
from flashsac_opt.objectives import CosineSchedule, categorical_projection, target_entropy
from flashsac_opt.testing.oracle import synthetic_batch
from flashsac_opt.reward_norm import RewardNormalizer

DIMS = {"obs_dim": 12, "critic_obs_dim": 15, "action_dim": 4}
SMALL = dict(batch_size=16, updates_per_step=4, policy_frequency=2, actor_hidden_dim=16, critic_hidden_dim=32, num_atoms=21)


def make(**overrides):
    torch.manual_seed(0)
    return FlashSACLearner(FlashSACConfig(**{**SMALL, **overrides}), **DIMS)


def batch_for(learner, seed=0, rows=None):
    rows = rows or learner.cfg.batch_size * learner.cfg.updates_per_step
    return synthetic_batch(rows, generator=torch.Generator().manual_seed(seed), **DIMS)


def snapshot(learner):
    sd = learner.state_dict()
    sd.pop("iterations")
    sd.pop("skipped_totals")
    return sd


def flat_tensors(tree, prefix=""):
    if isinstance(tree, torch.Tensor):
        return {prefix: tree}
    if isinstance(tree, dict):
        out = {}
        for k, v in tree.items():
            out.update(flat_tensors(v, f"{prefix}.{k}"))
        return out
    return {}


# ----------------------------------------------------------------- boundary errors
@pytest.mark.parametrize(
    "mutate,message",
    [
        (lambda b: b.pop("next_critic"), "missing field(s) ['next_critic']"),
        (lambda b: b.__setitem__("obs", b["obs"][:, :-1]), "batch['obs']: expected shape (64, 12), got (64, 11)"),
        (lambda b: b.__setitem__("rewards", b["rewards"][:-1]), "batch['rewards']: expected shape (64,) or (64, 1), got (63,)"),
        (lambda b: b.__setitem__("rewards", b["rewards"].long()), "batch['rewards']: expected dtype torch.float32, got torch.int64"),
        # checked up front: float64 would fail inside batch_norm after the iteration's first
        # critic step was applied, bfloat16 would round silently
        (lambda b: b.__setitem__("obs", b["obs"].double()), "batch['obs']: expected dtype torch.float32, got torch.float64"),
        (lambda b: b.__setitem__("next_critic", b["next_critic"].bfloat16()), "batch['next_critic']: expected dtype torch.float32, got torch.bfloat16"),
        (lambda b: b.__setitem__("dones", b["dones"].to("meta")), "batch['dones']: expected device cpu, got meta"),
        (lambda b: b.__setitem__("actions", b["actions"][:-2]), "expected rows = updates_per_step (4) x batch_size"),
        (lambda b: b.__setitem__("critic", b["critic"].numpy()), "batch['critic']: expected a torch.Tensor, got ndarray"),
        (lambda b: b.__setitem__("actions", b["actions"].tolist()), "batch['actions']: expected a torch.Tensor, got list"),
    ],
)
def test_bad_batches_raise_naming_the_field_and_change_nothing(mutate, message):
    learner = make()
    before = snapshot(learner)
    batch = batch_for(learner)
    mutate(batch)
    with pytest.raises(ValueError) as excinfo:
        learner.update(batch)
    assert message in str(excinfo.value)
    after = snapshot(learner)
    for name, tensor in flat_tensors(before).items():
        assert torch.equal(tensor, flat_tensors(after)[name]), name
    assert learner.iterations == 0


def test_rewards_may_be_a_column():
    a, b = make(), make()
    batch = batch_for(a)
    column = dict(batch, rewards=batch["rewards"][:, None], dones=batch["dones"][:, None])
    torch.manual_seed(7)
    a.update(batch)
    torch.manual_seed(7)
    b.update(column)
    assert torch.equal(a.critic.params, b.critic.params)


# ------------------------------------------------------------------ finite guard
def test_non_finite_batch_skips_every_step():
    learner = make()
    learner.update(batch_for(learner, seed=1))  # a normal iteration first: non-trivial state
    before = snapshot(learner)
    bad = batch_for(learner, seed=2)
    bad["next_obs"][:, 0] = float("nan")  # feeds the critic target (via a') and the joint actor batch
    learner.update(bad)
    metrics = learner.read_metrics()
    after = snapshot(learner)
    for name, tensor in flat_tensors(before).items():
        if name.endswith("schedule_step"):
            continue  # the LR schedule advances on attempts, as in UniLab
        assert torch.equal(tensor, flat_tensors(after)[name]), f"{name} changed on a skipped step"
    assert metrics["Learner/critic_updates_skipped"] == 4.0
    assert metrics["Learner/actor_updates_skipped"] == 2.0


def test_only_the_update_with_bad_rows_is_skipped():
    learner = make()
    bad = batch_for(learner, seed=2)
    bad["critic"][5, 1] = float("inf")  # row 5 lies in update 0's slice (rows 0..15)
    learner.update(bad)
    table = learner.update_metrics_table()
    assert table[:4, COL["critic_applied"]].tolist() == [0.0, 1.0, 1.0, 1.0]
    # The actor of update 0 reads critic obs too (frozen critic on s): skipped as well.
    assert table[[0, 2], COL["actor_applied"]].tolist() == [0.0, 1.0]
    assert torch.isfinite(learner.critic.params).all() and torch.isfinite(learner.actor.params).all()
    assert torch.isfinite(learner.critic.bn_stats).all() and torch.isfinite(learner.target_critic.bn_stats).all()


def test_skipped_update_leaves_parameters_bitwise_unchanged():
    learner = make(updates_per_step=1, policy_frequency=1)
    learner.update(batch_for(learner, seed=1))
    before = snapshot(learner)
    bad = batch_for(learner, seed=2)
    bad["rewards"][:] = float("nan")  # critic loss NaN; the actor does not read rewards
    learner.update(bad)
    after = snapshot(learner)
    for name in ("critic", "target_critic"):
        for key, tensor in flat_tensors(before[name]).items():
            assert torch.equal(tensor, flat_tensors(after[name])[key]), f"{name}{key}"
    assert torch.equal(before["optim"]["critic"]["exp_avg"], after["optim"]["critic"]["exp_avg"])
    assert float(after["optim"]["critic"]["step"]) == float(before["optim"]["critic"]["step"])
    assert float(after["optim"]["critic"]["schedule_step"]) == float(before["optim"]["critic"]["schedule_step"]) + 1
    assert not torch.equal(before["actor"]["params"], after["actor"]["params"])  # actor step applied
    assert learner.read_metrics()["Learner/skipped_total"] == 1.0
    learner.update(batch_for(learner, seed=3))
    assert learner.read_metrics()["Learner/critic_updates_skipped"] == 0.0
    assert torch.isfinite(learner.critic.params).all() and not torch.equal(learner.critic.params, after["critic"]["params"])


# -------------------------------------------------------------- invariants
def test_parameters_stay_unit_normalized():
    learner = make()
    for seed in range(3):
        learner.update(batch_for(learner, seed=seed))
    unit_rows = ("in_proj", ".up", ".down", "mean.weight", "log_std.weight", "logits.weight")
    checked = 0
    for net in (learner.actor, learner.critic):
        views = net.layout.views(net.params.detach())
        for name, v in views.items():
            if name.endswith(unit_rows):
                torch.testing.assert_close(v.norm(dim=-1), torch.ones_like(v[..., 0]), rtol=0, atol=1e-5)
            elif name.endswith("_bn.weight"):
                bias = views[name[: -len("weight")] + "bias"]
                sq = (v * v + bias * bias).sum(dim=-1)
                torch.testing.assert_close(sq, torch.full_like(sq, v.shape[-1]), rtol=1e-5, atol=0)
            elif name == "out_rms":
                sq = (v * v).sum(dim=-1)
                torch.testing.assert_close(sq, torch.full_like(sq, v.shape[-1]), rtol=1e-5, atol=0)
            else:
                continue
            checked += 1
    # actor: 7 unit-row matrices + 5 BatchNorms + RMSNorm; critic: 6 + 5 + 1
    assert checked == 25


def test_target_critic_moves_toward_critic_by_tau():
    learner = make(updates_per_step=1, policy_frequency=1, tau=0.25)
    target_before = learner.target_critic.params.detach().clone()
    learner.update(batch_for(learner))
    expected = target_before + 0.25 * (learner.critic.params.detach() - target_before)
    torch.testing.assert_close(learner.target_critic.params, expected, rtol=0, atol=1e-6)


def test_state_dict_resume_is_bitwise():
    a = make()
    a.update_reward_stats(torch.randn(2, 5), torch.zeros(2, 5))
    a.update(batch_for(a, seed=1))
    state = a.state_dict()
    # What construction chose and the state replaces must not matter: a learner built from
    # another seed (other weights) and another initial temperature continues exactly as `a`.
    torch.manual_seed(1)
    b = FlashSACLearner(FlashSACConfig(**{**SMALL, "temp_initial_value": 0.5}), **DIMS)
    assert not torch.equal(b.actor.params, a.actor.params)
    assert not torch.equal(b.temperature.log_temp, a.temperature.log_temp)
    b.load_state_dict(state)
    for learner in (a, b):
        torch.manual_seed(11)
        learner.update(batch_for(learner, seed=2))
    ta, tb = flat_tensors(a.state_dict()), flat_tensors(b.state_dict())
    assert len(ta) > 20 and ta.keys() == tb.keys()
    assert [k for k in ta if not torch.equal(ta[k], tb[k])] == []
    assert a.iterations == b.iterations == 2

    # The config is not part of what a load restores (the state records it, the loading
    # learner keeps its own): c's tau of 0.3 acts in the Polyak update and nowhere else.
    # One update (critic, Polyak, then actor, which reads the critic, not the target):
    # everything but the target critic's weights stays bit-identical to a tau=0.01 twin.
    state = a.state_dict()
    ref, c = make(), make(tau=0.3)
    for learner in (ref, c):
        learner.load_state_dict(state)
        torch.manual_seed(12)
        learner.update(batch_for(learner, seed=3, rows=16), updates_per_step=1, policy_frequency=1)
    tr, tc = flat_tensors(ref.state_dict()), flat_tensors(c.state_dict())
    assert [k for k in tr if not torch.equal(tr[k], tc[k])] == [".target_critic.params"]
    before = state["target_critic"]["params"]
    for learner, tau in ((ref, 0.01), (c, 0.3)):
        expected = before + tau * (learner.critic.params.detach() - before)
        torch.testing.assert_close(learner.target_critic.params.detach(), expected, rtol=0, atol=1e-6)


def test_load_rejects_foreign_state():
    learner = make()
    with pytest.raises(ValueError, match="not a flashsac_opt learner state"):
        learner.load_state_dict({"actor": {}})
    other = FlashSACLearner(FlashSACConfig(**SMALL), obs_dim=13, critic_obs_dim=15, action_dim=4)
    with pytest.raises(ValueError, match="dims"):
        learner.load_state_dict(other.state_dict())


def test_read_metrics_reports_last_critic_and_last_actor_update():
    learner = make(updates_per_step=4, policy_frequency=2)
    learner.update(batch_for(learner))
    table = learner.update_metrics_table()
    metrics = learner.read_metrics()
    assert metrics["Loss/critic"] == pytest.approx(float(table[3, COL["critic_loss"]]))
    assert metrics["Loss/actor"] == pytest.approx(float(table[2, COL["actor_loss"]]))
    assert float(table[1, COL["actor_loss"]]) == 0.0 and float(table[3, COL["actor_loss"]]) == 0.0
    assert metrics["Policy/temperature"] == pytest.approx(math.exp(float(learner.temperature.log_temp.detach())))
    assert all(math.isfinite(v) for v in metrics.values())


# -------------------------------------------------------------- objectives
def test_categorical_projection_matches_brute_force():
    # float64 so the comparison checks the algorithm, not float32 rounding of positions.
    g = torch.Generator().manual_seed(0)
    support = torch.linspace(-5, 5, 101, dtype=torch.float64)
    probs = torch.softmax(torch.randn(32, 101, generator=g, dtype=torch.float64), -1)
    rewards = torch.randn(32, generator=g, dtype=torch.float64) * 2
    bootstrap = (torch.rand(32, generator=g) > 0.2).double()
    entropy = torch.randn(32, generator=g, dtype=torch.float64) * 0.1
    out = categorical_projection(support, probs, rewards, bootstrap, entropy, 0.97)
    torch.testing.assert_close(out.sum(-1), torch.ones(32, dtype=torch.float64))
    # Reference: every shifted atom spreads its mass with a triangular kernel of width dz.
    dz = float(support[1] - support[0])
    tz = (rewards[:, None] + bootstrap[:, None] * 0.97 * (support - entropy[:, None])).clamp(-5, 5)
    kernel = (1 - (tz[:, :, None] - support[None, None, :]).abs() / dz).clamp(min=0)
    reference = (probs[:, :, None] * kernel).sum(1)
    torch.testing.assert_close(out, reference, rtol=0, atol=1e-10)
    # A terminal transition puts all mass on the two atoms around the reward.
    done = categorical_projection(support, probs[:1], torch.tensor([1.05], dtype=torch.float64), torch.zeros(1), torch.zeros(1), 0.97)
    assert done[0, 60].item() == pytest.approx(0.5) and done[0, 61].item() == pytest.approx(0.5)
    assert done[0].sum().item() == pytest.approx(1.0)


def test_device_schedule_matches_host_schedule():
    for warmup in (0, 10):
        sched = CosineSchedule(1e-4, 3e-4, 1.5e-4, warmup, 1000)
        for step in (0, 1, 5, 10, 11, 500, 999, 1000, 5000):
            host = sched.peak * sched(step)
            device = float(sched.on_device(torch.tensor(float(step), dtype=torch.float64)))
            assert device == pytest.approx(host, rel=1e-12), (warmup, step)
    sched = CosineSchedule(3e-4, 3e-4, 1.5e-4, 0, 500000)
    assert sched(0) == 1.0 and sched(500000) == pytest.approx(0.5)


def test_target_entropy_for_g1():
    assert target_entropy(29, 0.15) == pytest.approx(29 * 0.5 * math.log(2 * math.pi * math.e * 0.0225))
    assert target_entropy(29, 0.15, override=-3.0) == -3.0


def test_reward_normalizer_matches_numpy_reference():
    g = torch.Generator().manual_seed(0)
    rewards = torch.randn(30, 6, generator=g)
    dones = (torch.rand(30, 6, generator=g) < 0.1).float()
    norm = RewardNormalizer(gamma=0.9, g_max=5.0, device=torch.device("cpu"))
    norm.update(rewards[:10], dones[:10])
    for t in range(10, 30):
        norm.update(rewards[t], dones[t])
    returns, history = np.zeros(6), []
    for t in range(30):
        returns = 0.9 * (1 - dones[t].numpy()) * returns + rewards[t].numpy()
        history.append(returns.copy())
    history = np.stack(history)
    # Running (count, mean, var) starting from count=1e-4, mean 0, var 1, merged per step.
    count, mean, var = 1e-4, 0.0, 1.0
    for row in history:
        n, bm, bv = row.size, row.mean(), row.var()
        delta, total = bm - mean, count + n
        var = (var * count + bv * n + delta**2 * count * n / total) / total
        mean, count = mean + delta * n / total, total
    assert float(norm.var) == pytest.approx(var, rel=1e-5)
    assert float(norm.mean) == pytest.approx(mean, rel=1e-5, abs=1e-6)
    assert float(norm.abs_max) == pytest.approx(np.abs(history).max(), rel=1e-6)
    expected_scale = max(math.sqrt(var + 1e-8), np.abs(history).max() / 5.0)
    assert float(norm.scale()) == pytest.approx(expected_scale, rel=1e-5)
    with pytest.raises(ValueError, match="floating point"):
        norm.update(torch.ones(6, dtype=torch.long), torch.zeros(6))


# -------------------------------------------------------------- exploration
def test_zeta_held_noise_holds_and_resets():
    torch.manual_seed(0)
    actor = FlashSACActor(obs_dim=6, action_dim=3, hidden_dim=8, num_blocks=1, noise_zeta_max=16)
    obs = torch.randn(4096, 6)
    actions = [actor.explore(obs) for _ in range(40)]
    changed = torch.stack([(actions[t] != actions[t - 1]).any(-1) for t in range(1, 40)])  # (39, envs)
    # Hold lengths: steps between changes; all within [1, 16], distributed ~ n^-2.
    runs = []
    for env in range(0, 4096, 4):
        idx = torch.nonzero(changed[:, env]).flatten().tolist()
        runs += [b - a for a, b in zip(idx, idx[1:])]
    runs = np.array(runs)
    assert runs.min() >= 1 and runs.max() <= 16
    pmf = np.arange(1, 17, dtype=float) ** -2.0
    pmf /= pmf.sum()
    # P(hold = 1) under the truncated Zeta law is ~0.63; allow sampling noise.
    assert abs((runs == 1).mean() - pmf[0]) < 0.03
    # Episode ends force a redraw for those envs only (ones that would have held).
    before = actor.explore(obs)
    held = actor._hold_count < actor._hold_target  # these keep their noise next step
    dones = torch.zeros(4096)
    dones[:2048] = 1.0
    after = actor.explore(obs, dones)
    still = held.clone()
    still[:2048] = False
    assert (after[still] == before[still]).all()  # no done, still holding: same action
    assert (after[:2048] != before[:2048]).any(-1).float().mean() > 0.99
    torch.testing.assert_close(actor.explore(obs, deterministic=True), torch.tanh(actor.distribution_params(obs, actor.params, actor.bn_stats, False)[0]))


# -------------------------------------------------------------- config + CLI
def test_config_from_mapping_and_validation():
    cfg = FlashSACConfig.from_unilab(
        {"algo": {"batch_size": 256, "tau": 0.05, "algo_params": {"n_step": 1, "normalize_reward": False}, "unknown": 1}, "training": {"use_amp": False}}
    )
    assert (cfg.batch_size, cfg.tau, cfg.normalize_reward, cfg.use_amp) == (256, 0.05, False, False)
    with pytest.raises(ValueError, match="learner_mode"):
        FlashSACConfig(learner_mode="fast")
    with pytest.raises(ValueError, match="n_step"):
        FlashSACConfig(n_step=3)
    with pytest.raises(ValueError, match="obs_normalization"):
        FlashSACConfig(obs_normalization=True)


@pytest.mark.parametrize(
    ("mode", "rows_per_update", "fused_update", "functions"),
    [
        ("compile", 16, None, ["critic_step", "actor_step"]),  # default: fused up to 1024 rows per update
        ("compile", 1025, None, ["critic_loss", "critic_apply", "actor_loss", "actor_apply"]),
        ("compile", 1025, True, ["critic_step", "actor_step"]),
        ("compile", 16, False, ["critic_loss", "critic_apply", "actor_loss", "actor_apply"]),
        ("eager", 16, True, ["critic_loss", "critic_apply", "actor_loss", "actor_apply"]),  # eager: always split
    ],
)
def test_update_form_is_chosen_from_the_first_batch_not_the_configured_batch_size(mode, rows_per_update, fused_update, functions):
    # cfg.batch_size says the opposite of the batch each time: only the batch's shape counts
    configured = 2048 if rows_per_update <= 1024 else 16
    cfg = FlashSACConfig(**{**SMALL, "batch_size": configured, "updates_per_step": 1, "fused_update": fused_update},
                         learner_mode=mode, compile_backend="eager")
    learner = FlashSACLearner(cfg, **DIMS)
    assert learner.fused_update is None and learner.engine.compiled_names() == []  # nothing built before a batch
    learner.update(batch_for(learner, rows=rows_per_update))
    assert learner.engine.compiled_names() == functions
    assert learner.fused_update == (functions[0] == "critic_step")
    # later batches of another size keep the form (shapes are static per run; no warning)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        # torch's own: dynamo instantiates member_linear's autograd.Function while tracing it
        # (the compiled modes' default contiguous_weight_grads); the learner calls .apply
        warnings.filterwarnings("ignore", message=".*should not be instantiated", category=DeprecationWarning)
        learner.update(batch_for(learner, rows=32 if rows_per_update <= 1024 else 8))
    assert learner.engine.compiled_names() == functions and torch.isfinite(learner.critic.params).all()


def test_a_cpu_learner_accepts_cpu_batches_whatever_the_device_spelling():
    learner = FlashSACLearner(FlashSACConfig(**SMALL), **DIMS, device="cpu:0")
    assert learner.device == torch.device("cpu")
    learner.update(batch_for(learner))  # batches report "cpu": canonical devices compare equal
    assert learner.iterations == 1


@pytest.mark.parametrize("argument", ["updates_per_step", "policy_frequency"])
@pytest.mark.parametrize("value", [0, -1, 2.0, True])
def test_update_rejects_a_schedule_argument_that_is_not_a_positive_integer(argument, value):
    """Only None means "the config's value": a 0 must not silently mean it too."""
    learner = make()
    before = flat_tensors(snapshot(learner))
    with pytest.raises(ValueError, match=f"{argument} must be a positive integer"):
        learner.update(batch_for(learner), **{argument: value})
    after = flat_tensors(snapshot(learner))
    assert all(torch.equal(before[k], after[k]) for k in before) and learner.iterations == 0


def test_cli_info(capsys):
    from flashsac_opt.cli import main

    assert main(["info"]) == 0
    out = capsys.readouterr().out
    assert "torch" in out and "unilab" in out and torch.__version__ in out

