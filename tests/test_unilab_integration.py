"""patches/, `flashsac-opt unilab`, the adapter, and a real G1 MuJoCo training run on CPU."""

import glob
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from flashsac_opt.unilab import patch as unilab_patch
from flashsac_opt.cli import main as cli_main
from flashsac_opt.testing.oracle import unilab_learner_kwargs

from unilab_tree import add_g1_placeholders, copy_unilab, g1_cpu_training

pytestmark = pytest.mark.unilab
REPO = Path(__file__).resolve().parents[1]


def tree_digest(base: Path) -> dict[str, str]:
    return {str(p.relative_to(base)): hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted((base / "unilab").rglob("*")) if p.is_file()}


@pytest.fixture
def checkout(tmp_path, require_unilab):
    """A checkout-like tree: <root>/src/unilab and a pyproject.toml carrying the version."""
    root = tmp_path / "UniLab"
    (root / "src").mkdir(parents=True)
    shutil.copytree(copy_unilab(tmp_path / "tmp_site") / "unilab", root / "src" / "unilab")
    (root / "pyproject.toml").write_text('[project]\nname = "unilab"\nversion = "1.5.2"\n')
    return root


def test_apply_is_idempotent_and_revert_is_byte_identical(site):
    original = tree_digest(site)
    changed = unilab_patch.apply(site, include_optional=True)
    assert len(changed) == 12  # 0001: 2 files, 0002: 3, 0003: 4, 0004: 1, 0005: 2, 0006: 1 (one of 0003's)
    patched = tree_digest(site)
    assert {k for k in original if original[k] != patched[k]} == set(changed)
    assert unilab_patch.apply(site, include_optional=True) == []  # again: nothing to do
    assert tree_digest(site) == patched
    states = {p["name"]: p["state"] for p in unilab_patch.status(site)["patches"]}
    assert set(states.values()) == {"applied"}
    assert sorted(unilab_patch.revert(site)) == sorted(changed)
    assert tree_digest(site) == original


def test_two_patches_of_one_file_apply_and_revert_in_any_order(site):
    # 0003 (optional) and 0006 both change scripts/train_offpolicy.py: each is applied or reverted
    # alone with the other's change kept, and the file's state names which of them it carries
    target = site / "unilab" / "scripts" / "train_offpolicy.py"
    original = target.read_bytes()
    states = lambda: {p["name"][:4]: p["state"] for p in unilab_patch.status(site)["patches"]}  # noqa: E731
    unilab_patch.apply(site, names=["0006-startup-probe-eager"])
    only_0006 = target.read_bytes()
    assert b'set_stance("force_eager")' in only_0006 and states()["0003"] == "not applied" and states()["0006"] == "applied"
    unilab_patch.apply(site, names=["0003-data-parallel-launch"])
    both = target.read_bytes()
    assert b'set_stance("force_eager")' in both and states()["0003"] == states()["0006"] == "applied"
    unilab_patch.revert(site, names=["0006-startup-probe-eager"])  # 0003's change stays
    assert b'set_stance("force_eager")' not in target.read_bytes() and states()["0003"] == "applied" and states()["0006"] == "not applied"
    unilab_patch.apply(site, names=["0006-startup-probe-eager"])
    assert target.read_bytes() == both  # the same bytes whichever came first
    unilab_patch.revert(site, names=["0003-data-parallel-launch"])
    assert target.read_bytes() == only_0006
    unilab_patch.revert(site)
    assert target.read_bytes() == original
    # a local change to the shared file: neither patch claims it, both refuse
    target.write_bytes(both + b"# mine\n")
    assert states()["0003"] == states()["0006"] == "conflict"
    for name in ("0003-data-parallel-launch", "0006-startup-probe-eager"):
        with pytest.raises(unilab_patch.PatchError, match="locally modified"):
            unilab_patch.revert(site, names=[name])


