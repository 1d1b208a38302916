"""experiments/time_to_reward.py: the moving-mean threshold crossing, grouping by
configuration with the seed-count mark, the JSON and figure it writes, its summary of the
committed H200 trainings (none reaches reward 20), and the device's time-to-reward runs (the
driver's dry run shows their trainings' commands)."""

import copy
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "experiments" / "time_to_reward.py"
TRAININGS = REPO / "results" / "trainings"
TEMPLATE = TRAININGS / "training_u8_b256_flashsac_opt_graph_s1.json.gz"  # committed reports are gzipped


def load():
    import importlib.util

    saved = list(sys.path)
    try:
        spec = importlib.util.spec_from_file_location("time_to_reward", SCRIPT)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module
    finally:
        sys.path[:] = saved


ttr = load()


def cli(*args):
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=300, cwd=REPO)


def rows_of(rewards, start_s=100.0, step_s=0.5, first_iteration=1):
    return [{"iteration": first_iteration + i, "wall_s": start_s + step_s * i, "reward": r, "learner_train_ms": 5.0 + i % 3,
             "iter_ms": 30.0 + i % 5} for i, r in enumerate(rewards)]


def test_moving_mean_is_over_full_windows_only():
    assert ttr.moving_mean(list(range(25)), 20) == pytest.approx([9.5 + k for k in range(6)])
    assert ttr.moving_mean([1.0] * 19, 20) == []  # shorter than the window: no mean at all
    assert ttr.moving_mean([2.0] * 20, 20) == [2.0]


def test_first_crossing_names_the_exact_iteration_and_seconds():
    # 30 rows at 0, then 40: the window ending at row k (k >= 30) holds (k - 29) fours of ten;
    # the mean reaches 20 when 10 of the 20 are 40, i.e. at row 39 (iteration 40, 100 + 39 * 0.5 s)
    rows = rows_of([0.0] * 30 + [40.0] * 30)
    hit = ttr.first_crossing(rows, 20.0)
    assert hit == {"iteration": 40, "seconds": 119.5, "seconds_after_first_update": 19.5, "moving_mean": 20.0}
    hit30 = ttr.first_crossing(rows, 30.0)
    assert hit30["iteration"] == 45 and hit30["seconds"] == 122.0 and hit30["moving_mean"] == pytest.approx(30.0)
    # a single spike above the threshold does not move a 20-iteration mean there
    assert ttr.first_crossing(rows_of([0.0] * 40 + [100.0] + [0.0] * 40), 20.0) is None


def test_never_reached_and_a_run_shorter_than_the_window_give_null():
    assert ttr.first_crossing(rows_of([19.9] * 200), 20.0) is None
    assert ttr.first_crossing(rows_of([50.0] * 19), 20.0) is None  # 19 rows: no full window


def test_median_over_seeds_counts_a_seed_that_never_got_there_as_latest():
    assert ttr.median_or_none([100.0, 200.0, 300.0]) == 200.0
    assert ttr.median_or_none([100.0, 200.0, None]) == 200.0
    assert ttr.median_or_none([100.0, None, None]) is None  # most seeds never: no median time
    assert ttr.median_or_none([]) is None


def fake_run(tmp_path, learner, seed, rewards, updates=64, stopped=False, carrier=None):
    report = ttr.read_json(TEMPLATE)  # a fresh copy each call
    if carrier is not None:  # as benchmark_flashsac_training passes an --override
        report["unilab_command"] += f" training.collector_tensor_device={carrier}"
    report["learner"] = learner
    report["training_config"].update(seed=seed, updates_per_step=updates, iterations=len(rewards) + 1)
    report["rows_all"] = rows_of(rewards, start_s=90.0 + seed)
    report["rows"] = report["rows_all"][-10:]
    report["iterations_logged"] = len(rewards)
    report["stopped_by_time_limit"] = stopped
    report["completed"] = not stopped
    path = tmp_path / f"training_u{updates}_b256{'_' + carrier if carrier else ''}_{learner}_graph_s{seed}.json"
    path.write_text(json.dumps(report))
    return path


