"""Learner-only benchmark: UniLab 1.5.2's FlashSAC learner vs flashsac_opt, same process, same GPU.

Variants (each driven as UniLab's runner drives it, one learner iteration at a time):
  unilab_eager    (a) use_compile=false: per-update path, deferred metrics
  unilab_compile  (b) compile_full_objectives, no whole-cycle graph (Inductor CUDA graphs)
  unilab_graph    (c) UniLab's default: compile + whole-cycle CUDA graph
  ours_eager / ours_compile / ours_graph: flashsac_opt's learner_mode eager|compile|graph
  ours_graph_replay: graph mode sampling from a GPUReplay inside the captured iteration
    (its time *includes* sampling; the others get a pre-sampled batch)
  ours_graph_fused / ours_graph_split: graph mode with fused_update forced on / off (one
    compile boundary per update vs loss and step compiled apart); ours_graph uses the
    default, which picks by batch size
  ours_graph_<study>: graph mode with one setting changed (GRAPH_STUDIES: Inductor options, critic
    options, Programmatic Dependent Launch and its placement), each described there

Workloads: bench/workloads.py (W1-W4), synthetic batches sampled on the GPU from a GPU-resident pool.

Timed per iteration (host clock): update phase + metrics read (D2H) + stream synchronize, the
batch already sampled. Cold start: construction to the end of the first iteration (compile and
capture). Every cell is timed before any is profiled (torch.profiler leaves CUPTI attached and
slows later launches); kernels per iteration (torch.profiler's CUDA kernel events) and launches
(host-side launch API calls) come from a second pass over the same learners.

--prewarm N: every cell is first compiled in a process of its own, N at a time, on the same
Inductor cache (UniLab's max-autotune compile alone takes ~190 s a workload on the H200); the
timed cells then start warm, and the prewarm processes' cold starts are kept (`prewarm`: upper
bounds, as they share the CPUs and the GPU).

    python experiments/bench/benchmark_learner.py --output results/learner_benchmark/benchmark_learner.json \\
        --plot results/learner_benchmark/benchmark_learner.png
    python experiments/bench/benchmark_learner.py --plot-only results/learner_benchmark/benchmark_learner.json \\
        --plot results/learner_benchmark/benchmark_learner.png
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import logging
import os
import statistics
import sys
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # experiments/: common, report.plotting
from common import add_output_arguments, percentile, plot_only_or_require_cuda, run_environment, write_report  # noqa: E402
from report import plotting  # noqa: E402
from bench.workloads import WORKLOADS  # noqa: E402
from bench.roofline import counted_kernels, inductor_kernel_gb, inductor_kernel_sources, kernel_classes, measure_peaks, unique_kernel_names  # noqa: E402
from flashsac_opt.config import COMPILED_MODE_NETWORK_OPTIONS  # noqa: E402

# Graph mode with one setting changed (a study): what each buys and costs in start-up. The
# results of each are under results/learner_benchmark/ (studies_*, side_by_side_*).
# The critic network options the compiled modes turn on by default (config.COMPILED_MODE_NETWORK_OPTIONS), all off.
PLAIN_NETWORK = {name: False for name in COMPILED_MODE_NETWORK_OPTIONS}
# Study keys the variant builder reads itself (neither Inductor options nor config fields).
BUILDER_SWITCHES = ("pdl_placement",)
GRAPH_STUDIES = {
    # coordinate-descent tuning of Triton launch configs, as UniLab's max-autotune does
    "ours_graph_tuned": {"inductor_options": {"coordinate_descent_tuning": True}},
    # without horizontal fusion (combo_kernels, graph mode's default on CUDA; older reports hold
    # "ours_graph_combo", the other way round: combo at 0.79-0.89x of none at W1, 0.93-0.98x at W3)
    "ours_graph_no_combo": {"inductor_options": {"combo_kernels": False}},
    # fuse nodes even without shared memory reads (fewer, larger kernels)
    "ours_graph_aggressive": {"inductor_options": {"aggressive_fusion": True}},
    # the GEMM weights cast to bf16 per matmul instead of once per network call
    "ours_graph_percast": {"cast_gemm_weights_once": False},
    # cooperative reductions: the BatchNorm statistics over the batch axis have few outputs
    "ours_graph_coop": {"inductor_options": {"triton.cooperative_reductions": True}},
    # the critics' input BN statistics in chunks of 128 rows, then combined (chunking every critic
    # BN layer, ours_graph_bnchunks at commit 62bc0bd, 2026-12-01, was 1.02-1.12x slower)
    "ours_graph_input_bn_chunks": {"input_bn_chunk_rows": 128},
    # the online and target critics as one 4-member ensemble in the critic loss (stack_target_critic)
    "ours_graph_stacked": {"stack_target_critic": True},
    # GEMMs autotuned among Inductor's Triton templates too, with prologue/epilogue fusion (their
    # cold compile took ~10x graph mode's on 2026-12-03: studies_2026-12-03/)
    "ours_graph_triton_gemm": {"inductor_options": {"max_autotune_gemm": True, "max_autotune_gemm_backends": "ATEN,TRITON"}},
    # the critic's target branch on a second stream inside the captured iteration (critic_target_stream;
    # the critic then runs the split form: compare with ours_graph_split too)
    "ours_graph_target_stream": {"critic_target_stream": True},
    # Programmatic Dependent Launch (Hopper+) forced on / off at every batch. Inductor's own placement
    # failed two GPU tests as a default (commit 4b6e2bc, withdrawn in de1fb3f, 2026-12-03:
    # side_by_side_pdl_2026-12-03/); flashsac_opt/pdl.py's wait-first codegen made it correct
    # (5dae6df: side_by_side_pdl_wait_first_2026-12-03/), graph mode's default up to
    # engine.PDL_MAX_BATCH rows per update: ours_graph_pdl is ours_graph at W1 / W2, ours_graph_no_pdl at W3 / W4.
    "ours_graph_pdl": {"inductor_options": {"triton.enable_pdl": True}},
    "ours_graph_no_pdl": {"inductor_options": {"triton.enable_pdl": False}},
    # the two placements of each kernel's gdc_launch_dependents (pdl.py): right after its wait
    # (trigger_first, the default since 130a62a: 0.972x / 0.982x of wait-only at W1 / W2 on 2026-12-03,
    # side_by_side_pdl_trigger_first_2026-12-03/) or after its last load (wait_first, 5dae6df's)
    "ours_graph_pdl_trigger_first": {"inductor_options": {"triton.enable_pdl": True}, "pdl_placement": "trigger_first"},
    "ours_graph_pdl_wait_only": {"inductor_options": {"triton.enable_pdl": True}, "pdl_placement": "wait_first"},
    # single critic options, measured 2026-12-02 while off by default, so against their baseline then
    # (the other two off, as in ours_graph_plain): the weight gradients in the weights' own layout
    # (0.993x / 0.988x / 1.000x at W1 / W2 / W4); the input BN statistics reduced once for both
    # members, alone and with 128-row chunks (W3 / W4: 0.989x / 0.975x, both 1.000x / 0.970x)
    "ours_graph_weight_grads": {**PLAIN_NETWORK, "contiguous_weight_grads": True},
    "ours_graph_shared_input_bn": {**PLAIN_NETWORK, "shared_input_bn_statistics": True},
    "ours_graph_shared_input_bn_chunks": {**PLAIN_NETWORK, "shared_input_bn_statistics": True, "input_bn_chunk_rows": 128},
    # AOTAutograd's activation memory budget: the backward recomputes the critic's BN apply and ReLU
    # (bench/saved_activations.py); 1.069x / 1.088x at W3 / W4 on 2026-12-02
    "ours_graph_budget": {"activation_memory_budget": 0.7},
    # the critic's ReLU after each up projection on the rounded (bf16) BN output
    "ours_graph_relu_bf16": {**PLAIN_NETWORK, "relu_in_autocast_dtype": True},
    # the three critic options together: the compiled modes' default since 37ad83f (2026-12-02), so the
    # same learner as ours_graph now (kept: the runs name it); ours_graph_plain: the three off
    "ours_graph_options": {name: True for name in COMPILED_MODE_NETWORK_OPTIONS},
    "ours_graph_plain": PLAIN_NETWORK,
    # issue 45's first Triton kernel: each layer of a critic or actor block (GEMM, training BN, ReLU,
    # the skip connection) in one launch (kernels.member_linear_bn_relu; up to kernels.MAX_ROWS rows: W1 / W2)
    "ours_graph_fused_linear_bn_relu": {"fused_linear_bn_relu": True},
    # issue 45 item 1: each block's GEMMs with BatchNorm statistics epilogues and the apply in the
    # next GEMM's prologue (gemm_stats.block; up to gemm_stats.MAX_ROWS rows: W1 / W2)
    "ours_graph_gemm_stats_block": {"gemm_stats_block": True},
    # issue 45 item 3: each network's post-backward step (Adam, renormalization, guarded commit,
    # Polyak) as one Triton launch (fused_step.py; any batch)
    "ours_graph_fused_gated_step": {"fused_gated_step": True},
    # every GEMM on Inductor's Triton template at one fixed configuration (gemm_templates.py): its
    # epilogue / prologue fusion without the autotuning that ruled ours_graph_triton_gemm out
    "ours_graph_triton_gemm_table": {"triton_gemm_table": True},
}
VARIANTS = (
    "unilab_eager", "unilab_compile", "unilab_graph",
    "ours_eager", "ours_compile", "ours_graph", "ours_graph_replay", "ours_graph_fused", "ours_graph_split",
    *GRAPH_STUDIES,
)
POOL_ROWS = 65536


class Pool:
    """GPU-resident replay-like pool; each iteration gathers a fresh large batch on the GPU."""

    def __init__(self, rows: int, obs_dim: int, critic_obs_dim: int, action_dim: int, device, seed: int = 0):
        import torch

        g = torch.Generator(device=device).manual_seed(seed)
        self.g = g
        self.rows = rows
        randn = lambda *s: torch.randn(*s, device=device, generator=g)  # noqa: E731
        rand = lambda *s: torch.rand(*s, device=device, generator=g)  # noqa: E731
        dones = (rand(rows) < 0.02).float()
        self.fields = {
            "obs": randn(rows, obs_dim),
            "next_obs": randn(rows, obs_dim),
            "actions": torch.tanh(randn(rows, action_dim)),
            "rewards": 0.5 * randn(rows) + 0.1,
            "dones": dones,
            "truncated": (rand(rows) < 0.01).float() * (1 - dones),
            "critic": randn(rows, critic_obs_dim),
            "next_critic": randn(rows, critic_obs_dim),
        }

    def sample(self, n: int) -> dict:
        import torch

        idx = torch.randint(0, self.rows, (n,), device=self.fields["obs"].device, generator=self.g)
        return {k: v.index_select(0, idx) for k, v in self.fields.items()}


INDUCTOR_OPTIONS: dict = {}  # --inductor-option KEY=VALUE, for flashsac_opt's variants


def build(variant: str, w: dict, device: str, pool: "Pool | None" = None):
    """Return (learner, run_iteration) for a variant."""
    import torch

    from flashsac_opt.config import FlashSACConfig

    cfg = FlashSACConfig(
        batch_size=w["batch_size"],
        updates_per_step=w["updates_per_step"],
        policy_frequency=w["policy_frequency"],
        gamma=0.97,
        tau=0.05,
        use_amp=True,
        amp_dtype="bf16",
        inductor_options=dict(INDUCTOR_OPTIONS) or None,
    )
    dims = {k: w[k] for k in ("obs_dim", "critic_obs_dim", "action_dim")}
    u, pf = w["updates_per_step"], w["policy_frequency"]
    if variant == "ours_graph_replay":
        from flashsac_opt.learner import FlashSACLearner
        from flashsac_opt.replay import GPUReplay

        learner = FlashSACLearner(cfg.replace(learner_mode="graph"), device=device, **dims)
        assert pool is not None
        replay = GPUReplay(pool.rows, device=device, **dims)
        replay.extend(pool.fields)

        def run(batch):
            del batch  # sampled inside the graph
            learner.update_from_replay(replay)
            metrics = learner.read_metrics()
            torch.cuda.current_stream().synchronize()
            return metrics

        return learner, run

    if variant.startswith("ours_"):
        from flashsac_opt.learner import FlashSACLearner

        if variant in ("ours_graph_fused", "ours_graph_split"):
            cfg = cfg.replace(learner_mode="graph", fused_update=variant == "ours_graph_fused")
        elif variant in GRAPH_STUDIES:
            change = dict(GRAPH_STUDIES[variant])
            options = {**(cfg.inductor_options or {}), **change.pop("inductor_options", {})}
            if (placement := change.pop("pdl_placement", None)) is not None:
                from flashsac_opt import pdl

                options["post_grad_custom_pre_pass"] = pdl.cache_key(trigger_first=placement == "trigger_first")
            cfg = cfg.replace(learner_mode="graph", inductor_options=options or None, **change)
        else:
            cfg = cfg.replace(learner_mode=variant[5:])
        learner = FlashSACLearner(cfg, device=device, **dims)

        def run(batch):
            learner.update(batch)
            metrics = learner.read_metrics()
            torch.cuda.current_stream().synchronize()
            return metrics

        return learner, run

    from unilab.rl.algos.flash_sac.learner import FlashSACLearner as UniLabLearner

    flags = {
        "unilab_eager": dict(use_compile=False, compile_full_objectives=False, use_whole_cycle_cuda_graph=False),
        "unilab_compile": dict(use_compile=True, compile_full_objectives=True, use_whole_cycle_cuda_graph=False),
        "unilab_graph": dict(use_compile=True, compile_full_objectives=True, use_whole_cycle_cuda_graph=True),
    }[variant]
    kwargs = dict(
        obs_dim=dims["obs_dim"], action_dim=dims["action_dim"], critic_obs_dim=dims["critic_obs_dim"], device=device,
        gamma=cfg.gamma, tau=cfg.tau, use_amp=True, amp_dtype="bf16", **flags,
    )
    learner = UniLabLearner(**kwargs)

    if learner.use_update_cycle:

        def run(batch):
            learner.update_cycle(batch, updates_per_step=u, policy_frequency=pf, target_frequency=1, policy_before_critic=False)
            metrics = learner.read_deferred_cycle_metrics()
            torch.cuda.current_stream().synchronize()
            return metrics

        return learner, run

    def run(batch):  # the runner's per-update path (double_buffer_runner.py, 1.5.2)
        bsz = batch["actions"].shape[0] // u
        metrics = {}
        for i in range(u):
            b = {k: v[i * bsz : (i + 1) * bsz] for k, v in batch.items()}
            metrics.update(learner.update_critic(b, read_metrics=i == u - 1))
            if i % pf == 0:
                learner.update_actor(b, read_metrics=False)
            learner.soft_update_target()
        metrics.update(learner.read_deferred_actor_metrics())
        torch.cuda.current_stream().synchronize()
        return metrics

    return learner, run


def _compile_seconds() -> dict[str, float]:
    """Cumulative seconds per torch.compile phase timer in this process (best effort)."""
    try:
        from torch._dynamo.utils import compilation_time_metrics
    except ImportError:
        return {}
    return {k: float(sum(v)) for k, v in compilation_time_metrics.items()}


def _cache_counters() -> dict[str, int]:
    """torch's compile-cache counters so far in this process (Inductor and AOTAutograd)."""
    from torch._dynamo.utils import counters

    return {f"{group}.{key}": int(value) for group in ("inductor", "aot_autograd")
            for key, value in counters[group].items() if "cache" in key}


