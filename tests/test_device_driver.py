"""The device driver (experiments/device/) on the CPU: its run matrix, dry run, time limits,
wheel check, baseline extraction, and the before/after comparison."""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
DEVICE = REPO / "experiments" / "device"


def _module(name: str):
    spec = importlib.util.spec_from_file_location(f"device_{name}", DEVICE / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


driver = _module("run")
before_after = _module("before_after")


def _driver(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(DEVICE / "run.py"), *args], cwd=REPO, capture_output=True, text=True,
                          env={**os.environ, **(env or {})}, timeout=120)


# ---- the matrix ----------------------------------------------------------------------------

def test_every_run_executes_something_that_exists_and_fits_the_device_limits():
    matrix = driver.load_matrix()
    assert {"env", "face_before_after_W1_W3", "side_by_side_default_W1_W4", "gpu_tests_parallel6"} <= set(matrix.runs)
    for name, run in matrix.runs.items():
        if run.script:
            assert (REPO / run.script).is_file(), f"{name}: {run.script}"
        if run.module:
            assert importlib.util.find_spec(run.module) is not None, f"{name}: {run.module}"
        for arg in run.pytest or []:
            if arg.startswith("tests/"):
                assert (REPO / arg).exists(), f"{name}: {arg}"
        # script paths named in the arguments (the before/after sides), except the carried baseline
        for arg in run.args:
            for part in arg.split(":"):
                if part.endswith(".py") and not arg.startswith(".baseline"):
                    assert (REPO / part).is_file(), f"{name}: {arg}"
        files = driver.returned_files(matrix, [name])
        assert len(files) <= driver.MAX_FILES, f"{name} returns {files}"
        assert all(f.count("/") <= 1 for f in files), files  # $OUT/job/file at most
    # what the old benchmark needs is what the baseline extracts
    assert "experiments/benchmark_learner.py" in matrix.baseline["paths"]


def test_the_before_after_call_returns_few_enough_files():
    matrix = driver.load_matrix()
    call = ["face_before_after_W1_W3", "side_by_side_default_W1_W4", "gpu_tests_parallel6", "env"]
    assert len(driver.returned_files(matrix, call)) <= driver.MAX_FILES
    assert driver.carried(matrix, call) == [".whl", ".baseline"]


@pytest.mark.parametrize(
    "body, complaint",
    [
        ('script = "a.py"\npytest = ["tests/"]', "exactly one of"),
        ('script = "a.py"\nfrobnicate = 1', "unknown keys"),
        ('script = "a.py"\nenv = { NCCL_NVLS_ENABLE = "1" }', "may not override"),
        ('script = "a.py"\noutputs = ["sub/x.json"]', "plain file name"),
        ('script = "a.py"\nwheels = "nonexistent"', "not a [wheels.*] set"),
    ],
)
def test_the_matrix_refuses_mistakes(tmp_path, body, complaint):
    path = tmp_path / "runs.toml"
    path.write_text(f"[runs.bad]\n{body}\n")
    with pytest.raises(ValueError, match=complaint.replace("[", r"\[").replace("*", r"\*")):
        driver.load_matrix(path)


def test_missing_wheels_names_the_pins_without_a_wheel(tmp_path):
    matrix = driver.load_matrix()
    for name in ("unilab-1.5.2-py3-none-any.whl", "hydra_core-1.3.8-py3-none-any.whl",
                 "antlr4_python3_runtime-4.9.3-py3-none-any.whl", "mujoco-3.10.0-cp312-cp312-manylinux_2_17_x86_64.whl"):
        (tmp_path / name).write_text("")
    missing = driver.missing_wheels(matrix, ["training"], tmp_path)
    assert "mujoco==3.11.0" in missing  # another version is not the pinned one
    assert "omegaconf==2.3.1" in missing
    assert not {"unilab==1.5.2", "hydra-core==1.3.8", "antlr4-python3-runtime==4.9.3"} & set(missing)
    assert driver.missing_wheels(matrix, ["learner"], tmp_path) == ["omegaconf==2.3.1"]