def test_the_runner_patches_0004_and_0007_apply_and_revert_alone(site):
    # both change the off-policy runner: either order gives the same bytes, each reverts alone
    target = site / "unilab" / "rl" / "runtime" / "offpolicy" / "double_buffer_runner.py"
    original = target.read_bytes()
    unilab_patch.apply(site, names=["0007-update-phase-runs-ahead"])
    only_0007 = target.read_bytes()
    assert b'getattr(learner, "update_phase_runs_ahead", False)' in only_0007 and b"use_startup_idle_time" not in only_0007
    unilab_patch.apply(site, names=["0004-startup-idle-compile"])
    both = target.read_bytes()
    unilab_patch.revert(site, names=["0007-update-phase-runs-ahead"])
    assert b"update_phase_runs_ahead" not in target.read_bytes() and b"use_startup_idle_time" in target.read_bytes()
    unilab_patch.apply(site, names=["0007-update-phase-runs-ahead"])
    assert target.read_bytes() == both
    unilab_patch.revert(site, names=["0004-startup-idle-compile"])
    assert target.read_bytes() == only_0007
    unilab_patch.revert(site)
    assert target.read_bytes() == original


def test_the_series_refuses_overlapping_patches_of_one_file(tmp_path):
    # two patches whose hunks touch the same lines of one file cannot be combined: load_series says so
    series = [unilab_patch.FilePatch("f.py", "0" * 64, "1" * 64, [(3, 3, [" a\n", "-b\n", "+B\n"])]),
              unilab_patch.FilePatch("f.py", "0" * 64, "2" * 64, [(4, 4, [" b\n", "+c\n"])])]
    with pytest.raises(unilab_patch.PatchError, match="overlap at line 4"):
        unilab_patch._spans(series)
    assert len(unilab_patch._spans(series[:1])) == 1


def test_checkout_layout_and_dry_run(checkout):
    before = tree_digest(checkout / "src")
    changed = unilab_patch.apply(checkout, dry_run=True)
    assert changed == ["unilab/rl/algos/flash_sac/double_buffer.py", "unilab/conf/flashsac/config.yaml",
                       "unilab/rl/runtime/offpolicy/double_buffer_runner.py", "unilab/scripts/train_flashsac.py",
                       "unilab/rl/runtime/async_runner.py", "unilab/scripts/train_offpolicy.py"]  # 0001, 0004-0006: the required ones
    assert tree_digest(checkout / "src") == before  # dry run: nothing written
    unilab_patch.apply(checkout)
    report = unilab_patch.status(checkout)
    assert report["version"] == "1.5.2"
    assert [p["state"] for p in report["patches"]] == ["applied", "not applied", "not applied", "applied", "applied", "applied", "applied"]  # 0002, 0003: optional


def test_refuses_a_locally_modified_file(site):
    target = site / "unilab" / "conf" / "flashsac" / "config.yaml"
    target.write_text(target.read_text() + "# my local change\n")
    before = tree_digest(site)
    with pytest.raises(unilab_patch.PatchError, match="locally modified"):
        unilab_patch.apply(site)
    assert tree_digest(site) == before
    assert cli_main(["unilab", "apply", "--root", str(site)]) == 2


def test_refuses_another_unilab_version(site):
    meta = next(site.glob("unilab-*.dist-info")) / "METADATA"
    meta.write_text(meta.read_text().replace("Version: 1.5.2", "Version: 1.6.0"))
    before = tree_digest(site)
    with pytest.raises(unilab_patch.PatchError, match="UniLab 1.6.0"):
        unilab_patch.apply(site)
    assert tree_digest(site) == before


def test_refuses_a_half_applied_patch(site):
    original = (site / "unilab" / "conf" / "flashsac" / "config.yaml").read_bytes()
    unilab_patch.apply(site)
    (site / "unilab" / "conf" / "flashsac" / "config.yaml").write_bytes(original)  # undo one file of 0001
    before = tree_digest(site)
    for action in (unilab_patch.apply, unilab_patch.revert):
        with pytest.raises(unilab_patch.PatchError, match="half-applied"):
            action(site)
    assert tree_digest(site) == before


def test_apply_rolls_back_when_a_write_fails(site, monkeypatch):
    before = tree_digest(site)
    real_replace, calls = os.replace, []

    def failing_replace(src, dst):
        calls.append(dst)
        if len(calls) == 2:
            raise OSError("disk full")
        real_replace(src, dst)

    monkeypatch.setattr(unilab_patch.os, "replace", failing_replace)
    with pytest.raises(OSError, match="disk full"):
        unilab_patch.apply(site)
    monkeypatch.undo()
    assert tree_digest(site) == before  # the first file was restored: all or nothing