def test_grouping_by_configuration_marks_groups_with_fewer_than_three_seeds(tmp_path):
    climb = [0.0] * 30 + [40.0] * 30
    files = [fake_run(tmp_path, "flashsac_opt", s, climb) for s in (1, 2, 3)]
    files += [fake_run(tmp_path, "unilab", s, [5.0] * 60) for s in (1, 2)]
    runs = [ttr.summarize_file(f, last=10) for f in files]
    groups = {g["learner"]: g for g in ttr.group_runs(runs)}
    ours, stock = groups["flashsac_opt"], groups["unilab"]
    assert ours["seeds"] == [1, 2, 3] and ours["count"] == 3 and ours["enough_seeds"] and ours["note"] == ""
    assert stock["seeds"] == [1, 2] and not stock["enough_seeds"] and "fewer than 3 seeds" in stock["note"]
    # seed s starts at 90 + s s: iteration 40 comes at 90 + s + 19.5 s; the median over seeds is seed 2's
    assert ours["median"]["time_to_reward_20_s"] == 111.5
    assert ours["median"]["first_update_to_reward_20_s"] == 19.5  # the same for every seed: start-up taken out
    assert ours["reached"] == {"20": 3, "30": 3}
    assert stock["median"]["time_to_reward_20_s"] is None and stock["reached"] == {"20": 0, "30": 0}
    # tail timings over the last 10 rows (rows 50..59): learner 5 + i % 3, iteration 30 + i % 5
    assert runs[0]["learner_ms"]["count"] == 10 and runs[0]["learner_ms"]["median"] == 6.0
    assert runs[0]["iteration_ms"]["median"] == 32.0


def test_a_run_under_mps_is_its_own_configuration(tmp_path):
    climb = [float(i) / 10 for i in range(400)]
    fake_run(tmp_path, "flashsac_opt", 1, climb)
    named = fake_run(tmp_path, "flashsac_opt", 2, climb)  # with_mps.py's name tag, before the field
    named.rename(tmp_path / "training_u64_b256_mps_flashsac_opt_graph_s2.json")
    recorded = fake_run(tmp_path, "flashsac_opt", 3, climb)
    report = json.loads(recorded.read_text())
    report["environment"] = {**report.get("environment", {}), "cuda_mps_pipe_directory": "/tmp/x/pipe"}
    recorded.write_text(json.dumps(report))
    groups = ttr.group_runs([ttr.summarize_file(p, 100) for p in sorted(tmp_path.glob("training_*.json"))])
    by_sharing = {g["gpu_sharing"]: g for g in groups}
    assert set(by_sharing) == {"time-slicing", "mps"}
    assert by_sharing["mps"]["seeds"] == [2, 3] and by_sharing["time-slicing"]["seeds"] == [1]
    assert by_sharing["mps"]["label"].endswith(", MPS") and "MPS" not in by_sharing["time-slicing"]["label"]


def test_a_run_on_another_collector_carrier_is_its_own_configuration(tmp_path):
    climb = [0.0] * 30 + [40.0] * 30
    files = [fake_run(tmp_path, "flashsac_opt", 1, climb), fake_run(tmp_path, "flashsac_opt", 1, climb, carrier="cpu"),
             fake_run(tmp_path, "flashsac_opt", 2, climb, carrier="auto")]  # auto is UniLab's default
    groups = ttr.group_runs([ttr.summarize_file(f, last=10) for f in files])
    by_carrier = {g["carrier"]: g for g in groups}
    assert set(by_carrier) == {"default", "cpu"}
    assert by_carrier["default"]["seeds"] == [1, 2] and by_carrier["cpu"]["seeds"] == [1]
    assert by_carrier["cpu"]["label"].endswith(", CPU carrier") and "carrier" not in by_carrier["default"]["label"]


def test_a_run_with_the_collector_eager_is_its_own_configuration(tmp_path):
    climb = [0.0] * 30 + [40.0] * 30
    (tmp_path / "compiled").mkdir()
    compiled = fake_run(tmp_path / "compiled", "flashsac_opt", 1, climb, carrier="cpu")
    eager = fake_run(tmp_path, "flashsac_opt", 1, climb, carrier="cpu")
    report = json.loads(eager.read_text())
    report["environment"].setdefault("flashsac_opt_switches", {})["FLASHSAC_OPT_COLLECTOR_EAGER"] = "1"
    eager.write_text(json.dumps(report))
    groups = ttr.group_runs([ttr.summarize_file(f, last=10) for f in (compiled, eager)])  # seed 1 twice, two configurations
    assert [g.get("collector") for g in groups] == [None, "eager"]
    assert groups[1]["label"].endswith(", CPU carrier, eager collector") and "eager" not in groups[0]["label"]
    # "auto" (unset, recorded so since 2026-12-07) is eager on the CPU carrier only; unset before meant off
    for value, carrier, expected in (("auto", "cpu", True), ("auto", None, False), (None, "cpu", False)):
        path = fake_run(tmp_path / "compiled", "flashsac_opt", 2, climb, carrier=carrier)
        report = json.loads(path.read_text())
        report["environment"].setdefault("flashsac_opt_switches", {})["FLASHSAC_OPT_COLLECTOR_EAGER"] = value
        path.write_text(json.dumps(report))
        assert (ttr.summarize_file(path, last=10).get("collector") == "eager") is expected


