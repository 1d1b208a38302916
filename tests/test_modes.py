"""learner_mode compile / graph: equality with eager, no recompiles, no host syncs, frozen critic."""

import dataclasses
import functools

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

from flashsac_opt.config import FlashSACConfig
from flashsac_opt.learner import COL, FlashSACLearner
from flashsac_opt.testing.oracle import synthetic_batch
from flashsac_opt.testing.saved_tensors import recording_backend, saved_bytes

DIMS = {"obs_dim": 12, "critic_obs_dim": 15, "action_dim": 4}
SMALL = dict(batch_size=16, updates_per_step=4, policy_frequency=2, actor_hidden_dim=16, critic_hidden_dim=32, num_atoms=21)
G1 = {"obs_dim": 98, "critic_obs_dim": 101, "action_dim": 29}


@pytest.fixture(autouse=True)
def fresh_dynamo():
    # Each learner instance compiles its own bound methods; start every test from a clean
    # Dynamo cache so the recompile counters below see only this test's learner.
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def make(mode, device="cpu", dims=DIMS, **overrides):
    torch.manual_seed(0)
    cfg = FlashSACConfig(**{**SMALL, "learner_mode": mode, **overrides})
    return FlashSACLearner(cfg, device=device, **dims)


def batches(learner, n, seed=0, device="cpu"):
    rows = learner.cfg.batch_size * learner.cfg.updates_per_step
    g = torch.Generator().manual_seed(seed)
    dims = {"obs_dim": learner.obs_dim, "critic_obs_dim": learner.critic_obs_dim, "action_dim": learner.action_dim}
    return [synthetic_batch(rows, generator=g, device=device, **dims) for _ in range(n)]


def train(learner, data, seed=0):
    losses = []
    for i, b in enumerate(data):
        torch.manual_seed(seed + i)
        if learner.device.type == "cuda":
            torch.cuda.manual_seed(seed + i)
        learner.update(b)
        losses.append(learner.update_metrics_table()[:-1, [COL["critic_loss"], COL["actor_loss"]]].clone())
    return torch.cat(losses)


def rel(a, b):
    a, b = a.detach(), b.detach()
    return float((a - b).norm() / b.norm())


# ------------------------------------------------------------------ CPU
@pytest.mark.parametrize("fused_update", [True, False], ids=["fused", "split"])
def test_compile_mode_traces_without_breaks_and_matches_eager_bitwise_cpu(fused_update):
    """aot_eager runs the traced graphs op for op: any divergence is a tracing bug.

    (It caught one: torch.compile dropped in-place updates to 0-dim float64 tensors, which
    is why FlatAdam's counters have shape (1,).) Both compile boundaries: the fused step
    (torch.func gradient inside the graph) and the split loss/step pair.
    """
    eager = make("eager")
    compiled = make("compile", compile_backend="aot_eager", fused_update=fused_update)
    data = batches(eager, 4)
    le, lc = train(eager, data), train(compiled, data)
    assert torch.equal(le, lc)
    for name in ("actor", "critic", "target_critic"):
        assert torch.equal(getattr(eager, name).params, getattr(compiled, name).params), name
        assert torch.equal(getattr(eager, name).bn_stats, getattr(compiled, name).bn_stats), name
    assert torch.equal(eager.critic_adam.exp_avg_sq, compiled.critic_adam.exp_avg_sq)
    assert torch.equal(eager.temperature.log_temp, compiled.temperature.log_temp)


def test_a_deferred_compile_runs_eager_first_then_compiles_in_the_same_learner(tmp_path, monkeypatch):
    """defer_compile(): the first iterations run uncompiled (as eager does, bit for bit, nothing
    traced, no compile-cache file written); compile_now() compiles at the next iteration and the
    learner goes on as the eager one would (aot_eager runs the traced graphs op for op)."""
    from torch._dynamo.utils import counters

    from flashsac_opt import compile_cache

    saved = []
    monkeypatch.setattr(compile_cache, "save", lambda path: saved.append(path) or False)
    eager = make("eager")
    deferred = make("compile", compile_backend="aot_eager", compile_cache_file=str(tmp_path / "cc.bin"))
    deferred.engine.defer_compile()
    data = batches(eager, 4)
    graphs = counters["stats"].get("unique_graphs", 0)
    assert torch.equal(train(eager, data[:2]), train(deferred, data[:2]))
    assert counters["stats"].get("unique_graphs", 0) == graphs and deferred.engine.compiled_names() == [] and saved == []
    for name in ("actor", "critic", "target_critic"):
        assert torch.equal(getattr(eager, name).params, getattr(deferred, name).params), name
    deferred.engine.compile_now()
    assert torch.equal(train(eager, data[2:], seed=2), train(deferred, data[2:], seed=2))
    assert counters["stats"].get("unique_graphs", 0) > graphs and deferred.engine.compiled_names() == ["critic_step", "actor_step"]
    assert saved == [str(tmp_path / "cc.bin")]  # once, after the first compiled iteration
    for name in ("actor", "critic", "target_critic"):
        assert torch.equal(getattr(eager, name).params, getattr(deferred, name).params), name
    assert deferred.iterations == eager.iterations == 4
    with pytest.raises(RuntimeError, match="before the first iteration"):
        deferred.engine.defer_compile()
    with pytest.raises(ValueError, match="eager compiles nothing"):
        eager.engine.defer_compile()


def test_no_recompiles_after_warmup_while_lr_and_counters_change():
    from torch._dynamo.utils import counters

    learner = make("compile", compile_backend="aot_eager", learning_rate_warmup_steps=3, learning_rate_decay_steps=20)
    data = batches(learner, 5)
    learner.update(data[0])  # warm-up: compiles each function once
    frames = dict(counters["stats"])
    with torch._dynamo.config.patch(error_on_recompile=True):
        for b in data[1:]:
            learner.update(b)  # the LR moves through warm-up and cosine decay here
    assert dict(counters["stats"]).get("unique_graphs") == frames.get("unique_graphs")
    assert float(learner.critic_adam.schedule_step) == 5 * 4


def test_inductor_compile_matches_eager_cpu():
    """Inductor fuses and reorders: not bitwise, but within fp32 rounding after 3 iterations."""
    eager, compiled = make("eager"), make("compile")
    data = batches(eager, 3)
    le, lc = train(eager, data), train(compiled, data)
    assert rel(lc, le) < 1e-5
    for name in ("actor", "critic", "target_critic"):
        assert rel(getattr(compiled, name).params, getattr(eager, name).params) < 1e-5, name


def loop_body(code: str, start: int) -> str:
    """The brace-delimited body of the C++ loop whose header ends before ``start``."""
    begin = code.index("{", start)
    depth = 0
    for i in range(begin, len(code)):
        depth += {"{": 1, "}": -1}.get(code[i], 0)
        if depth == 0:
            return code[begin : i + 1]
    raise ValueError("unbalanced braces")