@pytest.mark.skipif(shutil.which("patch") is None, reason="no `patch` program")
def test_plain_patch_p1_gives_the_same_files(site, tmp_path):
    other = copy_unilab(tmp_path / "other")
    unilab_patch.apply(site, include_optional=True)
    series = json.loads((REPO / "patches" / "series.json").read_text())["patches"]
    assert len(series) >= 7  # every patch of the series, in its order
    for name in [p["file"] for p in series]:
        subprocess.run(["patch", "-p1", "-s", "--no-backup-if-mismatch", "-i", str(REPO / "patches" / name)], cwd=other, check=True)
    assert tree_digest(other) == tree_digest(site)


_RUNNER_WAIT = """
import queue, types
from unilab.rl.runtime.offpolicy import double_buffer_runner as r
from unilab.rl.runtime.offpolicy.coordination import LearnerCoordinationState
from unilab.rl.runtime.offpolicy.worker import COLLECTOR_READY_TICK

class Requests:  # empty twice, the collector's ready signal, empty once more, then its tick 0
    items = [None, None, COLLECTOR_READY_TICK, None, 0]
    def get(self, timeout):
        item = self.items.pop(0)
        if item is None:
            raise queue.Empty
        return item

calls = []
class Learner:
    def use_startup_idle_time(self):  # the phase the collector sees while the learner uses the wait
        calls.append(runner._learner_coordination.snapshot()[0].name)

runner = object.__new__(r.DoubleBufferOffPolicyRunner)
runner.learner, runner._collector_ready = Learner(), False
runner._learner_coordination = LearnerCoordinationState()
runner._drain_metrics = lambda *a, **k: None
runner._check_collector_alive = lambda: True
tick = runner._wait_for_inference_request(
    Requests(), expected_tick=0, replay_pipeline=types.SimpleNamespace(progress=lambda: None), metrics_queue=None,
    reward_history=None, latest_reward_components=None, logger=types.SimpleNamespace(start=lambda: None),
    trace_recorder=None, replay_buffer=None, ckpt_path=None, train_start_wall=0.0)
print(tick, calls, runner._learner_coordination.snapshot()[0].name)
"""