class CacheBypassReasons(logging.Handler):
    """Why AOTAutograd's cache bypassed a graph: torch counts bypasses but gives the reason only
    to its logger (at INFO). Attached for one cell's compile; ``reasons`` holds each distinct
    reason's first line (a bypassed graph is traced and partitioned again at every launch)."""

    LOGGER = "torch._functorch._aot_autograd.autograd_cache"
    PREFIX = "Bypassing autograd cache due to: "

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.reasons: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        if message.startswith(self.PREFIX):
            lines = message[len(self.PREFIX):].strip().splitlines()
            reason = lines[0] if lines else ""
            if reason not in self.reasons:
                self.reasons.append(reason)

    def __enter__(self) -> "CacheBypassReasons":
        logger = logging.getLogger(self.LOGGER)
        self._level = logger.level
        logger.addHandler(self)
        if logger.getEffectiveLevel() > logging.INFO:
            logger.setLevel(logging.INFO)
        return self

    def __exit__(self, *exc) -> None:
        logger = logging.getLogger(self.LOGGER)
        logger.removeHandler(self)
        logger.setLevel(self._level)


def ratios(cells: list[dict]) -> list[dict]:
    """Per workload, from the same run: flashsac_opt's modes against UniLab's (b) and (c), and
    graph-mode variants (Inductor studies, fused/split, in-graph replay) against ours_graph."""
    out = []
    for w in WORKLOADS:
        by = {c["variant"]: c for c in cells if c["workload"] == w and "ms_median" in c}
        row = {"workload": w}
        if "unilab_graph" in by:
            c_ms = by["unilab_graph"]["ms_median"]
            for v in ("ours_graph", *GRAPH_STUDIES, "ours_graph_fused", "ours_graph_split", "ours_graph_replay", "ours_compile", "ours_eager"):
                if v in by:
                    row[f"{v}_vs_unilab_graph"] = by[v]["ms_median"] / c_ms
            if "unilab_compile" in by and "ours_compile" in by:
                row["ours_compile_vs_unilab_compile"] = by["ours_compile"]["ms_median"] / by["unilab_compile"]["ms_median"]
            for v in ("ours_graph", *GRAPH_STUDIES):
                if v in by and "kernels_per_iteration" in by[v] and "kernels_per_iteration" in by["unilab_graph"]:
                    row[f"{v}_kernels_vs_unilab_graph"] = by[v]["kernels_per_iteration"] / by["unilab_graph"]["kernels_per_iteration"]
        if "ours_graph" in by:
            base = by["ours_graph"]
            for v in (*GRAPH_STUDIES, "ours_graph_fused", "ours_graph_split", "ours_graph_replay"):
                if v in by:
                    row[f"{v}_vs_ours_graph"] = by[v]["ms_median"] / base["ms_median"]
                    if "kernels_per_iteration" in by[v] and "kernels_per_iteration" in base:
                        row[f"{v}_kernels_vs_ours_graph"] = by[v]["kernels_per_iteration"] / base["kernels_per_iteration"]
        if len(row) > 1:
            out.append(row)
    return out


