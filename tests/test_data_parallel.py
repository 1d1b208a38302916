"""Data-parallel learner on CPU: 2 gloo processes (torch.multiprocessing), as CI runs it."""

import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from flashsac_opt.config import FlashSACConfig
from flashsac_opt.data_parallel import RANK_LOCAL_STATE, collective_bytes_per_iteration, named_tensors
from flashsac_opt.learner import COL, FlashSACLearner
from flashsac_opt.testing.oracle import synthetic_batch

DIMS = {"obs_dim": 12, "critic_obs_dim": 15, "action_dim": 4}
SMALL = dict(batch_size=16, updates_per_step=4, policy_frequency=2, actor_hidden_dim=16, critic_hidden_dim=32, num_atoms=21)


def _worker(rank: int, world: int, out_dir: str, scenario: str) -> None:
    # NVLink multicast off (NCCL), as the GPU hosts require
    os.environ.update(NCCL_NVLS_ENABLE="0")
    cuda = scenario.startswith("nccl_graph")
    device = torch.device("cuda", rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    # rendezvous through a file (no TCP port to race for)
    dist.init_process_group("nccl" if cuda else "gloo", init_method=f"file://{out_dir}/rendezvous", rank=rank, world_size=world)
    try:
        torch.manual_seed(100 + rank)  # different seeds: the learner must still start equal
        mode = "graph" if cuda else {"compile": "compile"}.get(scenario, "eager")
        overrides = {"compile_backend": "aot_eager"} if mode == "compile" else {}
        if scenario == "diverged_broadcast":
            overrides["dp_broadcast_params"] = True
        if scenario == "nccl_graph_no_broadcast":
            overrides["dp_broadcast_params"] = False
        learner = FlashSACLearner(
            FlashSACConfig(**SMALL, learner_mode=mode, **overrides), process_group=True, device=device, **DIMS
        )
        if scenario.startswith("diverged") and rank == 1:
            # what a rank-dependent rounding in a compiled step leaves behind: parameters a
            # few ulp apart while moments and statistics agree
            # (random directions: the renormalization would undo a uniform scale)
            g1 = torch.Generator().manual_seed(5)
            with torch.no_grad():
                for net in (learner.actor, learner.critic, learner.target_critic):
                    net.params.add_(1e-6 * torch.randn(net.params.shape, generator=g1).to(device))
        rows = SMALL["batch_size"] * SMALL["updates_per_step"]
        # "same_data": every rank gets rank 0's batches (compared with one process below);
        # otherwise each rank draws its own (rank-local replay).
        g = torch.Generator().manual_seed(0 if scenario == "same_data" else 1 + rank)
        for it in range(3):
            b = {k: v.to(device) for k, v in synthetic_batch(rows, generator=g, **DIMS).items()}
            if scenario == "nan" and it == 1 and rank == 1:
                b["rewards"][0] = float("nan")  # one rank's batch poisons this iteration's first critic step
            learner.update_reward_stats(torch.randn(2, 8, generator=g).to(device), torch.zeros(2, 8, device=device))
            torch.manual_seed(7 + it)
            learner.update(b)
        to_cpu = lambda t: t.cpu() if isinstance(t, torch.Tensor) else t  # noqa: E731
        state = torch.utils._pytree.tree_map(to_cpu, learner.state_dict())
        state["metrics_table"] = learner.update_metrics_table()
        torch.save(state, os.path.join(out_dir, f"rank{rank}.pt"))
        learner.release_graphs()  # a live graph with captured NCCL calls hangs the teardown
    finally:
        dist.destroy_process_group()


def _run(tmp_path, scenario: str, world: int = 2) -> list[dict]:
    mp.start_processes(_worker, args=(world, str(tmp_path), scenario), nprocs=world, start_method="spawn")
    return [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(world)]


@pytest.mark.parametrize("scenario", ["eager", "compile"])
def test_ranks_with_different_data_stay_bit_identical(tmp_path, scenario):
    s0, s1 = _run(tmp_path, scenario)
    t0, t1 = dict(named_tensors(s0)), dict(named_tensors(s1))
    assert t0.keys() == t1.keys()
    for name in t0:
        if name in RANK_LOCAL_STATE:  # each rank's own envs' running returns: different data
            assert not torch.equal(t0[name], t1[name]), name
        else:
            assert torch.equal(t0[name], t1[name]), name
    # one global reward scale from both ranks' envs: not what either rank's alone would give
    assert float(s0["reward_normalizer"]["count"]) > 2 * 8 * 3 * 2 - 1  # 2 ranks x 8 envs x 2 steps x 3 iterations (+1e-4)
    # The ranks trained on different batches: the run moved the networks away from init.
    fresh = FlashSACLearner(FlashSACConfig(**SMALL), **DIMS)
    assert not torch.equal(s0["critic"]["params"], fresh.critic.params.detach())


@pytest.mark.gpu
def test_nccl_graph_mode_ranks_stay_bit_identical(tmp_path):
    """Two GPUs, NCCL, graph mode with its defaults: the all-reduces and the parameter
    broadcast (dp_broadcast_params, on by default here) are captured with the iteration."""
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    s0, s1 = _run(tmp_path, "nccl_graph")
    for name, t in named_tensors(s0):
        if name not in RANK_LOCAL_STATE:  # each rank's own envs' running returns
            assert torch.equal(t, dict(named_tensors(s1))[name]), name
    assert torch.isfinite(s0["critic"]["params"]).all()


@pytest.mark.gpu
def test_nccl_graph_mode_without_broadcast_keeps_ranks_within_rounding(tmp_path):
    """Without the broadcast the ranks' parameters end a few ulp apart on the H200 (the
    compiled optimizer step rounds differently on two GPUs for identical inputs:
    results/diagnose_nccl_graph/, made by experiments/archive/diagnose_nccl_graph.py at commit
    2f362b4), while everything the averaged gradients decide stays bit-identical."""
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    s0, s1 = _run(tmp_path, "nccl_graph_no_broadcast")
    t0, t1 = dict(named_tensors(s0)), dict(named_tensors(s1))
    for name in ("actor.params", "critic.params", "target_critic.params"):
        assert float((t0[name] - t1[name]).abs().max()) <= 1e-5, name
    for name in ("optim.critic.exp_avg_sq", "optim.actor.exp_avg_sq", "critic.bn_stats", "temperature.log_temp"):
        assert torch.equal(t0[name], t1[name]), name


def test_two_ranks_on_the_same_data_equal_one_process(tmp_path):
    """Averaging two identical gradients is exact, so 2 ranks x the same batches == 1 process
    (reward statistics aside: each iteration the ranks fold both ranks' partials of the same
    rewards, which the single process does by hand)."""
    s0, _ = _run(tmp_path, "same_data")
    torch.manual_seed(100)
    single = FlashSACLearner(FlashSACConfig(**SMALL, fused_update=False), **DIMS)
    g = torch.Generator().manual_seed(0)
    rows = SMALL["batch_size"] * SMALL["updates_per_step"]
    for it in range(3):
        b = synthetic_batch(rows, generator=g, **DIMS)
        r = torch.randn(2, 8, generator=g)
        single.reward_normalizer.accumulate(r, torch.zeros(2, 8))
        partial = single.reward_normalizer.take_pending()
        single.reward_normalizer.fold(torch.stack([partial, partial]))
        torch.manual_seed(7 + it)
        single.update(b)
    # rank 0 of the pair started from seed 100 as the single learner did
    for name in ("actor", "critic", "target_critic"):
        assert torch.equal(s0[name]["params"], single.state_dict()[name]["params"]), name
    assert torch.equal(s0["optim"]["critic"]["exp_avg_sq"], single.critic_adam.exp_avg_sq)


def test_non_finite_batch_on_one_rank_skips_the_step_on_every_rank(tmp_path):
    s0, s1 = _run(tmp_path, "nan")
    for s in (s0, s1):
        assert float(s["skipped_totals"][0]) >= 1.0  # critic steps skipped, counted on both ranks
    assert torch.equal(s0["critic"]["params"], s1["critic"]["params"])
    assert torch.isfinite(s0["critic"]["params"]).all()
    # training continued: the last iteration applied its critic steps
    assert float(s0["metrics_table"][-2, COL["critic_applied"]]) == 1.0


def test_parameter_broadcast_makes_diverged_ranks_bit_identical(tmp_path):
    """dp_broadcast_params: ranks whose parameters drifted apart end every iteration with
    rank 0's; without it, the drift survives the averaged updates."""
    (tmp_path / "off").mkdir(), (tmp_path / "on").mkdir()
    off = [dict(named_tensors(s)) for s in _run(tmp_path / "off", "diverged")]
    on = [dict(named_tensors(s)) for s in _run(tmp_path / "on", "diverged_broadcast")]
    for name in ("actor.params", "critic.params", "target_critic.params"):
        assert not torch.equal(off[0][name], off[1][name]), name
        assert torch.equal(on[0][name], on[1][name]), name
    # the averaged steps still agree everywhere else (moments, statistics, temperature)
    for name in ("optim.critic.exp_avg_sq", "critic.bn_stats", "temperature.log_temp"):
        assert torch.equal(on[0][name], on[1][name]), name


def test_parameter_broadcast_defaults_to_compiled_modes_on_cuda():
    from flashsac_opt.data_parallel import broadcasts_params

    cuda, cpu = torch.device("cuda", 0), torch.device("cpu")
    assert broadcasts_params(None, True, cuda)  # compile and graph mode on CUDA
    assert not broadcasts_params(None, False, cuda)  # eager ranks were exact on the H200
    assert not broadcasts_params(None, True, cpu)
    assert broadcasts_params(True, False, cpu) and not broadcasts_params(False, True, cuda)
    # a single-process learner never broadcasts, whatever the flag
    assert not FlashSACLearner(FlashSACConfig(**SMALL, dp_broadcast_params=True), **DIMS).broadcast_params


def test_collective_bytes_follow_the_layout():
    learner = FlashSACLearner(FlashSACConfig(**SMALL), **DIMS)
    per_critic = learner.critic.layout.numel + 1 + 2 * learner.critic.stats_layout.numel
    per_actor = learner.actor.layout.numel + 2 + learner.actor.stats_layout.numel
    assert collective_bytes_per_iteration(learner, 4, 2) == 4 * (4 * per_critic + 2 * per_actor)
    assert collective_bytes_per_iteration(learner, 3, 2) == 4 * (3 * per_critic + 2 * per_actor)
    synced = FlashSACLearner(FlashSACConfig(**SMALL), **DIMS)
    synced.broadcast_params = True  # what a data-parallel learner in graph mode on CUDA sets
    params = synced.actor.layout.numel + 2 * synced.critic.layout.numel
    assert collective_bytes_per_iteration(synced, 4, 2) == 4 * (4 * per_critic + 2 * per_actor + params)


def test_data_parallel_needs_an_initialized_process_group():
    with pytest.raises(ValueError, match="init_process_group"):
        FlashSACLearner(FlashSACConfig(**SMALL), process_group=True, **DIMS)


def test_reward_partials_fold_into_the_statistics_of_every_ranks_envs():
    """The data-parallel reward statistics without processes: two ranks' partials, folded in rank
    order, give the count, mean, variance and max |G| of all their envs' returns (with the prior
    the running statistics start from); an empty partial changes no bit."""
    from flashsac_opt.reward_norm import RewardNormalizer

    g = torch.Generator().manual_seed(3)
    rewards = [torch.randn(5, 8, generator=g) for _ in range(2)]
    dones = [(torch.rand(5, 8, generator=g) < 0.2).float() for _ in range(2)]
    ranks = [RewardNormalizer(0.9, 10.0, torch.device("cpu")) for _ in range(2)]
    for rn, r, d in zip(ranks, rewards, dones):
        rn.accumulate(r, d)
    partials = torch.stack([rn.take_pending() for rn in ranks])
    assert torch.equal(ranks[0].pending, torch.zeros(4))  # taken: reset
    folded = RewardNormalizer(0.9, 10.0, torch.device("cpu"))
    folded.fold(partials)
    values = []  # every env's G after every step, all ranks
    for r, d in zip(rewards, dones):
        ret = torch.zeros(8, dtype=torch.float64)
        for t in range(5):
            ret = 0.9 * (1 - d[t].double()) * ret + r[t].double()
            values.append(ret.clone())
    x = torch.cat(values)
    prior, n = 1e-4, x.numel()  # the running statistics start at count 1e-4, mean 0, var 1
    mean = n * x.mean() / (prior + n)
    var = (prior * 1.0 + n * x.var(unbiased=False) + x.mean() ** 2 * prior * n / (prior + n)) / (prior + n)
    assert float(folded.count) == pytest.approx(prior + n)
    assert float(folded.mean) == pytest.approx(float(mean), rel=1e-5)
    assert float(folded.var) == pytest.approx(float(var), rel=1e-5)
    assert float(folded.abs_max) == pytest.approx(float(x.abs().max()), rel=1e-6)
    before = [t.clone() for t in (folded.mean, folded.var, folded.count, folded.abs_max)]
    folded.fold(torch.zeros(2, 4))  # ranks with nothing new
    assert all(torch.equal(a, b) for a, b in zip(before, (folded.mean, folded.var, folded.count, folded.abs_max)))
