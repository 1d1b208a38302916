"""flashsac_opt/gemm_stats.py (issue 45 item 1, a study): the row-split GEMM with BatchNorm statistics
in its epilogue and the previous layer's BatchNorm + ReLU in its prologue, against the composite
block. On the CPU through Triton's interpreter (TRITON_INTERPRET=1, set by conftest.py), float32."""

import os

import pytest
import torch

pytest.importorskip("triton", reason="the kernels are Triton kernels (.ci/run installs triton)")
if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("without CUDA these tests need Triton's interpreter (TRITON_INTERPRET=1 before Triton is imported)",
                allow_module_level=True)

from flashsac_opt import gemm_stats  # noqa: E402
from flashsac_opt.networks import BN_EPS  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def bn_relu(h, gamma, beta):
    mean, var = h.mean(1, keepdim=True), h.var(1, correction=0, keepdim=True)
    return torch.relu((h - mean) * torch.rsqrt(var + BN_EPS) * gamma.unsqueeze(1) + beta.unsqueeze(1)), mean.squeeze(1), var.squeeze(1)


def affine(members, width, g):
    return (torch.rand(members, width, generator=g) + 0.5).to(DEVICE), torch.randn(members, width, generator=g).to(DEVICE)


@pytest.mark.parametrize("members,rows,inputs,wide,expanded", [
    (2, 150, 24, 80, False),  # three row tiles, the last one partial; inputs and features off the block sizes
    (3, 64, 40, 70, True),    # one full row tile; the critic's input rows expanded over the members (stride 0)
    (2, 2, 8, 32, False),     # the fewest rows BatchNorm allows
])
def test_a_block_through_gemm_stats_is_the_composite_block(members, rows, inputs, wide, expanded):
    g = torch.Generator().manual_seed(rows)
    x = torch.randn(1 if expanded else members, rows, inputs, generator=g).to(DEVICE) + 3.0
    x = x.expand(members, -1, -1)
    w_up = (torch.randn(members, wide, inputs, generator=g) / inputs**0.5).to(DEVICE)
    w_down = (torch.randn(members, inputs, wide, generator=g) / wide**0.5).to(DEVICE)
    (g_up, b_up), (g_down, b_down) = affine(members, wide, g), affine(members, inputs, g)

    h_up, s_up, m2_up = gemm_stats.gemm_stats(x, w_up)
    assert s_up.shape == m2_up.shape == (members, gemm_stats.row_tiles(rows), wide)
    ref_up = torch.bmm(x, w_up.transpose(1, 2))
    torch.testing.assert_close(h_up, ref_up, rtol=1e-5, atol=1e-5)
    a_up, mean_ref, var_ref = bn_relu(ref_up, g_up, b_up)
    mean, var, scale, shift = gemm_stats.finalize(s_up, m2_up, g_up, b_up, rows, BN_EPS)
    torch.testing.assert_close(mean, mean_ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(var, var_ref, rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(scale, g_up * torch.rsqrt(var_ref + BN_EPS), rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(shift, b_up - mean_ref * scale, rtol=1e-4, atol=1e-4)
    assert (a_up > 0).any() and (a_up == 0).any()  # the prologue's ReLU cuts something

    h_down, s_down, m2_down = gemm_stats.gemm_stats(h_up, w_down, (scale, shift))
    ref_down = torch.bmm(a_up, w_down.transpose(1, 2))
    torch.testing.assert_close(h_down, ref_down, rtol=1e-4, atol=1e-4)
    y, mean, var = gemm_stats.bn_relu_apply(h_down, s_down, m2_down, g_down, b_down, residual=x, eps=BN_EPS)
    a_down, mean_ref, var_ref = bn_relu(ref_down, g_down, b_down)
    torch.testing.assert_close(y, a_down + x, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(mean, mean_ref, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(var, var_ref, rtol=1e-4, atol=1e-4)
    no_skip, _, _ = gemm_stats.bn_relu_apply(h_down, s_down, m2_down, g_down, b_down, eps=BN_EPS)
    torch.testing.assert_close(no_skip, a_down, rtol=1e-4, atol=1e-4)


def test_the_partials_keep_the_variance_of_features_far_from_zero():
    """Outputs near 1000 with unit spread: float32 E[h^2] - E[h]^2 would lose the variance
    (1e6 - 1e6 at float32's 0.06 step); the centred partials keep it to float32's rounding of h."""
    g = torch.Generator().manual_seed(0)
    rows, members, width = 200, 2, 16
    x = torch.cat([torch.randn(members, rows, 8, generator=g, dtype=torch.float64), torch.ones(members, rows, 1, dtype=torch.float64)], 2)
    w = torch.cat([torch.randn(members, width, 8, generator=g, dtype=torch.float64), torch.full((members, width, 1), 1000.0, dtype=torch.float64)], 2)
    exact = torch.bmm(x, w.transpose(1, 2))
    _, s, m2 = gemm_stats.gemm_stats(x.float().to(DEVICE), w.float().to(DEVICE))
    ones = torch.ones(members, width, device=DEVICE)
    _, var, _, _ = gemm_stats.finalize(s, m2, ones, ones, rows, BN_EPS)
    torch.testing.assert_close(var.double().cpu(), exact.var(1, correction=0), rtol=2e-3, atol=0)


def test_bad_operands_are_refused_with_what_was_given():
    a, w = torch.zeros(2, 16, 8, device=DEVICE), torch.zeros(2, 12, 8, device=DEVICE)
    with pytest.raises(ValueError, match="one GEMM dtype"):
        gemm_stats.gemm_stats(a, w.double())
    with pytest.raises(ValueError, match=r"\(members, rows, in\)"):
        gemm_stats.gemm_stats(a, w[:, :, :4])
    with pytest.raises(ValueError, match="at least 2 rows"):
        gemm_stats.gemm_stats(a[:, :1], w)
    h, s, m2 = gemm_stats.gemm_stats(a, w)
    gamma = torch.ones(2, 12, device=DEVICE)
    with pytest.raises(ValueError, match="partials"):
        gemm_stats.bn_relu_apply(h, s[:, :0], m2, gamma, gamma)
    with pytest.raises(ValueError, match="gamma"):
        gemm_stats.finalize(s, m2, gamma[:, :3], gamma, 16)
    with pytest.raises(ValueError, match="scale and shift must be float32"):
        gemm_stats.gemm_stats(h, torch.zeros(2, 4, 12, device=DEVICE), (gamma[:, :3], gamma))
    with pytest.raises(ValueError, match="residual"):
        gemm_stats.bn_relu_apply(h, s, m2, gamma, gamma, residual=h[:, :3])


def composite_block(x, w_up, w_down, g_up, b_up, g_down, b_down):
    a_up, mean_up, var_up = bn_relu(torch.bmm(x, w_up.transpose(1, 2)), g_up, b_up)
    y, mean_down, var_down = bn_relu(torch.bmm(a_up, w_down.transpose(1, 2)), g_down, b_down)
    return y + x, (mean_up, var_up), (mean_down, var_down)


@pytest.mark.parametrize("rows", [150, 64])
def test_the_block_is_the_composite_block_forward_and_backward(rows):
    members, hidden, wide = 2, 24, 80
    g = torch.Generator().manual_seed(rows)
    x = (torch.randn(members, rows, hidden, generator=g) + 1.0).to(DEVICE).requires_grad_()
    w_up = (torch.randn(members, wide, hidden, generator=g) / hidden**0.5).to(DEVICE).requires_grad_()
    w_down = (torch.randn(members, hidden, wide, generator=g) / wide**0.5).to(DEVICE).requires_grad_()
    affines = [t.requires_grad_() for t in affine(members, wide, g) + affine(members, hidden, g)]
    params = (x, w_up, w_down, *affines)
    y, up, down = gemm_stats.block(*params, eps=BN_EPS)
    y_ref, up_ref, down_ref = composite_block(*params)
    torch.testing.assert_close(y, y_ref, rtol=1e-4, atol=1e-4)
    for got, want in zip(up + down, up_ref + down_ref):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    grad = torch.randn(y.shape, generator=g).to(DEVICE)
    # only y carries a gradient: the statistics feed the running statistics, which are buffers
    got = torch.autograd.grad(y, params, grad)
    want = torch.autograd.grad(y_ref, params, grad)
    for name, a, b in zip(("x", "w_up", "w_down", "g_up", "b_up", "g_down", "b_down"), got, want):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4, msg=lambda m, name=name: f"grad {name}: {m}")


def test_a_critic_and_an_actor_with_gemm_stats_blocks_are_the_composite_ones():
    import copy

    from flashsac_opt.networks import FlashSACActor, FlashSACCritic

    torch.manual_seed(0)
    plain = FlashSACCritic(20, 5, hidden_dim=32, num_blocks=2, num_atoms=11).to(DEVICE)
    fused = copy.deepcopy(plain)
    fused.gemm_stats_block = True
    obs, actions = torch.randn(80, 20, device=DEVICE), torch.randn(80, 5, device=DEVICE)  # two row tiles, the second partial
    q, log_probs, stats = plain(obs, actions, True)
    q_f, log_probs_f, stats_f = fused(obs, actions, True)
    torch.testing.assert_close(q_f, q, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(log_probs_f, log_probs, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(stats_f, stats, rtol=1e-5, atol=1e-6)  # the running statistics it commits
    grad, = torch.autograd.grad((log_probs.exp() * 0.3).sum() + q.sum(), plain.params)
    grad_f, = torch.autograd.grad((log_probs_f.exp() * 0.3).sum() + q_f.sum(), fused.params)
    torch.testing.assert_close(grad_f, grad, rtol=1e-4, atol=1e-4)
    assert torch.equal(fused(obs, actions, False)[0], plain(obs, actions, False)[0])  # evaluation: composite

    actor = FlashSACActor(obs_dim=10, action_dim=3, hidden_dim=16).to(DEVICE)
    actor_f = copy.deepcopy(actor)
    actor_f.gemm_stats_block = True
    obs = torch.randn(48, 10, device=DEVICE)
    mean, std, stats = actor.distribution_params(obs, actor.params, actor.bn_stats, True)
    mean_f, std_f, stats_f = actor_f.distribution_params(obs, actor_f.params, actor_f.bn_stats, True)
    torch.testing.assert_close(mean_f, mean, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(stats_f, stats, rtol=1e-5, atol=1e-6)
    grad, = torch.autograd.grad((mean * std).sum(), actor.params)
    grad_f, = torch.autograd.grad((mean_f * std_f).sum(), actor_f.params)
    torch.testing.assert_close(grad_f, grad, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("mode", [
    {"learner_mode": "eager"},
    # traced by torch.compile (the ops as opaque nodes), differentiated through torch.func (the fused update)
    {"learner_mode": "compile", "compile_backend": "aot_eager"},
])
def test_a_learner_with_gemm_stats_blocks_updates_as_the_composite_one(mode, monkeypatch):
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("a CPU learner's Triton kernels run in the interpreter only (the GPU test below covers CUDA)")
    from flashsac_opt import FlashSACConfig, FlashSACLearner
    from flashsac_opt.testing.oracle import synthetic_batch

    launches = []
    gemm = gemm_stats.gemm_stats
    monkeypatch.setattr(gemm_stats, "gemm_stats", lambda *a, **k: launches.append(1) or gemm(*a, **k))
    dims = {"obs_dim": 12, "critic_obs_dim": 14, "action_dim": 4}
    learners = []
    for on in (False, True):
        torch.manual_seed(0)
        cfg = FlashSACConfig(batch_size=32, updates_per_step=2, critic_hidden_dim=32, actor_hidden_dim=16, num_atoms=11,
                             gemm_stats_block=on, **{"learner_mode": "eager", **mode})
        learners.append(FlashSACLearner(cfg, **dims, device=torch.device("cpu")))
    plain, fused = learners
    assert all(net.gemm_stats_block for net in (fused.critic, fused.target_critic, fused.actor))
    for learner in learners:
        torch.manual_seed(1)
        for i in range(3):
            learner.update(synthetic_batch(64, 12, 14, 4, torch.Generator().manual_seed(i)))
    # two GEMMs per training-mode block: the critic's and the target critic's every update, the
    # actor's every policy_frequency-th
    cfg, updates = plain.cfg, 3 * 2
    assert len(launches) == updates * 2 * (2 * cfg.critic_num_blocks + cfg.actor_num_blocks / cfg.policy_frequency)
    assert fused.read_metrics()["Loss/critic"] == pytest.approx(plain.read_metrics()["Loss/critic"], rel=1e-4)
    for a, b in ((plain.critic.params, fused.critic.params), (plain.critic.bn_stats, fused.critic.bn_stats),
                 (plain.actor.params, fused.actor.params)):
        torch.testing.assert_close(b, a, rtol=1e-4, atol=5e-5)


def test_the_switch_needs_triton_and_excludes_the_fused_layer(monkeypatch):
    from flashsac_opt import FlashSACConfig, FlashSACLearner, kernels

    with pytest.raises(ValueError, match="exclude each other"):
        FlashSACConfig(gemm_stats_block=True, fused_linear_bn_relu=True)
    with pytest.raises(ValueError, match="gemm_stats_block must be true or false"):
        FlashSACConfig(gemm_stats_block="yes")
    monkeypatch.setattr(kernels, "available", lambda: False)
    with pytest.raises(ValueError, match="gemm_stats_block=true needs Triton"):
        FlashSACLearner(FlashSACConfig(gemm_stats_block=True, learner_mode="eager"), obs_dim=12, critic_obs_dim=14, action_dim=4,
                        device=torch.device("cpu"))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("mode", ["compile", "graph"])
def test_on_cuda_gemm_stats_blocks_train_as_the_composite_ones_under_bf16(mode):
    """Compiled and captured, within bf16 drift of the composite blocks."""
    from switch_drift import assert_trains_as_the_composite_under_bf16

    assert_trains_as_the_composite_under_bf16("gemm_stats_block", mode)


def test_the_bench_and_its_sweep_check_the_outputs_on_the_cpu(tmp_path):
    import json
    import sys
    from pathlib import Path

    if torch.cuda.is_available():
        pytest.skip("the CPU form of the bench (the GPU runs it through runs.toml)")
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "experiments"))
    from bench import gemm_stats_block

    out = tmp_path / "block.json"
    assert gemm_stats_block.main(["--device", "cpu", "--output", str(out)]) == 0
    cells = json.loads(out.read_text())["cells"]
    checked = {c["variant"]: c["max_abs_error"] for c in cells if "max_abs_error" in c}
    assert set(checked) == {"composite (bmm + Inductor)", "gemm_stats", "member_linear_bn_relu"}
    assert all(0 < e < 0.1 for e in checked.values())  # float16 rounding, not zero, not garbage
    out = tmp_path / "sweep.json"
    assert gemm_stats_block.main(["--device", "cpu", "--sweep", "--output", str(out)]) == 0
    sweep = json.loads(out.read_text())["cells"]
    # the up GEMM's float16 output equals the reference's rounding; the down one's prologue rounds on its own
    assert {c["layer"] for c in sweep} == {"up", "down"} and all(c["max_abs_error"] < 0.1 for c in sweep)
    assert any(c["max_abs_error"] > 0 for c in sweep if c["layer"] == "down")