def test_the_patched_runner_lends_its_wait_for_the_collector_to_the_learner(site):
    # patches/0004: while UniLab's runner waits for its collector to start, the learner may use
    # the time (flashsac_opt compiles there); once the collector is ready, the waits are its own
    unilab_patch.apply(site)
    env = dict(os.environ, PYTHONPATH=f"{site}{os.pathsep}{REPO}", CUDA_VISIBLE_DEVICES="")
    done = subprocess.run([sys.executable, "-c", _RUNNER_WAIT], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    # called on both empty polls before the ready signal, marked busy meanwhile; not after it
    assert done.stdout.split("\n")[-2] == "0 ['BUSY', 'BUSY'] BUSY"


# ------------------------------------------------------------------ adapter
_unilab_kwargs = unilab_learner_kwargs  # the other adapter tests import it from here


def test_adapter_serves_the_runner_surface_and_stock_unilab_loads_its_checkpoint(require_unilab, tmp_path):
    from unilab.rl.algos.flash_sac.learner import FlashSACLearner as UniLabLearner
    from unilab.rl.algos.flash_sac.network import FlashSACActor as UniLabActor
    from unilab.rl.logging.metric_schema import normalize_metric_map

    from flashsac_opt.testing.oracle import synthetic_batch
    from flashsac_opt.unilab.adapter import build_unilab_learner

    learner = build_unilab_learner(device="cpu", learner_mode="eager", **_unilab_kwargs())
    g = torch.Generator().manual_seed(0)
    learner.update_reward_stats(torch.randn(2, 16), torch.zeros(2, 16))
    batch = synthetic_batch(64, 98, 101, 29, generator=g)
    assert learner.use_update_cycle
    learner.update_cycle(batch, updates_per_step=2, policy_frequency=2, target_frequency=1, policy_before_critic=False)
    assert learner.update_phase_runs_ahead and learner.read_deferred_cycle_metrics() == {}  # the default: one iteration late
    learner.update_cycle(batch, updates_per_step=2, policy_frequency=2, target_frequency=1, policy_before_critic=False)
    metrics = learner.read_deferred_cycle_metrics()
    assert set(metrics) == {"Loss/critic", "Train/reward_scale_std", "Loss/actor", "Loss/entropy", "Policy/temperature", "Loss/temperature"}
    normalize_metric_map(metrics)  # UniLab's logger accepts every name
    # per-update path, as the runner drives it without the whole cycle
    b = {k: v[:32] for k, v in batch.items()}
    assert set(learner.update_critic(b, read_metrics=True)) == {"Loss/critic", "Train/reward_scale_std"}
    assert learner.update_actor(b, read_metrics=False) == {}
    learner.soft_update_target()
    assert set(learner.read_deferred_actor_metrics()) == {"Loss/actor", "Loss/entropy", "Policy/temperature", "Loss/temperature"}
    actions = learner.actor.explore(batch["obs"][:16], dones=torch.zeros(16))
    assert actions.shape == (16, 29) and actions.abs().max() <= 1
    assert learner.inference_startup_memory_categories(16) == {"persistent_exploration_scratch": 16 * (29 * 4 + 8)}
    learner.update_count = 3
    path = tmp_path / "model_3.pt"
    torch.save(learner.get_state_dict(), path)
    state = torch.load(path, weights_only=True)  # what UniLab's play/eval does
    stock = UniLabLearner(**_unilab_kwargs(use_amp=False, use_compile=False), device="cpu")
    stock.load_state_dict(state)
    actor = UniLabActor(num_blocks=2, input_dim=98, hidden_dim=32, action_dim=29)
    actor.load_state_dict(state["actor"])  # strict: same key names as UniLab's actor
    obs = batch["obs"][:8]
    torch.testing.assert_close(actor.explore(obs, deterministic=True), learner.actor.explore(obs, deterministic=True))
    resumed = build_unilab_learner(device="cpu", learner_mode="eager", **_unilab_kwargs())
    resumed.load_state_dict(state)
    assert resumed.update_count == 3 and resumed.learner.iterations == learner.learner.iterations
    assert torch.equal(resumed.learner.critic.params, learner.learner.critic.params)


def test_adapter_rejects_what_it_does_not_support(require_unilab):
    from flashsac_opt.unilab.adapter import build_unilab_learner

    with pytest.raises(ValueError, match="learner_mode=graph needs a CUDA device"):
        build_unilab_learner(device="cpu", learner_mode="graph", **_unilab_kwargs())
    with pytest.raises(ValueError, match="built-in FlashSAC actor"):
        build_unilab_learner(device="cpu", learner_mode="eager", actor_config={"builder": "x:y"}, **_unilab_kwargs())
    with pytest.raises(ValueError, match="does not know"):
        build_unilab_learner(device="cpu", learner_mode="eager", **_unilab_kwargs(some_new_knob=1))


# ------------------------------------------------------------------ real training
def test_real_g1_training_on_cpu_uses_flashsac_opt(site, tmp_path):
    """`train --algo flashsac --task g1_walk_flat --sim mujoco`, 16 envs, CPU, patched UniLab, the
    update phase running ahead of the runner (the default, patches/0007: the runner's path without
    its synchronize; the synchronizing path is the training benchmark's CPU test's)."""
    unilab_patch.apply(site, include_optional=True)
    scene = add_g1_placeholders(site / "unilab")
    logs = tmp_path / "logs"
    env = dict(os.environ, PYTHONPATH=f"{site}{os.pathsep}{REPO}", CUDA_VISIBLE_DEVICES="", WANDB_MODE="disabled",
               FLASHSAC_OPT_UPDATE_RUNS_AHEAD="1")
    env.pop("FLASHSAC_OPT_COLLECTOR_EAGER", None)
    proc = subprocess.run(
        g1_cpu_training(scene, logs, f"algo.algo_params.compile_cache_file={tmp_path / 'cc.bin'}"),
        env=env, capture_output=True, text=True, timeout=900, cwd=tmp_path,  # Hydra writes train_flashsac.log into the cwd
    )
    log = proc.stdout + proc.stderr
    run_dirs = glob.glob(str(logs / "G1WalkFlat" / "*"))
    assert run_dirs, log[-3000:]
    run = Path(run_dirs[0])
    checkpoint = run / "model_6.pt"
    assert checkpoint.is_file() and (run / "model_3.pt").is_file(), log[-3000:]
    state = torch.load(checkpoint, weights_only=True)
    assert state["flashsac_opt"]["iterations"] > 0  # flashsac_opt's learner did the updates
    # UniLab routes the collector's tensor device (here the CPU) where the forked collector reads it
    assert "the collector compiles nothing (FLASHSAC_OPT_COLLECTOR_EAGER=auto, its tensors on cpu)" in log, log[-3000:]
    # the patch routes flashsac_opt's own knobs from UniLab's config
    assert state["flashsac_opt"]["fused_update"] is False
    assert state["flashsac_opt"]["batch_size"] == 32  # the runner's batch size reached the learner
    assert state["flashsac_opt"]["compile_cache_file"] == str(tmp_path / "cc.bin")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(run))
    events.Reload()
    tags = set(events.Tags()["scalars"])
    assert {"Loss/critic", "Loss/actor", "Policy/temperature", "Perf/learning_time"} <= tags
    assert all(torch.isfinite(torch.tensor(e.value)) for e in events.Scalars("Loss/critic"))
    # running ahead, each iteration logs the previous one's losses: the first logs none
    timed = [e.step for e in events.Scalars("Perf/learning_time")]
    assert [e.step for e in events.Scalars("Loss/critic")] == timed[1:] and len(timed) >= 6
    assert all(e.value > 0 for e in events.Scalars("Perf/learning_time"))

    # Stock (unpatched) UniLab's own `eval` plays the checkpoint flashsac_opt wrote.
    from unilab_tree import stock_eval

    played = stock_eval(tmp_path, run, env)
    out = played.stdout + played.stderr
    assert played.returncode == 0, out[-3000:]
    assert f"Loading flashsac checkpoint: {checkpoint}" in out, out[-3000:]
    assert "Traceback" not in out, out[-3000:]


