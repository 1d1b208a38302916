"""flashsac_opt/fused_step.py (issue 45 item 3, a study): a network's post-backward step (Adam, the unit
renormalization, the guarded commit, Polyak) as one Triton launch, against optim.GatedStep's composite.
On the CPU through Triton's interpreter (TRITON_INTERPRET=1, set by conftest.py), float32."""

import os

import pytest
import torch

pytest.importorskip("triton", reason="the kernel is a Triton kernel (.ci/run installs triton)")
if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("without CUDA these tests need Triton's interpreter (TRITON_INTERPRET=1 before Triton is imported)",
                allow_module_level=True)

from flashsac_opt import FlashSACConfig, FlashSACLearner, fused_step  # noqa: E402
from flashsac_opt.networks import RENORM_EPS, FlashSACActor, FlashSACCritic  # noqa: E402
from flashsac_opt.optim import FlatAdam, GatedStep  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
SMALL = {"obs_dim": 12, "critic_obs_dim": 14, "action_dim": 4}


@pytest.mark.parametrize("net", [
    FlashSACCritic(101, 29, 256, 2, 101, -5.0, 5.0),  # the recipe's critic: 2 members, every renormalization class
    FlashSACActor(98, 29, 128, 2),
])
def test_the_units_cover_every_parameter_once_with_its_class(net):
    units = fused_step.renorm_units(net.layout, net.renorm_groups)
    hits = torch.zeros(net.layout.numel, dtype=torch.int32)
    kinds = torch.full((net.layout.numel,), -1, dtype=torch.int32)
    for first, second, length, kind in units.tolist():
        for start in (first, first + second) if second else (first,):
            hits[start : start + length] += 1
            kinds[start : start + length] = kind
    assert (hits == 1).all()
    views = net.layout.views(kinds)
    assert (views["in_proj"] == 1).all() and (views["block0.down"] == 1).all()  # unit-norm rows
    assert (views["block0.up_bn.weight"] == 2).all() and (views["block0.up_bn.bias"] == 2).all()
    assert (views["out_rms"] == 2).all()
    tail = [name for name in net.layout.names() if name.endswith(".bias") and name not in ("logits.bias", "mean.bias", "log_std.bias")]
    assert all((views[name] == 2).all() for name in tail)  # every other bias is a BatchNorm bias, renormalized with its weight
    assert all((views[name] == 0).all() for name in net.layout.names() if name in ("logits.bias", "mean.bias", "log_std.bias"))
    # an affine unit's second segment is its bias row: the weight row of the same member and pair
    w = net.layout.slots["block0.up_bn.weight"]
    row = [u for u in units.tolist() if u[0] == w.offset][0]
    assert row[1] == net.layout.slots["block0.up_bn.bias"].offset - w.offset and row[2] == w.shape[-1]


def steppers(net, fused: bool):
    adam = FlatAdam(net.layout.numel, torch.device(DEVICE))
    units = fused_step.renorm_units(net.layout, net.renorm_groups).to(DEVICE) if fused else None
    params = net.params.detach().clone().to(DEVICE)
    step = GatedStep(params, None, adam, net.renormalized, lambda s: torch.full_like(s, 3e-3), units)
    return step, params