def test_the_training_wheels_serve_the_learner_runs_too():
    # one .whl/ for a call that mixes runs: the training set holds every pin of the learner set
    matrix = driver.load_matrix()
    assert set(matrix.wheels["learner"]["pins"]) <= set(matrix.wheels["training"]["pins"])


# ---- dry run -------------------------------------------------------------------------------

def test_dry_run_prints_the_exact_commands():
    done = _driver("--dry-run", "env", "face_before_after_W1_W3", "gpu_tests_parallel6")
    assert done.returncode == 0, done.stdout + done.stderr
    out = done.stdout
    assert "experiments/device/environment.py --output '$OUT/env.json'" in out
    assert "-m pytest -q -p no:cacheprovider -m gpu -n 6 -rs tests/" in out
    assert out.count("NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1") >= 3
    # the before/after helper lists its processes: cold ones alternate sides, each with its own empty cache
    cold = [line for line in out.splitlines() if "_cold]" in line]
    assert [line.split("]")[0].split("[")[1] for line in cold] == ["before_W1_cold", "after_W1_cold", "after_W3_cold", "before_W3_cold"]
    assert "cache/before_W1 " in cold[0] and "cache/after_W1 " in cold[1]
    assert "== device call: python3 experiments/device/run.py env face_before_after_W1_W3 gpu_tests_parallel6" in out


def test_dry_run_of_every_run_stays_within_the_device_limits(monkeypatch, capsys):
    """Every run's dry run, in this process (a subprocess and a git listing per run took ~25 s
    of CI): the matrix parsed and the working tree sized once for all of them."""
    matrix, size = driver.load_matrix(), driver.tree_mib()
    monkeypatch.setattr(driver, "load_matrix", lambda path=driver.MATRIX: matrix)
    monkeypatch.setattr(driver, "tree_mib", lambda: size)
    for name in matrix.runs:
        rc = driver.main(["--dry-run", name])
        out = capsys.readouterr().out
        assert rc == 0, f"{name}: {out[-2000:]}"
        assert "== device call: python3 experiments/device/run.py " + name in out
    assert _driver("--dry-run", next(iter(matrix.runs))).returncode == 0  # and as a command


def test_a_helper_whose_own_dry_run_fails_fails_the_dry_run(monkeypatch, capsys):
    """switch_cache.py once measured for 5 minutes and then lost its JSON to an error in its last
    line; its dry run now reaches that line, and the driver's dry run reports a helper's failure."""
    real = subprocess.run

    def helper_fails(cmd, *args, **kwargs):
        if "--dry-run" in cmd and any(str(c).endswith("switch_cache.py") for c in cmd):
            return subprocess.CompletedProcess(cmd, 1, stdout="", stderr="TypeError: run_environment()")
        return real(cmd, *args, **kwargs)

    monkeypatch.setattr(driver.subprocess, "run", helper_fails)
    assert driver.main(["--dry-run", "switch_cache"]) == 1
    assert "!! the helper's own dry run failed: switch_cache (exit status 1)" in capsys.readouterr().out