def test_a_non_editable_install_carries_the_patch_series(tmp_path):
    """The wheel holds patches/ (via the flashsac_opt/patches link), so `flashsac-opt unilab`
    works from a plain `pip install flashsac-opt`, not only from a checkout."""
    wheels, site = tmp_path / "wheels", tmp_path / "site"
    built = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(wheels), str(REPO)],
                           capture_output=True, text=True, timeout=600)
    assert built.returncode == 0, built.stderr[-2000:]
    (wheel,) = wheels.glob("flashsac_opt-*.whl")
    installed = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(site), str(wheel)],
                               capture_output=True, text=True, timeout=600)
    assert installed.returncode == 0, installed.stderr[-2000:]
    code = "from flashsac_opt.unilab.patch import patches_dir, load_series; print(patches_dir()); print(len(load_series()))"
    found = subprocess.run([sys.executable, "-c", code], env=dict(os.environ, PYTHONPATH=str(site)), cwd=tmp_path,
                           capture_output=True, text=True, timeout=120)
    assert found.returncode == 0, found.stderr[-2000:]
    where, count = found.stdout.split()
    assert Path(where).resolve().is_relative_to(site.resolve()) and int(count) == len(unilab_patch.load_series()) == 7


@pytest.mark.parametrize("version", [0, 1, 2])
def test_an_earlier_version_of_the_patch_is_upgraded_or_reverted(site, version):
    """Files as a previous flashsac_opt's 0001 left them (v1, v2, v3): status says so, apply
    upgrades them to exactly what a fresh apply writes, revert restores UniLab's originals."""
    series = unilab_patch.load_series()
    current = series[0]
    assert len(current.earlier) == 3
    old = current.earlier[version]
    originals = {f.path: (site / f.path).read_bytes() for f in current.files}
    for f in old.files:  # what the earlier flashsac_opt wrote
        (site / f.path).write_text(unilab_patch._apply_hunks((site / f.path).read_text(), f.hunks, reverse=False))
    assert unilab_patch.patch_state(site, current)[0] == "applied-earlier"
    assert cli_main(["unilab", "status", "--root", str(site)]) == 0
    assert cli_main(["unilab", "apply", "--root", str(site)]) == 0  # the upgrade, as a user runs it
    assert unilab_patch.patch_state(site, current)[0] == "applied"
    upgraded = {f.path: (site / f.path).read_bytes() for f in current.files}
    unilab_patch.revert(site)
    assert {f.path: (site / f.path).read_bytes() for f in current.files} == originals
    unilab_patch.apply(site)
    assert {f.path: (site / f.path).read_bytes() for f in current.files} == upgraded
    for f in old.files:  # earlier version again, then straight back to the originals
        (site / f.path).write_bytes(originals[f.path])
        (site / f.path).write_text(unilab_patch._apply_hunks((site / f.path).read_text(), f.hunks, reverse=False))
    unilab_patch.revert(site)
    assert {f.path: (site / f.path).read_bytes() for f in current.files} == originals