@pytest.mark.parametrize("polyak", [False, True])
def test_the_fused_step_is_the_composite_step_and_a_skipped_one_writes_nothing(polyak):
    fused_step.register()
    torch.manual_seed(0)
    net = FlashSACCritic(14, 4, 16, 1, 11, -5.0, 5.0)  # 2 members, hidden 16: every class, a few hundred units
    (plain, p_plain), (fused, p_fused) = steppers(net, False), steppers(net, True)
    targets = [net.params.detach().clone().to(DEVICE) * 0.5 for _ in range(2)]
    g = torch.Generator().manual_seed(1)
    for i, finite in enumerate((True, True, False, True)):
        grad = torch.randn(net.layout.numel, generator=g).to(DEVICE) * 0.1
        if not finite:
            grad[7] = float("nan")
        loss = torch.tensor(1.0 + i, device=DEVICE)
        before = [t.clone() for t in (p_fused, fused.adam.exp_avg, fused.adam.exp_avg_sq, targets[1])]
        ok_plain = plain(grad, loss, polyak=(targets[0], 0.005) if polyak else None)
        ok_fused = fused(grad, loss, polyak=(targets[1], 0.005) if polyak else None)
        assert bool(ok_plain) == bool(ok_fused) == finite
        if not finite:  # every buffer bit for bit as it was
            for t, b in zip((p_fused, fused.adam.exp_avg, fused.adam.exp_avg_sq, targets[1]), before):
                assert torch.equal(t, b)
        torch.testing.assert_close(p_fused, p_plain, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(fused.adam.exp_avg, plain.adam.exp_avg, rtol=1e-5, atol=1e-7)
        torch.testing.assert_close(fused.adam.exp_avg_sq, plain.adam.exp_avg_sq, rtol=1e-5, atol=1e-9)
        torch.testing.assert_close(targets[1], targets[0], rtol=1e-5, atol=1e-7)
        assert torch.equal(fused.adam.step, plain.adam.step) and torch.equal(fused.adam.coefficients, plain.adam.coefficients)
    # the target moved toward the parameters only where asked to
    assert torch.equal(targets[1], net.params.detach().to(DEVICE) * 0.5) == (not polyak)
    # the renormalization held: unit rows, BatchNorm pairs at squared norm D
    rows = net.layout.views(p_fused)["block0.up"]
    torch.testing.assert_close(rows.norm(dim=-1), torch.ones(rows.shape[:-1], device=DEVICE))
    v = net.layout.views(p_fused)
    pair = v["block0.up_bn.weight"] ** 2 + v["block0.up_bn.bias"] ** 2
    torch.testing.assert_close(pair.sum(-1), torch.full(pair.shape[:-1], float(pair.shape[-1]), device=DEVICE))


def test_bad_operands_are_refused_with_what_was_given():
    net = FlashSACActor(12, 4, 16, 1)
    units = fused_step.renorm_units(net.layout, net.renorm_groups)
    p = torch.zeros(net.layout.numel)
    args = dict(param=p, grad=p.clone(), exp_avg=p.clone(), exp_avg_sq=p.clone(), coefficients=torch.ones(2),
                ok=torch.ones(()), units=units, target=None, polyak_weight=None, beta1=0.9, beta2=0.999, eps=1e-8, renorm_eps=RENORM_EPS)
    with pytest.raises(ValueError, match="grad must be a contiguous float32 tensor"):
        fused_step.gated_adam_(**{**args, "grad": p.double()})
    with pytest.raises(ValueError, match="target must be a contiguous float32 tensor"):
        fused_step.gated_adam_(**{**args, "target": p[:-1]})
    with pytest.raises(ValueError, match="a Polyak target needs its weight"):
        fused_step.gated_adam_(**{**args, "target": p.clone()})
    with pytest.raises(ValueError, match="units must be an int32"):
        fused_step.gated_adam_(**{**args, "units": units.long()})


def test_a_compiled_learner_with_the_fused_step_updates_as_the_composite_one(monkeypatch):
    """Traced by torch.compile (aot_eager: the mutating op functionalized, its writes reaching the
    learner's buffers) beside the eager composite learner; the eager step is the test above's."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("a CPU learner's Triton kernels run in the interpreter only (the GPU test below covers CUDA)")
    from flashsac_opt.testing.oracle import synthetic_batch

    launches = []
    launch = fused_step.gated_adam_
    monkeypatch.setattr(fused_step, "gated_adam_", lambda *a, **k: launches.append(a[7] is not None) or launch(*a, **k))
    learners = []
    for on in (False, True):
        torch.manual_seed(0)
        cfg = FlashSACConfig(batch_size=32, updates_per_step=2, critic_hidden_dim=16, actor_hidden_dim=16, num_atoms=11,
                             fused_gated_step=on, **({"learner_mode": "compile", "compile_backend": "aot_eager"} if on else {"learner_mode": "eager"}))
        learners.append(FlashSACLearner(cfg, **SMALL, device=torch.device("cpu")))
    plain, fused = learners
    for learner in learners:
        torch.manual_seed(1)
        for i in range(2):
            learner.update(synthetic_batch(64, 12, 14, 4, torch.Generator().manual_seed(i)))
    # one launch per critic update (with its Polyak target) and per actor update (without)
    cfg = plain.cfg
    assert launches.count(True) == 2 * cfg.updates_per_step
    assert launches.count(False) == 2 * cfg.updates_per_step // cfg.policy_frequency
    assert fused.read_metrics()["Loss/critic"] == pytest.approx(plain.read_metrics()["Loss/critic"], rel=1e-5)
    for a, b in ((plain.critic.params, fused.critic.params), (plain.target_critic.params, fused.target_critic.params),
                 (plain.actor.params, fused.actor.params), (plain.critic_adam.exp_avg_sq, fused.critic_adam.exp_avg_sq)):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6)
    assert not torch.equal(fused.target_critic.params, fused.critic.params)


def test_the_switch_needs_triton(monkeypatch):
    from flashsac_opt import kernels

    with pytest.raises(ValueError, match="fused_gated_step must be true or false"):
        FlashSACConfig(fused_gated_step="yes")
    # a CPU learner outside Triton's interpreter: refused at construction, not at the first launch
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match="fused_gated_step=true needs a CUDA device .* got cpu"):
        FlashSACLearner(FlashSACConfig(fused_gated_step=True, learner_mode="eager"), **SMALL, device=torch.device("cpu"))
    monkeypatch.setattr(kernels, "available", lambda: False)
    with pytest.raises(ValueError, match="fused_gated_step=true needs Triton"):
        FlashSACLearner(FlashSACConfig(fused_gated_step=True, learner_mode="eager"), **SMALL, device=torch.device("cpu"))


COMPILE_FOR_SM90 = """
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from flashsac_opt import fused_step, fused_step_triton

signature = {name: "*fp32" for name in ("param_ptr", "grad_ptr", "m_ptr", "v_ptr", "target_ptr", "coefficients_ptr", "ok_ptr")}
signature.update(units_ptr="*i32", weight_ptr="*fp32", beta1="fp32", beta2="fp32", eps="fp32", renorm_eps="fp32",
                 HAS_TARGET="constexpr", CHUNK="constexpr")
for has_target in (True, False):
    source = ASTSource(fn=fused_step_triton.gated_adam_kernel, signature=signature,
                       constexprs={"HAS_TARGET": has_target, "CHUNK": fused_step.CHUNK})
    compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": fused_step.NUM_WARPS})
    print(has_target, len(compiled.asm["cubin"]), compiled.asm["ptx"].count("st.global"))
"""


def test_the_kernel_compiles_for_the_gpus_architecture_without_a_gpu():
    """Triton's interpreter (the tests above) accepts what the compiler may refuse: the kernel through
    Triton's compiler and ptxas for sm_90 (H100, H200), in a process outside the interpreter."""
    import subprocess
    import sys
    from pathlib import Path

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-c", COMPILE_FOR_SM90], capture_output=True, text=True, env=env,
                          cwd=Path(__file__).resolve().parents[1], timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = [line.split() for line in done.stdout.splitlines()]
    assert [line[0] for line in lines] == ["True", "False"]
    # a cubin each; the Polyak form stores a fourth array (the target)
    stores = {line[0]: int(line[2]) for line in lines}
    assert all(int(line[1]) > 0 for line in lines) and stores["True"] > stores["False"] > 0


def test_the_bench_checks_the_two_forms_agree_on_the_cpu(tmp_path):
    import json
    import sys
    from pathlib import Path

    if torch.cuda.is_available():
        pytest.skip("the CPU form of the bench (the GPU runs it through runs.toml)")
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "experiments"))
    from bench import gated_step

    out = tmp_path / "gated_step.json"
    assert gated_step.main(["--device", "cpu", "--output", str(out)]) == 0
    cells = json.loads(out.read_text())["cells"]
    assert {(c["network"], c["variant"]) for c in cells} == {
        (n, v) for n in ("critic", "actor") for v in ("composite", "fused_step", "copy of its bytes")}
    differences = [c["max_abs_difference_from_composite"] for c in cells if c["variant"] == "fused_step"]
    assert all(0 <= d < 1e-5 for d in differences) and any(d > 0 for d in differences)  # float32 rounding, not a copy


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("mode", ["compile", "graph"])
def test_on_cuda_the_fused_step_trains_as_the_composite_one_under_bf16(mode):
    """Compiled by Inductor and captured, within bf16 drift of the composite step."""
    from switch_drift import assert_trains_as_the_composite_under_bf16

    assert_trains_as_the_composite_under_bf16("fused_gated_step", mode)