def test_switch_cache_dry_run_reaches_its_record(tmp_path):
    """Its dry run builds the JSON's environment record (what failed on the device) and writes no file."""
    out = tmp_path / "switch_cache.json"
    done = subprocess.run([sys.executable, str(DEVICE / "switch_cache.py"), "--output", str(out), "--dry-run"], cwd=REPO,
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert [line.split(":")[0] for line in done.stdout.splitlines()] == ["launch_aligned", "engine_aligned_late", "unaligned"]
    assert not out.exists()


# ---- running on the CPU with stand-in scripts ------------------------------------------------

STAND_IN = """
import json, os, sys, time
out = sys.argv[1]
open(os.path.join(out, "made.json"), "w").write(json.dumps({"gpu": os.environ.get("CUDA_VISIBLE_DEVICES"),
    "nvls": os.environ.get("NCCL_NVLS_ENABLE"), "cache": os.environ.get("TORCHINDUCTOR_CACHE_DIR"),
    "affinity": sorted(os.sched_getaffinity(0))}))
raw = os.path.join(sys.argv[2], "raw")
open(os.path.join(raw, "detail.txt"), "w").write("raw detail")
print("stand-in wrote its output", flush=True)
try:
    time.sleep(float(sys.argv[3]))
except KeyboardInterrupt:
    print("stand-in interrupted: saving", flush=True)
"""


def _stand_in_matrix(tmp_path: Path, sleep: float, limit: int) -> Path:
    script = tmp_path / "stand_in.py"
    script.write_text(STAND_IN)
    matrix = tmp_path / "runs.toml"
    run = f'script = "{script}"\nargs = ["{{out}}", "{{work}}", "{sleep}"]\nlimit = {limit}\noutputs = ["made.json"]\n'
    matrix.write_text(f"[runs.slow]\n{run}pack = true\ncold_cache = true\n[runs.two]\n{run}gpus = 2\n")
    return matrix


@pytest.mark.parametrize("sigint", ["default", "ignored"])
def test_a_run_is_stopped_at_its_limit_and_its_output_comes_back(tmp_path, sigint):
    """"ignored": the driver started as a background job of a non-interactive shell (`nohup ... &`),
    whose SIGINT its children would inherit ignored; the run must still get the SIGINT that lets
    it save."""
    matrix = _stand_in_matrix(tmp_path, sleep=60, limit=2)
    out = tmp_path / "out"
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN if sigint == "ignored" else signal.default_int_handler)
    try:  # the driver inherits this process's SIGINT disposition
        done = _driver("--matrix", str(matrix), "--work-root", str(tmp_path / "work"), "--assume-gpus", "1", "slow",
                       env={"OUT": str(out)})
    finally:
        signal.signal(signal.SIGINT, previous)
    assert done.returncode == 1  # a stopped run counts as failed
    assert "limit of 2 s reached" in done.stdout and "stand-in interrupted: saving" in done.stdout
    record = json.loads((out / "runs.json").read_text())["runs"][0]
    assert record["timed_out"] and record["seconds"] < 20
    assert record["outputs"]["made.json"] > 0 and record["outputs"]["slow.tgz"] > 0
    made = json.loads((out / "made.json").read_text())
    assert made["nvls"] == "0"
    assert made["cache"] == str(tmp_path / "work" / "slow" / "inductor_cache")  # cold: the run's own, fresh
    with tarfile.open(out / "slow.tgz") as tar:
        names = tar.getnames()
        assert "slow.log" in names and "raw/detail.txt" in names
        assert b"stand-in wrote its output" in tar.extractfile("slow.log").read()
    assert sorted(p.name for p in out.iterdir()) == ["made.json", "runs.json", "slow.tgz"]


def test_a_run_needing_more_gpus_than_found_is_skipped(tmp_path):
    matrix = _stand_in_matrix(tmp_path, sleep=0, limit=30)
    out = tmp_path / "out"
    done = _driver("--matrix", str(matrix), "--work-root", str(tmp_path / "work"), "--assume-gpus", "1", "two",
                   env={"OUT": str(out)})
    assert done.returncode == 1 and "skipped: needs 2 GPUs, found 1" in done.stdout
    assert json.loads((out / "runs.json").read_text())["runs"][0]["skipped"] == "needs 2 GPUs, found 1"