def _learner_import(source: str) -> str:
    """The import statement patch 0001 puts into UniLab's double_buffer.py."""
    (line,) = [ln.strip() for ln in source.splitlines() if "import build_unilab_learner" in ln]
    return line


@pytest.mark.parametrize("version", [0, 1, 2])
def test_a_tree_patched_by_an_earlier_version_fails_with_a_clear_error(site, version):
    """v1-v3 import flashsac_opt.unilab_adapter at train time: that now raises an error that
    says to upgrade the patch (not a bare ModuleNotFoundError); v4's import works."""
    from flashsac_opt.unilab_adapter import OutdatedUniLabPatchError

    current = unilab_patch.load_series()[0]
    target = site / "unilab/rl/algos/flash_sac/double_buffer.py"
    original = target.read_text()
    (old_file,) = [f for f in current.earlier[version].files if f.path.endswith("double_buffer.py")]
    statement = _learner_import(unilab_patch._apply_hunks(original, old_file.hunks, reverse=False))
    assert "flashsac_opt.unilab_adapter" in statement
    namespace: dict = {}
    exec(statement, namespace)  # what the patched runner executes with learner_impl=flashsac_opt
    with pytest.raises(OutdatedUniLabPatchError, match=r"earlier flashsac_opt patch.*flashsac-opt unilab apply"):
        namespace["build_unilab_learner"](device="cpu", learner_mode="eager", **_unilab_kwargs())
    with pytest.raises(OutdatedUniLabPatchError, match="flashsac-opt unilab apply"):
        exec("from flashsac_opt.unilab_adapter import UniLabFlashSACLearner", {})

    (new_file,) = [f for f in current.files if f.path.endswith("double_buffer.py")]
    namespace = {}
    exec(_learner_import(unilab_patch._apply_hunks(original, new_file.hunks, reverse=False)), namespace)
    from flashsac_opt.unilab.adapter import build_unilab_learner

    assert namespace["build_unilab_learner"] is build_unilab_learner


# ------------------------------------------------------------------ CLI output and errors
def _failing_replace(fail_on: int):
    real_replace, calls = os.replace, []

    def replace(src, dst):
        calls.append(dst)
        if len(calls) == fail_on:
            raise PermissionError(13, "Permission denied", str(dst))
        real_replace(src, dst)

    return replace


@pytest.mark.parametrize("action", ["apply", "revert"])
def test_cli_reports_a_write_failure_in_one_line_and_changes_nothing(site, monkeypatch, capsys, action):
    """A file that cannot be written (read-only directory, immutable file): one line naming the
    file and the reason, a non-zero exit, and every file as it was (rolled back)."""
    if action == "revert":
        unilab_patch.apply(site, include_optional=True)
    before = tree_digest(site)
    monkeypatch.setattr(unilab_patch.os, "replace", _failing_replace(fail_on=2))
    code = cli_main(["unilab", action, "--root", str(site), "--with-cpu-smoke"] if action == "apply"
                    else ["unilab", action, "--root", str(site)])
    monkeypatch.undo()
    out, err = capsys.readouterr()
    assert code == 1
    assert out == ""
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    changed = sorted(unilab_patch.apply(site, include_optional=True, dry_run=True) if action == "apply"
                     else unilab_patch.revert(site, dry_run=True))
    second = [path for path in changed if path in lines[0]]
    assert len(second) == 1 and "Permission denied" in lines[0] and "nothing changed" in lines[0], lines[0]
    assert str(site) in lines[0]  # the full path of the file, not only its name
    assert tree_digest(site) == before