def test_the_compiled_adam_step_computes_its_scalars_once_not_per_parameter():
    """Inductor inlined the LR's cosine and the bias corrections' float64 powers into the loop
    over every parameter (the critic's Adam kernel 51-85 us an update on an H200 where its bytes
    need ~15: results/roofline/README.md). The step reads them from FlatAdam.coefficients,
    computed once after the previous step: the loop over the parameters has no cos and no pow."""
    import re

    from torch._inductor.utils import run_and_get_code

    from flashsac_opt.objectives import CosineSchedule
    from flashsac_opt.optim import FlatAdam, GatedStep

    n = 4096
    adam = FlatAdam(n, torch.device("cpu"))
    step = GatedStep(torch.randn(n), None, adam, None, CosineSchedule(1e-4, 3e-4, 1e-5, 10, 100).on_device)
    eager = GatedStep(step.param.clone(), None, FlatAdam(n, torch.device("cpu")), None, step.lr_fn)
    torch._dynamo.reset()
    grads = [torch.randn(n) for _ in range(3)]
    compiled = torch.compile(step.__call__, fullgraph=True, backend="inductor")
    _, codes = run_and_get_code(compiled, grads[0], torch.tensor(1.0))
    code = "\n".join(codes)
    loops = [loop_body(code, m.end()) for m in re.finditer(rf"for\(int64_t x0=[^;]*; x0<static_cast<int64_t>\({n}L\)", code)]
    assert loops and not any(re.search(r"cos|pow", body) for body in loops)  # no scalar math per parameter
    assert re.search(r"std::cos", code)  # it is computed: once, outside those loops
    for g in grads[1:]:
        compiled(g, torch.tensor(1.0))
    for g in grads:
        eager(g, torch.tensor(1.0))
    torch.testing.assert_close(step.param, eager.param)  # and the steps still agree with eager's
    assert float(adam.step) == float(adam.schedule_step) == 3.0


def _compiled_actor_step_profile(freeze_critic: bool) -> tuple[int, int]:
    """GEMM FLOPs and GEMM count of one compiled actor loss forward+backward (profiler, CPU).

    aot_eager runs AOTAutograd's compiled backward as aten ops, so the profiler sees every
    GEMM the compiled graph contains. Both cases ask autograd only for actor gradients, as
    UniLab does with backward(inputs=actor params).
    """
    from flashsac_opt.objectives import actor_objective

    learner = make("eager", dims=G1, batch_size=64, actor_hidden_dim=32, critic_hidden_dim=64)
    b = {k: v[:64] for k, v in batches(learner, 1)[0].items()}
    objective = torch.compile(actor_objective, backend="aot_eager", fullgraph=True, dynamic=False)
    args = (
        learner.actor, learner.critic, learner.actor.params, learner.critic.params, learner.temperature.log_temp,
        b["obs"], b["next_obs"], b["critic"], b["actions"], torch.randn(128, 29), 0.0, None, freeze_critic,
    )
    torch.autograd.grad(objective(*args).loss, learner.actor.params)  # compile outside the profile
    with profile(activities=[ProfilerActivity.CPU], with_flops=True) as prof:
        torch.autograd.grad(objective(*args).loss, learner.actor.params)
    gemms = [e for e in prof.key_averages() if e.key in ("aten::bmm", "aten::mm", "aten::addmm")]
    return sum(e.flops for e in gemms), sum(e.count for e in gemms)


def test_frozen_critic_does_no_weight_gradient_work():
    """The profiler sees the critic dW GEMMs in the compiled backward unless the critic is frozen."""
    frozen_flops, frozen_gemms = _compiled_actor_step_profile(freeze_critic=True)
    full_flops, full_gemms = _compiled_actor_step_profile(freeze_critic=False)
    # One dW GEMM per critic weight matrix: embed, 2 blocks x (up, down), logits; each
    # 2*B*members*out*in FLOPs with B=64 policy rows, 2 members, hidden 64, input 101+29,
    # 21 atoms (SMALL).
    b, n, h, d, atoms = 64, 2, 64, 101 + 29, 21
    expected = 2 * b * n * (h * d + 2 * (4 * h * h + h * 4 * h) + atoms * h)
    assert full_gemms - frozen_gemms == 6
    assert full_flops - frozen_flops == pytest.approx(expected, rel=0.01)


@pytest.mark.parametrize("contiguous_weight_grads", [False, True], ids=["einsum", "member_linear"])
def test_learner_actor_step_has_no_critic_weight_gradient_gemms(contiguous_weight_grads):
    """The learner's own compiled actor step (fused: torch.func gradient w.r.t. the actor
    only) runs exactly the GEMM FLOPs of the frozen objective, and the critic dW FLOPs fewer
    than an objective that lets autograd reach the critic weights; with the critic's GEMMs
    through member_linear as well."""
    learner = make("compile", dims=G1, batch_size=64, actor_hidden_dim=32, critic_hidden_dim=64, compile_backend="aot_eager",
                   contiguous_weight_grads=contiguous_weight_grads)
    b = {k: v[:64] for k, v in batches(learner, 1)[0].items()}
    learner.step_actor(b)  # compile outside the profile
    assert learner.fused_update
    with profile(activities=[ProfilerActivity.CPU], with_flops=True) as prof:
        learner.step_actor(b)
    gemms = [e for e in prof.key_averages() if e.key in ("aten::bmm", "aten::mm", "aten::addmm")]
    learner_flops = sum(e.flops for e in gemms)
    frozen_flops, _ = _compiled_actor_step_profile(freeze_critic=True)
    full_flops, _ = _compiled_actor_step_profile(freeze_critic=False)
    assert learner_flops == frozen_flops
    assert full_flops > learner_flops