def test_a_run_the_call_leaves_less_than_its_min_limit_is_skipped_for_the_next_call(tmp_path):
    """A time-to-reward seed started on a short share is cut before its reward: with min_limit it
    is skipped instead (the call says so), and a run without one still gets what is left."""
    script = tmp_path / "noop.py"
    script.write_text("")
    matrix = tmp_path / "runs.toml"
    matrix.write_text(f'[runs.seed]\nscript = "{script}"\nlimit = 60\nmin_limit = 40\n'
                      f'[runs.plain]\nscript = "{script}"\nlimit = 60\n')
    m = driver.load_matrix(matrix)
    assert m.runs["seed"].min_limit == 40 and m.runs["plain"].min_limit == 0
    out = tmp_path / "out"
    # a 50-s call: each run may have 50 - 15 (stopping grace) = 35 s, less than seed's 40
    done = _driver("--matrix", str(matrix), "--work-root", str(tmp_path / "work"), "--assume-gpus", "1", "--budget", "50",
                   "seed", "plain", env={"OUT": str(out)})
    runs = json.loads((out / "runs.json").read_text())["runs"]
    assert runs[0]["run"] == "seed" and runs[0]["skipped"].endswith("(it needs 40)"), runs
    assert runs[1]["run"] == "plain" and "skipped" not in runs[1] and runs[1]["rc"] == 0 and runs[1]["limit_s"] >= 30
    assert done.returncode == 1 and "== seed: skipped: only" in done.stdout
    bad = tmp_path / "bad.toml"
    bad.write_text(f'[runs.x]\nscript = "{script}"\nlimit = 30\nmin_limit = 31\n')
    with pytest.raises(ValueError, match="min_limit 31 is not within"):
        driver.load_matrix(bad)


# ---- before / after ------------------------------------------------------------------------

def _cell(workload: str, ms: float, p90: float, cold: float, kernels: float | None) -> dict:
    """One ours_graph cell with benchmark_learner's keys (run_cell, count_kernels)."""
    cell = {
        "variant": "ours_graph", "workload": workload, "batch_size": 256, "updates_per_step": 2, "policy_frequency": 2,
        "obs_dim": 98, "critic_obs_dim": 101, "action_dim": 29, "construct_s": 0.4, "cold_start_s": cold,
        "warmup_iterations": 20, "warmup_ms": [ms] * 20, "iterations": 1500, "ms_median": ms, "ms_p90": p90, "ms_mean": ms,
        "updates_per_s": 2 / (ms / 1e3), "peak_memory_mib": 120.0, "last_metrics": {"critic_loss": 0.5}, "finite": True,
        "compile_phase_s": {"inductor_compile": cold / 2}, "graph_warmup_s": 0.2, "graph_capture_s": 0.3,
    }
    if kernels is not None:
        cell.update(kernels_per_iteration=kernels, launches_per_iteration=1.0, kernel_us_per_iteration=900.0,
                    kernels_under_5us_per_iteration=100.0, top_kernels=[])
    return cell


def _report(cell: dict) -> dict:
    return {"experiment": "benchmark_learner", "timed": "host clock", "command": "python benchmark_learner.py",
            "environment": {"date": "2026-01-01T00:00:00+00:00", "device": "cuda", "gpu": "NVIDIA H200", "torch": "2.11.0",
                            "python": "3.12.3", "triton": "3.6.0", "unilab": None},
            "inductor_options": {}, "note": "", "cells": [cell], "ratios": []}


def test_compare_computes_after_over_before_from_benchmark_reports(tmp_path):
    raw = {
        "before_W1_cold": _cell("W1", 1.50, 1.60, 50.0, 480), "before_W1_warm1": _cell("W1", 1.54, 1.62, 4.0, 480),
        "after_W1_cold": _cell("W1", 1.47, 1.55, 40.0, 480), "after_W1_warm1": _cell("W1", 1.50, 1.58, 3.5, 480),
        "before_W3_cold": _cell("W3", 9.0, 9.2, 60.0, 2000), "after_W3_cold": _cell("W3", 9.9, 10.1, 66.0, 2010),
    }
    for name, cell in raw.items():
        (tmp_path / f"{name}.json").write_text(json.dumps(_report(cell)))
    (tmp_path / "unrelated.json").write_text("{}")
    report = before_after.compare(tmp_path)
    w1, w3 = report["workloads"]["W1"], report["workloads"]["W3"]
    # timings from the warm processes where there are some (one cache for both sides), else the cold ones
    assert w1["before"]["ms_median"] == pytest.approx(1.54) and w1["after"]["ms_median"] == pytest.approx(1.50)
    assert w1["before"]["timed_processes"] == "warm" and w3["before"]["timed_processes"] == "cold"
    assert w1["after_vs_before"]["ms_median"] == pytest.approx(1.50 / 1.54)
    assert w1["after_vs_before"]["ms_p90"] == pytest.approx(1.58 / 1.62)
    assert w1["after_vs_before"]["cold_start_s"] == pytest.approx(0.8)  # from the cold processes only
    assert w1["before"]["ms_median_spread"] is None  # one warm process: no spread to report
    assert w1["before"]["kernels_per_iteration"] == 480 and w1["after_vs_before"]["kernels_per_iteration"] == 1.0
    assert w1["checks"] == {"ms_median_within_3pct": True, "kernels_equal": True, "cold_start_not_slower": True}
    assert w3["after_vs_before"]["ms_median"] == pytest.approx(1.1)
    assert w3["checks"] == {"ms_median_within_3pct": False, "kernels_equal": False, "cold_start_not_slower": False}
    assert report["environment"]["gpu"] == "NVIDIA H200" and report["environment"]["triton"] == "3.6.0"