def count_kernels(run, pool: Pool, rows: int, iterations: int = 3) -> dict:
    import torch
    from torch.profiler import ProfilerActivity, profile

    batches = [pool.sample(rows) for _ in range(iterations)]
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for b in batches:
            run(b)
    kernels, launches, by_name = 0, 0, {}
    launch_apis = ("cudaLaunchKernel", "cuLaunchKernel", "cudaGraphLaunch", "cuLaunchKernelEx", "cudaLaunchKernelExC")
    for evt in prof.events():
        if evt.device_type == torch.autograd.DeviceType.CUDA:
            if "memcpy" in evt.name.lower() or "memset" in evt.name.lower():
                continue
            kernels += 1
            t = by_name.setdefault(evt.name, [0, 0.0])
            t[0] += 1
            t[1] += evt.device_time if hasattr(evt, "device_time") else evt.cuda_time
        elif any(evt.name.startswith(api) for api in launch_apis):
            launches += 1
    top = sorted(by_name.items(), key=lambda kv: -kv[1][1])[:40]
    from torch._inductor import config as inductor_config

    counted = inductor_config.benchmark_kernel  # --kernel-bytes: each generated kernel carries its bytes
    gb_by_name, ambiguous = inductor_kernel_gb() if counted else (None, [])
    bytes_fields = {"kernel_bytes_ambiguous": [n for n in ambiguous if n in by_name]} if counted else {}
    if counted:  # the sources of the Triton kernels among the ten slowest: what the ones named by number compute
        bytes_fields["top_kernel_sources"] = inductor_kernel_sources([n for n, _ in top[:10] if n.startswith("triton_")])
        bytes_fields["counted_kernels"] = counted_kernels({n: (c, t) for n, (c, t) in by_name.items()}, iterations, gb_by_name)
    return {
        "kernels_per_iteration": kernels / iterations,
        "launches_per_iteration": launches / iterations,
        "kernel_us_per_iteration": sum(t for _, t in by_name.values()) / iterations,
        "kernels_under_5us_per_iteration": sum(c for c, t in by_name.values() if t / max(c, 1) < 5.0) / iterations,
        "top_kernels": [{"name": n[:120], "count_per_iteration": c / iterations, "us_per_iteration": t / iterations} for n, (c, t) in top],
        # every kernel, by class (bench/roofline.py's map of where the GPU time goes)
        "kernel_classes": kernel_classes({n: (c, t) for n, (c, t) in by_name.items()}, iterations, gb_by_name),
        **bytes_fields,
    }