@pytest.mark.parametrize("network", ["actor", "critic"])
def test_gemm_weights_cast_once_under_autocast_same_values_fewer_casts(network):
    """Under bf16 autocast each network casts its GEMM weights in one op per call, not one per
    matmul; outputs and fp32 parameter gradients stay bit-identical."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from flashsac_opt.networks import FlashSACActor, FlashSACCritic

    class CountCasts(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.casts = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            if func in (torch.ops.aten._to_copy.default, torch.ops.prims.convert_element_type.default):
                self.casts += 1
            return func(*args, **kwargs)

    torch.manual_seed(0)
    net = FlashSACActor(98, 29) if network == "actor" else FlashSACCritic(101, 29)
    g = torch.Generator().manual_seed(1)
    inputs = (torch.randn(64, 98, generator=g), torch.randn(64, 29, generator=g)) if network == "actor" else (
        torch.randn(64, 101, generator=g), torch.tanh(torch.randn(64, 29, generator=g)))
    results = {}
    for once in (False, True):
        net.cast_gemm_weights_once = once
        flat = net.params.detach().clone().requires_grad_(True)
        with CountCasts() as counter, torch.autocast("cpu", dtype=torch.bfloat16):
            first, second, stats = net(*inputs, training=True, params=flat)
            (first.float().sum() + second.float().sum()).backward()
        results[once] = (counter.casts, first, second, stats, flat.grad)
    (casts_per_op, *per_op), (casts_once, *once) = results[False], results[True]
    for a, b in zip(per_op, once, strict=True):
        assert a.dtype == b.dtype and torch.equal(a, b)
    weights = len(net.gemm_layout.names())
    print(f"{network}: {casts_per_op} casts per matmul, {casts_once} with one cast per call")
    assert weights >= 6 and casts_once <= casts_per_op - (weights - 1), (casts_once, casts_per_op)


def test_chunked_batch_moments_equal_one_pass_and_fall_back_where_rows_do_not_split():
    from flashsac_opt.networks import batch_moments

    g = torch.Generator().manual_seed(3)
    x = (torch.randn(48, 13, generator=g, dtype=torch.float64) * 3 + 1).unsqueeze(0).expand(2, -1, -1)  # the input BN's shape
    one_mean, one_var = batch_moments(x)
    assert torch.equal(one_mean, x.mean(dim=1, keepdim=True)) and torch.equal(one_var, x.var(dim=1, correction=0, keepdim=True))
    for chunk in (4, 8, 16, 24):
        mean, var = batch_moments(x, chunk)
        assert mean.shape == var.shape == (2, 1, 13)
        torch.testing.assert_close(mean, one_mean, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(var, one_var, rtol=1e-12, atol=1e-12)
        assert not torch.equal(var, one_var) or chunk == 24  # a different summation order, not the same code
    for chunk in (5, 48, 96):  # 48 rows: not divisible, one chunk, fewer rows than a chunk
        mean, var = batch_moments(x, chunk)
        assert torch.equal(mean, one_mean) and torch.equal(var, one_var)
    low = x.to(torch.bfloat16)  # bf16 autocast: the result keeps x's dtype, one rounding from the float64 truth
    mean, var = batch_moments(low, 8)
    assert mean.dtype == var.dtype == torch.bfloat16
    torch.testing.assert_close(mean.double(), one_mean, rtol=2 ** -8, atol=2 ** -8)
    torch.testing.assert_close(var.double(), one_var, rtol=2 ** -7, atol=0)


def test_chunked_input_bn_statistics_keep_the_critic_update_within_rounding_of_one_pass():
    """input_bn_chunk_rows changes the summation order of the critics' input BN statistics,
    nothing else: those agree with one pass to fp32 rounding, every other BN layer's statistics
    (computed from them) as well, the first critic loss too, and the actor's BN is untouched."""
    one, chunked = make("eager"), make("eager", input_bn_chunk_rows=8)  # 2 x 16 rows per critic forward: 4 chunks
    assert chunked.critic.input_bn_chunk_rows == chunked.target_critic.input_bn_chunk_rows == 8
    assert not hasattr(chunked.actor, "input_bn_chunk_rows")
    data = batches(one, 1)
    l1, l2 = train(one, data), train(chunked, data)
    assert abs(float(l1[0, 0] - l2[0, 0])) <= 1e-5 * abs(float(l1[0, 0]))
    layout = one.critic.stats_layout
    chunked_input = torch.cat([layout.view(chunked.critic.bn_stats, f"in_bn.{k}").reshape(-1) for k in ("mean", "var")])
    one_input = torch.cat([layout.view(one.critic.bn_stats, f"in_bn.{k}").reshape(-1) for k in ("mean", "var")])
    assert rel(chunked_input, one_input) < 1e-6 and not torch.equal(chunked_input, one_input)  # the chunked path ran
    assert rel(chunked.critic.bn_stats, one.critic.bn_stats) < 1e-5
    assert rel(chunked.critic.params, one.critic.params) < 1e-2  # Adam: rounding in near-zero gradients becomes +-lr
    with pytest.raises(ValueError, match="input_bn_chunk_rows"):
        make("eager", input_bn_chunk_rows=-1)


def test_member_linear_gives_einsums_values_with_the_weight_gradient_in_the_weights_layout():
    """contiguous_weight_grads: einsum's weight gradient comes out transposed (the flat gradient's
    assembly then gathers it with strided reads); member_linear's has the weight's own strides,
    the same values up to the order the GEMM sums in, and the same dtypes under bf16 autocast."""
    from flashsac_opt.networks import member_linear

    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 16, 12, generator=g, requires_grad=True)
    w = torch.randn(2, 8, 12, generator=g, requires_grad=True)
    up = torch.randn(2, 16, 8, generator=g)
    for amp in (False, True):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=amp):
            ref, y = torch.einsum("nbi,noi->nbo", x, w), member_linear(x, w)
        assert y.dtype == ref.dtype == (torch.bfloat16 if amp else torch.float32) and torch.equal(y, ref)
        (ref_gx, ref_gw), (gx, gw) = (torch.autograd.grad(out, (x, w), up.to(out.dtype)) for out in (ref, y))
        assert not ref_gw.is_contiguous() and gw.is_contiguous() and gw.dtype == ref_gw.dtype == torch.float32
        torch.testing.assert_close(gx, ref_gx)
        torch.testing.assert_close(gw, ref_gw)
    # a frozen weight (the critic in the actor step) gets no weight-gradient GEMM
    frozen = w.detach()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        torch.autograd.grad(member_linear(x, frozen), x, up)
    assert sum(e.count for e in prof.key_averages() if e.key == "aten::bmm") == 2  # forward + grad_x


def test_contiguous_weight_grads_keep_the_update_within_rounding_and_compile_op_for_op():
    """The option changes only the order the critic's weight-gradient GEMMs sum in: the first
    critic loss agrees, the parameters stay within Adam's rounding amplification; compile mode
    (aot_eager, op for op) matches eager with the option bit for bit, fused and split."""
    plain, option = make("eager"), make("eager", contiguous_weight_grads=True)
    assert option.critic.contiguous_weight_grads and option.target_critic.contiguous_weight_grads
    assert not plain.critic.contiguous_weight_grads
    data = batches(plain, 3)
    lp, lo = train(plain, data), train(option, data)
    assert float(lp[0, 0]) == float(lo[0, 0])
    assert rel(option.critic.params, plain.critic.params) < 1e-2
    # the option's path ran: the critic's autograd graph holds member_linear's backward, not einsum's bmm
    b = data[0]
    def backward_nodes(learner):
        _, log_probs, _ = learner.critic(b["critic"][:16], b["actions"][:16], training=True)
        seen, todo = {}, [log_probs.grad_fn]
        while todo:
            fn = todo.pop()
            if fn is not None and id(fn) not in seen:
                seen[id(fn)] = type(fn).__name__
                todo += [f for f, _ in fn.next_functions]
        return set(seen.values())
    assert "_MemberLinearBackward" in backward_nodes(option) and "BmmBackward0" not in backward_nodes(option)
    assert "_MemberLinearBackward" not in backward_nodes(plain) and "BmmBackward0" in backward_nodes(plain)
    for fused_update in (True, False):
        torch._dynamo.reset()
        compiled = make("compile", compile_backend="aot_eager", fused_update=fused_update, contiguous_weight_grads=True)
        assert torch.equal(train(compiled, data), lo)
        for name in ("actor", "critic", "target_critic"):
            assert torch.equal(getattr(compiled, name).params, getattr(option, name).params), (fused_update, name)


