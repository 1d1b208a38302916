"""flashsac_opt/gemm_templates.py (issue 45, a study): every GEMM on Inductor's Triton template at one
fixed configuration, no autotuning. The rule, the choice it hands Inductor, the per-compile
installation of the choices class, and the switch's refusals run on the CPU; the GPU test trains
with it beside graph mode's default."""

import pickle
import types

import pytest
import torch
from torch._inductor.virtualized import V

from flashsac_opt import FlashSACConfig, FlashSACLearner, gemm_templates
from flashsac_opt.engine import compile_objective, inductor_options


@pytest.mark.parametrize("sizes,tile", [
    ((2, 512, 1024, 256), (64, 64, 64, 3)),  # W1's up projection: 256 tiles of 64 x 64
    ((2, 512, 256, 1024), (32, 64, 64, 3)),  # its down projection: 64 tiles of 64 x 64 would leave half the SMs idle
    ((2, 512, 101, 256), (32, 32, 64, 3)),  # the atoms' head: 64 tiles of 32 x 64, 128 of 32 x 32
    ((1, 256, 29, 128), (32, 32, 64, 2)),  # the actor's mean head: too small for half a wave at any tile
    ((1, 2048, 256, 130), (64, 64, 64, 3)),  # K = 130: three steps of 64, the last masked
    ((2, 512, 256, 16), (32, 64, 32, 2)),  # a short K: one step of 32
    ((1, 1, 1, 1), (32, 32, 32, 2)),
])
def test_the_rule_trades_tile_size_for_half_a_wave(sizes, tile):
    c = gemm_templates.gemm_config(*sizes)
    assert (c["BLOCK_M"], c["BLOCK_N"], c["BLOCK_K"], c["num_stages"]) == tile
    assert c["num_warps"] == 4 and c["GROUP_M"] == 8


def test_the_rule_refuses_empty_sizes():
    with pytest.raises(ValueError, match="sizes must be >= 1"):
        gemm_templates.gemm_config(2, 0, 64, 64)


class _Params:
    def __init__(self, kwargs):
        self.kwargs = kwargs

    def to_kwargs(self):
        return dict(self.kwargs)


def _inputs(device_type, m, n, k, batch):
    return types.SimpleNamespace(device_type=device_type, mnk_hinted=lambda: (m, n, k), batch_hinted=lambda: batch)


class _Choices(gemm_templates.choices_class()):
    """The heuristic's first configuration stubbed (Inductor's own needs CUDA inputs)."""

    def get_ktc(self, kernel_inputs, template, op_name, kwarg_overrides=None):
        params = _Params({"BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 32, "EVEN_K": True, "num_stages": 5, "num_warps": 8,
                          "GROUP_M": 8, "ACC_TYPE": "tl.float32", "ALLOW_TF32": False})
        yield types.SimpleNamespace(template=template, params=params, extra_kwargs={"epilogue_fn": "addmm"}, layout="L", inputs="I")


@pytest.mark.parametrize("op,uid,batch", [("bmm", "triton::bmm", 2), ("addmm", "triton::mm", 1)])
def test_a_cuda_gemm_gets_the_template_alone_at_the_rules_configuration(op, uid, batch):
    templates = [types.SimpleNamespace(uid=f"aten::{op}"), types.SimpleNamespace(uid=uid)]
    aten_only = {"aten": iter(["the aten choice"])}
    chosen = _Choices()._finalize_template_configs(aten_only, _inputs("cuda", 512, 256, 130, batch), templates, op)
    assert len(chosen) == 1 and chosen[0].template.uid == uid
    kwargs = chosen[0].params.to_kwargs()
    rule = gemm_templates.gemm_config(batch, 512, 256, 130)
    assert {key: kwargs[key] for key in rule} == rule
    assert kwargs["EVEN_K"] is False  # 130 is not a multiple of 64: the K loop must mask
    assert kwargs["ACC_TYPE"] == "tl.float32" and kwargs["ALLOW_TF32"] is False  # what the template derived, kept
    assert chosen[0].extra_kwargs == {"epilogue_fn": "addmm"}
    even = _Choices()._finalize_template_configs({}, _inputs("cuda", 512, 256, 128, batch), templates, op)
    assert even[0].params.to_kwargs()["EVEN_K"] is True