def run_cell(variant: str, wname: str, iters: int, warmup: int, device: str):
    """Time one cell; return (cell, profile) where profile() counts its kernels later."""
    import torch

    w = WORKLOADS[wname]
    rows = w["batch_size"] * w["updates_per_step"]
    torch._dynamo.reset()
    gc.collect()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    compile_before, cache_before = _compile_seconds(), _cache_counters()
    pool = Pool(max(POOL_ROWS, 2 * rows), w["obs_dim"], w["critic_obs_dim"], w["action_dim"], device)
    first = pool.sample(rows)
    torch.cuda.synchronize()
    start = time.perf_counter()
    with CacheBypassReasons() as bypass:
        learner, run = build(variant, w, device, pool)
        built = time.perf_counter()
        run(first)
        cold = time.perf_counter() - start
    def timed(n: int) -> tuple[list[float], dict]:
        """ms per iteration; each batch is sampled and synchronized before the clock starts."""
        out, metrics = [], {}
        for _ in range(n):
            b = pool.sample(rows)
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            metrics = run(b)
            out.append((time.perf_counter() - t0) * 1e3)
        return out, metrics

    compile_after = _compile_seconds()
    warm_ms, _ = timed(warmup)
    times, metrics = timed(iters)
    cell = {
        "variant": variant,
        "workload": wname,
        **w,
        "construct_s": built - start,
        "cold_start_s": cold,
        "warmup_iterations": warmup,
        "warmup_ms": warm_ms,
        "iterations": iters,
        "ms_median": statistics.median(times),
        "ms_p90": percentile(times, 0.9),
        "ms_mean": statistics.fmean(times),
        "updates_per_s": w["updates_per_step"] / (statistics.median(times) / 1e3),
        "peak_memory_mib": torch.cuda.max_memory_allocated() / 2**20,
        "last_metrics": {k: float(v) for k, v in metrics.items()},
        "finite": all(v == v and abs(v) != float("inf") for v in metrics.values()),
        # Seconds of the cold start spent in each compile phase (torch._dynamo's timers):
        # Dynamo tracing, AOTAutograd, Inductor code generation, Triton compilation.
        "compile_phase_s": {
            k: round(v - compile_before.get(k, 0.0), 3)
            for k, v in compile_after.items()
            if v - compile_before.get(k, 0.0) >= 0.05
        },
    }
    # Inductor's FX-graph and AOTAutograd cache hits, misses and bypasses of this cell's compile
    # (torch's counters are per process: the cells before it are subtracted). A cell that misses
    # nothing on a cache another tree filled compiled graphs identical to that tree's.
    cache_after = _cache_counters()
    cell["compile_cache_counters"] = {k: v - cache_before.get(k, 0) for k, v in cache_after.items() if v != cache_before.get(k, 0)}
    cell["compile_cache_bypass_reasons"] = bypass.reasons
    graph = learner.engine.graph if variant.startswith("ours_") else None  # graph mode's captured iteration
    if graph is not None:
        cell["graph_warmup_s"] = graph.last_warmup_seconds
        cell["graph_capture_s"] = graph.last_capture_seconds
    def profile() -> dict:  # `run` holds the learner (and its captured graphs) alive
        return count_kernels(run, pool, rows)

    return cell, profile


