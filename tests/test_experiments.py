"""Command-line handling and JSON schema of the experiments (CPU)."""

import ast
import copy
import importlib.util
import json
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

REPO = Path(__file__).resolve().parents[1]


def run(script, *args):
    """Run experiments/<script> (a path below experiments/) as a command, as its users do."""
    return subprocess.run([sys.executable, str(REPO / "experiments" / script), *args], capture_output=True, text=True, timeout=600)


def load(script):
    """experiments/<script> imported as a module; the sys.path entry it adds for its own
    imports is taken out again."""
    saved = list(sys.path)
    try:
        spec = importlib.util.spec_from_file_location(Path(script).stem, REPO / "experiments" / script)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    finally:
        sys.path[:] = saved
    return module


def test_benchmark_rejects_bad_options_and_needs_cuda():
    bad = run("bench/benchmark_learner.py", "--workloads", "W9")
    assert bad.returncode == 2 and "invalid choice: 'W9'" in bad.stderr
    # byte counts need every cell compiled in one process (its kernel numbering), before any GPU work
    mixed = run("bench/benchmark_learner.py", "--kernel-bytes", "--prewarm", "2", "--workloads", "W1")
    assert mixed.returncode == 2 and "drop --prewarm" in mixed.stderr
    if not torch.cuda.is_available():
        no_gpu = run("bench/benchmark_learner.py", "--workloads", "W1")
        assert no_gpu.returncode == 2 and "needs a CUDA device" in no_gpu.stderr
        assert "Traceback" not in no_gpu.stderr


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the command line through the benchmark's no-CUDA refusal")
def test_benchmark_prewarm_runs_one_process_per_cell_with_the_options_passed_on():
    """--prewarm compiles each cell in a process of its own: the command it builds must parse
    (an unknown option would fail as 'unrecognized arguments', before the CUDA check), keep the
    cells in order and keep why a process failed."""
    prewarm = load("bench/benchmark_learner.py").prewarm
    rows = prewarm(["W1", "W3"], ["ours_graph", "unilab_graph"], 2, ["--inductor-option=combo_kernels=false", "--kernel-bytes"])
    assert [(r["workload"], r["variant"]) for r in rows] == [("W1", "ours_graph"), ("W1", "unilab_graph"), ("W3", "ours_graph"), ("W3", "unilab_graph")]
    for row in rows:
        assert row["rc"] == 2 and "needs a CUDA device" in row["error"] and "cold_start_s" not in row, row


def test_every_graph_study_changes_an_inductor_option_or_a_config_field_that_exists():
    """A misspelt study would be refused only on the device, after its prewarm (Inductor rejects an
    unknown option): each study's options must be Inductor config keys of this torch, its other
    keys fields of the learner's config, and each study must change something."""
    import dataclasses

    import torch._inductor.config as inductor_config

    from flashsac_opt.config import FlashSACConfig

    benchmark = load("bench/benchmark_learner.py")
    studies = benchmark.GRAPH_STUDIES
    fields = {f.name for f in dataclasses.fields(FlashSACConfig)} | set(benchmark.BUILDER_SWITCHES)
    known = set(inductor_config.get_config_copy())
    assert "ours_graph_pdl" in studies
    for name, change in studies.items():
        change = dict(change)
        options = change.pop("inductor_options", {})
        assert options or change, name
        assert change.get("pdl_placement", "wait_first") in ("wait_first", "trigger_first"), name
        assert set(options) <= known, (name, set(options) - known)
        assert set(change) <= fields, (name, set(change) - fields)


def test_benchmark_prewarm_stops_a_process_past_its_timeout_and_says_so():
    """--prewarm-timeout: a compile still running is stopped (a Triton-template autotune can
    outlast a device call), its row marked, and the process returns at once."""
    prewarm = load("bench/benchmark_learner.py").prewarm
    start = time.monotonic()
    (row,) = prewarm(["W1"], ["ours_graph"], 1, [], timeout=0.01)  # the interpreter alone takes longer
    assert time.monotonic() - start < 30
    assert row["timed_out"] is True and "did not finish within --prewarm-timeout 0.01 s" in row["error"] and "rc" not in row


def test_benchmark_plot_only_redraws_a_committed_result(tmp_path):
    source = REPO / "results" / "learner_benchmark" / "benchmark_learner_side_by_side_W1.json"
    out = tmp_path / "chart.png"
    done = run("bench/benchmark_learner.py", "--plot-only", str(source), "--plot", str(out))
    assert done.returncode == 0, done.stderr
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.stat().st_size > 10_000


def test_benchmark_ratios_compare_modes_within_one_workload():
    ratios = load("bench/benchmark_learner.py").ratios
    cell = lambda v, w, ms, k: {"variant": v, "workload": w, "ms_median": ms, "kernels_per_iteration": k}
    cells = [
        cell("unilab_graph", "W1", 2.0, 800), cell("unilab_compile", "W1", 10.0, 800),
        cell("ours_graph", "W1", 1.0, 300), cell("ours_compile", "W1", 4.0, 300),
        cell("ours_graph", "W3", 5.0, 900), cell("ours_graph_no_combo", "W3", 4.0, 450),  # no UniLab cell at W3
        {"variant": "unilab_graph", "workload": "W4", "error": "OOM"}, cell("ours_graph", "W4", 9.0, 900),
    ]
    row, study = ratios(cells)
    assert study == {"workload": "W3", "ours_graph_no_combo_vs_ours_graph": 0.8, "ours_graph_no_combo_kernels_vs_ours_graph": 0.5}
    assert row == {
        "workload": "W1",
        "ours_graph_vs_unilab_graph": 0.5,
        "ours_compile_vs_unilab_graph": 2.0,
        "ours_compile_vs_unilab_compile": 0.4,
        "ours_graph_kernels_vs_unilab_graph": 0.375,
    }


def test_validate_numerics_writes_its_schema(tmp_path, require_unilab):
    out = tmp_path / "numerics.json"
    done = run("validate_numerics.py", "--iterations", "2", "--batch-size", "8", "--updates-per-step", "2",
               "--normalize-reward", "on", "--output", str(out))
    assert done.returncode == 0, done.stdout + done.stderr
    report = json.loads(out.read_text())
    assert report["passed"] is True and report["tolerance_rel"] == 0.0  # CPU fp32: bit-identical
    case = report["cases"][0]
    assert case["mismatches"] == []
    assert len(case["per_update_loss_rel"]) == 4
    assert {"max_abs", "max_rel"} <= set(case["per_tensor"]["critic.predictor.logit_w.weight"])
    assert {"date", "torch", "device", "unilab"} <= set(report["environment"])