def test_activation_memory_budget_saves_fewer_bytes_for_the_same_update():
    """activation_memory_budget: the split form's losses keep less for their backward (the
    partitioner recomputes the BN/ReLU chain instead), the update is the same bit for bit, and
    the budget reaches the partitioner only through the learner's compiled calls."""
    data = batches(make("eager"), 2)
    runs = {}
    for budget in (None, 0.7):
        torch._dynamo.reset()
        learner = make("compile", fused_update=False, activation_memory_budget=budget)
        graphs: list[dict] = []
        learner.engine._backend = recording_backend(graphs)  # Inductor's partitioner, graphs run eagerly
        runs[budget] = (learner, train(learner, data), [saved_bytes(g) for g in graphs])
    (plain, lp, saved_plain), (budgeted, lb, saved_budget) = runs[None], runs[0.7]
    assert len(saved_plain) == len(saved_budget) == 2  # critic loss, actor loss
    # the critic's (these small widths: 252 against 360 kB, the parameters are most of it)
    assert saved_budget[0] < 0.8 * saved_plain[0], (saved_budget, saved_plain)
    assert torch._functorch.config.activation_memory_budget == 1.0  # not left set process-wide
    assert torch.equal(lp, lb)
    for name in ("actor", "critic", "target_critic"):
        assert torch.equal(getattr(plain, name).params, getattr(budgeted, name).params), name
    for bad in (0.0, 1.0, 1.5):
        with pytest.raises(ValueError, match="activation_memory_budget"):
            make("compile", activation_memory_budget=bad)


def test_aot_autograds_cache_keeps_a_graph_with_the_weight_grad_function_only_when_allowed(tmp_path, monkeypatch):
    """member_linear (contiguous_weight_grads) is a custom autograd.Function: AOTAutograd bypasses
    its cache for a graph holding one (re-traced and re-partitioned at every launch: the options'
    warm start doubled on the H200) unless autograd_cache_allow_custom_autograd_functions is set,
    which compile_objective sets around its calls only."""
    from torch._dynamo.utils import counters

    from flashsac_opt.engine import compile_objective
    from flashsac_opt.networks import member_linear

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    x, w = torch.randn(2, 8, 4, requires_grad=True), torch.randn(2, 3, 4, requires_grad=True)
    expected = torch.autograd.grad(torch.einsum("nbi,noi->nbo", x, w).square().sum(), (x, w))

    def loss(x, w):
        return member_linear(x, w).square().sum()

    seen = {}
    for run, allow in (("bypassed", False), ("cold", True), ("warm", True)):
        torch._dynamo.reset()
        before = dict(counters["aot_autograd"])
        fn = compile_objective(loss, "inductor", None, {"autograd_cache_allow_custom_autograd_functions": True} if allow else {})
        grads = torch.autograd.grad(fn(x, w), (x, w))
        assert all(torch.allclose(g, e, rtol=1e-5, atol=1e-6) for g, e in zip(grads, expected)), run
        seen[run] = {k: counters["aot_autograd"][k] - before.get(k, 0) for k in ("autograd_cache_bypass", "autograd_cache_miss", "autograd_cache_hit")}
    assert seen["bypassed"]["autograd_cache_bypass"] == 1 and seen["cold"]["autograd_cache_bypass"] == 0, seen
    assert seen["cold"]["autograd_cache_miss"] == 1 and seen["warm"]["autograd_cache_hit"] == 1, seen  # the warm start loads it
    assert not torch._functorch.config.autograd_cache_allow_custom_autograd_functions  # not left set process-wide


@pytest.mark.parametrize("contiguous", [False, True])
def test_the_learner_allows_the_cache_for_custom_functions_exactly_with_contiguous_weight_grads(contiguous, monkeypatch):
    """The learner hands the setting to every compiled objective when (and only when) its
    networks call member_linear; other settings (the activation budget) travel with it."""
    import flashsac_opt.engine as engine

    given = []
    monkeypatch.setattr(engine, "compile_objective", lambda fn, backend, options, functorch_config=None: given.append(functorch_config) or fn)
    learner = make("compile", contiguous_weight_grads=contiguous, fused_update=False, activation_memory_budget=0.7)
    train(learner, batches(learner, 1))
    assert given and all(c == {"activation_memory_budget": 0.7, **({"autograd_cache_allow_custom_autograd_functions": True} if contiguous else {})}
                         for c in given), given


@pytest.mark.parametrize("mode", ["eager", "compile", "graph"])
def test_the_critic_options_default_to_on_in_the_compiled_modes_and_off_in_eager(mode):
    """None (the default) resolves by mode: eager keeps UniLab's einsum and per-member BN order
    (the oracle stays bit-identical), the compiled modes take the measured-faster options; an
    explicit value wins in every mode. Resolved on the config: graph mode's learner needs CUDA."""
    from flashsac_opt.config import COMPILED_MODE_NETWORK_OPTIONS

    resolved = FlashSACConfig(**{**SMALL, "learner_mode": mode}).critic_network_options()
    assert resolved == {name: mode != "eager" for name in COMPILED_MODE_NETWORK_OPTIONS}
    for value in (False, True):
        explicit = FlashSACConfig(**{**SMALL, "learner_mode": mode, **{n: value for n in COMPILED_MODE_NETWORK_OPTIONS}})
        assert explicit.critic_network_options() == {name: value for name in COMPILED_MODE_NETWORK_OPTIONS}
    with pytest.raises(ValueError, match="contiguous_weight_grads must be true, false or null"):
        FlashSACConfig(**{**SMALL, "learner_mode": mode, "contiguous_weight_grads": "false"})
    if mode != "graph":  # and the learner's critics (online and target) carry the resolved values
        learner = make(mode)
        for net in (learner.critic, learner.target_critic):
            assert {name: getattr(net, name) for name in COMPILED_MODE_NETWORK_OPTIONS} == resolved


