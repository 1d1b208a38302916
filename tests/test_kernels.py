"""flashsac_opt/kernels.py: the fused up projection + training BatchNorm + ReLU (issue 45), against
the composite layer it replaces. On the CPU through Triton's interpreter (TRITON_INTERPRET=1), in
float32; on CUDA (marked gpu) compiled, under bf16 autocast, in graph mode."""

import copy
import os

import pytest
import torch

pytest.importorskip("triton", reason="the fused kernels are Triton kernels (.ci/run installs triton)")
if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":  # set by conftest.py
    pytest.skip("without CUDA these tests need Triton's interpreter (TRITON_INTERPRET=1 before Triton is imported)",
                allow_module_level=True)

from flashsac_opt import FlashSACConfig, FlashSACLearner, kernels  # noqa: E402
from flashsac_opt.networks import BN_EPS, FlashSACActor, FlashSACCritic  # noqa: E402
from flashsac_opt.testing.oracle import synthetic_batch  # noqa: E402

CPU = torch.device("cpu")


def composite(x, w, gamma, beta):
    h = torch.bmm(x, w.transpose(1, 2))
    mean, var = h.mean(1, keepdim=True), h.var(1, correction=0, keepdim=True)
    y = torch.relu((h - mean) * torch.rsqrt(var + BN_EPS) * gamma.unsqueeze(1) + beta.unsqueeze(1))
    return y, mean.squeeze(1), var.squeeze(1)