def test_compare_reports_a_failed_cell_instead_of_a_number(tmp_path):
    (tmp_path / "before_W1_cold.json").write_text(json.dumps(_report({"variant": "ours_graph", "workload": "W1", "error": "RuntimeError: boom"})))
    (tmp_path / "after_W1_cold.json").write_text(json.dumps(_report(_cell("W1", 1.5, 1.6, 40.0, 480))))
    report = before_after.compare(tmp_path)
    assert report["errors"] == [{"file": "before_W1_cold.json", "error": "RuntimeError: boom"}]
    assert report["workloads"]["W1"]["after_vs_before"]["ms_median"] is None


BENCH_STAND_IN = """
import argparse, json, os
p = argparse.ArgumentParser()
p.add_argument("--variants", nargs="+"); p.add_argument("--workloads", nargs="+"); p.add_argument("--iters", type=int)
p.add_argument("--warmup", type=int); p.add_argument("--no-profile", action="store_true"); p.add_argument("--note")
p.add_argument("--output")
a = p.parse_args()
import flashsac_opt
ms = flashsac_opt.MS
cell = {"variant": a.variants[0], "workload": a.workloads[0], "cold_start_s": 9.0 if "empty" in a.note else 1.0,
        "ms_median": ms, "ms_p90": ms * 1.1, "iterations": a.iters, "kernels_per_iteration": 7.0,
        "cache": os.environ["TORCHINDUCTOR_CACHE_DIR"]}
os.makedirs(os.path.join(os.environ["TORCHINDUCTOR_CACHE_DIR"], "fxgraph"), exist_ok=True)  # as Inductor fills it
open(os.path.join(os.environ["TORCHINDUCTOR_CACHE_DIR"], "fxgraph", "entry"), "a").write(a.variants[0] + chr(10))
json.dump({"cells": [cell], "environment": {"gpu": "stand-in"}}, open(a.output, "w"))
"""


def _side(root: Path, ms: float) -> None:
    (root / "flashsac_opt").mkdir(parents=True)
    (root / "flashsac_opt" / "__init__.py").write_text(f"MS = {ms}\n")
    (root / "bench.py").write_text(BENCH_STAND_IN)