def environment() -> dict:
    return {
        **run_environment("cuda", packages=("triton", "unilab")),
        "TORCHINDUCTOR_MAX_AUTOTUNE_GEMM_BACKENDS": os.environ.get("TORCHINDUCTOR_MAX_AUTOTUNE_GEMM_BACKENDS"),
        "TORCHINDUCTOR_CACHE_DIR": os.environ.get("TORCHINDUCTOR_CACHE_DIR"),
    }


COLORS = {"unilab_eager": "#bbbbbb", "unilab_compile": "#888888", "unilab_graph": "#444444", "ours_eager": "#9ecae1",
          "ours_compile": "#4292c6", "ours_graph": "#08519c", "ours_graph_replay": "#2ca25f", "ours_graph_fused": "#9e9ac8",
          "ours_graph_split": "#6a51a3", "ours_graph_tuned": "#54278f", "ours_graph_combo": "#807dba",
          "ours_graph_no_combo": "#6baed6", "ours_graph_aggressive": "#bcbddc", "ours_graph_percast": "#dadaeb"}


def plot(report: dict, path: Path) -> None:
    cells = [c for c in report["cells"] if "ms_median" in c]
    workloads = [w for w in WORKLOADS if any(c["workload"] == w for c in cells)]
    present = list(dict.fromkeys(c["variant"] for c in cells))  # (older reports may hold retired variants)
    variants = [v for v in VARIANTS if v in present] + [v for v in present if v not in VARIANTS]
    by = {(c["variant"], c["workload"]): c for c in cells}
    series = [{"label": v, "color": COLORS.get(v),
               "values": [by[v, w]["ms_median"] if (v, w) in by else None for w in workloads],
               "upper": [by[v, w]["ms_p90"] - by[v, w]["ms_median"] if (v, w) in by else None for w in workloads]}
              for v in variants]
    fig, ax = plotting.subplots(figsize=(11, 5.5))
    plotting.grouped_bars(ax, [f"{w}\nB{WORKLOADS[w]['batch_size']} x {WORKLOADS[w]['updates_per_step']} upd" for w in workloads],
                          series, lambda y: f"{y:.2f}" if y < 10 else f"{y:.1f}" if y < 100 else f"{y:.0f}")
    env = report["environment"]
    what = "UniLab 1.5.2 vs flashsac_opt" if any(v.startswith("unilab") for v in variants) else "flashsac_opt variants"
    ax.set_title(f"FlashSAC learner iteration: {what} ({env.get('gpu')}, torch {env.get('torch')}, bf16)")
    plotting.log_value_axis(ax, "ms per learner iteration (median; whisker = p90), log scale")
    plotting.save(fig, path)


