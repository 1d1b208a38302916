"""flashsac_opt against UniLab 1.5.2's own learner (CPU, fp32, compile and graphs off).

On CPU in fp32 the two learners are bit-identical, update by update: every loss value and
every state tensor must be exactly equal (no tolerance).
"""

import copy

import pytest
import torch

from flashsac_opt.config import FlashSACConfig
from flashsac_opt.learner import FlashSACLearner
from flashsac_opt.testing.oracle import (
    G1_DIMS,
    Comparison,
    compare_with_unilab,
    synthetic_batch,
    tensor_mismatches,
    unilab_iteration,
    unilab_learner,
)
from flashsac_opt.unilab.compat import from_unilab_state_dict, to_unilab_state_dict

pytestmark = pytest.mark.unilab

# Every tensor family the comparison must cover; a silently shrunk comparison fails here.
EXPECTED_FAMILIES = (
    "actor.encoder.1.w2.w.weight",
    "actor.embedder.norm.running_var",
    "critic.predictor.logit_w.weight",
    "critic.encoder.0.norm1.running_mean",
    "target_critic.encoder.1.norm2.running_var",
    "target_critic.predictor.logit_bias",
    "temperature.log_temp",
    "critic_optimizer.state.17.exp_avg_sq",
    "actor_optimizer.state.0.exp_avg",
    "temperature_optimizer.state.0.step",
)
ACTOR_METRICS = {"Loss/actor", "Loss/entropy", "Policy/temperature", "Loss/temperature"}


def assert_bit_identical(result, updates_per_step, policy_frequency, normalize_reward=True):
    # Every update compared its losses (a silently empty comparison would pass).
    for u, row in enumerate(result.loss_values):
        expected = {"Loss/critic"} | ({"Train/reward_scale_std"} if normalize_reward else set())
        if (u % updates_per_step) % policy_frequency == 0:
            expected |= ACTOR_METRICS
        assert set(row) == expected, f"update {u}: compared {sorted(row)}"
    mismatches = result.mismatches()
    assert not mismatches, f"{len(mismatches)} not bit-identical, first: " + "; ".join(mismatches[:5])


@pytest.mark.parametrize(
    "updates_per_step,normalize_reward",
    [(8, True), (8, False), (2, True), (2, False)],
)
def test_matches_unilab_update_by_update(require_unilab, updates_per_step, normalize_reward):
    cfg = FlashSACConfig(
        batch_size=64,
        updates_per_step=updates_per_step,
        policy_frequency=2,
        gamma=0.97,
        tau=0.05,
        normalize_reward=normalize_reward,
    )
    result = compare_with_unilab(cfg, iterations=20)
    assert len(result.loss_rel) == 20 * updates_per_step
    for family in EXPECTED_FAMILIES:
        assert family in result.state_diffs, family
    if normalize_reward:
        assert "reward_normalizer.g_r" in result.state_diffs
    assert_bit_identical(result, updates_per_step, 2, normalize_reward)


def test_matches_unilab_policy_before_critic(require_unilab):
    cfg = FlashSACConfig(batch_size=32, updates_per_step=4, policy_frequency=2, policy_before_critic=True)
    result = compare_with_unilab(cfg, iterations=3)
    assert len(result.loss_values) == 3 * 4
    assert_bit_identical(result, 4, 2)