def test_a_patched_run_carries_its_start_up_phases(tmp_path):
    path = fake_run(tmp_path, "flashsac_opt", 1, [5.0] * 30)
    report = json.loads(path.read_text())
    report["startup_timeline"] = {"learner_constructed_s": 30.0, "prepare_for_collection_start_s": 31.0,
                                  "prepare_for_collection_end_s": 61.0, "first_update_start_s": 70.0, "first_update_end_s": 70.5}
    path.write_text(json.dumps(report))
    phases = ttr.summarize_file(path, last=10)["startup_phases_s"]
    assert phases["UniLab start to the learner"] == 30.0 and phases["start-up compile and capture"] == 30.0
    assert phases["collector start, learning_starts"] == 9.0
    assert ttr.summarize_file(fake_run(tmp_path, "unilab", 1, [5.0] * 30), last=10)["startup_phases_s"] is None


def test_a_run_with_a_host_load_record_carries_its_brief(tmp_path):
    import subprocess
    import time

    sys.path.insert(0, str(REPO / "experiments"))
    from report.host_load import HostLoad

    if not HostLoad.available():
        pytest.skip("needs Linux /proc")
    # a real record, of a short process tree, as benchmark_flashsac_training writes it
    child = subprocess.Popen([sys.executable, "-c", "import time\nend = time.time() + 0.8\nwhile time.time() < end: pass"])
    launched = time.time()
    load = HostLoad(interval_s=0.2).start(child.pid)
    child.wait(timeout=30)
    path = fake_run(tmp_path, "flashsac_opt", 1, [5.0] * 30)
    report = json.loads(path.read_text())
    report["host_load"] = load.stop(launched)
    path.write_text(json.dumps(report))
    brief = ttr.summarize_file(path, last=10)["host_load"]
    assert brief["busiest_training_processes"][0]["cores_median"] > 0.3
    assert set(brief) == {"outside_training_cores", "host_busy_share", "load1", "outside_training_top", "busiest_training_processes"}
    assert "host_load" not in ttr.summarize_file(fake_run(tmp_path, "flashsac_opt", 2, [5.0] * 30), last=10)  # older reports


def test_a_run_carries_its_wall_clock_per_compiled_iteration_and_which_side_bound_it(tmp_path):
    path = fake_run(tmp_path, "flashsac_opt", 1, [5.0] * 40)
    report = json.loads(path.read_text())
    for i, row in enumerate(report["rows_all"]):  # uncompiled rows 0-9 at 2 s apart, then 40 ms an iteration
        row["wall_s"] = 10.0 + 2.0 * i if i < 10 else 28.0 + 0.04 * (i - 9)
        row["collector_env_step_ms"] = 36.0
    report["startup_timeline"] = {"learner_constructed_s": 5.0, "first_update_start_s": 9.0, "first_update_end_s": 10.0,
                                  "compile_ahead_done_s": 27.0, "background_compile_switched_s": 28.0}
    path.write_text(json.dumps(report))
    run = ttr.summarize_file(path, last=10)
    assert run["first_compiled_update_s"] == 28.0
    assert run["compiled_iteration_wall_ms"] == pytest.approx(40.0)  # the uncompiled rows left out
    assert run["iteration_bound"] == "collector"  # env step 36 ms against an update phase of 5-7 ms
    assert ttr.group_runs([run])[0]["median"]["compiled_iteration_wall_ms"] == pytest.approx(40.0)
    plain = ttr.summarize_file(fake_run(tmp_path, "flashsac_opt", 2, [5.0] * 40), last=10)
    assert plain["compiled_iteration_wall_ms"] == pytest.approx(500.0) and plain["iteration_bound"] is None  # no env step logged


def test_a_seed_given_twice_in_one_configuration_is_refused_naming_the_files(tmp_path):
    (tmp_path / "call1").mkdir(), (tmp_path / "call2").mkdir()
    first = fake_run(tmp_path / "call1", "flashsac_opt", 3, [0.0] * 60)
    again = fake_run(tmp_path / "call2", "flashsac_opt", 3, [40.0] * 60)
    others = [fake_run(tmp_path / "call1", "flashsac_opt", s, [0.0] * 60) for s in (1, 2)]
    with pytest.raises(ValueError, match=r"seed\(s\) \[3\] more than once"):
        ttr.group_runs([ttr.summarize_file(f, last=10) for f in (*others, first, again)])
    done = cli("summarize", *map(str, (*others, first, again)), "--output", str(tmp_path / "out.json"))
    assert done.returncode == 2 and "one run per seed" in done.stderr and first.name in done.stderr
    assert not (tmp_path / "out.json").exists()


