"""The roofline map's kernel classes and arithmetic (CPU)."""

import importlib.util
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def load_bench(name: str):
    """experiments/bench/<name>.py as a module; the caller keeps experiments/ on sys.path for as
    long as the module's functions run (they import common and report lazily)."""
    spec = importlib.util.spec_from_file_location(name, REPO / "experiments" / "bench" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def roofline():
    saved = list(sys.path)
    sys.path.insert(0, str(REPO / "experiments"))
    try:
        yield load_bench("roofline")
    finally:
        sys.path[:] = saved


@pytest.fixture
def gemm_ceiling(monkeypatch):
    """experiments/bench/gemm_ceiling.py (it records and replays torch GEMMs: skipped without torch)."""
    pytest.importorskip("torch")
    monkeypatch.syspath_prepend(str(REPO / "experiments"))
    return load_bench("gemm_ceiling")


# Kernel names as torch.profiler recorded them on the H200 (results/learner_benchmark/, W3)
@pytest.mark.parametrize("name, expected", [
    ("nvjet_sm90_tst_256x128_64x4_1x2_h_bz_coopA_TNT", "GEMM"),
    ("void cutlass::Kernel2<cutlass_80_tensorop_bf16_s16816gemm_relu_bf16_64x64_32x6_tn_align8>(", "GEMM"),
    ("triton_red_fused_mean_permute_var_view_23", "BN statistics"),
    ("triton_red_fused__to_copy_mul_neg_permute_rsqrt_slice_squeeze_sub_sum_threshold_backward_unsqueeze_view_19", "BN statistics"),
    # the input BN's statistics with their running-mean lerp (W4, 2026-12-02): not the optimizer
    ("triton_red_fused__to_copy_add_cat_expand_lerp_mean_mul_permute_rsqrt_split_with_sizes_squeeze_unsqueeze_var_view_9", "BN statistics"),
    ("triton_poi_fused__to_copy_add_mul_permute_relu_rsqrt_slice_squeeze_sub_threshold_backward_unsqueeze_view_11", "BN apply"),
    ("triton_poi_fused__to_copy_abs_add_addcmul_all_bitwise_and_clamp_copy__cos_div_eq_lerp_mul_ne_pow_rsub_sqrt_sub", "optimizer"),
    ("Optimizer.step#Adam.step", "optimizer"),
    ("gated_adam_kernel", "optimizer"),  # fused_step's Triton kernel, named by its function
    ("triton_poi_fused_clamp_min_div_expand_linalg_vector_norm_slice_view_5", "renormalization"),
    ("void at::native::reduce_kernel<128, 4, at::native::ReduceOp<c10::BFloat16, at::native::WelfordOps<c10::BFloat16, float", "BN statistics"),
    ("triton_poi_fused_relu_threshold_backward_3", "activations"),
    ("triton_per_fused__to_copy_div_mul_squeeze_sum_view_6", "other"),  # a loss sum, no normalization
    ("void at::native::elementwise_kernel<128, 2, at::native::gpu_kernel_impl_nocast<at::native::BinaryFunctor<float", "other"),
])
def test_kernels_fall_into_their_class(roofline, name, expected):
    assert roofline.classify(name) == expected


def test_the_table_adds_up_and_derives_the_gemm_rate_from_the_counted_flops(roofline):
    cell = {"variant": "ours_graph", "workload": "W3", "ms_median": 9.0, "kernel_us_per_iteration": 1000.0,
            "top_kernels": [{"name": "nvjet_sm90_x", "count_per_iteration": 4, "us_per_iteration": 500.0},
                            {"name": "triton_red_fused_mean_var_1", "count_per_iteration": 2, "us_per_iteration": 300.0}]}
    t = roofline.table(cell, {"gemm_flops": 2.0e11})
    rows = {r["class"]: r for r in t["rows"]}
    assert t["source"] == "top_kernels" and t["coverage"] == pytest.approx(0.8)  # 800 of 1000 us profiled by name
    assert t["outside_kernels_us"] == pytest.approx(8000.0)  # 9 ms of iteration, 1 ms of it in kernels
    assert rows["GEMM"]["tflops_achieved"] == pytest.approx(400.0)  # 2e11 FLOP in 500 us
    assert rows["GEMM"]["floor_us"] == pytest.approx(2.0e11 / 989e12 * 1e6)
    assert rows["BN statistics"]["share_of_kernel_time"] == pytest.approx(0.3) and rows["other"]["us"] == 0
    # a new benchmark JSON carries every kernel by class: the table takes those
    cell["kernel_classes"] = roofline.kernel_classes({"nvjet_a": (3, 900.0), "x": (3, 300.0)}, iterations=3)
    t = roofline.table(cell, {"gemm_flops": 2.0e11})
    assert t["source"] == "kernel_classes" and t["rows"][0]["us"] == 300.0 and t["rows"][0]["kernels"] == 1.0


def test_gemm_work_scales_with_rows_and_updates(roofline):
    small = dict(batch_size=16, updates_per_step=2, policy_frequency=2, obs_dim=6, critic_obs_dim=7, action_dim=3)
    base = roofline.work(small)["gemm_flops"]
    assert base > 0
    assert roofline.work({**small, "batch_size": 32})["gemm_flops"] == pytest.approx(2 * base)
    assert roofline.work({**small, "updates_per_step": 4})["gemm_flops"] == pytest.approx(2 * base)


def test_inductor_byte_counts_give_each_memory_class_its_rate_and_floor(roofline):
    by_name = {"nvjet_a": (6, 600.0), "triton_red_fused_mean_var_1": (6, 300.0),
               "triton_poi_fused_add_rsqrt_2": (3, 90.0), "triton_poi_fused_relu_3": (3, 30.0)}
    # GB per launch as Inductor counts them; the relu kernel has no count (e.g. an ambiguous name)
    gb = {"triton_red_fused_mean_var_1": 0.05, "triton_poi_fused_add_rsqrt_2": 0.1}
    classes = roofline.kernel_classes(by_name, iterations=3, gb_by_name=gb)
    assert classes["BN statistics"]["gb"] == pytest.approx(0.1) and classes["BN statistics"]["gb_us"] == 100.0
    assert "gb" not in classes["activations"] and "gb" not in classes["GEMM"]
    cell = {"variant": "ours_graph", "workload": "W3", "ms_median": 1.0, "kernel_us_per_iteration": 340.0, "kernel_classes": classes}
    peaks = {"bf16_dense_tflops": 500.0, "hbm_tb_per_s": 4.0}
    t = roofline.table(cell, {"gemm_flops": 1.0e11}, peaks)
    rows = {r["class"]: r for r in t["rows"]}
    assert rows["BN statistics"]["gb_per_s_achieved"] == pytest.approx(0.1 / 100e-6)  # 1000 GB/s
    assert rows["BN statistics"]["floor_us"] == pytest.approx(25.0)  # 0.1 GB at 4 TB/s
    assert rows["BN apply"]["floor_us"] == pytest.approx(0.1 / 4e3 * 1e6) and rows["BN apply"]["gb_covered_share"] == 1.0
    assert "floor_us" not in rows["activations"]
    assert rows["GEMM"]["floor_us"] == pytest.approx(200.0)  # 1e11 FLOP at 500 TFLOP/s
    assert t["floor_us"] == pytest.approx(200.0 + 25.0 + 25.0)
    # at the floors: GEMMs 200 -> 200 us, BN statistics 100 -> 25, BN apply 30 -> 25, the relu kernel (no count) as measured
    assert t["ms_at_class_floors"] == pytest.approx(1.0 - (75.0 + 5.0) / 1e3)
    # without byte counts there is no whole floor, only the GEMM's
    plain = roofline.table({**cell, "kernel_classes": roofline.kernel_classes(by_name, 3)}, {"gemm_flops": 1.0e11}, peaks)
    assert plain["floor_us"] is None and plain["gemm_floor_us"] == pytest.approx(200.0)
    assert "chain_floor_us" not in t and "launch_floor_us" not in rows["GEMM"]  # no measured kernel latency


def test_a_measured_kernel_latency_gives_each_class_and_the_chain_its_launch_floor(roofline):
    by_name = {"nvjet_a": (6, 600.0), "triton_red_fused_mean_var_1": (9, 300.0), "triton_poi_fused_3": (3, 30.0)}
    cell = {"variant": "ours_graph", "workload": "W1", "ms_median": 1.0, "kernel_us_per_iteration": 310.0,
            "kernel_classes": roofline.kernel_classes(by_name, iterations=3)}
    t = roofline.table(cell, {"gemm_flops": 1.0e9}, {"bf16_dense_tflops": 500.0, "hbm_tb_per_s": 4.0, "graph_kernel_us": 2.5})
    rows = {r["class"]: r for r in t["rows"]}
    assert rows["GEMM"]["launch_floor_us"] == pytest.approx(2 * 2.5)  # 2 kernels an iteration
    assert rows["BN statistics"]["launch_floor_us"] == pytest.approx(3 * 2.5)
    assert rows["other"]["launch_floor_us"] == pytest.approx(1 * 2.5) and rows["activations"]["launch_floor_us"] == 0
    assert t["chain_floor_us"] == pytest.approx(6 * 2.5)  # every kernel of the iteration, one after another
    # no byte counts: only the GEMMs can come down, to their launch floor (above their FLOP floor of 2 us)
    assert t["ms_at_class_floors"] == pytest.approx(1.0 - (200.0 - 5.0) / 1e3)


@pytest.mark.gpu
def test_a_graph_kernel_takes_microseconds_not_nanoseconds_or_milliseconds(roofline):
    us = roofline.graph_kernel_us(kernels=200)
    assert 0.3 < us < 50.0, us  # a replayed graph launches back to back: far below a stream launch's ~5 us


@pytest.mark.gpu
def test_a_copy_kernel_pays_a_fixed_cost_when_small_and_the_hbm_rate_when_large(roofline):
    curve = roofline.graph_copy_us(moved_bytes=(4096, 2**20, 2**30), kernels=20)
    (small, us_small), (_, us_mid), (large, us_large) = curve
    assert 0.3 < us_small < 50.0 and us_small <= us_mid * 1.1 <= us_large, curve  # more bytes never faster
    assert 1.0 < large / (us_large * 1e-6) / 1e12 < 6.0, curve  # 1 GiB near the HBM rate (H200: ~4 TB/s)
    assert small / (us_small * 1e-6) < 0.1 * large / (us_large * 1e-6), curve  # 4 KiB far below it


@pytest.mark.gpu
def test_inductor_counts_the_bytes_of_a_generated_kernel(roofline, tmp_path, monkeypatch):
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from torch._inductor import config
    from torch._inductor.codecache import PyCodeCache

    n = 1 << 20
    torch._dynamo.reset()
    # As benchmark_learner --kernel-bytes compiles: benchmark_kernel on, an empty cache of its own
    # (so nothing compiled without byte counts is reused). force_disable_caches, tried first,
    # left no counted kernel on the H200 (torch 2.11).
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "triton"))
    # two graphs of the same ops at two sizes, numbered across graphs as the benchmark compiles them
    with config.patch(benchmark_kernel=True), roofline.unique_kernel_names():
        for rows in (n, n // 4):
            torch._dynamo.reset()
            fn = torch.compile(lambda x, y: torch.relu(x * 3.0 + y), dynamic=False)
            x, y = torch.randn(rows, device="cuda"), torch.randn(rows, device="cuda")
            torch.testing.assert_close(fn(x, y), torch.relu(x * 3.0 + y))
    gb, ambiguous = roofline.inductor_kernel_gb()
    ours = sorted((name for name in gb if name.startswith("triton_poi_fused_add_mul_relu")), key=lambda k: int(k.rsplit("_", 1)[1]))
    named = sorted({getattr(v, "inductor_meta", {}).get("kernel_name", "?") for m in PyCodeCache.modules for v in vars(m).values()
                    if isinstance(getattr(v, "inductor_meta", None), dict)})
    assert len(ours) >= 2, (f"not two generated kernels with a byte count among {sorted(gb)[:20]} (ambiguous: {ambiguous}); "
                            f"{len(PyCodeCache.modules)} loaded modules, kernels with inductor_meta: {named[:20]}")
    assert not [a for a in ambiguous if a.startswith("triton_poi_fused_add_mul_relu")]
    # two fp32 inputs read, one output written, each graph's own count under its own name
    assert [gb[k] for k in ours[-2:]] == [pytest.approx(3 * n * 4 / 1e9), pytest.approx(3 * (n // 4) * 4 / 1e9)]


def test_kernel_names_are_numbered_across_graphs_inside_the_context_only(roofline):
    # Two graphs of the same ops (different shapes) compiled on the CPU: Inductor numbers each
    # graph's kernels from 0, so both would be `cpp_fused_mul_sum_0` and a profile could not tell
    # their byte counts apart; inside unique_kernel_names the second is numbered on, and after it
    # the per-graph numbering is back.
    torch = pytest.importorskip("torch")
    import re

    from torch._inductor import config
    from torch._inductor.utils import run_and_get_code

    def kernel_names(rows: int) -> set[str]:
        torch._dynamo.reset()
        fn = torch.compile(lambda x: (x * 2.0).sum(0), dynamic=False)
        with config.patch(fx_graph_cache=False):  # compile here, not load names another process chose
            out, code = run_and_get_code(fn, torch.ones(rows, 8))
        assert torch.equal(out, torch.full((8,), 2.0 * rows))
        return set(re.findall(r"cpp_fused_\w+", "\n".join(code)))

    with roofline.unique_kernel_names():
        first, second = kernel_names(4), kernel_names(16)
    after = kernel_names(4)
    assert first and second and not first & second, (first, second)
    assert after == first  # numbering restarts per graph again: the patch is gone


def test_kernel_sources_come_from_the_loaded_modules_one_per_distinct_body(roofline, monkeypatch):
    # Inductor's generated modules hold each kernel as an autotuner whose inductor_meta names it
    # and whose fn.src is the Triton source; names repeat across graphs, bodies may differ
    pytest.importorskip("torch")
    import types

    from torch._inductor.codecache import PyCodeCache

    def kernel(name, src):
        return types.SimpleNamespace(inductor_meta={"kernel_name": name}, fn=types.SimpleNamespace(src=src))

    graph_a = types.SimpleNamespace(k3=kernel("triton_poi_fused_3", "def a(): pass"), k4=kernel("triton_poi_fused_4", "def b(): pass"), other=1)
    graph_b = types.SimpleNamespace(k3=kernel("triton_poi_fused_3", "def c(): pass"), again=kernel("triton_poi_fused_3", "def a(): pass"))
    monkeypatch.setattr(PyCodeCache, "modules", [graph_a, graph_b])
    monkeypatch.setattr(PyCodeCache, "modules_no_attr", {})
    found = roofline.inductor_kernel_sources(["triton_poi_fused_3", "triton_red_fused_9"], limit=5)
    assert found == {"triton_poi_fused_3": ["def a", "def c"]}  # cut at the limit; the repeat of a kept once


def test_the_ratio_without_a_class_bounds_what_a_remedy_of_that_class_can_give(roofline):
    cell = {"variant": "ours_graph", "workload": "W4", "ms_median": 10.0, "kernel_us_per_iteration": 9000.0,
            "kernel_classes": roofline.kernel_classes({"nvjet_a": (1, 4000.0), "triton_red_fused_mean_var_1": (1, 3000.0),
                                                       "triton_poi_fused_7": (1, 2000.0)}, iterations=1)}
    t = roofline.against_unilab(roofline.table(cell, {"gemm_flops": 1.0e12}), unilab_ms=16.0)
    rows = {r["class"]: r for r in t["rows"]}
    assert t["ratio_to_unilab_graph"] == pytest.approx(10.0 / 16.0)
    assert t["ratio_at_class_floors"] == pytest.approx(t["ms_at_class_floors"] / 16.0)
    assert rows["GEMM"]["ratio_without_class"] == pytest.approx(6.0 / 16.0)
    assert rows["BN statistics"]["ratio_without_class"] == pytest.approx(7.0 / 16.0)
    assert rows["other"]["ratio_without_class"] == pytest.approx(8.0 / 16.0)
    assert rows["BN apply"]["ratio_without_class"] == pytest.approx(10.0 / 16.0)  # a class with no kernels gives nothing


def test_the_gemm_ceiling_records_every_gemm_flop_of_an_iteration_and_rebuilds_its_operands(gemm_ceiling):
    # gemm_ceiling replays what one eager iteration dispatched: the recorded calls must carry all
    # of torch's counted FLOPs (forward and backward) and rebuild operands of the same layout
    import torch
    workload = dict(batch_size=16, updates_per_step=2, policy_frequency=2, obs_dim=12, critic_obs_dim=15, action_dim=4)
    calls, flops = gemm_ceiling.record(workload, "cpu")
    assert {name for name, _, _ in calls} >= {"mm", "bmm"}  # the actor's linears and the critic ensemble's batched GEMMs
    assert sum(gemm_ceiling.gemm_flops(name, spec) for name, spec, _ in calls) == flops > 0
    g = torch.Generator().manual_seed(0)
    for name, spec, kwargs in calls:
        args = gemm_ceiling.operands(spec, "cpu", g)
        tensors = [a for a in args if isinstance(a, torch.Tensor)]
        assert [(tuple(t.shape), t.stride(), t.dtype) for t in tensors] == [s for s in spec if gemm_ceiling.is_operand(s)]
        out = getattr(torch.ops.aten, name).default(*args, **kwargs)
        assert torch.isfinite(out).all()
    # no autocast on the CPU: every call counted once, under its op and fp32 operands
    dtypes = gemm_ceiling.operand_dtypes(calls)
    assert sum(dtypes.values()) == len(calls) and set(dtypes) >= {"mm:float32,float32", "bmm:float32,float32"}


def test_the_aligned_replay_pads_every_gemm_dim_alike_and_keeps_each_operands_layout(gemm_ceiling):
    # --align: eager's calls with their matrix dims rounded up as Inductor's pad_mm does (W1's
    # obs 98 / critic obs 101 / action 29 are not 16-byte multiples): every padded call must
    # still be a valid GEMM, each operand keep its dim order (a transposed one stays transposed)
    import torch
    # W1's dims, a small batch (12: not a multiple of 8 either)
    workload = dict(batch_size=12, updates_per_step=1, policy_frequency=1, obs_dim=98, critic_obs_dim=101, action_dim=29)
    calls, flops = gemm_ceiling.record(workload, "cpu")
    g = torch.Generator().manual_seed(0)
    padded_flops = 0
    unaligned = 0
    for name, spec, kwargs in calls:
        padded = gemm_ceiling.aligned(spec, 8)
        for (shape, stride, dtype), (pshape, pstride, pdtype) in zip(
                [s for s in spec if gemm_ceiling.is_operand(s)], [s for s in padded if gemm_ceiling.is_operand(s)]):
            assert pdtype == dtype and all(n % 8 == 0 for n in pshape[-2:]) and all(p >= n for p, n in zip(pshape, shape))
            order = lambda st: sorted((i for i in range(len(st)) if st[i]), key=lambda i: (st[i], i))  # noqa: E731
            assert order(pstride) == order(stride)
            unaligned += any(n % 8 for n in shape[-2:])
        out = getattr(torch.ops.aten, name).default(*gemm_ceiling.operands(padded, "cpu", g), **kwargs)
        assert torch.isfinite(out).all()
        padded_flops += gemm_ceiling.gemm_flops(name, padded)
    assert unaligned and padded_flops > flops  # there was something to pad, and padding adds work


def test_a_copy_kernels_time_is_read_off_its_curve_in_log_log(roofline):
    curve = [[1e4, 2.0], [1e6, 4.0], [1e8, 40.0]]
    assert roofline.copy_us(1e-6, curve) == pytest.approx(2.0)  # 1 kB: below the smallest size, its fixed cost
    assert roofline.copy_us(1e-3, curve) == pytest.approx(4.0)  # 1 MB: a measured point
    assert roofline.copy_us(1e-4, curve) == pytest.approx(2.0 * 2.0**0.5)  # 100 kB: halfway in log-log
    assert roofline.copy_us(1.0, curve) == pytest.approx(400.0)  # 1 GB: the largest's rate, 10x its bytes


def test_the_size_ceiling_gives_each_kernel_its_copys_time_and_the_gemms_their_time_alone(roofline):
    # two BN-statistics kernels of 1 MB (10 us measured against the copy's 4 us: 6 above), one of
    # 1 kB faster than its copy (nothing above, and it does not offset the others), GEMMs 500 us
    # against 300 us alone: the iteration at the ceilings is 10 ms - (2 x 6 + 200) us
    curve = [[1e4, 2.0], [1e6, 4.0], [1e8, 40.0]]
    by_name = {"nvjet_a": (1, 500.0), "triton_red_fused_mean_var_1": (2, 20.0), "triton_red_fused_mean_var_2": (1, 1.0)}
    gb = {"triton_red_fused_mean_var_1": 1e-3, "triton_red_fused_mean_var_2": 1e-6}
    cell = {"variant": "ours_graph", "workload": "W1", "ms_median": 10.0, "kernel_us_per_iteration": 521.0,
            "kernel_classes": roofline.kernel_classes(by_name, 1, gb), "counted_kernels": roofline.counted_kernels(by_name, 1, gb)}
    peaks = {**roofline.H200_PEAKS, "copy_us_by_bytes": curve}
    t = roofline.table(cell, {"gemm_flops": 1e9}, peaks, gemm_alone_us=300.0)
    rows = {r["class"]: r for r in t["rows"]}
    assert rows["BN statistics"]["copy_floor_us"] == pytest.approx(2 * 4.0 + 2.0)
    assert t["ms_at_size_ceilings"] == pytest.approx(10.0 - (12.0 + 200.0) / 1e3)
    assert rows["GEMM"]["alone_us"] == 300.0 and t["gemm_ceiling"].startswith("alone")
    assert roofline.against_unilab(t, unilab_ms=20.0)["ratio_at_size_ceilings"] == pytest.approx(t["ms_at_size_ceilings"] / 20.0)
    # without a gemm_ceiling measurement the GEMMs fall back to their FLOP floor (1 GFLOP: ~1 us)
    t = roofline.table(cell, {"gemm_flops": 1e9}, peaks)
    assert t["ms_at_size_ceilings"] == pytest.approx(10.0 - (12.0 + 500.0 - 1e9 / 989e12 * 1e6) / 1e3)
    # an older benchmark JSON (no counted_kernels) gets no size bound rather than a wrong one
    del cell["counted_kernels"]
    assert "ms_at_size_ceilings" not in roofline.table(cell, {"gemm_flops": 1e9}, peaks)


def test_the_gemm_ceiling_is_the_aligned_replay_where_it_ran(roofline):
    # graph mode's GEMMs are Inductor-padded: the aligned replay is their ceiling, the plain one only without it
    assert roofline.gemm_ceiling_us({"us_median": 4251.0, "aligned": {"us_median": 2400.0}}) == 2400.0
    assert roofline.gemm_ceiling_us({"us_median": 4251.0}) == 4251.0