def test_status_identifies_the_version_by_file_hashes_without_metadata(checkout, capsys):
    """A checkout's src/ without dist-info or pyproject.toml: the patched files' hashes say 1.5.2."""
    (checkout / "pyproject.toml").unlink()
    report = unilab_patch.status(checkout)
    assert (report["version"], report["version_source"]) == ("1.5.2", "identified by file hashes")
    unilab_patch.apply(checkout)  # patched files are known 1.5.2 hashes too
    assert unilab_patch.status(checkout)["version"] == "1.5.2"
    assert cli_main(["unilab", "status", "--root", str(checkout)]) == 0
    assert "UniLab 1.5.2 (identified by file hashes)" in " ".join(capsys.readouterr().out.split())
    target = checkout / "src/unilab/rl/runtime/ipc/replay_pipelines/device.py"
    target.write_text(target.read_text() + "# local change\n")
    report = unilab_patch.status(checkout)
    assert report["version"] is None
    assert "no package metadata or pyproject.toml" in report["version_source"]
    assert "unilab/rl/runtime/ipc/replay_pipelines/device.py (unknown hash)" in report["version_source"]


def test_status_is_readable_at_80_columns(site, monkeypatch, capsys):
    """No line wider than 80 characters whatever the terminal says, and nothing folded: every
    file path and state on one line, descriptions complete."""
    monkeypatch.setenv("COLUMNS", "200")
    unilab_patch.apply(site, include_optional=True)
    current = unilab_patch.load_series()[0]
    for f in current.earlier[2].files:  # 0001 as v3 left it: the longest state, applied-earlier
        (site / f.path).write_text(unilab_patch._apply_hunks(
            unilab_patch._apply_hunks((site / f.path).read_text(), next(c for c in current.files if c.path == f.path).hunks, reverse=True),
            f.hunks, reverse=False))
    (next(site.glob("unilab-*.dist-info")) / "METADATA").unlink()  # a long "version unknown" reason too
    target = site / "unilab/rl/runtime/ipc/replay_pipelines/transfer/factory.py"
    target.write_text(target.read_text() + "# local change\n")
    assert cli_main(["unilab", "status", "--root", str(site)]) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    assert max(len(line) for line in lines) <= 80, out
    report = unilab_patch.status(site)
    for patch in report["patches"]:
        for path, state in patch["files"].items():
            assert any(line.split() == [state, path] for line in lines), (path, state, out)
        assert patch["description"].split() == " ".join(
            lines[lines.index(f"{patch['name']}{' (optional)' if patch['optional'] else ''}: {patch['state']}") + 1:]
        ).split()[: len(patch["description"].split())]
    assert "version unknown" in out and "factory.py (unknown hash)" in out


# ------------------------------------------------------------------ placeholder meshes
def _g1(site: Path) -> Path:
    return site / "unilab" / "assets" / "robots" / "g1"