@pytest.mark.parametrize("device_type,op,uid", [("cpu", "bmm", "triton::bmm"), ("cuda", "bmm", "aten::bmm"), ("cuda", "convolution", "triton::mm")])
def test_anything_else_keeps_inductors_own_choices(device_type, op, uid):
    templates = [types.SimpleNamespace(uid=uid)]
    own = _Choices()._finalize_template_configs({"x": iter(["a", "b"])}, _inputs(device_type, 64, 64, 64, 1), templates, op)
    assert own == ["a", "b"]


def test_the_choices_class_is_this_threads_only_around_a_compile_with_the_option():
    """Inductor keeps a thread's first choices object: compile_objective installs the class around
    each call of a function compiled with it and restores the previous one after."""
    seen = []

    class Spy(gemm_templates.choices_class()):
        def _finalize_template_configs(self, template_choices, kernel_inputs, templates, op_name, kwarg_overrides=None):
            seen.append((op_name, [t.uid for t in templates]))
            return super()._finalize_template_configs(template_choices, kernel_inputs, templates, op_name, kwarg_overrides)

    def f(a, b):
        return torch.relu(torch.bmm(a, b)) * 2

    a, b = torch.randn(2, 16, 8), torch.randn(2, 8, 12)
    torch.compile(f, backend="inductor")(a, b)  # this thread's choices object now exists: Inductor's own
    before = V.choices
    # no FX graph cache: a second run of this test would load the graph without lowering it
    options = {**gemm_templates.inductor_options(), "inductor_choices_class": Spy, "fx_graph_cache": False}
    compiled = compile_objective(f, "inductor", options)
    torch.testing.assert_close(compiled(a, b), f(a, b))
    assert seen and seen[0][0] == "bmm"  # on the CPU the template list is ATen's alone: Inductor's own choice kept
    assert V.choices is before


def test_the_options_and_the_switch(monkeypatch):
    cuda = torch.device("cuda")
    on = inductor_options("graph", cuda, rows=256, triton_gemm_table=True)
    assert on["inductor_choices_class"] is gemm_templates.choices_class()
    assert on["max_autotune_gemm"] is True and on["force_shape_pad"] is False
    assert "inductor_choices_class" not in inductor_options("graph", cuda, rows=256)
    assert inductor_options("graph", cuda, {"force_shape_pad": True}, rows=256, triton_gemm_table=True)["force_shape_pad"] is True
    assert gemm_templates.choices_class()().uuid().endswith(f"/{gemm_templates.TABLE_VERSION}")
    assert pickle.loads(pickle.dumps(on["inductor_choices_class"])) is gemm_templates.FixedGemmChoices  # by reference
    with pytest.raises(ValueError, match="triton_gemm_table must be true or false"):
        FlashSACConfig(triton_gemm_table="false")
    dims = {"obs_dim": 12, "critic_obs_dim": 14, "action_dim": 4}
    small = {"batch_size": 32, "critic_hidden_dim": 16, "actor_hidden_dim": 16, "num_atoms": 11, "triton_gemm_table": True}
    with pytest.raises(ValueError, match="triton_gemm_table applies to CUDA learners"):
        FlashSACLearner(FlashSACConfig(learner_mode="compile", **small), **dims, device=torch.device("cpu"))
    FlashSACLearner(FlashSACConfig(learner_mode="eager", **small), **dims, device=torch.device("cpu"))  # eager compiles nothing
    monkeypatch.delattr(torch._inductor.choices.InductorChoices, "_finalize_template_configs")
    with pytest.raises(RuntimeError, match="lacks it"):
        gemm_templates.require(cuda)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_on_cuda_a_gemm_with_its_neighbours_is_one_template_kernel():
    """The bf16 GEMM with its ReLU and scale in the template's epilogue: no cuBLAS call, one Triton kernel."""
    from torch._inductor.utils import run_and_get_code

    def f(a, b):
        return torch.relu(torch.bmm(a, b)).float() * 2

    a = torch.randn(2, 512, 256, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(2, 256, 1024, device="cuda", dtype=torch.bfloat16)
    compiled = compile_objective(f, "inductor", gemm_templates.inductor_options())
    out, (code, *_) = run_and_get_code(compiled, a, b)
    torch.testing.assert_close(out, f(a, b), rtol=2e-2, atol=2e-2)
    assert "extern_kernels.bmm" not in code and code.count(".run(") == 1, code


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("mode", ["compile", "graph"])
def test_on_cuda_the_table_trains_as_graph_modes_gemms_under_bf16(mode):
    from switch_drift import assert_trains_as_the_composite_under_bf16

    assert_trains_as_the_composite_under_bf16("triton_gemm_table", mode)
