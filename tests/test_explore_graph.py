"""The collection forward: in-place held-noise state (what a captured graph needs) and, on CUDA,
the captured explore against eager, step by step."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from flashsac_opt.config import FlashSACConfig
from flashsac_opt.learner import FlashSACLearner
from flashsac_opt.networks import FlashSACActor


def _reference_explore(actor: FlashSACActor, obs, dones, state):
    """The held-noise step written out of place (as before the state became in-place)."""
    mean, std, _ = actor.distribution_params(obs, actor.params, actor.bn_stats, training=False)
    held, count, target = state
    redraw = (count <= 0) | (count >= target)
    if dones is not None:
        redraw = redraw | (dones.reshape(-1) > 0.5)
    fresh = torch.searchsorted(actor.zeta_cdf, torch.rand(obs.shape[0])).to(torch.int32) + 1
    held = torch.where(redraw.unsqueeze(-1), torch.randn_like(mean), held)
    target = torch.where(redraw, fresh, target)
    count = torch.where(redraw, torch.ones_like(count), count + 1)
    return torch.tanh(mean + std * held), (held, count, target)


def test_explore_updates_its_state_in_place_with_the_out_of_place_numbers():
    torch.manual_seed(3)
    actor = FlashSACActor(obs_dim=6, action_dim=3, hidden_dim=8, num_blocks=1)
    obs = torch.randn(32, 6)
    dones = [None, torch.zeros(32), (torch.arange(32) % 3 == 0).float(), None, torch.ones(32)]
    generator = torch.get_rng_state()
    ours = [actor.explore(obs, d) for d in dones]
    state = actor.exploration_state()
    assert state is not None
    addresses = [t.data_ptr() for t in state]
    torch.set_rng_state(generator)
    reference_state = (torch.zeros(32, 3), torch.zeros(32, dtype=torch.int32), torch.zeros(32, dtype=torch.int32))
    for step, d in enumerate(dones):
        expected, reference_state = _reference_explore(actor, obs, d, reference_state)
        assert torch.equal(ours[step], expected), step
    assert all(torch.equal(a, b) for a, b in zip(state, reference_state))
    actor.explore(obs)
    assert [t.data_ptr() for t in actor.exploration_state()] == addresses  # same shape: same tensors
    actor.explore(obs[:8])  # another shape: new state, every env redraws
    held, count, _ = actor.exploration_state()
    assert held.shape == (8, 3) and (count == 1).all()


def test_the_collection_forward_falls_back_to_eager_off_cuda():
    from flashsac_opt.explore_graph import CapturedExplore

    for mode in ("eager", "compile"):  # only graph mode (CUDA only) captures it
        cfg = FlashSACConfig(actor_hidden_dim=8, critic_hidden_dim=8, batch_size=16, learner_mode=mode)
        assert FlashSACLearner(cfg, 6, 7, 3, device="cpu").actor.captured_explore is None
    torch.manual_seed(0)
    actor = FlashSACActor(obs_dim=6, action_dim=3, hidden_dim=8, num_blocks=1)
    plain = FlashSACActor(obs_dim=6, action_dim=3, hidden_dim=8, num_blocks=1)
    plain.load_state_dict(actor.state_dict())
    actor.captured_explore = CapturedExplore(actor)
    obs = torch.randn(4, 6)
    assert not actor.captured_explore.usable(obs, None)
    torch.manual_seed(1)
    a = actor.explore(obs, torch.zeros(4))
    torch.manual_seed(1)
    assert torch.equal(a, plain.explore(obs, torch.zeros(4))) and actor.captured_explore.graphs == {}


def test_bad_collection_input_gets_a_clear_error_and_changes_nothing():
    actor = FlashSACActor(obs_dim=6, action_dim=3, hidden_dim=8, num_blocks=1)
    actor.explore(torch.randn(4, 6))
    state = [t.clone() for t in actor.exploration_state()]
    for obs, dones, message in ((torch.randn(4, 5), None, r"obs must be a \(num_envs, 6\) tensor, got \(4, 5\)"),
                                (torch.randn(6), None, "obs must be a"),
                                (torch.ones(4, 6, dtype=torch.int64), None, "floating point"),
                                (torch.randn(4, 6), torch.zeros(3), r"one flag per env \(4\), got \(3,\)"),
                                ([[0.0] * 6] * 4, None, "got list")):
        with pytest.raises(ValueError, match=message):
            actor.explore(obs, dones)
    assert all(torch.equal(a, b) for a, b in zip(actor.exploration_state(), state))
    actor.explore(torch.randn(4, 6), torch.zeros(4, 1))  # a column of flags is fine


def test_the_switch_names_its_values_and_refuses_others(monkeypatch):
    from flashsac_opt import explore_graph

    monkeypatch.delenv(explore_graph.ENV_SWITCH, raising=False)
    assert explore_graph.wanted()  # on by default
    for value, expected in (("1", True), ("on", True), ("0", False), ("Off", False), ("no", False)):
        monkeypatch.setenv(explore_graph.ENV_SWITCH, value)
        assert explore_graph.wanted() == expected
    monkeypatch.setenv(explore_graph.ENV_SWITCH, "maybe")
    with pytest.raises(ValueError, match="expected 1/on or 0/off"):
        explore_graph.wanted()


@pytest.mark.gpu
def test_captured_explore_replays_what_eager_computes_step_by_step(monkeypatch):
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from flashsac_opt.explore_graph import MAX_GRAPHS

    cfg = FlashSACConfig(actor_hidden_dim=32, critic_hidden_dim=32, batch_size=64, learner_mode="graph")
    captured = FlashSACLearner(cfg, 98, 101, 29, device="cuda")
    eager = FlashSACLearner(dataclasses.replace(cfg, learner_mode="eager"), 98, 101, 29, device="cuda")
    eager.load_state_dict(captured.state_dict())
    assert captured.actor.captured_explore is not None and eager.actor.captured_explore is None
    with monkeypatch.context() as switched:
        switched.setenv("FLASHSAC_OPT_CAPTURE_EXPLORE", "0")
        assert FlashSACLearner(cfg, 98, 101, 29, device="cuda").actor.captured_explore is None
    obs_all = torch.randn(256, 128, device="cuda")
    obs = obs_all[:, :98]  # UniLab hands a column slice of its ring (not contiguous)
    steps = [None, torch.zeros(256, device="cuda"), (torch.arange(256, device="cuda") % 5 == 0).float(), None]

    def run(actor, seed, n=256):
        torch.cuda.manual_seed(seed)
        return [actor.explore(obs[:n], None if d is None else d[:n]) for d in steps]

    ours, theirs = run(captured.actor, 7), run(eager.actor, 7)
    for step, (a, b) in enumerate(zip(ours, theirs)):
        torch.testing.assert_close(a, b, rtol=0, atol=0, msg=f"step {step}")
    assert len(captured.actor.captured_explore.graphs) == 2  # with and without dones
    # the learner changes the actor's parameters in place: the graph reads the new ones
    with torch.no_grad():
        for learner in (captured, eager):
            learner.actor.params.mul_(0.5)
            learner.actor.bn_stats.add_(0.1)
    ours, theirs = run(captured.actor, 8), run(eager.actor, 8)
    for step, (a, b) in enumerate(zip(ours, theirs)):
        torch.testing.assert_close(a, b, rtol=0, atol=0, msg=f"after the update, step {step}")
    # another batch size captures its own graphs; coming back starts fresh state, as eager does
    ours, theirs = run(captured.actor, 9, n=64), run(eager.actor, 9, n=64)
    ours += run(captured.actor, 10)
    theirs += run(eager.actor, 10)
    for step, (a, b) in enumerate(zip(ours, theirs)):
        torch.testing.assert_close(a, b, rtol=0, atol=0, msg=f"shape switch, step {step}")
    assert len(captured.actor.captured_explore.graphs) == MAX_GRAPHS
    # past MAX_GRAPHS shapes: eager, same numbers
    torch.cuda.manual_seed(11)
    a = captured.actor.explore(obs[:32])
    torch.cuda.manual_seed(11)
    b = eager.actor.explore(obs[:32])
    torch.testing.assert_close(a, b, rtol=0, atol=0)