def test_relu_in_autocast_dtype_gives_the_same_update_and_keeps_less_for_the_backward():
    """relu_in_autocast_dtype: under bf16 autocast (CPU's here, as the CUDA learner runs it) the
    update is the default's bit for bit (rounding commutes with ReLU, and the down GEMM got the
    rounded value anyway); the split form's critic backward keeps fewer bytes (a bf16 ReLU output
    instead of an fp32 one); without autocast the option does nothing."""
    data = batches(make("eager"), 3)
    runs = {}
    for option in (False, True):
        learner = make("eager", relu_in_autocast_dtype=option)
        learner.amp_dtype = torch.bfloat16  # the CUDA learner's autocast, on CPU
        runs[option] = (learner, train(learner, data))
    (plain, lp), (rounded, lr) = runs[False], runs[True]
    assert rounded.critic.relu_in_autocast_dtype and rounded.target_critic.relu_in_autocast_dtype
    assert torch.equal(lp, lr)
    for name in ("actor", "critic", "target_critic"):
        assert torch.equal(getattr(plain, name).params, getattr(rounded, name).params), name
    fp32_plain, fp32_option = make("eager"), make("eager", relu_in_autocast_dtype=True)
    assert torch.equal(train(fp32_plain, data[:1]), train(fp32_option, data[:1]))
    saved = {}
    for option in (False, True):
        torch._dynamo.reset()
        learner = make("compile", fused_update=False, relu_in_autocast_dtype=option)
        learner.amp_dtype = torch.bfloat16
        graphs = []
        learner.engine._backend = recording_backend(graphs)  # Inductor's partitioner, graphs run eagerly
        runs[option] = train(learner, data[:1])
        saved[option] = [saved_bytes(g) for g in graphs]
    assert torch.equal(runs[False], runs[True])
    assert saved[True][0] < saved[False][0], saved  # the critic loss's backward
    fused = {}
    for option in (False, True):  # the fused form: torch.func's gradient inside one fullgraph compile
        torch._dynamo.reset()
        learner = make("compile", compile_backend="aot_eager", fused_update=True, relu_in_autocast_dtype=option)
        learner.amp_dtype = torch.bfloat16
        fused[option] = train(learner, data[:1])
    assert torch.equal(fused[False], fused[True])


def test_shared_input_bn_statistics_reduce_once_and_keep_the_update_bit_identical(monkeypatch):
    """Every critic member normalizes the same input rows (expanded over the members): reduced
    once, the statistics are each member's own, bit for bit (CPU), so the whole update is; the
    input BN's reduction sees one member instead of n; compile (aot_eager) agrees op for op."""
    import flashsac_opt.networks as networks

    seen = []
    moments = networks.batch_moments
    monkeypatch.setattr(networks, "batch_moments", lambda x, chunk_rows=0: (seen.append(x.shape[0]), moments(x, chunk_rows))[1])
    plain, shared = make("eager"), make("eager", shared_input_bn_statistics=True)
    assert shared.critic.shared_input_bn_statistics and shared.target_critic.shared_input_bn_statistics
    data = batches(plain, 3)
    lp = train(plain, data)
    plain_members, seen[:] = sorted(set(seen)), []
    ls = train(shared, data)
    assert plain_members == [2] and sorted(set(seen)) == [1, 2]  # the input BN's reduction: one member
    assert torch.equal(lp, ls)
    for name in ("actor", "critic", "target_critic"):
        assert torch.equal(getattr(plain, name).params, getattr(shared, name).params), name
        assert torch.equal(getattr(plain, name).bn_stats, getattr(shared, name).bn_stats), name
    monkeypatch.undo()  # the recording stand-in is not for Dynamo
    torch._dynamo.reset()
    compiled = make("compile", compile_backend="aot_eager", shared_input_bn_statistics=True)
    assert torch.equal(train(compiled, data), ls)
    with pytest.raises(ValueError, match="expanded over the members"):  # rows that differ per member
        shared.critic._bn(torch.randn(2, 8, 19), *(shared.critic.layout.views(shared.critic.params),
                          shared.critic.stats_layout.views(shared.critic.bn_stats)), "in_bn", True, [])