def test_a_compressed_training_report_summarizes_as_its_plain_form(tmp_path):
    """results/ keeps training reports gzip-compressed (experiments/common.py): a folder of .json.gz
    summarizes to the same records, file names included, as the same reports uncompressed; a name
    present in both forms counts once."""
    import gzip

    plain, packed = tmp_path / "plain", tmp_path / "packed"
    plain.mkdir(), packed.mkdir()
    for seed in (1, 2, 3):
        path = fake_run(plain, "flashsac_opt", seed, [0.0] * 30 + [40.0] * 30)
        (packed / (path.name + ".gz")).write_bytes(gzip.compress(path.read_bytes()))
    (packed / "training_u64_b256_flashsac_opt_graph_s1.json").write_bytes((plain / "training_u64_b256_flashsac_opt_graph_s1.json").read_bytes())
    outs = {}
    for name, folder in (("plain", plain), ("packed", packed)):
        assert cli("summarize", str(folder), "--output", str(tmp_path / f"{name}.json")).returncode == 0
        outs[name] = json.loads((tmp_path / f"{name}.json").read_text())
    assert outs["packed"]["runs"] == outs["plain"]["runs"] and outs["packed"]["groups"] == outs["plain"]["groups"]
    assert [r["file"] for r in outs["packed"]["runs"]] == [f"training_u64_b256_flashsac_opt_graph_s{s}.json" for s in (1, 2, 3)]


def test_summarize_writes_the_json_schema_and_the_figure(tmp_path):
    files = [fake_run(tmp_path, "flashsac_opt", s, [0.0] * 30 + [40.0] * 30) for s in (1, 2, 3)]
    files.append(fake_run(tmp_path, "unilab", 1, [5.0] * 60, stopped=True))
    out, fig = tmp_path / "out" / "ttr.json", tmp_path / "out" / "ttr.png"
    table = tmp_path / "out" / "ttr.md"
    done = cli("summarize", *map(str, files), "--last", "10", "--output", str(out), "--plot", str(fig), "--markdown", str(table))
    assert done.returncode == 0, done.stderr
    # the table: a header, its rule and one row per configuration, stock first; the cut stock seed
    # is named with the iterations it got, the patched seeds' climb reached both thresholds
    caption, blank, *lines = table.read_text().splitlines()
    assert caption.startswith("Generated by `experiments/time_to_reward.py summarize` from 4 training reports") and not blank
    assert len(lines) == 4 and lines[0].startswith("| configuration | seeds |") and set(lines[1]) == {"|", "-"}
    stock, patched = lines[2], lines[3]
    assert stock.startswith("| stock UniLab graph, U64") and "(too few seeds)" in stock and "| - (0 of 1) |" in stock
    assert stock.endswith("| 5.0-5.0 | s1 at 60 (120 s) |")  # its last row at 91 s + 59 x 0.5 s = 120.5 s
    assert patched.startswith("| patched (flashsac_opt) graph, U64") and "| 1, 2, 3 |" in patched and "(3 of 3)" in patched
    assert patched.endswith("| none |") and "too few" not in patched
    report = json.loads(out.read_text())
    assert report["experiment"] == "time_to_reward" and report["window"] == 20 and report["thresholds"] == [20.0, 30.0]
    assert report["summarizes"] == [str(f) for f in files] and report["command"].startswith("python ")
    assert len(report["runs"]) == 4 and len(report["groups"]) == 2
    run = next(r for r in report["runs"] if r["learner"] == "unilab")
    assert run["stopped_by_time_limit"] is True and run["iterations_logged"] == 60
    assert run["time_to_reward"] == {"20": None, "30": None}
    for key in ("gpu", "torch", "date", "cpu_cores_usable", "run_note", "command"):
        assert key in run["provenance"]
    assert run["provenance"]["gpu"] == "NVIDIA H200" and "--updates-per-step" in run["provenance"]["command"]
    assert "no threshold reached within 60 iterations, cut by its time limit" in done.stdout
    assert fig.is_file() and fig.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and fig.stat().st_size > 10_000


def test_summary_of_the_committed_h200_trainings_says_no_run_reaches_reward_20(tmp_path):
    out = tmp_path / "h200.json"
    done = cli("summarize", str(TRAININGS), "--output", str(out))
    assert done.returncode == 0, done.stderr
    report = json.loads(out.read_text())
    files = sorted(TRAININGS.glob("training_*.json.gz"))
    assert len(report["runs"]) == len(files) == 17 and not report["skipped"]
    assert all(r["time_to_reward"] == {"20": None, "30": None} for r in report["runs"])
    assert all(g["median"]["time_to_reward_20_s"] is None and g["reached"]["20"] == 0 for g in report["groups"])
    assert "reward 20: not reached" in done.stdout and done.stdout.count("no threshold reached") == len(files)
    # the launch -> first update is the first logged row's seconds, as summarize_trainings reports it
    for r in report["runs"]:
        rows = ttr.read_json(TRAININGS / f"{r['file']}.gz")["rows_all"]  # summaries name the .json
        assert r["first_update_s"] == min(x["wall_s"] for x in rows)
    # the 3-seed groups at 2 updates per step are the only ones with enough seeds
    assert sorted((g["learner"], g["updates_per_step"]) for g in report["groups"] if g["enough_seeds"]) == [
        ("flashsac_opt", 2), ("unilab", 2)]