@pytest.mark.parametrize("members,rows,inputs,features,expanded,residual", [
    (2, 40, 24, 48, False, False),   # rows, inputs and features off the block sizes (masked edges)
    (2, 2, 8, 32, False, False),     # the fewest rows BatchNorm allows
    (3, 64, 40, 70, True, False),    # the critic's input rows: one tensor expanded over the members (stride 0)
    (2, 40, 96, 24, False, True),    # a down projection with its skip connection added after the ReLU
])
def test_the_kernel_is_the_composite_layer_forward_and_backward(members, rows, inputs, features, expanded, residual):
    g = torch.Generator().manual_seed(rows)
    if expanded:
        x = torch.randn(1, rows, inputs, generator=g).expand(members, -1, -1).clone().requires_grad_()
        x_in = x[:1].expand(members, -1, -1)
    else:
        x = torch.randn(members, rows, inputs, generator=g, requires_grad=True)
        x_in = x
    w = torch.randn(members, features, inputs, generator=g, requires_grad=True)
    gamma = (torch.rand(members, features, generator=g) + 0.5).requires_grad_()
    beta = torch.randn(members, features, generator=g, requires_grad=True)
    skip = torch.randn(members, rows, features, generator=g, requires_grad=True) if residual else None
    y, mean, var = kernels.member_linear_bn_relu(x_in, w, gamma, beta, BN_EPS, residual=skip)
    y_ref, mean_ref, var_ref = composite(x_in, w, gamma, beta)
    relu_out = y_ref
    if residual:
        y_ref = y_ref + skip
    torch.testing.assert_close(y, y_ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(mean, mean_ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(var, var_ref, rtol=1e-5, atol=1e-5)
    assert (relu_out > 0).any() and (relu_out == 0).any()  # the ReLU cut something: its mask is exercised
    grad = torch.randn(y.shape, generator=g)
    inputs_ = (x, w, gamma, beta) + ((skip,) if residual else ())
    got = torch.autograd.grad(y, inputs_, grad)
    want = torch.autograd.grad(y_ref, inputs_, grad)
    for name, a, b in zip(("x", "w", "gamma", "beta", "residual"), got, want):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4, msg=lambda m, name=name: f"grad {name}: {m}")


def test_the_output_in_the_gemm_dtype_is_the_float32_output_rounded_once():
    """y_in_input_dtype (the layer under relu_in_autocast_dtype): one rounding of the float32 result,
    and a backward through it. Half precision here: Triton's interpreter reads bfloat16 wrongly
    (numpy has no bfloat16), so bf16 runs in the GPU tests."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(2, 40, 24, generator=g).half().requires_grad_()
    w = torch.randn(2, 48, 24, generator=g).half().requires_grad_()
    gamma, beta = torch.rand(2, 48, generator=g) + 0.5, torch.randn(2, 48, generator=g)
    y32, mean32, _ = kernels.member_linear_bn_relu(x, w, gamma, beta, BN_EPS)
    y16, mean16, _ = kernels.member_linear_bn_relu(x, w, gamma, beta, BN_EPS, y_in_input_dtype=True)
    assert y32.dtype == torch.float32 and y16.dtype == torch.float16
    torch.testing.assert_close(y16, y32.half(), rtol=0, atol=1e-3)  # the accumulations may differ in the last bit
    torch.testing.assert_close(mean16, mean32)
    y_ref, _, _ = composite(x.float(), w.float(), gamma, beta)
    grad = torch.randn(y16.shape, generator=g)
    got = torch.autograd.grad(y16, (x, w), grad.half())
    want = torch.autograd.grad(y_ref, (x, w), grad)
    for a, b in zip(got, want):
        assert a.dtype == torch.float16
        torch.testing.assert_close(a.float(), b.float(), rtol=2e-2, atol=2e-2)


def test_shapes_and_dtypes_the_kernel_does_not_take_are_refused():
    x, w = torch.randn(2, kernels.MAX_ROWS + 1, 8), torch.randn(2, 16, 8)
    assert not kernels.supports(x, w) and kernels.supports(x[:, :kernels.MAX_ROWS], w)
    gamma, beta = torch.ones(2, 16), torch.zeros(2, 16)
    with pytest.raises(ValueError, match=f"2..{kernels.MAX_ROWS} rows"):
        kernels.member_linear_bn_relu(x, w, gamma, beta)
    with pytest.raises(ValueError, match="one GEMM dtype"):
        kernels.member_linear_bn_relu(x[:, :16], w.double(), gamma, beta)
    with pytest.raises(ValueError, match="residual .* is not the output's shape"):
        kernels.member_linear_bn_relu(x[:, :16], w, gamma, beta, residual=torch.zeros(2, 16, 8))


def test_a_critic_with_the_fused_layer_is_the_composite_critic():
    torch.manual_seed(0)
    plain = FlashSACCritic(20, 5, hidden_dim=32, num_blocks=2, num_atoms=11)
    fused = copy.deepcopy(plain)
    fused.fused_linear_bn_relu = True
    obs, actions = torch.randn(48, 20), torch.randn(48, 5)
    q, log_probs, stats = plain(obs, actions, True)
    q_f, log_probs_f, stats_f = fused(obs, actions, True)
    torch.testing.assert_close(q_f, q, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(log_probs_f, log_probs, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(stats_f, stats, rtol=1e-5, atol=1e-6)  # the running statistics it commits
    loss, loss_f = (log_probs.exp() * 0.3).sum() + q.sum(), (log_probs_f.exp() * 0.3).sum() + q_f.sum()
    grad, = torch.autograd.grad(loss, plain.params)
    grad_f, = torch.autograd.grad(loss_f, fused.params)
    torch.testing.assert_close(grad_f, grad, rtol=1e-4, atol=1e-4)
    # evaluation mode normalizes with the running statistics: the composite path, unchanged
    assert torch.equal(fused(obs, actions, False)[0], plain(obs, actions, False)[0])


def test_an_actor_with_the_fused_layer_is_the_composite_actor():
    """The actor's blocks (one member: its rows go through the kernel as a one-member ensemble)."""
    torch.manual_seed(0)
    plain = FlashSACActor(obs_dim=10, action_dim=3, hidden_dim=16)
    fused = copy.deepcopy(plain)
    fused.fused_linear_bn_relu = True
    obs = torch.randn(48, 10)
    mean, std, stats = plain.distribution_params(obs, plain.params, plain.bn_stats, True)
    mean_f, std_f, stats_f = fused.distribution_params(obs, fused.params, fused.bn_stats, True)
    torch.testing.assert_close(mean_f, mean, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(std_f, std, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(stats_f, stats, rtol=1e-5, atol=1e-6)
    grad, = torch.autograd.grad((mean * std).sum(), plain.params)
    grad_f, = torch.autograd.grad((mean_f * std_f).sum(), fused.params)
    torch.testing.assert_close(grad_f, grad, rtol=1e-4, atol=1e-4)
    assert torch.equal(fused.distribution_params(obs, fused.params, fused.bn_stats, False)[0],
                       plain.distribution_params(obs, plain.params, plain.bn_stats, False)[0])


def _small_config(**options) -> FlashSACConfig:
    options.setdefault("learner_mode", "eager")
    return FlashSACConfig(batch_size=32, updates_per_step=2, critic_hidden_dim=32, actor_hidden_dim=16,
                          num_atoms=11, **options)


@pytest.mark.parametrize("mode", [
    {"learner_mode": "eager"},
    # traced by torch.compile as one opaque node, differentiated through torch.func (the fused update);
    # aot_eager because Inductor's C++ build would double this file's time and adds nothing about the op
    {"learner_mode": "compile", "compile_backend": "aot_eager"},
])
def test_a_learner_with_the_fused_layer_updates_as_the_composite_one(mode, monkeypatch):
    launches = []
    launch = kernels._launch
    monkeypatch.setattr(kernels, "_launch", lambda *args: launches.append(1) or launch(*args))
    dims = {"obs_dim": 12, "critic_obs_dim": 14, "action_dim": 4}
    learners = []
    for fused in (False, True):
        torch.manual_seed(0)
        learners.append(FlashSACLearner(_small_config(fused_linear_bn_relu=fused, **mode), **dims, device=CPU))
    plain, fused = learners
    assert all(net.fused_linear_bn_relu for net in (fused.critic, fused.target_critic, fused.actor))
    assert not plain.critic.fused_linear_bn_relu
    for learner in learners:  # each from the same RNG state: the actor's noise comes from the global generator
        torch.manual_seed(1)
        for i in range(3):
            learner.update(synthetic_batch(64, 12, 14, 4, torch.Generator().manual_seed(i)))
    # every training-mode block ran as two launches: per update the critic's and the target
    # critic's blocks, and at every policy_frequency-th update the actor's
    cfg, updates = plain.cfg, 3 * 2
    per_update = 2 * 2 * cfg.critic_num_blocks + 2 * cfg.actor_num_blocks / cfg.policy_frequency
    assert len(launches) == updates * per_update
    m, m_f = plain.read_metrics(), fused.read_metrics()
    assert m_f["Loss/critic"] == pytest.approx(m["Loss/critic"], rel=1e-4)
    # the kernel sums each dot product in BLOCK_K chunks, the CPU GEMM in its own order: float32's
    # last bits differ, and six Adam steps (gradient / sqrt of its square) carry them to ~1e-5; where
    # a gradient element is near zero its sign can differ, and Adam's step then by up to 2 lr (one
    # element of 4784 at 5.4e-5 on the 2026-12-08 CI machine)
    for a, b in ((plain.critic.params, fused.critic.params), (plain.critic.bn_stats, fused.critic.bn_stats),
                 (plain.actor.params, fused.actor.params)):
        diff = (b - a).abs()
        assert diff.max().item() <= 2 * updates * cfg.peak_lr, diff.max().item()
        assert (diff > 5e-5 + 1e-4 * a.abs()).float().mean().item() < 1e-3  # the bulk: rounding carried by Adam


def test_the_switch_needs_triton(monkeypatch):
    monkeypatch.setattr(kernels, "available", lambda: False)
    with pytest.raises(ValueError, match="fused_linear_bn_relu=true needs Triton"):
        FlashSACLearner(_small_config(fused_linear_bn_relu=True), obs_dim=12, critic_obs_dim=14, action_dim=4, device=CPU)
    with pytest.raises(ValueError, match="fused_linear_bn_relu must be true or false"):
        _small_config(fused_linear_bn_relu="yes")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("mode", ["compile", "graph"])
def test_on_cuda_the_fused_layer_trains_as_the_composite_one_under_bf16(mode):
    """Compiled (the fused update's torch.func path) and captured, within bf16 drift of the composite."""
    from switch_drift import assert_trains_as_the_composite_under_bf16

    assert_trains_as_the_composite_under_bf16("fused_linear_bn_relu", mode)


def test_the_configuration_sweep_checks_every_configuration_on_the_cpu(tmp_path):
    import json
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "experiments"))
    from bench import fused_kernel_configs

    out = tmp_path / "sweep.json"
    assert fused_kernel_configs.main(["--device", "cpu", "--output", str(out)]) == 0
    result = json.loads(out.read_text())
    fused = [c for c in result["cells"] if c["variant"] == "fused"]
    # an up projection and a down projection with its skip connection, each in every configuration
    assert len(fused) == 2 * len(fused_kernel_configs.GRID) and result["configs_over_error_bound"] == 0
    assert {c["skip_connection"] for c in fused} == {True, False}
    assert all(0 < c["max_abs_error"] < 1e-2 for c in fused)  # float16 GEMM: its rounding, not zero, not garbage