def test_exact_comparison_notices_one_ulp_a_dtype_and_a_nan():
    """The comparison the tests rely on must fail on the smallest differences."""
    x = torch.randn(4, 3, generator=torch.Generator().manual_seed(0))
    assert tensor_mismatches({"a": {"w": x}}, {"a": {"w": x.clone()}}) == {}
    one_ulp = x.clone()
    one_ulp[2, 1] = torch.nextafter(x[2, 1], torch.tensor(float("inf")))
    assert set(tensor_mismatches({"a": {"w": one_ulp}}, {"a": {"w": x}})) == {"a.w"}
    assert set(tensor_mismatches({"step": torch.tensor(3)}, {"step": torch.tensor(3.0)})) == {"step"}
    nan = x.clone()
    nan[0, 0] = float("nan")
    assert set(tensor_mismatches({"w": nan}, {"w": nan.clone()})) == {"w"}
    one = torch.tensor(1.0)
    next_up = float(torch.nextafter(one, torch.tensor(2.0)))
    assert Comparison(loss_values=[{"Loss/critic": (1.0, 1.0)}]).mismatches() == []
    assert len(Comparison(loss_values=[{"Loss/critic": (next_up, 1.0)}]).mismatches()) == 1
    assert len(Comparison(loss_values=[{"Loss/actor": (float("nan"), float("nan"))}]).mismatches()) == 1


def test_detects_a_different_learner(require_unilab):
    """The oracle itself must notice a real difference (here: a different tau)."""
    cfg = FlashSACConfig(batch_size=32, updates_per_step=2, tau=0.05)
    torch.manual_seed(0)
    theirs = unilab_learner(cfg, **G1_DIMS)
    ours = FlashSACLearner(cfg.replace(tau=0.06), **{k: v for k, v in G1_DIMS.items()})
    from_unilab_state_dict(ours, theirs.get_state_dict())
    batch = synthetic_batch(64, generator=torch.Generator().manual_seed(3), **G1_DIMS)
    torch.manual_seed(1)
    unilab_iteration(theirs, batch, cfg)
    torch.manual_seed(1)
    ours.update(batch)
    mine = to_unilab_state_dict(ours)["target_critic"]["embedder.w.weight"]
    assert not torch.equal(mine, theirs.target_critic.state_dict()["embedder.w.weight"])


def _assert_identical(a, b, path=""):
    if isinstance(b, torch.Tensor):
        assert isinstance(a, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape, path
        assert torch.equal(a, b), path
    elif isinstance(b, dict):
        assert set(a) == set(b), f"{path}: {set(a) ^ set(b)}"
        for k in b:
            _assert_identical(a[k], b[k], f"{path}.{k}")
    elif isinstance(b, (list, tuple)):
        assert len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b)):
            _assert_identical(x, y, f"{path}[{i}]")
    else:
        assert a == b, f"{path}: {a!r} != {b!r}"


@pytest.mark.parametrize("trained", [False, True])
def test_checkpoint_round_trip_is_exact(require_unilab, trained):
    cfg = FlashSACConfig(batch_size=32, updates_per_step=4, policy_frequency=2)
    torch.manual_seed(0)
    theirs = unilab_learner(cfg, **G1_DIMS)
    if trained:
        theirs.update_reward_stats(torch.randn(3, 8), torch.zeros(3, 8))
        for seed in range(2):
            batch = synthetic_batch(128, generator=torch.Generator().manual_seed(seed), **G1_DIMS)
            unilab_iteration(theirs, batch, cfg)
    original = copy.deepcopy(theirs.get_state_dict())
    ours = FlashSACLearner(cfg, **G1_DIMS)
    from_unilab_state_dict(ours, original)
    back = to_unilab_state_dict(ours)
    _assert_identical(back, original)
    # ... and UniLab itself accepts it.
    fresh = unilab_learner(cfg, **G1_DIMS)
    fresh.load_state_dict(back)
    _assert_identical(fresh.get_state_dict(), original)


def test_config_reads_unilab_yaml(require_unilab):
    from importlib.resources import files

    path = files("unilab") / "conf" / "flashsac" / "config.yaml"
    cfg = FlashSACConfig.from_unilab(str(path))
    assert (cfg.batch_size, cfg.updates_per_step, cfg.num_atoms, cfg.tau) == (2048, 2, 101, 0.01)
    assert cfg.learning_rate_decay_steps == 500000 and cfg.normalize_reward is True
    assert cfg.use_amp is True and cfg.learner_mode == "eager"