def test_stacked_critic_forward_gives_each_critic_its_own_forward():
    """forward_stacked on (online, target) = each critic's own training-mode forward (the
    members are independent), the new statistics split back per critic, and a detached
    target half gets no gradient while the online half's equals the plain forward's."""
    learner = make("eager")
    critic, target = learner.critic, learner.target_critic
    with torch.no_grad():  # make the two critics differ
        target.params.mul_(1.01)
        target.bn_stats.add_(0.1)
    g = torch.Generator().manual_seed(5)
    obs = torch.randn(24, learner.critic_obs_dim, generator=g)
    act = torch.randn(24, learner.action_dim, generator=g).tanh()
    online = critic.params.detach().clone().requires_grad_(True)
    q2, lp2, (s_online, s_target) = critic.forward_stacked(obs, act, (online, target.params.detach()), (critic.bn_stats, target.bn_stats))
    (lp2[:2].sum() + 0.5 * lp2[2:].sum()).backward()
    grad_stacked = online.grad.clone()
    online.grad = None
    q_a, lp_a, stats_a = critic(obs, act, training=True, params=online)
    lp_a.sum().backward()
    q_b, lp_b, stats_b = target(obs, act, training=True)
    n = critic.num_members
    assert q2.shape == (2 * n, 24) and lp2.shape[0] == 2 * n
    for mine, ref in ((q2[:n], q_a), (q2[n:], q_b), (lp2[:n], lp_a), (lp2[n:], lp_b), (s_online, stats_a), (s_target, stats_b)):
        torch.testing.assert_close(mine, ref, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(grad_stacked, online.grad, rtol=1e-5, atol=1e-7)


def _eval_only(forward, *args, training, **kwargs):
    assert not training, "a critic ran its own training-mode forward: the stacked one did not replace it"
    return forward(*args, training=training, **kwargs)


def test_stacked_target_critic_keeps_the_update_within_rounding_of_two_forwards():
    """stack_target_critic changes how the two critics' forwards are batched, not the
    mathematics: eager and compiled (aot_eager, the traced graphs op for op) updates track the
    plain learner to fp32 rounding over a few iterations, both update forms."""
    plain = make("eager")
    data = batches(plain, 3)
    reference = train(plain, data)
    for mode, extra in (("eager", {}), ("compile", {"compile_backend": "aot_eager", "fused_update": True}),
                        ("compile", {"compile_backend": "aot_eager", "fused_update": False})):
        torch._dynamo.reset()  # each learner compiles its own functions: no recompile limit across them
        stacked = make(mode, stack_target_critic=True, **extra)
        for net in (stacked.critic, stacked.target_critic):  # the stacked forward is the only training-mode one
            net.forward = functools.partial(_eval_only, net.forward)
        losses = train(stacked, data)
        assert rel(losses, reference) < 1e-5, (mode, extra)
        for name in ("critic", "target_critic", "actor"):
            assert rel(getattr(stacked, name).params, getattr(plain, name).params) < 1e-3, (mode, extra, name)
        assert rel(stacked.target_critic.bn_stats, plain.target_critic.bn_stats) < 1e-5
        assert rel(stacked.critic.bn_stats, plain.critic.bn_stats) < 1e-5


def test_critic_target_stream_runs_the_same_mathematics_as_one_critic_loss():
    """critic_target_stream splits the critic loss into four functions (bootstrap inputs, target
    branch, online branch, cross-entropy) for a second stream in graph mode; nothing else changes:
    eager and aot_eager (the traced graphs op for op; both update forms, as in the test above) are
    bit-identical to the plain eager learner, and the critic really ran the composed loss."""
    reference = make("eager")
    data = batches(reference, 3)
    ref_losses = train(reference, data)
    for mode, extra in (("eager", {}), ("compile", {"compile_backend": "aot_eager", "fused_update": False}),
                        ("compile", {"compile_backend": "aot_eager", "fused_update": True})):
        torch._dynamo.reset()
        branched = make(mode, critic_target_stream=True, **extra)
        calls = []
        original = branched.update_functions._critic_branched_loss
        critic_update = branched.engine._networks["critic"]
        branched.engine._networks["critic"] = dataclasses.replace(critic_update, compose_loss=lambda c, s: calls.append(s) or original(c, s))
        assert torch.equal(train(branched, data), ref_losses), (mode, extra)
        assert calls == [None], (mode, extra)  # built once, at the first batch; no second stream off the GPU
        for name in ("actor", "critic", "target_critic"):
            for attr in ("params", "bn_stats"):
                assert torch.equal(getattr(getattr(branched, name), attr), getattr(getattr(reference, name), attr)), (mode, extra, name, attr)
        names = branched.engine.compiled_names()
        if mode == "compile":  # the critic runs the split form even where the actor is fused
            assert "critic_loss" in names and "critic_apply" in names and "critic_step" not in names
            assert ("actor_step" in names) == bool(extra["fused_update"])
    with pytest.raises(ValueError, match="exclude each other"):
        make("eager", critic_target_stream=True, stack_target_critic=True)


def test_graph_mode_needs_cuda():
    if torch.cuda.is_available():
        pytest.skip("CUDA present")
    with pytest.raises(ValueError, match="needs a CUDA device"):
        make("graph")


def test_inductor_options_turn_horizontal_fusion_on_for_graph_mode_on_cuda_only(monkeypatch):
    from flashsac_opt import pdl
    from flashsac_opt.engine import inductor_options

    monkeypatch.setattr(pdl, "supported", lambda device: device.type == "cuda")  # a Hopper GPU
    cuda, cpu = torch.device("cuda", 0), torch.device("cpu")
    assert inductor_options("graph", cuda)["combo_kernels"] is True
    assert inductor_options("graph", cuda)["triton.cudagraphs"] is False  # no capture inside the capture
    assert inductor_options("compile", cuda, rows=256) == {"triton.cudagraphs": True, "force_shape_pad": True, "combo_kernels": False,
                                                           "triton.enable_pdl": False}
    assert not any(inductor_options("compile", cpu, rows=256).values())
    # the user's options win over the defaults, and add to them
    mine = {"combo_kernels": False, "aggressive_fusion": True}
    assert inductor_options("graph", cuda, mine, rows=256) == {"triton.cudagraphs": False, "force_shape_pad": True, "combo_kernels": False,
                                                               "triton.enable_pdl": True, "aggressive_fusion": True,
                                                               "post_grad_custom_pre_pass": pdl.cache_key()}


def test_graph_mode_launches_programmatically_at_small_batches_on_hopper_and_always_waiting_first(monkeypatch):
    from flashsac_opt import pdl
    from flashsac_opt.engine import PDL_MAX_BATCH, inductor_options

    cuda = torch.device("cuda", 0)
    monkeypatch.setattr(pdl, "supported", lambda device: device.type == "cuda")
    graph = inductor_options("graph", cuda, rows=256)
    # PDL comes only with the pass that keys (and turns on) the wait-first codegen
    assert graph["triton.enable_pdl"] is True and graph["post_grad_custom_pre_pass"] is pdl.cache_key()
    # by the per-update batch: on up to PDL_MAX_BATCH rows, off above and while the rows are unknown
    assert inductor_options("graph", cuda, rows=PDL_MAX_BATCH)["triton.enable_pdl"] is True
    for rows in (PDL_MAX_BATCH + 1, 8192, None):
        options = inductor_options("graph", cuda, rows=rows)
        assert options["triton.enable_pdl"] is False and "post_grad_custom_pre_pass" not in options, rows
    opted_out = inductor_options("graph", cuda, {"triton.enable_pdl": False}, rows=256)
    assert opted_out["triton.enable_pdl"] is False and "post_grad_custom_pre_pass" not in opted_out
    # PDL asked for (compile mode, a large batch) gets the wait-first key too: never Inductor's own placement
    assert inductor_options("compile", cuda, {"triton.enable_pdl": True}, rows=256)["post_grad_custom_pre_pass"] is pdl.cache_key()
    assert inductor_options("graph", cuda, {"triton.enable_pdl": True}, rows=8192)["post_grad_custom_pre_pass"] is pdl.cache_key()
    with pytest.raises(ValueError, match="post_grad_custom_pre_pass"):
        inductor_options("graph", cuda, {"post_grad_custom_pre_pass": lambda graph: None}, rows=256)
    # pdl's own keys pick the placement: the wait-only study's, or the default (trigger-first) said explicitly
    assert pdl.cache_key(trigger_first=False) is not pdl.cache_key()
    for key in (pdl.cache_key(trigger_first=False), pdl.cache_key()):
        assert inductor_options("graph", cuda, {"post_grad_custom_pre_pass": key}, rows=256)["post_grad_custom_pre_pass"] is key
    # the user's own pass is fine once PDL is off
    mine = lambda graph: None  # noqa: E731
    assert inductor_options("graph", cuda, {"triton.enable_pdl": False, "post_grad_custom_pre_pass": mine}, rows=256)["post_grad_custom_pre_pass"] is mine
    monkeypatch.setattr(pdl, "supported", lambda device: False)  # a GPU older than Hopper
    assert inductor_options("graph", cuda, rows=256)["triton.enable_pdl"] is False


def test_the_engine_asks_for_its_options_with_the_first_batchs_rows(monkeypatch):
    """PDL is decided by the rows per update: the engine must pass them both to the compile and to
    the compile-cache key (the same options in both, or a cache file would hold other kernels)."""
    from flashsac_opt import engine as engine_module

    asked = []
    real = engine_module.inductor_options

    def recording(mode, device, extra=None, rows=None, triton_gemm_table=False):
        asked.append(rows)
        return real(mode, device, extra, rows, triton_gemm_table)

    monkeypatch.setattr(engine_module, "inductor_options", recording)
    learner = make("compile")
    rows = learner.cfg.batch_size
    learner.engine.compile_cache_key(rows)
    learner.engine.update_functions(rows)  # builds the compiled callables (torch.compile compiles at the first call)
    assert asked and set(asked) == {rows}


# ------------------------------------------------------------------ GPU
def _drift_against_eager(mode: str, amp: bool, updates_per_step: int, iterations: int = 50, **mode_overrides):
    """Relative drift of `mode` from eager, next to the drift of eager from itself.

    The reference drift ("floor") comes from an eager run whose critic weights were
    perturbed by 1e-7 relative once, at the start: rounding-sized. Adam turns rounding
    differences in near-zero gradients into +-lr steps, so two correct implementations that
    round differently drift apart by about this floor; a semantic error (wrong LR, wrong
    target, a skipped update) drifts by orders of magnitude more.
    """
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    kw = dict(batch_size=256, updates_per_step=updates_per_step, use_amp=amp, actor_hidden_dim=128, critic_hidden_dim=256, num_atoms=101)
    eager, other, floor = make("eager", "cuda", G1, **kw), make(mode, "cuda", G1, **kw, **mode_overrides), make("eager", "cuda", G1, **kw)
    with torch.no_grad():
        g = torch.Generator(device="cuda").manual_seed(123)
        floor.critic.params.mul_(1 + 1e-7 * torch.randn(floor.critic.params.shape, device="cuda", generator=g))
    data = batches(eager, iterations, device="cuda")
    le, lo, lf = train(eager, data), train(other, data), train(floor, data)
    out = {"losses": (rel(lo, le), rel(lf, le))}
    for name in ("actor", "critic", "target_critic"):
        a, b, c = (getattr(x, name).params.detach() for x in (other, eager, floor))
        out[name] = (rel(a, b), rel(c, b))
    print(f"drift {mode} amp={amp}: " + ", ".join(f"{k} {v[0]:.2e} (floor {v[1]:.2e})" for k, v in out.items()))
    return out


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["compile", "graph"])
@pytest.mark.parametrize("amp", [False, True], ids=["fp32", "bf16"])
def test_gpu_mode_tracks_eager_within_rounding_drift(mode, amp):
    _assert_tracks_eager(_drift_against_eager(mode, amp, updates_per_step=2 if not amp else 8), amp)