def test_the_committed_summary_is_what_the_command_makes_from_the_committed_runs(tmp_path):
    committed = json.loads((REPO / "results" / "time_to_reward" / "time_to_reward_h200_trainings.json").read_text())
    out = tmp_path / "again.json"
    assert cli("summarize", "results/trainings/", "--output", str(out)).returncode == 0
    again = json.loads(out.read_text())
    assert committed["groups"] == again["groups"] and committed["runs"] == again["runs"]
    assert "summary of the training JSON" in committed["what"]


def test_the_committed_one_gpu_matrix_and_its_table_are_what_the_command_makes_from_its_runs(tmp_path):
    committed = json.loads((REPO / "results" / "time_to_reward" / "time_to_reward_one_gpu.json").read_text())
    out, table = tmp_path / "again.json", tmp_path / "again.md"
    done = cli("summarize", *committed["summarizes"], "--output", str(out), "--markdown", str(table))
    assert done.returncode == 0, done.stderr
    again = json.loads(out.read_text())
    assert committed["groups"] == again["groups"] and committed["runs"] == again["runs"]
    assert table.read_text() == (REPO / "results" / "time_to_reward" / "time_to_reward_one_gpu.md").read_text()
    # the matrix: stock and patched at 8, 32, 64 and 128 updates (256 envs, batch 256) and at UniLab's
    # G1 default (4096 envs, batch 2048, 8 updates); every patched group from 32 up, and both G1-default
    # groups, have three seeds at 30
    assert sorted((g["learner"], g["updates_per_step"], g["num_envs"], g["batch_size"]) for g in again["groups"]) == sorted(
        [(learner, u, 256, 256) for learner in ("unilab", "flashsac_opt") for u in (8, 32, 64, 128)]
        + [(learner, 8, 4096, 2048) for learner in ("unilab", "flashsac_opt")])
    assert all(g["reached"]["30"] == 3 for g in again["groups"] if g["learner"] == "flashsac_opt" and g["updates_per_step"] >= 32)
    assert [g["reached"]["30"] for g in again["groups"] if g["num_envs"] == 4096] == [3, 3]


def test_the_protocol_runs_show_their_trainings_in_the_drivers_dry_run():
    """runs.toml's cold-first protocol runs under MPS: the recipe's three patched seeds in one call,
    stock UniLab's G1 default in two (its cold seed, then its warm seeds on the cache it left)."""
    for run, expected in (
        ("ttr_protocol_u64_mps", ["flashsac_opt, cold seed on emptied caches", "--updates 64 --batch 256 --envs 256 --replay-buffer-n 512 --learning-starts 98",
                                  "flashsac_opt:graph:1\n", "flashsac_opt:graph:2 flashsac_opt:graph:3"]),
        ("ttr_protocol_stock_default_cold", ["unilab, cold seed on emptied caches", "--updates 8 --batch 2048 --envs 4096 --replay-buffer-n 256 --learning-starts 49",
                                             "--time-limit 545", "unilab:graph:1\n"]),
        ("ttr_protocol_stock_default_warm", ["unilab, warm seeds on", "protocol_cache_stock_default as an earlier call left it", "unilab:graph:2 unilab:graph:3"]),
    ):
        dry = subprocess.run([sys.executable, "experiments/device/run.py", "--dry-run", run], cwd=REPO, capture_output=True, text=True, timeout=120)
        assert dry.returncode == 0 and "over the device's limits" not in dry.stdout, dry.stdout
        assert "experiments/device/with_mps.py" in dry.stdout
        for text in expected:
            assert text in dry.stdout, (run, text)


def test_trainings_names_a_tagged_configuration_and_sizes_limits_by_the_given_start_up(tmp_path):
    def dry(*extra):
        return subprocess.run([sys.executable, "experiments/device/trainings.py", "--updates", "64", "--replay-buffer-n", "512",
                               "--no-eval", "--time-limit", "580", "--out", str(tmp_path / "o"), "--work", str(tmp_path / "w"),
                               "--dry-run", *extra, "flashsac_opt:graph:1", "flashsac_opt:graph:2"],
                              cwd=REPO, capture_output=True, text=True, timeout=120)
    plain, tagged = dry(), dry("--name-tag", "cpu_carrier", "--startup-s", "220,90")
    assert plain.returncode == 0 and tagged.returncode == 0, plain.stderr + tagged.stderr
    assert "[training_u64_b256_r512_flashsac_opt_graph_s1] time limit" in plain.stdout
    first, second = [line for line in tagged.stdout.splitlines() if line.startswith("[training_u64_b256_r512_cpu_carrier_flashsac_opt_graph_s")]
    # 580 s less two 20-s shutdowns and both start-ups (220 cold, 90 warm) leaves 230 s, half to each
    # run: 335 s and 205 s (a second less where the clock moved on)
    limits = [int(re.search(r"time limit (\d+) s \(start-up ~(\d+) s\)", line).group(1)) for line in (first, second)]
    assert 333 <= limits[0] <= 335 and 203 <= limits[1] <= 205 and "~220 s" in first and "~90 s" in second
    assert "training_u64_b256_r512_cpu_carrier_flashsac_opt_graph_s1.json" in first
    for bad in (["--name-tag", "CPU carrier"], ["--startup-s", "220"], ["--startup-s", "0,90"]):
        refused = dry(*bad)
        assert refused.returncode == 2 and "Traceback" not in refused.stderr, bad


