"""Test helpers: a private, patchable copy of the installed UniLab 1.5.2 and G1 placeholders."""

from __future__ import annotations

import importlib.util
import shutil
from pathlib import Path

from flashsac_opt.unilab.assets import placeholder_meshes


def installed_unilab() -> Path:
    spec = importlib.util.find_spec("unilab")
    assert spec is not None and spec.origin is not None
    return Path(spec.origin).parent


def copy_unilab(dest: Path) -> Path:
    """Copy the installed `unilab` package (+ its dist-info) into dest (a site-packages-like dir)."""
    src = installed_unilab()
    shutil.copytree(src, dest / "unilab", ignore=shutil.ignore_patterns("__pycache__"))
    for info in src.parent.glob("unilab-*.dist-info"):
        shutil.copytree(info, dest / info.name)
    return dest


def add_g1_placeholders(pkg: Path) -> Path:
    """`flashsac-opt unilab placeholder-meshes` on the unilab package dir pkg; the G1 scene path."""
    return placeholder_meshes(pkg).scene


# What UniLab's `train` console script runs (a test calls it as `python -c TRAIN_CODE ...`).
TRAIN_CODE = "import sys; from unilab.cli import train_main; sys.argv = ['train'] + sys.argv[1:]; train_main()"


def g1_cpu_training(scene: Path, logs: Path, *overrides: str, iterations: int = 6) -> list[str]:
    """`train --algo flashsac --task g1_walk_flat --sim mujoco` as the CPU tests run it: 16 envs,
    batch 32, 2 updates, checkpoints every 3 iterations, flashsac_opt's learner in eager mode."""
    import sys

    return [sys.executable, "-c", TRAIN_CODE, "--algo", "flashsac", "--task", "g1_walk_flat", "--sim", "mujoco",
            "algo.num_envs=16", "algo.batch_size=32", "algo.updates_per_step=2", f"algo.max_iterations={iterations}",
            "algo.learning_starts=2", "algo.save_interval=3", "training.no_play=true", f"training.log_root={logs}",
            "algo.algo_params.learner_impl=flashsac_opt", "algo.algo_params.learner_mode=eager", f"env.scene.model_file={scene}",
            "algo.algo_params.fused_update=false", *overrides]


EVAL_CODE = "import sys; from unilab.cli import eval_main; sys.argv = ['eval'] + sys.argv[1:]; sys.exit(eval_main())"


def stock_eval(tmp_path: Path, run: Path, env: dict):
    """Stock (unpatched) UniLab's `eval` of the latest flashsac checkpoint in the run folder ``run``
    (under its log root, run.parent.parent), from a fresh copy of the installed UniLab with
    placeholder meshes: 2 envs, 2 steps, recorded. Returns the CompletedProcess.

    2 steps, not more: the checkpoint is loaded and the policy acts on an observation its own
    action produced either way, but `record` renders each step's frame in a pool of spawned
    processes (stock UniLab's PlaybackSession: up to 8, one more per frame until then), each
    importing UniLab and opening an off-screen MuJoCo renderer (~5 s apiece on two cores):
    measured 29-33 s for this eval at 5 steps, 18.6 s at 2."""
    import subprocess
    import sys

    stock = copy_unilab(tmp_path / "stock")
    scene = add_g1_placeholders(stock / "unilab")
    return subprocess.run(
        [sys.executable, "-c", EVAL_CODE, "--algo", "flashsac", "--task", "g1_walk_flat", "--sim", "mujoco",
         "--load-run", run.name, "--render-mode", "record", "training.play_steps=2", "training.play_env_num=2",
         "training.export_onnx=false", f"training.log_root={run.parent.parent}", f"env.scene.model_file={scene}"],
        env=dict(env, PYTHONPATH=str(stock), CUDA_VISIBLE_DEVICES=""), capture_output=True, text=True, timeout=600, cwd=tmp_path,
    )