def prewarm(workloads: list[str], variants: list[str], processes: int, passthrough: list[str], timeout: float | None = None) -> list[dict]:
    """Compile every (workload, variant) cell in a process of its own, ``processes`` at a time,
    on this process's Inductor cache; return each one's cold start (or why it has none: a
    process still compiling after ``timeout`` seconds is stopped, ``timed_out``)."""
    import signal
    import subprocess
    import tempfile
    from concurrent.futures import ThreadPoolExecutor

    def one(cell: tuple[str, str], folder: Path) -> dict:
        wname, variant = cell
        out = folder / f"{wname}_{variant}.json"
        cmd = [sys.executable, str(Path(__file__).resolve()), "--workloads", wname, "--variants", variant,
               "--iters", "1", "--warmup", "0", "--no-profile", "--note", "prewarm", "--output", str(out), *passthrough]
        start = time.perf_counter()
        # A process group of its own: a timeout stops it whole, Inductor's compile workers included.
        child = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
        try:
            _, stderr = child.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(child.pid, signal.SIGKILL)
            child.communicate()
            row = {"workload": wname, "variant": variant, "timed_out": True, "seconds": round(time.perf_counter() - start, 1),
                   "error": f"its compile did not finish within --prewarm-timeout {timeout:g} s"}
            print(f"   prewarm {wname} {variant}: {row['error']}", flush=True)
            return row
        row = {"workload": wname, "variant": variant, "rc": child.returncode, "seconds": round(time.perf_counter() - start, 1)}
        cells = json.loads(out.read_text())["cells"] if out.is_file() else []
        if cells and "cold_start_s" in cells[0]:
            row["cold_start_s"] = cells[0]["cold_start_s"]
        else:
            row["error"] = (cells[0].get("error") if cells else None) or stderr[-2000:]
        print(f"   prewarm {wname} {variant}: {row.get('cold_start_s', row.get('error', ''))!s:.80}", flush=True)
        return row

    with tempfile.TemporaryDirectory(prefix="prewarm_") as folder, ThreadPoolExecutor(max_workers=max(1, processes)) as workers:
        return list(workers.map(lambda cell: one(cell, Path(folder)), [(w, v) for w in workloads for v in variants]))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workloads", nargs="+", default=list(WORKLOADS), choices=list(WORKLOADS))
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    parser.add_argument("--iters", type=int, default=50)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--no-profile", action="store_true", help="skip the torch.profiler kernel count")
    parser.add_argument("--kernel-bytes", action="store_true",
                        help="compile with Inductor's per-kernel byte counts (benchmark_kernel) and measure the GPU's copy and "
                             "GEMM peaks, for bench/roofline.py (changes Inductor's cache key: cold starts are not comparable); "
                             "kernels are numbered across the process's graphs, so every profiled name has one byte count")
    parser.add_argument("--inductor-option", action="append", default=[], metavar="KEY=VALUE",
                        help="extra Inductor option for flashsac_opt's variants (VALUE parsed as JSON), e.g. coordinate_descent_tuning=true")
    parser.add_argument("--note", default="", help="free text stored in the JSON (e.g. the Inductor cache state)")
    parser.add_argument("--prewarm", type=int, default=0, metavar="N",
                        help="compile every cell first in processes of their own, N at a time, on the same Inductor cache")
    parser.add_argument("--prewarm-timeout", type=float, default=None, metavar="S",
                        help="stop a prewarm process after S seconds; its cell is then not timed (it would compile as long again)")
    add_output_arguments(parser)
    args = parser.parse_args(argv)
    if args.kernel_bytes and args.prewarm:
        # a prewarm process numbers its kernels from 0 too: the cells it compiled would share names again
        parser.error("--kernel-bytes compiles every cell in this process (unique kernel names): drop --prewarm")

    if plot_only_or_require_cuda(parser, args, plot):
        return 0
    for item in args.inductor_option:
        key, sep, value = item.partition("=")
        if not sep:
            parser.error(f"--inductor-option expects KEY=VALUE, got {item!r}")
        try:
            INDUCTOR_OPTIONS[key] = json.loads(value)
        except json.JSONDecodeError:
            INDUCTOR_OPTIONS[key] = value
    if args.kernel_bytes:
        from torch._inductor import config as inductor_config

        inductor_config.benchmark_kernel = True  # every generated Triton kernel records kernel_num_gb
    # a name per generated kernel across all graphs (--kernel-bytes): one byte count per profiled name
    with unique_kernel_names() if args.kernel_bytes else contextlib.nullcontext():
        if any(v.startswith("unilab") for v in args.variants):
            try:
                import unilab.rl.algos.flash_sac.learner  # noqa: F401
            except ImportError:
                parser.error("UniLab 1.5.2 is not installed (needed for the unilab_* variants)")
        report = {
            "experiment": "benchmark_learner",
            "timed": "host clock around: update phase + metrics read (D2H) + current-stream synchronize; batch pre-sampled",
            "environment": {**environment(), **({"measured_peaks": measure_peaks()} if args.kernel_bytes else {})},
            "command": " ".join(["python", *sys.argv]),
            "inductor_options": INDUCTOR_OPTIONS,
            "note": args.note,
            "cells": [],
        }
        def save() -> None:
            report["ratios"] = ratios(report["cells"])
            if args.output:
                write_report(report, args.output)

        if args.prewarm:
            passthrough = [f"--inductor-option={item}" for item in args.inductor_option]
            start = time.perf_counter()
            report["prewarm"] = prewarm(args.workloads, args.variants, args.prewarm, passthrough, args.prewarm_timeout)
            report["prewarm_processes"], report["prewarm_s"] = args.prewarm, round(time.perf_counter() - start, 1)
            save()

        # Pass 1 times every cell; pass 2 profiles them. torch.profiler leaves CUPTI attached
        # when it ends (pytorch/pytorch#144455), which slows every later kernel launch, so no
        # cell may be timed after any profile has run in this process.
        profiles = []
        unfinished = {(row["workload"], row["variant"]) for row in report.get("prewarm", []) if row.get("timed_out")}
        for wname in args.workloads:
            for variant in args.variants:
                print(f"== {wname} {variant}", flush=True)
                if (wname, variant) in unfinished:
                    cell = {"variant": variant, "workload": wname, "error": f"not timed: its prewarm compile did not finish within {args.prewarm_timeout:g} s"}
                else:
                    try:
                        cell, profile = run_cell(variant, wname, args.iters, args.warmup, "cuda")
                        profiles.append((cell, profile))
                    except Exception as exc:  # keep measuring the other cells
                        cell = {"variant": variant, "workload": wname, "error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()[-3000:]}
                report["cells"] = [c for c in report["cells"] if not (c["variant"] == variant and c["workload"] == wname)]
                report["cells"].append(cell)
                summary = {k: (round(v, 3) if isinstance(v, float) else v) for k, v in cell.items() if k in ("ms_median", "ms_p90", "cold_start_s", "peak_memory_mib", "error")}
                print(f"   {summary}", flush=True)
                save()
        # Compile-mode learners recompile here (Dynamo was reset between cells): profile them
        # last, so a time limit cuts the slowest part.
        profiles.sort(key=lambda item: "compile" in item[0]["variant"])
        for cell, profile in profiles if not args.no_profile else []:
            try:
                cell.update(profile())
            except Exception as exc:
                cell["profile_error"] = f"{type(exc).__name__}: {exc}"
            print(f"   kernels {cell['workload']} {cell['variant']}: {cell.get('kernels_per_iteration')}", flush=True)
            save()
        profiles.clear()
        if args.plot:
            plot(report, args.plot)
        print(f"{'workload':8} {'variant':15} {'median ms':>10} {'p90 ms':>8} {'cold s':>7} {'kernels':>8}")
        for c in report["cells"]:
            if "ms_median" in c:
                print(f"{c['workload']:8} {c['variant']:15} {c['ms_median']:10.3f} {c['ms_p90']:8.3f} {c['cold_start_s']:7.1f} {c.get('kernels_per_iteration', float('nan')):8.0f}")
            else:
                print(f"{c['workload']:8} {c['variant']:15} ERROR {c['error'][:80]}")
        for row in report.get("ratios", []):
            print(row["workload"], {k: round(v, 3) for k, v in row.items() if k != "workload"})
        return 0


if __name__ == "__main__":
    sys.exit(main())