@pytest.mark.gpu
def test_gpu_graph_mode_without_combo_kernels_tracks_eager():
    """graph mode's default on CUDA has Inductor's horizontal fusion (combo_kernels); the
    mode-vs-eager test above covers it. The opt-out must not change the maths either."""
    _assert_tracks_eager(_drift_against_eager("graph", True, updates_per_step=8, inductor_options={"combo_kernels": False}), True)


def _assert_tracks_eager(drift: dict, amp: bool) -> None:
    for name, (mode_drift, floor) in drift.items():
        bound = 10 * floor + 1e-6
        if amp and name == "losses":
            # Under bf16 autocast eager rounds every op's output to bf16 while Inductor keeps
            # fused intermediates in fp32: every loss differs by ~bf16 epsilon (2^-8 = 3.9e-3)
            # from the first update on, independent of drift (seen: 7.6e-3 vs floor 5.2e-4).
            bound = max(bound, 2e-2)
        assert mode_drift <= bound, f"{name}: {mode_drift:.3e} vs rounding floor {floor:.3e}"
        assert mode_drift < (1e-2 if not amp else 1e-1), name


@pytest.mark.gpu
def test_gpu_graph_mode_with_contiguous_weight_grads_tracks_eager():
    """contiguous_weight_grads: the critic's weight gradients from member_linear's backward, in the
    captured iteration with bf16 autocast; the same mathematics as einsum's."""
    _assert_tracks_eager(_drift_against_eager("graph", True, updates_per_step=8, contiguous_weight_grads=True), True)


@pytest.mark.gpu
def test_gpu_graph_mode_with_shared_input_bn_statistics_tracks_eager():
    """shared_input_bn_statistics: the input BN's statistics from one member's reduction, in the
    captured iteration with bf16 autocast."""
    _assert_tracks_eager(_drift_against_eager("graph", True, updates_per_step=8, shared_input_bn_statistics=True), True)


@pytest.mark.gpu
def test_gpu_graph_mode_with_an_activation_memory_budget_tracks_eager():
    """activation_memory_budget: the split form's backward recomputes the BN/ReLU chain from the
    bf16 GEMM outputs instead of reading the forward's fp32 copies, in the captured iteration."""
    _assert_tracks_eager(_drift_against_eager("graph", True, updates_per_step=8, fused_update=False, activation_memory_budget=0.7), True)


@pytest.mark.gpu
def test_gpu_graph_mode_with_relu_in_autocast_dtype_tracks_eager():
    """relu_in_autocast_dtype: the up projections' ReLU on the rounded BN output, in the captured
    iteration with bf16 autocast (fused form at this batch), against plain eager."""
    _assert_tracks_eager(_drift_against_eager("graph", True, updates_per_step=8, relu_in_autocast_dtype=True), True)


@pytest.mark.gpu
@pytest.mark.parametrize("fused_update", [True, False], ids=["fused", "split"])
def test_gpu_graph_mode_with_the_candidate_options_together_tracks_eager(fused_update):
    """The three options measured together beside UniLab (`ours_graph_options`): weight gradients
    in the weights' layout, the input BN's statistics once for both members and the bf16 ReLU, in
    both update forms (W1/W2 run fused, W3/W4 split), against plain eager."""
    _assert_tracks_eager(_drift_against_eager("graph", True, updates_per_step=8, fused_update=fused_update, contiguous_weight_grads=True,
                                              shared_input_bn_statistics=True, relu_in_autocast_dtype=True), True)


@pytest.mark.gpu
def test_gpu_graph_mode_with_the_target_branch_on_a_second_stream_tracks_eager():
    """critic_target_stream: the captured iteration forks the target branch onto a second stream
    and joins it before the loss; a missing join would read half-written target distributions."""
    _assert_tracks_eager(_drift_against_eager("graph", True, updates_per_step=8, critic_target_stream=True), True)


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["compile", "graph"])
def test_gpu_iteration_has_no_host_sync(mode):
    learner = make(mode, "cuda", G1, batch_size=256, updates_per_step=8, actor_hidden_dim=128, critic_hidden_dim=256, num_atoms=101)
    data = batches(learner, 5, device="cuda")
    for b in data[:3]:
        learner.update(b)  # warm-up: compile, cudagraph recording / capture
        learner.read_metrics()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        with torch._dynamo.config.patch(error_on_recompile=True):  # and no recompiles either
            learner.update(data[3])
            learner.update(data[4])
    finally:
        torch.cuda.set_sync_debug_mode(0)
    metrics = learner.read_metrics()  # the one D2H copy of the iteration
    assert metrics["Learner/critic_updates_skipped"] == 0.0