def test_trainings_builds_unilabs_native_extension_from_the_copy_before_any_timed_run(site, tmp_path):
    """The copy's own replay pipeline module is imported (not the installed UniLab's) and its
    extension built or reported unavailable (a CPU-only torch has no CUDA toolkit); a copy whose
    module fails stops the call instead of timing a training that will pay the build."""
    import torch

    import importlib.util

    spec = importlib.util.spec_from_file_location("trainings", REPO / "experiments" / "device" / "trainings.py")
    trainings = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(trainings)
    state, seconds = trainings.prebuild_native_extension(site)
    assert state == ("built" if torch.cuda.is_available() else "unavailable") and seconds > 0
    broken = tmp_path / "broken" / "unilab" / "rl" / "runtime" / "ipc" / "replay_pipelines"
    broken.mkdir(parents=True)
    for d in [broken, *broken.parents][:5]:
        (d / "__init__.py").write_text("")
    (broken / "native_h2d.py").write_text("raise ImportError('a half-copied UniLab')\n")
    with pytest.raises(SystemExit, match="native H2D extension"):
        trainings.prebuild_native_extension(tmp_path / "broken")


def test_each_unilab_copy_builds_its_extension_in_a_folder_of_its_own(tmp_path, monkeypatch):
    """UniLab names its JIT extension alike in every copy and torch's build file names the source
    by path: a folder shared by the stock and the patched copy rebuilt it at every switch (21 s
    inside a timed start). Every process of a copy, the prebuild included, gets the copy's folder."""
    import importlib.util
    import types

    spec = importlib.util.spec_from_file_location("trainings", REPO / "experiments" / "device" / "trainings.py")
    trainings = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(trainings)
    seen = []
    monkeypatch.setattr(trainings.subprocess, "run", lambda cmd, env, cwd: seen.append(env) or types.SimpleNamespace(returncode=3))
    for name in ("stock", "patched"):
        assert trainings.prebuild_native_extension(tmp_path / name)[0] == "unavailable"
    assert [env["TORCH_EXTENSIONS_DIR"] for env in seen] == [str(tmp_path / "stock" / "torch_extensions"), str(tmp_path / "patched" / "torch_extensions")]
    assert trainings.copy_env({"A": "1"}, tmp_path / "stock") == {"A": "1", "TORCH_EXTENSIONS_DIR": str(tmp_path / "stock" / "torch_extensions")}


def test_trainings_runs_every_training_and_exits_non_zero_naming_those_that_failed(tmp_path, monkeypatch, capsys):
    """A training that fails (stock's cold compile used its whole share: rc 2, no JSON) does not
    stop the others, and the call's exit status and last line name it (it said 0 before)."""
    import importlib.util
    import types

    spec = importlib.util.spec_from_file_location("trainings", REPO / "experiments" / "device" / "trainings.py")
    trainings = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(trainings)
    prepared = []

    def fake_prepare(copies, names):
        prepared.extend(names)
        return copies / "stock", copies / "patched"

    monkeypatch.setattr(trainings, "prepare_copies", fake_prepare)
    started = []

    def fake_run(cmd, **kwargs):
        started.append(cmd[cmd.index("--seed") + 1])
        return types.SimpleNamespace(returncode=2 if started[-1] == "1" else 0)

    monkeypatch.setattr(trainings.subprocess, "run", fake_run)
    argv = ["--updates", "8", "--no-eval", "--time-limit", "580", "--out", str(tmp_path / "out"), "--work", str(tmp_path / "work"),
            "unilab:graph:1", "unilab:graph:2", "unilab:graph:3"]
    assert trainings.main(argv) == 1 and started == ["1", "2", "3"]
    assert prepared == ["stock"]  # stock trainings only: no patched copy made (nor its extension built)
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert last == "== trainings: 1 of 3 failed: training_u8_b256_unilab_graph_s1 (rc=2)"
    monkeypatch.setattr(trainings.subprocess, "run", lambda cmd, **kwargs: types.SimpleNamespace(returncode=0))
    assert trainings.main(argv) == 0
    # patched trainings make the patched copy, and the stock one only for the stock eval
    monkeypatch.setattr(trainings, "stock_eval", lambda *args: prepared.append("eval"))
    for no_eval, copies in ((["--no-eval"], ["patched"]), ([], ["stock", "patched", "eval"])):
        prepared.clear()
        argv = ["--updates", "8", *no_eval, "--time-limit", "580", "--out", str(tmp_path / "out"), "--work", str(tmp_path / "work"),
                "flashsac_opt:graph:2"]
        assert trainings.main(argv) == 0 and prepared == copies