def test_placeholder_meshes_checks_then_creates_only_missing_files(site, capsys):
    import mujoco

    from flashsac_opt.unilab import assets

    g1 = _g1(site)
    mesh_names = sorted(set(re.findall(r'file="([^"]+\.STL)"', (g1 / "g1.xml").read_text())))
    assert len(mesh_names) == 35
    (g1 / "assets").mkdir()
    real = assets.tetrahedron_stl(0.2)  # stands for a real mesh already downloaded
    (g1 / "assets" / "pelvis.STL").write_bytes(real)

    assert cli_main(["unilab", "placeholder-meshes", "--root", str(site), "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert sorted(p.name for p in (g1 / "assets").iterdir()) == ["pelvis.STL"] and not (g1 / "textures").exists()
    assert out.count("would create: ") == 35  # 34 meshes + the floor.png marker

    assert cli_main(["unilab", "placeholder-meshes", "--root", str(site)]) == 0
    out = capsys.readouterr().out
    assert max(len(line) for line in out.splitlines()) <= 80, out
    flat = " ".join(out.split())
    for claim in ("physics is unchanged", "no robot body", "kept, never overwritten: 1", "created: textures/floor.png",
                  "scene_flat.xml", "g1.xml"):
        assert claim in flat, (claim, out)
    assert sorted(p.name for p in (g1 / "assets").iterdir()) == mesh_names
    assert (g1 / "assets" / "pelvis.STL").read_bytes() == real  # the real mesh was not overwritten
    assert all((g1 / "assets" / n).read_bytes() == assets.PLACEHOLDER for n in mesh_names if n != "pelvis.STL")
    assert (g1 / "textures" / "floor.png").read_bytes().startswith(b"\x89PNG")
    model = mujoco.MjModel.from_xml_path(str(g1 / "scene_flat.xml"))  # what UniLab loads: compiles now
    meshes = model.geom_type == mujoco.mjtGeom.mjGEOM_MESH
    assert meshes.sum() == 35 and not model.geom_contype[meshes].any() and not model.geom_conaffinity[meshes].any()

    before = tree_digest(site)
    assert cli_main(["unilab", "placeholder-meshes", "--root", str(site)]) == 0  # again: nothing to do
    assert "created:" not in capsys.readouterr().out and tree_digest(site) == before


@pytest.mark.parametrize("how", ["geom attribute", "default class"])
def test_placeholder_meshes_refuses_when_a_mesh_geom_can_collide(site, capsys, how):
    g1 = _g1(site)
    xml = (g1 / "g1.xml").read_text()
    if how == "geom attribute":
        old = '<geom class="visual" material="black" mesh="pelvis"/>'
        new = '<geom class="visual" material="black" mesh="pelvis" contype="1"/>'
    else:  # every geom of the "visual" class inherits it
        old = 'material="silver" contype="0" conaffinity="0"/>'
        new = 'material="silver" contype="0" conaffinity="1"/>'
    assert xml.count(old) == 1
    (g1 / "g1.xml").write_text(xml.replace(old, new))
    before = tree_digest(site)
    assert cli_main(["unilab", "placeholder-meshes", "--root", str(site)]) == 2
    out, err = capsys.readouterr()
    assert out == "" and len(err.strip().splitlines()) == 1, err
    assert "can collide" in err and "mesh pelvis," in err and "nothing written" in err, err
    assert tree_digest(site) == before and not (g1 / "assets").exists() and not (g1 / "textures").exists()


def test_placeholder_meshes_write_failure_leaves_nothing_behind(site, monkeypatch, capsys):
    from flashsac_opt.unilab import assets

    g1, calls = _g1(site), []

    def failing_open(path, mode="r", *args, **kwargs):
        calls.append(path)
        if len(calls) == 3:
            raise OSError(28, "No space left on device", str(path))
        return open(path, mode, *args, **kwargs)

    before = tree_digest(site)
    monkeypatch.setattr(assets, "open", failing_open, raising=False)
    assert cli_main(["unilab", "placeholder-meshes", "--root", str(site)]) == 1
    monkeypatch.undo()
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and str(calls[2]) in err and "No space left on device" in err, err
    assert tree_digest(site) == before and not (g1 / "assets").exists() and not (g1 / "textures").exists()


def test_a_one_gpu_cuda_run_without_an_mps_daemon_is_told_how_to_start_one(tmp_path):
    from flashsac_opt.unilab.adapter import mps_notice

    told = mps_notice("cuda", False, {}, default_pipe=tmp_path)
    assert told is not None and "uni-cumps start" in told and "time-slice" in told
    assert mps_notice("cpu", False, {}, default_pipe=tmp_path) is None
    assert mps_notice("cuda", True, {}, default_pipe=tmp_path) is None  # uni-cumps serves one GPU
    assert mps_notice("cuda", False, {"CUDA_MPS_PIPE_DIRECTORY": "/tmp/u/pipe"}, default_pipe=tmp_path) is None
    (tmp_path / "control").write_text("")  # a system daemon on the default pipe
    assert mps_notice("cuda", False, {}, default_pipe=tmp_path) is None