@pytest.mark.parametrize("warm_cache", ["shared", "own"])
def test_before_after_runs_each_side_on_its_own_tree_and_cache(tmp_path, warm_cache):
    _side(tmp_path / "old", 2.0)
    _side(tmp_path / "new", 1.0)
    output = tmp_path / "result.json"
    done = subprocess.run([sys.executable, str(DEVICE / "before_after.py"), "run", "--before", f"{tmp_path / 'old'}:bench.py",
                           "--after", f"{tmp_path / 'new'}:bench.py", "--workloads", "W1", "--rounds", "1", "--no-warm-up",
                           "--time-limit", "120", "--work", str(tmp_path / "work"), "--output", str(output),
                           "--warm-cache", warm_cache],
                          cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    report = json.loads(output.read_text())
    assert [p["name"] for p in report["processes"]] == ["before_W1_cold", "after_W1_cold", "after_W1_warm1", "before_W1_warm1"]
    assert all(p["rc"] == 0 for p in report["processes"])
    w1 = report["workloads"]["W1"]
    assert w1["after_vs_before"]["ms_median"] == 0.5  # each side imported its own flashsac_opt
    assert w1["before"]["cold_start_s"] == 9.0 and w1["before"]["processes"] == ["cold", "warm1"]
    log = (tmp_path / "work" / "raw" / "before_W1_cold.log").read_text()
    assert f"flashsac_opt from {tmp_path / 'old' / 'flashsac_opt' / '__init__.py'}" in log
    raw = json.loads((tmp_path / "work" / "raw" / "after_W1_warm1.json").read_text())
    cold_cache = json.loads((tmp_path / "work" / "raw" / "after_W1_cold.json").read_text())["cells"][0]["cache"]
    assert cold_cache == str(tmp_path / "work" / "cache" / "after_W1")  # a cold process: its side's own, empty cache
    if warm_cache == "own":
        assert raw["cells"][0]["cache"] == cold_cache  # the cache its cold process filled
    else:
        # both sides' warm processes on one copy of the before side's cold cache
        shared = tmp_path / "work" / "cache" / "shared_W1"
        before_warm = json.loads((tmp_path / "work" / "raw" / "before_W1_warm1.json").read_text())
        assert raw["cells"][0]["cache"] == before_warm["cells"][0]["cache"] == str(shared)
        assert (shared / "fxgraph" / "entry").read_text().splitlines() == ["ours_graph"] * 3  # before cold + 2 warm
        assert (tmp_path / "work" / "cache" / "before_W1" / "fxgraph" / "entry").read_text().splitlines() == ["ours_graph"]


def test_a_side_that_would_import_the_other_trees_package_is_refused(tmp_path):
    _side(tmp_path / "new", 1.0)
    (tmp_path / "old").mkdir()
    (tmp_path / "old" / "bench.py").write_text(BENCH_STAND_IN)  # no flashsac_opt of its own
    work = tmp_path / "work"
    done = subprocess.run([sys.executable, str(DEVICE / "before_after.py"), "run", "--before", f"{tmp_path / 'old'}:bench.py",
                           "--after", f"{tmp_path / 'new'}:bench.py", "--workloads", "W1", "--rounds", "0", "--no-warm-up",
                           "--time-limit", "60", "--work", str(work), "--output", str(tmp_path / "r.json")],
                          cwd=REPO, capture_output=True, text=True, timeout=60,
                          env={**os.environ, "PYTHONPATH": str(tmp_path / "new")})
    assert done.returncode == 0
    assert "flashsac_opt would come from" in (work / "raw" / "before_W1_cold.log").read_text()
    assert not (work / "raw" / "before_W1_cold.json").exists()


def test_both_benchmark_scripts_take_the_arguments_before_after_passes():
    matrix = driver.load_matrix()
    args = matrix.runs["face_before_after_W1_W3"].args
    after_root, after_script = args[args.index("--after") + 1].split(":")
    text = subprocess.run([sys.executable, str(REPO / after_root / after_script), "--help"], cwd=REPO, capture_output=True,
                          text=True, timeout=60).stdout
    for flag in ("--variants", "--workloads", "--iters", "--warmup", "--no-profile", "--note", "--output"):
        assert flag in text, flag
    assert "cold_start_s" in (REPO / after_root / after_script).read_text()  # the key compare reads


def test_prepare_baseline_extracts_a_tree_that_imports(tmp_path):
    commit = "7ed485a"
    if subprocess.run(["git", "cat-file", "-e", f"{commit}^{{commit}}"], cwd=REPO, capture_output=True).returncode:
        pytest.skip(f"{commit} is not in this clone")
    matrix = driver.load_matrix()
    dest = driver.prepare_baseline(matrix, commit, tmp_path / "baseline")
    assert (dest / "BASELINE_COMMIT").read_text().startswith("7ed485a")
    assert (dest / "experiments" / "benchmark_learner.py").is_file() and (dest / "experiments" / "common.py").is_file()
    assert not (dest / "experiments" / "bench").exists()  # a path the commit lacks is skipped, not an error
    assert not [p for p in dest.rglob("*") if p.is_symlink()]
    done = subprocess.run([sys.executable, "-c", "import flashsac_opt.learner, flashsac_opt.replay; print(flashsac_opt.__file__)"],
                          cwd=dest, capture_output=True, text=True, timeout=120, env={**os.environ, "PYTHONPATH": str(dest)})
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == str(dest / "flashsac_opt" / "__init__.py")


def test_cold_pairs_alternate_the_first_side_and_report_the_median_cold_start(tmp_path):
    _side(tmp_path / "old", 2.0)
    _side(tmp_path / "new", 1.0)
    output = tmp_path / "result.json"
    done = subprocess.run([sys.executable, str(DEVICE / "before_after.py"), "run", "--before", f"{tmp_path / 'old'}:bench.py",
                           "--after", f"{tmp_path / 'new'}:bench.py", "--workloads", "W1", "--rounds", "0", "--cold-pairs", "3",
                           "--no-warm-up", "--time-limit", "120", "--work", str(tmp_path / "work"), "--output", str(output)],
                          cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    report = json.loads(output.read_text())
    assert [p["name"] for p in report["processes"]] == [
        "before_W1_cold", "after_W1_cold", "after_W1_cold2", "before_W1_cold2", "before_W1_cold3", "after_W1_cold3"]
    caches = {json.loads((tmp_path / "work" / "raw" / f"{p['name']}.json").read_text())["cells"][0]["cache"] for p in report["processes"]}
    assert len(caches) == 6  # every cold process started from its own empty cache
    w1 = report["workloads"]["W1"]
    assert w1["before"]["processes"] == ["cold", "cold2", "cold3"]
    assert w1["before"]["cold_start_s_per_process"] == [9.0, 9.0, 9.0] and w1["before"]["cold_start_s"] == 9.0


def test_compare_takes_the_median_cold_start_over_cold_pairs(tmp_path):
    raw = {
        "before_W1_cold": _cell("W1", 1.5, 1.6, 50.0, 480), "before_W1_cold2": _cell("W1", 1.5, 1.6, 40.0, 480),
        "before_W1_cold3": _cell("W1", 1.5, 1.6, 45.0, 480),
        "after_W1_cold": _cell("W1", 1.5, 1.6, 44.0, 480), "after_W1_cold2": _cell("W1", 1.5, 1.6, 47.0, 480),
        "after_W1_cold3": _cell("W1", 1.5, 1.6, 41.0, 480),
    }
    for name, cell in raw.items():
        (tmp_path / f"{name}.json").write_text(json.dumps(_report(cell)))
    w1 = before_after.compare(tmp_path)["workloads"]["W1"]
    assert w1["before"]["cold_start_s_per_process"] == [50.0, 40.0, 45.0] and w1["before"]["cold_start_s"] == 45.0
    assert w1["after"]["cold_start_s"] == 44.0
    assert w1["after_vs_before"]["cold_start_s"] == pytest.approx(44.0 / 45.0)
    assert w1["after_vs_before"]["cold_start_s_per_pair"] == pytest.approx([44.0 / 50.0, 47.0 / 40.0, 41.0 / 45.0])
    assert w1["checks"]["cold_start_not_slower"] is True


def test_a_module_run_is_python_dash_m_and_names_one_thing_to_run(tmp_path):
    matrix = tmp_path / "runs.toml"
    matrix.write_text('[runs.pre]\nmodule = "flashsac_opt.cli"\nargs = ["precompile", "--report", "{out}/p.json"]\n')
    run = driver.load_matrix(matrix).runs["pre"]
    assert driver.command(run, Path("/o"), Path("/w"), 60) == [sys.executable, "-m", "flashsac_opt.cli", "precompile", "--report", "/o/p.json"]
    matrix.write_text('[runs.both]\nmodule = "flashsac_opt.cli"\nscript = "x.py"\n')
    with pytest.raises(ValueError, match="exactly one of script, module, pytest"):
        driver.load_matrix(matrix)