def test_first_compiled_update_is_the_switch_after_a_child_and_none_when_it_never_came():
    child = {"learner_constructed": {"compile_ahead": True}, "compile_ahead_done": {"child": True}}
    assert ttr.first_compiled_update({**child, "background_compile_switched_s": 110.8}, 40.5) == 110.8
    assert ttr.first_compiled_update(child, 34.9) is None  # cut before the switch: it never trained compiled
    assert ttr.first_compiled_update({"learner_constructed": {"compile_ahead": True}}, 30.0) is None  # the child still running
    # the child done while the runner waited for a slow collector: the first update was compiled
    assert ttr.first_compiled_update({**child, "startup_idle_compile_end_s": 39.0}, 40.8) == 40.8
    warm = {"learner_constructed": {"compile_ahead": True}, "compile_ahead_done": {"child": False}}
    assert ttr.first_compiled_update(warm, 21.9) == 21.9 and ttr.first_compiled_update({}, 51.5) == 51.5  # warm; stock


def test_a_runs_precompiled_steps_come_from_its_last_compile_event():
    loaded = {"loaded": ["actor", "critic-True"], "saved": [], "fell_back": [], "stale": []}
    assert ttr.precompiled_steps({"startup_idle_compile_end": {"precompiled_steps": loaded}}) == loaded  # warm, in the runner's wait
    switch = {"startup_idle_compile_end": {"precompiled_steps": None}, "background_compile_switched": {"precompiled_steps": loaded}}
    assert ttr.precompiled_steps(switch) == loaded  # cold: the switch after the children
    assert ttr.precompiled_steps({"startup_idle_compile_end": {}}) is None and ttr.precompiled_steps({}) is None  # off; stock


def _stand_in_trainings(out: Path, calls: list):
    """trainings.py stood in for by copies of one committed training JSON, one per run it is given,
    each recording whether its compile cache held anything at launch and leaving a file there."""
    template = ttr.read_json(TEMPLATE)

    def fake_run(cmd, env):
        calls.append((cmd, env))
        cache = Path(env["TORCHINDUCTOR_CACHE_DIR"])
        runs = [a for a in cmd if re.fullmatch(r"(unilab|flashsac_opt):graph:\d+", a)]
        tag = cmd[cmd.index("--name-tag") + 1] + "_" if "--name-tag" in cmd else ""
        for run in runs:
            learner, _, seed = run.split(":")
            report = copy.deepcopy(template)
            report["learner"], report["training_config"]["seed"] = learner, int(seed)
            report["inductor_cache_at_launch"] = {"dir": str(cache), "files": len(list(cache.rglob("*"))), "warm": bool(list(cache.rglob("*")))}
            (cache / f"kernel_{learner}_{seed}").write_text("x")  # what a training leaves in its cache
            (out / f"training_u64_b256_r512_{tag}{learner}_graph_s{seed}.json").write_text(json.dumps(report))
        return subprocess.CompletedProcess(cmd, 0)

    return fake_run


def test_protocol_runs_each_learner_on_an_emptied_cache_then_the_start_up_pairs(tmp_path, monkeypatch):
    # what is checked is the protocol: order, caches, switches, names, and the verdicts it reads back
    calls = []
    (tmp_path / "out").mkdir()
    monkeypatch.setattr(ttr.subprocess, "run", _stand_in_trainings(tmp_path / "out", calls))
    stale = tmp_path / "work" / "cache_flashsac_opt"
    stale.mkdir(parents=True)
    (stale / "old_kernel").write_text("x")  # a cache from before must not make seed 1 warm
    args = ["protocol", "--out", str(tmp_path / "out"), "--work", str(tmp_path / "work"), "--learners", "flashsac_opt", "unilab",
            "--startup-pairs", "1", "--time-limit", "900"]
    monkeypatch.setattr(ttr.plotting, "save", lambda fig, path, **kwargs: None)
    assert ttr.main(args) == 0
    (ours_cold, _), (ours, _), (stock_cold, _), (stock, _), (spawn, spawn_env), (preload, preload_env) = calls
    # the cold seed alone with its own limit, then the warm ones
    assert [a for a in ours_cold if ":graph:" in a] == ["flashsac_opt:graph:1"]
    assert ours_cold[ours_cold.index("--time-limit") + 1] == "200"
    assert [a for a in ours if ":graph:" in a] == ["flashsac_opt:graph:2", "flashsac_opt:graph:3"]
    assert "--stop-at-reward" in ours and "--stop-at-reward" in stock and [a for a in stock_cold if ":graph:" in a] == ["unilab:graph:1"]
    assert any(a.startswith("--override=training.torch_threads.compile_threads=") for a in stock)
    assert spawn_env["FLASHSAC_OPT_COLLECTOR_PRELOAD"] == "0" and preload_env["FLASHSAC_OPT_COLLECTOR_PRELOAD"] == "1"
    assert spawn_env["TORCHINDUCTOR_CACHE_DIR"] == str(stale)  # the pairs: on what the patched seeds left
    report = json.loads((tmp_path / "out" / "time_to_reward_protocol.json").read_text())
    verdicts = report["protocol"]["verdicts"]
    assert verdicts["flashsac_opt"]["cold_seed_cache_warm_at_launch"] is False  # emptied before seed 1
    assert verdicts["flashsac_opt"]["seeds"] == [1, 2, 3] and verdicts["unilab"]["seeds"] == [1, 2, 3]
    assert [p["collector"] for p in report["protocol"]["startup_pairs"]] == ["UniLab's spawn", "preloaded (patches/0005)"]