@pytest.mark.gpu
def test_gpu_graph_mode_captures_the_uncompiled_iteration_until_the_compile_is_wanted():
    """defer_compile() in graph mode (compile ahead in the background): the first iteration runs
    uncaptured (the child is often done by the next), the later ones capture the uncompiled
    iteration and replay it (it tracks eager: the same kernels, C51's atomic adds aside), then
    compile_now() compiles and captures anew, and the training goes on."""
    from flashsac_opt.engine import DEFERRED_ITERATIONS_UNCAPTURED

    dims = dict(batch_size=128, updates_per_step=4, actor_hidden_dim=64, critic_hidden_dim=128, num_atoms=51)
    eager, learner = make("eager", "cuda", G1, **dims), make("graph", "cuda", G1, **dims)
    learner.engine.defer_compile()
    data = batches(learner, 6, device="cuda")
    train(eager, data[:3])
    train(learner, data[:DEFERRED_ITERATIONS_UNCAPTURED])
    assert learner.engine.graph.captures == 0 and learner.iterations == DEFERRED_ITERATIONS_UNCAPTURED
    train(learner, data[DEFERRED_ITERATIONS_UNCAPTURED:3], seed=DEFERRED_ITERATIONS_UNCAPTURED)
    assert learner.engine.graph.captures == 1 and learner.engine.compiled_names() == []
    for name in ("actor", "critic"):
        assert rel(getattr(learner, name).params, getattr(eager, name).params) < 1e-5, name
    learner.engine.compile_now()
    train(learner, data[3:], seed=3)
    assert learner.engine.graph.captures == 2 and learner.engine.compiled_names() != []
    assert learner.iterations == 6 and torch.isfinite(learner.critic.params).all()
    assert learner.read_metrics()["Learner/critic_updates_skipped"] == 0.0


@pytest.mark.gpu
def test_gpu_graph_mode_finite_guard_and_recapture():
    learner = make("graph", "cuda", G1, batch_size=128, updates_per_step=2, policy_frequency=1, actor_hidden_dim=64, critic_hidden_dim=128, num_atoms=51)
    data = batches(learner, 3, device="cuda")
    learner.update(data[0])
    before = learner.critic.params.detach().clone(), learner.actor.params.detach().clone()
    bad = {k: v.clone() for k, v in data[1].items()}
    bad["next_obs"][:, 0] = float("nan")
    learner.update(bad)
    m = learner.read_metrics()
    assert m["Learner/critic_updates_skipped"] == 2.0 and m["Learner/actor_updates_skipped"] == 2.0
    assert torch.equal(learner.critic.params, before[0]) and torch.equal(learner.actor.params, before[1])
    learner.update(data[2])
    assert learner.read_metrics()["Learner/critic_updates_skipped"] == 0.0
    assert not torch.equal(learner.critic.params, before[0])
    assert learner.engine.graph.captures == 1
    learner.update({k: v[:128] for k, v in data[2].items()}, updates_per_step=1, policy_frequency=1)
    assert learner.engine.graph.captures == 2  # a new shape is a new capture
    learner.release_graphs()  # (before destroy_process_group in data-parallel runs)
    assert learner.engine.graph.graph is None
    learner.update(data[0])
    assert learner.engine.graph.captures == 3 and torch.isfinite(learner.critic.params).all()


def test_compile_cache_file_is_skipped_without_artifacts_and_survives_a_corrupt_file(tmp_path):
    # The artifacts of earlier Inductor compilations in this process would be saved too.
    torch.compiler._cache.CacheArtifactManager.clear()
    cache = tmp_path / "compile_cache.bin"
    learner = make("compile", compile_backend="aot_eager", compile_cache_file=str(cache))
    learner.update(batches(learner, 1)[0])
    assert not learner.compile_cache_loaded and not cache.exists()  # aot_eager leaves nothing to cache
    cache.write_bytes(b"not an artifact file")
    with pytest.warns(UserWarning, match="could not be loaded"):
        again = make("compile", compile_backend="aot_eager", compile_cache_file=str(cache))
    assert not again.compile_cache_loaded
    again.update(batches(again, 1)[0])
    assert torch.isfinite(again.critic.params).all()
    # Nothing to rewrite it with: the corrupt file stays (and warns again next time).
    assert cache.read_bytes() == b"not an artifact file" and not again.engine.compile_cache_saved


_CACHE_SCRIPT = """
import json, sys, time, torch
from flashsac_opt.config import FlashSACConfig
from flashsac_opt.learner import FlashSACLearner
from flashsac_opt.testing.oracle import synthetic_batch
from flashsac_opt.testing.saved_tensors import recording_backend, saved_bytes
cfg = FlashSACConfig(batch_size=256, updates_per_step=2, learner_mode="graph", compile_cache_file=sys.argv[1])
batch = synthetic_batch(512, obs_dim=98, critic_obs_dim=101, action_dim=29, generator=torch.Generator().manual_seed(0), device="cuda")
start = time.perf_counter()
learner = FlashSACLearner(cfg, obs_dim=98, critic_obs_dim=101, action_dim=29, device="cuda")
learner.update(batch)
torch.cuda.synchronize()
print(json.dumps({"seconds": time.perf_counter() - start, "loaded": learner.compile_cache_loaded}))
"""


@pytest.mark.gpu
def test_gpu_compile_cache_file_cuts_a_fresh_process_cold_start(tmp_path):
    """Process 1 (empty Inductor cache) writes the artifact file; process 2 (another empty
    Inductor cache) loads it and starts faster."""
    import json
    import os
    import subprocess
    import sys

    cache = tmp_path / "compile_cache.bin"
    runs = []
    for i in range(2):
        env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=str(tmp_path / f"inductor{i}"), TRITON_CACHE_DIR=str(tmp_path / f"triton{i}"))
        done = subprocess.run([sys.executable, "-c", _CACHE_SCRIPT, str(cache)], env=env, capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, done.stderr[-3000:]
        runs.append(json.loads(done.stdout.strip().splitlines()[-1]))
    print(f"cold start: {runs[0]['seconds']:.1f} s without the artifact file, {runs[1]['seconds']:.1f} s with it")
    assert cache.is_file() and not runs[0]["loaded"] and runs[1]["loaded"]
    assert runs[1]["seconds"] < 0.6 * runs[0]["seconds"], runs