def test_validate_numerics_argument_errors():
    for args, message in (
        (["--dtype", "bf16"], "needs --device cuda"),
        (["--iterations", "0"], "--iterations must be >= 1"),
        (["--compare-modes", "graph"], "needs --device cuda"),
    ):
        done = run("validate_numerics.py", *args)
        assert done.returncode == 2 and message in done.stderr, (args, done.stderr)


def test_training_benchmark_refuses_an_unpatched_unilab(site, tmp_path):
    done = run("benchmark_flashsac_training.py", "--unilab-root", str(site), "--learner", "flashsac_opt", "--output", str(tmp_path / "x.json"))
    assert done.returncode == 2 and "not patched for flashsac_opt" in done.stderr and "Traceback" not in done.stderr
    assert run("benchmark_flashsac_training.py", "--num-envs", "0", "--output", "x").returncode == 2
    bad_limit = run("benchmark_flashsac_training.py", "--time-limit", "0", "--output", "x")
    assert bad_limit.returncode == 2 and "--time-limit must be > 0" in bad_limit.stderr


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU path is what CI exercises")
def test_training_benchmark_tiny_cpu_run(site, tmp_path, monkeypatch):
    """A real (tiny) G1 training through the CPU-admitting patch, stopped by --time-limit the
    way the device calls bound theirs: UniLab shuts down as on Ctrl-C and the JSON summarizes
    the iterations it logged."""
    from flashsac_opt.unilab import patch as unilab_patch
    from unilab_tree import add_g1_placeholders

    unilab_patch.apply(site, include_optional=True)
    add_g1_placeholders(site / "unilab")
    cache = tmp_path / "inductor_cache"  # (eager mode: the training adds nothing to it)
    (cache / "fxgraph").mkdir(parents=True)
    (cache / "fxgraph" / "entry").write_bytes(b"x")
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(cache))
    # UniLab's own torch.compile'd reset (reset_root_state_uniform_fused) would compile cold in this
    # fresh cache, in train's process and again in the collector's (~21 s on two cores) before the
    # first iteration; what this test checks is the benchmark's time limit, summary and start-up
    # record, so Dynamo is off (the learner is eager anyway) and the limit is shorter.
    monkeypatch.setenv("TORCHDYNAMO_DISABLE", "1")
    # UniLab's runner as it is, synchronizing after the update phase (the real G1 CPU test takes
    # the running-ahead path, the default)
    monkeypatch.setenv("FLASHSAC_OPT_UPDATE_RUNS_AHEAD", "0")
    limit = 30  # the first iteration ~10 s after launch on two cores without that compile
    out = tmp_path / "training.json"
    done = run(
        "benchmark_flashsac_training.py", "--unilab-root", str(site), "--learner", "flashsac_opt", "--mode", "eager",
        "--num-envs", "16", "--batch-size", "32", "--iterations", "100000", "--summary-last", "3",
        "--learning-starts", "2", "--replay-buffer-n", "8", "--log-root", str(tmp_path / "logs"), "--output", str(out),
        "--time-limit", str(limit), "--stack-samples", "0.5",
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    report = json.loads(out.read_text())
    assert report["stopped_by_time_limit"] and f"--time-limit {limit} s reached" in done.stderr
    assert report["iterations_logged"] == len(report["rows_all"]) < 100000
    assert len(report["rows"]) == 3 and len(report["rows_all"]) >= 3
    walls = [r["wall_s"] for r in report["rows_all"]]
    # (on two cores, Dynamo off: the first iteration ~10 s after launch, ~5 iterations a second after it)
    print(f"first logged iteration at {walls[0]:.1f} s, {len(walls)} iterations logged")
    # from launch, within the time limit: the iteration in flight when the limit's SIGINT lands is
    # still logged (one CI run logged its last at 55.0009 s with a 55-s limit) but is past the
    # limit, so not the run's; nor is what a training that swallowed the Ctrl-C logged after it
    assert 0 < walls[0] and walls == sorted(walls) and walls[-1] <= limit
    assert report["iterations_logged_past_time_limit"] >= 0
    for key in ("learner_train_ms", "collector_cycle_ms", "iter_ms", "inference_ms", "collector_update_state_ms"):
        assert set(report[key]) >= {"mean", "median", "p90", "p95"} and report[key]["median"] > 0, key
    assert "inference_ms" in report["rows"][-1]  # per row too
    # the learner's other phases and the collector's step: the iteration's gap, read whole
    for key in ("collector_wait_ms", "collector_release_ms", "replay_sample_ms", "inference_h2d_ms", "inference_d2h_ms",
                "collector_action_wait_ms", "collector_env_step_ms"):
        assert report[key] is not None and report[key]["median"] >= 0 and key in report["rows"][-1], key
    assert report["training_config"]["critic_updates_per_iteration"] == 2
    assert report["training_config"]["actor_updates_per_iteration"] == 1
    assert report["environment"]["device"] == "cpu" and report["unilab_patches"]["0001-flashsac-opt-learner"] == "applied"
    # the Inductor cache the training found at launch (set above): one file there, so a warm start
    assert report["inductor_cache_at_launch"] == {"dir": str(cache), "files": 1, "warm": True}
    assert report["data_parallel"] is None and all(k.startswith("NCCL_") for k in report["nccl_exported"])  # one CPU rank
    # the learner's start-up milestones, in order, before the first iteration's event
    t = report["startup_timeline"]
    assert t["learner_constructed"] == {"compile_ahead": False, "learner_mode": "eager"}
    assert 0 < t["learner_constructed_s"] <= t["first_update_start_s"] <= t["first_update_end_s"] <= walls[0]
    assert "prepare_for_collection_start_s" not in t  # eager: nothing to compile before collection
    # the stack samples: train's process from launch, and the collector process it spawned later,
    # each named by where in UniLab its main thread was until the first update
    procs = report["startup_stacks"]
    assert len(procs) >= 2 and procs[0]["started_s"] < 2.0 and procs[1]["started_s"] > procs[0]["started_s"]
    assert procs[0]["samples"] <= t["first_update_start_s"] / 0.5 + 1
    assert any(where.startswith("unilab/") for where, _ in procs[0]["seconds_by_where"]), procs[0]["seconds_by_where"]
    assert all(s["seconds"] >= 1.0 for p in procs for s in p["segments"])  # two samples or more
    # the host's CPU from the first to the last logged iteration, inside the training's process tree:
    # UniLab's `train` (the root) runs train_flashsac.py, the learner's process, which computed; the
    # collector, forked from patch 0005's server, computed too
    load = report["host_load"]
    assert load["since_s"] == walls[0] and load["until_s"] == walls[-1] and load["samples"] >= 3
    procs = load["training_processes"]
    learner = [p for p in procs if "train_flashsac.py" in p["cmd"] and not p["root"]]
    collector = [p for p in procs if "collector_start" in p["cmd"] and p["cpu_s"] > 0.1]
    assert learner and learner[0]["cpu_s"] > 1.0 and learner[0] is procs[0], procs
    assert collector, procs
    assert load["outside_training_cores"]["median"] is not None and 0 <= load["host_busy_share"]["median"] <= 1


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU path is what CI exercises")
def test_a_training_stopped_before_its_first_update_still_writes_its_report_and_fails(site, tmp_path):
    """Stock UniLab's cold compile once took a seed's whole share (issue 17's U8 call): the run
    must leave a report that says so (no rows, stopped by the limit) so the seed
    counts as one that reached nothing, and still exit 2. Here the limit comes during UniLab's
    own start (its first update is ~25-35 s after launch on two cores)."""
    from flashsac_opt.unilab import patch as unilab_patch
    from unilab_tree import add_g1_placeholders

    unilab_patch.apply(site, include_optional=True)
    add_g1_placeholders(site / "unilab")
    out = tmp_path / "training.json"
    done = run(
        "benchmark_flashsac_training.py", "--unilab-root", str(site), "--learner", "flashsac_opt", "--mode", "eager",
        "--num-envs", "16", "--batch-size", "32", "--iterations", "100000", "--learning-starts", "2", "--replay-buffer-n", "8",
        "--log-root", str(tmp_path / "logs"), "--output", str(out), "--time-limit", "8",
    )
    assert done.returncode == 2 and "logged no learner iteration" in done.stderr and str(out) in done.stderr, done.stderr[-2000:]
    report = json.loads(out.read_text())
    # stopped by its limit, not crashed ("completed" as for any run the limit stopped)
    assert report["stopped_by_time_limit"] and report["completed"] and report["iterations_logged"] == 0
    assert report["rows_all"] == report["rows"] == [] and report["learner_train_ms"] is None
    ttr = load("time_to_reward.py")
    run_summary = ttr.summarize_file(out, 500)
    assert run_summary["first_update_s"] is None and run_summary["time_to_reward"] == {"20": None, "30": None}
    group = ttr.group_runs([run_summary])[0]
    assert group["median"]["first_update_s"] is None and group["reached"] == {"20": 0, "30": 0}
    table = ttr.markdown_table({"runs": [run_summary], "groups": [group], "thresholds": [20.0, 30.0], "window": 20})
    assert "| s1 before its first update |" in table


def test_replay_stability_short_cpu_run(tmp_path):
    """The committed real-G1 replay file, a few iterations, compile (aot_eager) vs eager."""
    out, png = tmp_path / "stability.json", tmp_path / "stability.png"
    done = run("validate_replay_stability.py", "--device", "cpu", "--mode", "compile", "--compile-backend", "aot_eager",
               "--iterations", "8", "--batch-size", "16", "--updates-per-step", "2", "--check-every", "2",
               "--output", str(out), "--plot", str(png))
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    report = json.loads(out.read_text())
    assert report["checks"]["finite"] and report["checks"]["no_recompiles_after_warmup"]
    assert report["checks"]["memory_flat"] is None  # not measurable on CPU, and not claimed
    assert report["replay"]["rows"] == 4096 and report["replay"]["dims"]["obs_dim"] == 98
    assert len(report["drift"]["compile"]["critic"]) == 8
    assert report["final_drift"]["compile"]["critic"] == 0.0  # aot_eager runs eager's kernels
    assert png.stat().st_size > 10_000
    assert report["iterations_run"] == 8 and not report["stopped_by_time_limit"]
    # A time limit ends the run after the warm-up; the report covers what ran and says so.
    cut = tmp_path / "cut.json"
    done = run("validate_replay_stability.py", "--device", "cpu", "--mode", "compile", "--compile-backend", "aot_eager",
               "--iterations", "1000", "--batch-size", "16", "--updates-per-step", "2", "--time-limit", "0", "--output", str(cut))
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    report = json.loads(cut.read_text())
    assert report["stopped_by_time_limit"] and report["iterations_run"] == 6  # warm-up (5) + 1
    assert len(report["drift"]["compile"]["critic"]) == 6 and report["checks"]["finite"]


def test_replay_sampling_benchmark_plot_only_and_needs_cuda(tmp_path):
    report = {
        "workload": {"row_width": 930, "row_bytes": 3720, "rows_per_iteration": 32768, "mib_per_iteration": 116.25},
        "warmup": 5, "repeat": 20, "environment": {"gpu": "test", "torch": "x"},
        "capacities": [
            {"exponent": 20, "capacity_gib": 3.6, "speedup_graph": 50.0,
             "results": {k: {"median": m, "p90": m, "mean": m} for k, m in
                         (("cpu_sample", 6.0), ("h2d", 2.0), ("cpu_sample_h2d", 6.1), ("gpu_sample", 0.12), ("gpu_sample_graph", 0.1))}},
            {"exponent": 26, "capacity_gib": 232.5, "skipped": "too large"},
        ],
    }
    source, png = tmp_path / "r.json", tmp_path / "r.png"
    source.write_text(json.dumps(report))
    done = run("bench/benchmark_replay_sampling.py", "--plot-only", str(source), "--plot", str(png))
    assert done.returncode == 0, done.stderr
    assert png.read_bytes()[:4] == b"\x89PNG"
    if not torch.cuda.is_available():
        no_gpu = run("bench/benchmark_replay_sampling.py")
        assert no_gpu.returncode == 2 and "needs a CUDA device" in no_gpu.stderr


def test_time_to_reward_band_spans_the_longest_run_and_averages_only_where_all_seeds_run():
    """time_to_reward.band: two seeds, one 10 s and one 20 s long: min/max wherever one runs, the
    mean only up to the shorter one's end (after it a mean of one seed would jump)."""
    ttr = load("time_to_reward.py")
    t = np.arange(0.0, 21.0)
    b = ttr.band([(t[:11], t[:11]), (t, t + 2.0)], 21)
    assert b["grid_s"][-1] == 20.0 and b["runs_present"][:11] == [2] * 11 and b["runs_present"][11:] == [1] * 10
    assert (b["mean"][0], b["min"][0], b["max"][0]) == (1.0, 0.0, 2.0)
    assert b["mean"][10] == 11.0 and b["mean"][11] != b["mean"][11]  # NaN where one seed has ended
    assert (b["min"][20], b["max"][20]) == (22.0, 22.0)


def test_benchmark_multigpu_cpu_smoke_writes_its_schema(tmp_path):
    """Two gloo ranks on CPU (eager): the multi-GPU benchmark's JSON schema and plot."""
    out, png = tmp_path / "mg.json", tmp_path / "mg.png"
    done = run("bench/benchmark_multigpu.py", "--device", "cpu", "--nproc", "1", "2", "--workloads", "T", "--iters", "2",
               "--warmup", "1", "--capacity", "256", "--output", str(out), "--plot", str(png))
    assert done.returncode == 0, done.stdout + done.stderr
    report = json.loads(out.read_text())
    assert report["mode"] == "eager" and report["scaling"].startswith("weak")
    one, two = sorted(report["cells"], key=lambda c: c["world_size"])
    assert (one["world_size"], two["world_size"]) == (1, 2)
    assert "error" not in one and "error" not in two, (one.get("traceback"), two.get("traceback"))
    assert one["scaling_efficiency"] == 1.0 and one["collective_bytes_per_rank"] == 0
    assert two["finite"] and two["collective_bytes_per_rank"] > 0 and two["ranks_bit_identical"]
    assert two["bytes_sampled_global"] == 2 * two["bytes_sampled_per_rank"] == 2 * one["bytes_sampled_per_rank"]
    assert two["sample_new_ratio_global"] == 2 * one["sample_new_ratio_global"] == 2 * 16 * 4 / 2048
    assert len(two["ranks_ms_median"]) == 2 and two["scaling_efficiency"] == one["ms_median"] / two["ms_median"]
    assert two["collective_ms_per_iteration"] == max(0.0, two["ms_median"] - one["ms_median"])
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    bad = run("bench/benchmark_multigpu.py", "--device", "cpu", "--mode", "graph")
    assert bad.returncode == 2 and "--mode graph needs --device cuda" in bad.stderr and "Traceback" not in bad.stderr


@pytest.fixture(scope="module")
def grad_sync_cells(tmp_path_factory):
    """`benchmark_multigpu.py --grad-sync both` at one gradient wire dtype: its cells, each wire's
    command run once per module. The bfloat16 case compares against the float32 cells, the very
    command (same arguments, same seeds, deterministic on gloo) the float32 case asserts on: run
    twice, it cost ~17 s of two-rank start-up for the same JSON."""
    runs: dict[str, list[dict]] = {}

    def cells(wire: str) -> list[dict]:
        if wire not in runs:
            folder = tmp_path_factory.mktemp(f"grad_sync_{wire}")
            out = folder / f"mg_{wire}.json"
            done = run("bench/benchmark_multigpu.py", "--device", "cpu", "--nproc", "2", "--workloads", "T", "--iters", "2", "--warmup", "1",
                       "--capacity", "256", "--grad-sync", "both", "--gradient-wire-dtype", wire, "--output", str(out), "--plot", str(folder / "mg.png"))
            assert done.returncode == 0, done.stdout + done.stderr
            runs[wire] = json.loads(out.read_text())["cells"]
        return copy.deepcopy(runs[wire])

    return cells


@pytest.mark.parametrize("wire", ["float32", "bfloat16"])
def test_benchmark_multigpu_unilab_gradient_sync_reaches_the_same_state_as_the_own_bucket(require_unilab, grad_sync_cells, wire):
    """--grad-sync both: the 2-rank cell runs once with flashsac_opt's averager and once with
    UniLab's gradient all-reduce (plus a second all-reduce for the loss, BN statistics and
    entropy). Both average the same numbers the same way (fp32: a sum of two, divided by two;
    bf16 wire: rounded, summed, restored, times one half), so on gloo the two cells must end in the
    same learner state, bit for bit, with bit-identical ranks; the bf16 wire sends fewer bytes."""
    cells = grad_sync_cells
    own, unilab = cells(wire)
    assert (own["grad_sync"], unilab["grad_sync"]) == ("flashsac_opt", "unilab")
    assert "error" not in own and "error" not in unilab, (own.get("traceback"), unilab.get("traceback"))
    assert own["ranks_bit_identical"] and unilab["ranks_bit_identical"] and own["finite"]
    assert own["state_sha256_rank0"] == unilab["state_sha256_rank0"]
    if wire == "bfloat16":
        fp32, _ = cells("float32")
        assert own["state_sha256_rank0"] != fp32["state_sha256_rank0"]
        assert own["collective_bytes_per_rank"] < fp32["collective_bytes_per_rank"]


def test_multigpu_collective_cost_is_measured_against_the_same_code_path():
    """Efficiency against the best single GPU; the collective's cost against one GPU on the
    data-parallel (unfused) path, so fusing is not booked as communication."""
    add_scaling = load("bench/benchmark_multigpu.py").add_scaling
    cells = [
        {"workload": "W3", "world_size": 1, "ms_median": 8.0},
        {"workload": "W3", "world_size": 1, "ms_median": 9.0, "baseline_of_collectives": True},
        {"workload": "W3", "world_size": 2, "ms_median": 10.0},
        {"workload": "W4", "world_size": 1, "ms_median": 4.0},
        {"workload": "W4", "world_size": 2, "ms_median": 5.0},
        {"workload": "W4", "world_size": 4, "error": "NCCL"},
    ]
    add_scaling(cells)
    w3_one, w3_base, w3_two, w4_one, w4_two, w4_four = cells
    assert w3_two["scaling_efficiency"] == 0.8 and w3_two["collective_ms_per_iteration"] == 1.0
    assert w3_two["collective_share"] == 0.1
    assert "scaling_efficiency" not in w3_base  # the baseline is not a scaling point
    assert w3_one["scaling_efficiency"] == 1.0 and w3_one["collective_ms_per_iteration"] == 0.0
    # no unfused cell: the best single GPU is the baseline of both
    assert w4_two["scaling_efficiency"] == 0.8 and w4_two["collective_ms_per_iteration"] == 1.0
    assert "scaling_efficiency" not in w4_four


def test_bf16_obs_storage_experiment_short_cpu_run(tmp_path):
    out = tmp_path / "bf16.json"
    done = run("validate/validate_bf16_obs_storage.py", "--iterations", "2", "--batch-size", "16", "--output", str(out))
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    report = json.loads(out.read_text())
    assert report["stored_row_bytes"]["bf16_obs"] < report["stored_row_bytes"]["fp32"]
    assert 0 < report["obs_storage_max_relative_error"]["obs"] <= 2**-8  # bf16: 8 significant bits
    assert len(report["drift"]["bf16_obs"]["critic"]) == 2 and report["finite"]
    # the storage rounding moves the run more than the 1e-7 rounding floor does
    assert report["final_drift"]["bf16_obs"]["critic"] > report["final_drift"]["rounding_floor"]["critic"] > 0


def _committed(path: Path) -> dict:
    """A committed training report by its name or its file's (results/ keeps them gzipped; summaries
    name the .json), read as the experiments read them."""
    common = load("common.py")
    return common.read_json(path.with_name(f"{common.report_name(path)}.gz"))


def test_summarize_trainings_table_from_the_committed_h200_runs(tmp_path):
    runs = sorted((REPO / "results" / "trainings").glob("training_*.json.gz"))
    assert len(runs) >= 4
    out, md = tmp_path / "summary.json", tmp_path / "summary.md"
    done = run("report/summarize_trainings.py", *map(str, runs), "--output", str(out), "--markdown", str(md))
    assert done.returncode == 0, done.stderr
    summary = json.loads(out.read_text())["runs"]
    by = {(r["updates_per_step"], r["batch_size"], r["learner"], r["mode"], r["seed"]): r for r in summary}
    assert len(by) == len(runs)  # one row per run
    for u in (2, 8):
        stock, ours = by[(u, 256, "unilab", "graph", 1)], by[(u, 256, "flashsac_opt", "graph", 1)]
        assert stock["learner_ms_vs_unilab_default"] == 1.0
        assert ours["learner_ms_vs_unilab_default"] == ours["learner_ms_median"] / stock["learner_ms_median"]
        assert ours["first_learner_iteration_s"] == min(r["wall_s"] for r in _committed(REPO / "results" / "trainings" / ours["file"])["rows_all"])
    assert md.read_text().count("\n") == 2 + len(runs)
    # a run cut by its time limit is not complete, and says why
    assert all(r["completed"] or r["stopped_by_time_limit"] for r in summary)
    # ... in the table as well, on its own row; the committed reports predate the recorded
    # Inductor cache field, so every row says "unknown" there rather than a guess
    assert any(r["stopped_by_time_limit"] for r in summary)
    for r, line in zip(summary, md.read_text().splitlines()[2:], strict=True):
        assert line.startswith(f"| {r['updates_per_step']} | {r['batch_size']} | {r['learner']} | {r['mode']} | {r['seed']} |")
        assert ("(time limit)" in line) == r["stopped_by_time_limit"]
        assert r["inductor_cache_warm_at_launch"] is None and "| unknown |" in line
    # batch 2048 compares with stock UniLab's graph mode at batch 2048, not at 256
    b2048 = by[(8, 2048, "flashsac_opt", "graph", 1)]
    assert b2048["learner_ms_vs_unilab_default"] == b2048["learner_ms_median"] / by[(8, 2048, "unilab", "graph", 1)]["learner_ms_median"]
    # ... and without that reference a row has no ratio (stock's B2048 run left out)
    # (that row as reports that record a warm and a cold Inductor cache at launch: the table says which)
    report = _committed(REPO / "results" / "trainings" / b2048["file"])
    for state, files in (("warm", 12), ("cold", 0)):
        report["inductor_cache_at_launch"] = {"dir": str(tmp_path / "inductor_cache"), "files": files, "warm": state == "warm"}
        (tmp_path / f"{state}.json").write_text(json.dumps(report))
    alone = run("report/summarize_trainings.py", str(tmp_path / "warm.json"), str(tmp_path / "cold.json"),
                "--output", str(tmp_path / "a.json"), "--markdown", str(tmp_path / "a.md"))
    assert alone.returncode == 0, alone.stderr
    warm_row, cold_row = json.loads((tmp_path / "a.json").read_text())["runs"]
    assert warm_row.get("learner_ms_vs_unilab_default") is None and warm_row["inductor_cache_warm_at_launch"] is True
    assert cold_row["inductor_cache_warm_at_launch"] is False
    warm_line, cold_line = (tmp_path / "a.md").read_text().splitlines()[2:]
    assert f"| warm | {b2048['first_learner_iteration_s']:.0f} |" in warm_line
    assert f"| cold | {b2048['first_learner_iteration_s']:.0f} |" in cold_line
    assert b2048["inductor_cache_warm_at_launch"] is None  # written before the field: unknown, not cold
    # the U8 compile run that crashed after 172 of 1000 iterations (exit status 0) was rerun to
    # completion (results/trainings); the crashed report is kept under results/trainings/raw/
    assert by[(8, 256, "flashsac_opt", "compile", 1)]["completed"]
    crashed_file = REPO / "results" / "trainings" / "raw" / "training_u8_b256_flashsac_opt_compile_s1_crashed_2026-11-29.json"
    done = run("report/summarize_trainings.py", str(crashed_file), "--output", str(tmp_path / "c.json"), "--markdown", str(md))
    assert done.returncode == 0, done.stderr
    (crashed,) = json.loads((tmp_path / "c.json").read_text())["runs"]
    assert not crashed["completed"] and not crashed["stopped_by_time_limit"] and "ended early" in md.read_text()
    bad = run("report/summarize_trainings.py", str(REPO / "results" / "replay_sampling" / "replay_sampling_h200.json"), "--output", str(tmp_path / "x.json"))
    assert bad.returncode == 2 and "not a benchmark_flashsac_training.py report" in bad.stderr and "Traceback" not in bad.stderr


def test_summarize_trainings_compares_data_parallel_runs_with_stock_on_as_many_gpus(tmp_path):
    """A 2-GPU run's ratio is against stock UniLab on 2 GPUs, never the 1-GPU stock run; the table
    says how many GPUs and whether flashsac_opt's ranks ended bit-identical."""
    folder = REPO / "results" / "trainings"
    stock1, ours1 = (_committed(folder / f"training_u8_b256_{n}_graph_s1.json.gz") for n in ("unilab", "flashsac_opt"))
    stock2, ours2 = json.loads(json.dumps(stock1)), json.loads(json.dumps(ours1))
    stock2["environment"].update(cuda_visible_devices="0,1", device="cuda")
    stock2["learner_train_ms"]["median"] = 2 * stock1["learner_train_ms"]["median"]
    digests = {"state_digest": "a", "networks_digest": "b"}
    ours2["data_parallel"] = {"world_size": 2, "ranks": [{"rank": 0, **digests}, {"rank": 1, **digests}], "ranks_equal": True}
    paths = []
    for name, report in (("s1", stock1), ("o1", ours1), ("s2", stock2), ("o2", ours2)):
        paths.append(tmp_path / f"{name}.json")
        paths[-1].write_text(json.dumps(report))
    out, md = tmp_path / "summary.json", tmp_path / "summary.md"
    done = run("report/summarize_trainings.py", *map(str, paths), "--output", str(out), "--markdown", str(md))
    assert done.returncode == 0, done.stderr
    summary = json.loads(out.read_text())["runs"]
    by = {(r["learner"], r["gpus"]): r for r in summary}
    s1, o1, s2, o2 = (by[k] for k in (("unilab", 1), ("flashsac_opt", 1), ("unilab", 2), ("flashsac_opt", 2)))
    assert o1["learner_ms_vs_unilab_default"] == o1["learner_ms_median"] / s1["learner_ms_median"]
    assert o2["learner_ms_vs_unilab_default"] == o2["learner_ms_median"] / s2["learner_ms_median"]
    assert (o1["ranks_bit_identical"], o2["ranks_bit_identical"]) == (None, True)
    lines = dict(zip((r["file"] for r in summary), md.read_text().splitlines()[2:], strict=True))
    assert lines["o2.json"].startswith("| 8 | 256 | flashsac_opt | graph | 1 | 2 |") and lines["o2.json"].endswith("| yes |")
    assert lines["o1.json"].endswith("|  |") and "| 1 |" in lines["o1.json"]


class _Ranks:
    """A stand-in for torch.multiprocessing's spawn context: join() raises as a rank that died does."""

    def __init__(self, outcome):
        self.outcome, self.processes, self.killed = outcome, [self, self], 0

    def join(self, timeout=None):
        import torch.multiprocessing as mp

        if self.outcome == "died":
            raise mp.ProcessExitedException("process 1 terminated with signal SIGABRT", error_index=1, error_pid=1,
                                            exit_code=-6, signal_name="SIGABRT")
        return True

    def kill(self):
        self.killed += 1


def test_multigpu_cell_keeps_a_measurement_whose_rank_died_in_teardown(tmp_path):
    bench = load("bench/benchmark_multigpu.py")
    results = tmp_path / "ranks.json"
    # died before rank 0 wrote the results: the cell fails
    with pytest.raises(torch.multiprocessing.ProcessExitedException):
        bench.wait_for_ranks(_Ranks("died"), str(results), 2, 60)
    # died after: the measurement stands, the teardown error is reported, the ranks are killed
    results.write_text("[]")
    ranks = _Ranks("died")
    hung, error = bench.wait_for_ranks(ranks, str(results), 2, 60)
    assert (hung, ranks.killed) == (False, 2) and "SIGABRT" in error
    assert bench.wait_for_ranks(_Ranks("ok"), str(results), 2, 60) == (False, None)


def test_startup_summary_reads_first_update_and_the_compile_ahead_line(tmp_path):
    import io
    import tarfile

    training = {
        "rows_all": [{"wall_s": 92.5}, {"wall_s": 93.1}], "iterations_logged": 2,
        "learner_train_ms": {"median": 39.8, "p90": 40.2}, "iter_ms": {"median": 58.2},
        "inductor_cache_at_launch": {"files": 0, "warm": False}, "environment": {"gpu": "NVIDIA H200", "torch": "2.11.0"},
    }
    (tmp_path / "t.json").write_text(json.dumps(training))
    archive = tmp_path / "logs.tgz"
    with tarfile.open(archive, "w:gz") as tar:
        for name, text in {"raw/ok.log": "flashsac_opt: compile-ahead child done in 52.6 s; the first update waited 24.0 s for it\n",
                           "raw/cut.log": "benchmark_flashsac_training: --time-limit 114 s reached: interrupting the training\n"}.items():
            data = text.encode()
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    out = tmp_path / "summary.json"
    done = subprocess.run([sys.executable, str(REPO / "experiments" / "report" / "summarize_startup.py"),
                           "--run", f"ok={tmp_path / 't.json'}:{archive}:raw/ok.log", "--run", f"cut=-:{archive}:raw/cut.log",
                           "--output", str(out)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    runs = json.loads(out.read_text())["runs"]
    assert runs["ok"]["first_update_s"] == 92.5 and runs["ok"]["learner_ms_median"] == 39.8
    assert runs["ok"]["compile_ahead_child_s"] == 52.6 and runs["ok"]["compile_ahead_waited_s"] == 24.0
    assert runs["ok"]["stopped_by_time_limit_s"] is None and runs["ok"]["logged_an_iteration"]
    assert "first_update_s" not in runs["cut"] and runs["cut"]["stopped_by_time_limit_s"] == 114.0
    assert not runs["cut"]["logged_an_iteration"] and "compile_ahead_child_s" not in runs["cut"]
    assert "phases_s" not in runs["ok"]  # no milestones in that JSON

    # a JSON with flashsac_opt's milestones and stack samples: launch -> first update by phase
    training.update(startup_timeline={"learner_constructed_s": 38.0, "prepare_for_collection_start_s": 40.5,
                                      "prepare_for_collection_end_s": 80.0, "first_update_start_s": 91.0, "first_update_end_s": 91.4},
                    startup_stacks=[{"cmd": "python train", "started_s": 0.1, "samples": 70,
                                     "seconds_by_where": [["unilab/envs/mdp/events.py:reset_root_state_uniform_fused > torch/_dynamo", 10.0]]},
                                    {"cmd": "compile worker", "started_s": 41.0, "samples": 0, "seconds_by_where": []}])
    (tmp_path / "timed.json").write_text(json.dumps(training))
    fig = tmp_path / "startup.png"
    done = subprocess.run([sys.executable, str(REPO / "experiments" / "report" / "summarize_startup.py"),
                           "--run", f"timed={tmp_path / 'timed.json'}", "--run", f"stock={tmp_path / 't.json'}",
                           "--output", str(out), "--plot", str(fig)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    timed = json.loads(out.read_text())["runs"]["timed"]
    assert timed["phases_s"] == {"UniLab start to the learner": 38.0, "learner to start-up compile": 2.5,
                                 "start-up compile and capture": 39.5, "collector start, learning_starts": 11.0,
                                 "first update (compile-ahead wait, compile)": 0.4}
    (top,) = timed["startup_stacks_top"]  # the process with no samples is left out
    assert top["top"][0][1] == 10.0 and fig.read_bytes()[:4] == b"\x89PNG"
    # a warm start with compile ahead: the compile from the child's caches inside the collector's
    # start (patches/0004) is its own phase, and the phases still add up to the first update
    training.update(startup_timeline={"learner_constructed_s": 15.0, "prepare_for_collection_deferred_s": 16.0,
                                      "compile_ahead_done_s": 26.0, "startup_idle_compile_start_s": 26.0,
                                      "startup_idle_compile_end_s": 32.5, "first_update_start_s": 34.0, "first_update_end_s": 34.1})
    (tmp_path / "warm.json").write_text(json.dumps(training))
    done = subprocess.run([sys.executable, str(REPO / "experiments" / "report" / "summarize_startup.py"),
                           "--run", f"warm={tmp_path / 'warm.json'}", "--output", str(out)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert json.loads(out.read_text())["runs"]["warm"]["phases_s"] == {
        "UniLab start to the learner": 15.0, "learner to start-up compile": 1.0, "collector starting, before the compile from the caches": 10.0,
        "compile from the caches while the collector starts": 6.5, "collector start, learning_starts": 1.5,
        "first update (compile-ahead wait, compile)": 0.1}


# A stand-in for UniLab's train: logs Train/mean_reward (a ramp of 1 per iteration) through
# torch's SummaryWriter, as UniLab's logger does, then waits to be interrupted like Ctrl-C.
FAKE_TRAIN = """
import sys, time
from torch.utils.tensorboard import SummaryWriter
writer = SummaryWriter(log_dir=sys.argv[1])
try:
    for it in range(int(sys.argv[2])):
        writer.add_scalar("Train/mean_reward", float(it), it)
        time.sleep(0.01)
    time.sleep(120)
except KeyboardInterrupt:
    writer.close()
    sys.exit(3)
"""


@pytest.mark.parametrize("ramp, expect, sigint", [(200, "reward", "default"), (20, "time_limit", "default"), (200, "reward", "ignored")])
def test_training_benchmark_stops_once_the_moving_mean_reward_reaches_the_threshold(tmp_path, monkeypatch, request, ramp, expect, sigint):
    """--stop-at-reward: the watch reads the events while they are written and interrupts the
    training (SIGINT to its process group) once the 20-iteration mean reaches the threshold; a
    run whose reward never gets there is stopped by its time limit instead. "ignored": this
    process has SIGINT ignored, as a background job of a non-interactive shell has, and the
    training must still be interrupted as Ctrl-C would."""
    if sigint == "ignored":
        previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
        request.addfinalizer(lambda: signal.signal(signal.SIGINT, previous))
    pytest.importorskip("tensorboard")
    monkeypatch.syspath_prepend(str(REPO / "experiments"))  # its `common`, as when run as a script
    bench = load("benchmark_flashsac_training.py")
    watch = bench.RewardWatch(tmp_path, threshold=50.0)
    assert not watch.reached()  # no run directory yet
    run_dir = tmp_path / "g1" / "run0"
    started = time.monotonic()
    rc, reason = bench.run_training([sys.executable, "-c", FAKE_TRAIN, str(run_dir), str(ramp)], dict(os.environ),
                                    tmp_path, time_limit=60.0 if expect == "reward" else 8.0, watch=watch, poll_s=0.2)
    assert reason == expect and rc == 3  # interrupted as Ctrl-C would, and the writer closed
    elapsed = time.monotonic() - started
    if expect == "reward":
        assert elapsed < 30
        assert watch.reached()  # mean of 41..60 >= 50: the crossing is in the events
    else:
        assert elapsed >= 8 and not watch.reached()  # 0..19 never average 50


def test_saved_activations_lists_what_each_backward_keeps(monkeypatch):
    """saved_activations.py: one backward graph per loss (critic, actor) with its saved tensors,
    bf16 among them (the CUDA learner's autocast, applied on CPU), fp32 too (the BN affine's
    promotion), and totals that add up. (That a budget keeps less is test_modes' to check.)"""
    sa = load("bench/saved_activations.py")
    monkeypatch.setitem(sa.WORKLOADS, "T", dict(batch_size=64, updates_per_step=2, policy_frequency=2, obs_dim=5, critic_obs_dim=6, action_dim=3))
    r = sa.measure("T", "default")
    assert r["backward_graphs"] == 2 and r["saved_bytes"] == sum(g["saved_bytes"] for g in r["losses"])
    assert all(t["bytes"] > 0 and t["dtype"] for g in r["losses"] for t in g["tensors"])
    assert {"bfloat16", "float32"} <= {t["dtype"] for g in r["losses"] for t in g["tensors"]}
    assert 0 < r["bf16_share"] < 1 and r["backward_gemms"] == sum(g["backward_gemms"] for g in r["losses"]) > 0


def test_benchmark_records_why_aotautograd_bypassed_its_cache(tmp_path, monkeypatch):
    """A graph with an autocast region: on CPU, AOTAutograd's cache bypasses it and torch gives
    the reason to its logger only; the benchmark's handler keeps it (the options' warm start on
    the H200 doubled on two such bypasses whose reason the JSON did not hold)."""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    bench = load("bench/benchmark_learner.py")

    def loss(x, w):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return (x @ w).float().square().mean()

    logger = logging.getLogger(bench.CacheBypassReasons.LOGGER)
    level = logger.level
    torch._dynamo.reset()
    x, w = torch.randn(8, 4), torch.randn(4, 4, requires_grad=True)
    with bench.CacheBypassReasons() as bypass:
        torch.compile(loss, fullgraph=True)(x, w).backward()
    assert any("autocast" in r for r in bypass.reasons), bypass.reasons
    assert len(set(bypass.reasons)) == len(bypass.reasons)  # each reason once
    # detached afterwards, the logger as it was: a later compile's bypass is not collected
    seen = list(bypass.reasons)
    torch._dynamo.reset()
    torch.compile(loss, fullgraph=True)(x, w).backward()
    assert bypass.reasons == seen and bypass not in logger.handlers and logger.level == level


# ---- import circles (ast only, nothing imported) -------------------------------------------
# Each root is a folder its modules are imported from, its files named by their path under it, as
# `sys.path` would name them: the repository root for flashsac_opt/, experiments/ for the experiments
# (which put it on their path), tests/ for the tests. Every `import` and `from ... import` is an edge,
# also inside functions (imported when the function runs), except under `if TYPE_CHECKING:`; an edge
# goes to the module itself, not to the packages above it (a package's __init__ importing its own
# modules is no circle). The whole repository: python tests/test_experiments.py . experiments tests

def module_files(root: Path, others: list[Path] = ()) -> dict[str, Path]:
    """{dotted name: file} of the .py files under root (a package by its __init__.py), but for
    those under another root inside it, hidden folders (.venv) and build outputs (build/, dist/)."""
    found = {}
    for path in sorted(root.rglob("*.py")):
        parts = path.relative_to(root).with_suffix("").parts
        if any(p.startswith(".") or not p.isidentifier() or p in ("build", "dist") for p in parts[:-1]) or any(
                o != root and o.is_relative_to(root) and path.is_relative_to(o) for o in others):
            continue
        found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def _imported(tree: ast.AST, name: str, is_package: bool) -> list[str]:
    """The dotted names a module imports (a `from X import Y` gives X.Y and X: either may be a module)."""
    skip = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            skip.update(id(n) for stmt in node.body for n in ast.walk(stmt))
    out = []
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.Import):
            out += [[a.name] for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from the module's own package upwards
                package = name.split(".") if is_package else name.split(".")[:-1]
                package = package[: len(package) - (node.level - 1)]
                base = ".".join(package + ([base] if base else []))
            out += [[f"{base}.{a.name}" if base else a.name, base] for a in node.names]
    return out


def import_graph(roots: list[Path]) -> dict[Path, set[Path]]:
    """{file: files it imports} over the modules of every root; an import is looked up in the
    importing file's own root first, then in the others."""
    tables = [module_files(root, roots) for root in roots]
    graph: dict[Path, set[Path]] = {}
    for i, table in enumerate(tables):
        order = [table] + tables[:i] + tables[i + 1:]
        for name, path in table.items():
            edges = graph.setdefault(path, set())
            for candidates in _imported(ast.parse(path.read_text(), str(path)), name, path.name == "__init__.py"):
                for wanted in candidates:
                    target = next((t[wanted] for t in order if wanted in t), None)
                    if target is not None:
                        if target != path:
                            edges.add(target)
                        break
    return graph


def cycles(graph: dict[Path, set[Path]]) -> list[list[Path]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[Path, int] = {}
    low: dict[Path, int] = {}
    stack: list[Path] = []
    on_stack: set[Path] = set()
    found = []

    def visit(node: Path) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in graph.get(node, ()):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10 * len(graph) + 100))
    for node in sorted(graph):
        if node not in index:
            visit(node)
    return sorted(found)



def test_the_experiments_import_no_circle_and_the_check_finds_one(tmp_path):
    """The import graph over experiments/ (its own root, as the scripts put it on their path,
    flashsac_opt beside it): no circle. The same check on two modules that import each other (one
    of them inside a function, as benchmark_learner and roofline once did) and a package whose
    __init__ re-exports its module finds exactly that pair."""
    graph = import_graph([REPO / "experiments", REPO])
    assert REPO / "experiments" / "bench" / "workloads.py" in graph[REPO / "experiments" / "bench" / "roofline.py"]
    assert cycles(graph) == []
    (tmp_path / "a.py").write_text("import b\n")
    (tmp_path / "b.py").write_text("def f():\n    from a import g\n")
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "__init__.py").write_text("from .mod import h\n")
    (tmp_path / "pkg" / "mod.py").write_text("from pkg.other import x\nfrom typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import a\n")
    (tmp_path / "pkg" / "other.py").write_text("x = 1\n")
    graph = import_graph([tmp_path])
    assert graph[tmp_path / "pkg" / "mod.py"] == {tmp_path / "pkg" / "other.py"}  # not a: TYPE_CHECKING only
    assert cycles(graph) == [[tmp_path / "a.py", tmp_path / "b.py"]]
    done = subprocess.run([sys.executable, __file__, str(tmp_path)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 1 and "circle: " in done.stdout


if __name__ == "__main__":  # the import graph of the folders given (roots), its circles; exit 1 if any
    roots = [Path(r).resolve() for r in sys.argv[1:] or ["."]]
    graph = import_graph(roots)
    found = cycles(graph)
    print(f"{len(graph)} modules, {sum(map(len, graph.values()))} imports among them, {len(found)} circle(s)")
    for component in found:
        print("circle: " + " <-> ".join(str(p.relative_to(Path.cwd()) if p.is_relative_to(Path.cwd()) else p) for p in component))
    sys.exit(1 if found else 0)


def test_bytecode_state_is_reported_and_written_as_pip_would(tmp_path, monkeypatch):
    """A package installed with --no-compile under PYTHONDONTWRITEBYTECODE=1 has no bytecode: the
    report says so (share 0), compile_bytecode writes it (share 1), and a source edited after its
    .pyc counts as not cached again; an absent package is None."""
    monkeypatch.syspath_prepend(str(REPO / "experiments"))
    common = load("common.py")
    package = tmp_path / "fresh_pkg"
    (package / "sub").mkdir(parents=True)
    for rel in ("__init__.py", "a.py", "sub/__init__.py", "sub/b.py"):
        (package / rel).write_text("X = 1\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delenv("PYTHONPYCACHEPREFIX", raising=False)
    assert common.bytecode_cached(("fresh_pkg", "no_such_pkg_here")) == {"fresh_pkg": 0.0, "no_such_pkg_here": None}
    assert common.compile_bytecode(package) > 0
    assert common.bytecode_cached(("fresh_pkg",)) == {"fresh_pkg": 1.0}
    edited = package / "a.py"
    edited.write_text("X = 2\n")
    os.utime(edited, (time.time() + 60, time.time() + 60))
    assert common.bytecode_cached(("fresh_pkg",)) == {"fresh_pkg": 0.75}