def test_a_protocol_split_over_two_calls_keeps_the_cache_and_the_verdict_joins_them(tmp_path, monkeypatch, capsys):
    # stock's G1 default needs a call for its cold seed and another for the warm ones: the second
    # call must find the first one's cache untouched, and only the joined verdict has a cold seed
    calls = []
    monkeypatch.setattr(ttr.plotting, "save", lambda fig, path, **kwargs: None)
    cache = tmp_path / "shared_cache"
    for name, extra in (("cold", ["--seeds", "1"]), ("warm", ["--seeds", "2", "3", "--warm-cache"])):
        out = tmp_path / name
        out.mkdir()
        monkeypatch.setattr(ttr.subprocess, "run", _stand_in_trainings(out, calls))
        assert ttr.main(["protocol", "--out", str(out), "--work", str(tmp_path / f"work_{name}"), "--learners", "unilab",
                         "--cache", str(cache), "--time-limit", "560", *extra]) == 0
    (cold, cold_env), (warm, warm_env) = calls
    assert [a for a in cold if ":graph:" in a] == ["unilab:graph:1"] and cold[cold.index("--time-limit") + 1] == "200"
    assert [a for a in warm if ":graph:" in a] == ["unilab:graph:2", "unilab:graph:3"] and warm[warm.index("--time-limit") + 1] == "560"
    assert cold_env["TORCHINDUCTOR_CACHE_DIR"] == warm_env["TORCHINDUCTOR_CACHE_DIR"] == str(cache)
    assert (cache / "kernel_unilab_1").is_file()  # the warm call emptied nothing
    second = json.loads((tmp_path / "warm" / "time_to_reward_protocol.json").read_text())["protocol"]
    assert second["warm_cache_from_an_earlier_call"] is True
    assert second["verdicts"]["unilab"]["cold_seed"] is None and second["verdicts"]["unilab"]["meets_targets"] is False
    assert ttr.main(["verdict", str(tmp_path / "cold"), str(tmp_path / "warm"), "--output", str(tmp_path / "joined.json")]) == 0
    joined = json.loads((tmp_path / "joined.json").read_text())["protocol"]
    verdict = joined["verdicts"]["unilab"]
    assert verdict["seeds"] == [1, 2, 3] and verdict["cold_seed"] == 1 and verdict["cold_seed_cache_warm_at_launch"] is False
    assert len(joined["calls"]) == 2
    assert "unilab: seeds [1, 2, 3], cold seed 1" in capsys.readouterr().out


def test_the_protocol_refuses_a_shared_cache_for_two_learners_and_pairs_without_a_cold_seed(tmp_path, capsys):
    base = ["protocol", "--out", str(tmp_path / "out"), "--work", str(tmp_path / "work"), "--dry-run"]
    with pytest.raises(SystemExit):
        ttr.main([*base, "--learners", "flashsac_opt", "unilab", "--cache", str(tmp_path / "c")])
    assert "--cache takes one learner" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        ttr.main([*base, "--warm-cache", "--startup-pairs", "1"])
    assert "--warm-cache runs seeds only" in capsys.readouterr().err


def test_the_protocol_passes_its_overrides_to_every_training(tmp_path, capsys):
    # a variant of the recipe (here TensorBoard written every 10 iterations) reaches each seed's training
    override = "training.log_interval=10"
    assert ttr.main(["protocol", "--out", str(tmp_path / "out"), "--work", str(tmp_path / "work"), "--dry-run", "--override", override]) in (0, None)
    printed = capsys.readouterr().out
    commands = [line for line in printed.splitlines() if "trainings.py" in line]
    assert len(commands) == 2 and all(f"--override {override}" in line for line in commands), printed
