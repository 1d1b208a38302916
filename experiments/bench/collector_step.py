"""Where a UniLab collector's env step goes, without a learner: the G1 walk env at N envs stepped with
random actions, each step's phases as UniLab's own timing reports them (`info["timing"]`: MuJoCo's
step, the managers' state update, the reset of finished envs), per collector tensor carrier.

On a GPU host the collector keeps its tensors on the learner's CUDA device (UniLab's
`training.collector_tensor_device=auto`): every small op of the state update and the resets is a
kernel launch and a wait. The CPU carrier (opt-in: UNILAB_ALLOW_CUDA_LEARNER_CPU_CARRIER) keeps them
on the host. Both, one after the other in one process, give the carrier's own cost (a training adds
the learner's contention).

    python experiments/bench/collector_step.py --envs 256 --steps 200 --carriers cuda cpu --output /tmp/collector_step.json

It needs UniLab 1.5.2 and a G1 scene: it copies the installed `unilab` package into a temporary
folder with placeholder meshes, as the device's training driver does.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # experiments/: common

# the phases of UniLab's step timing this reports (the rest stays in the raw medians)
PHASES = ("env_step_total_ms", "step_core_ms", "backend_physics_ms", "update_state_ms", "reset_done_ms",
          "reset_done_reset_call_ms", "apply_action_ms")


def make_env(envs: int, carrier: str, scene: Path, conf: Path):
    """UniLab's G1WalkFlat env as its off-policy trainer builds it, with the given carrier."""
    import torch
    from hydra import compose, initialize_config_dir
    from unilab.base import registry
    from unilab.base.process_device import apply_collector_tensor_device_override
    from unilab.scripts.train_offpolicy import _build_offpolicy_env_cfg_override
    from unilab.training import ensure_registries

    ensure_registries()
    with initialize_config_dir(config_dir=str(conf), version_base="1.3"):
        cfg = compose("config", overrides=["task=g1_walk_flat/mujoco", f"env.scene.model_file={scene}", f"algo.num_envs={envs}"])
    base = _build_offpolicy_env_cfg_override("flashsac", cfg, root_dir=Path.cwd())
    learner = "cuda:0" if torch.cuda.is_available() else "cpu"
    override = apply_collector_tensor_device_override(base, "mujoco", collector_tensor_device=carrier, learner_device=learner)
    return registry.make(str(cfg.training.task_name), num_envs=envs, sim_backend="mujoco", env_cfg_override=override)


def measure(env, steps: int, warmup: int, seed: int) -> dict:
    import torch

    started = time.perf_counter()
    env.reset()  # the first reset builds UniLab's torch.compile'd root reset (a C++ build on the CPU carrier)
    first_reset_s = time.perf_counter() - started
    n, action_dim = env.num_envs, env.action_space.shape[-1]
    device = env._state.obs[next(iter(env._state.obs))].device
    g = torch.Generator().manual_seed(seed)
    rows: list[dict] = []
    wall = []
    warmup_started = time.perf_counter()
    for i in range(warmup + steps):
        if i == warmup:
            warmup_s = time.perf_counter() - warmup_started
        action = (torch.rand(n, action_dim, generator=g) * 2 - 1).to(device)
        started = time.perf_counter()
        env.step(action)
        if device.type == "cuda":
            torch.cuda.synchronize()
        if i >= warmup:
            wall.append((time.perf_counter() - started) * 1e3)
            timing = env._state.info.get("timing", {})
            rows.append({k: float(v) for k, v in timing.items() if isinstance(v, (int, float))})

    def stats(values: list[float]) -> dict:
        return {"median": statistics.median(values), "p90": statistics.quantiles(values, n=10)[-1], "mean": statistics.fmean(values)}

    keys = sorted({k for r in rows for k in r})
    return {
        "device": str(device),
        "first_reset_s": first_reset_s,
        "warmup_s": warmup_s,
        "wall_ms": stats(wall),
        "phases_ms": {k: stats([r.get(k, 0.0) for r in rows]) for k in PHASES if any(k in r for r in rows)},
        "all_medians": {k: statistics.median([r.get(k, 0.0) for r in rows]) for k in keys},
    }


def main(argv: list[str] | None = None) -> int:
    from common import run_environment
    from device.trainings import copy_installed_unilab

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--envs", type=int, default=256)
    parser.add_argument("--steps", type=int, default=200, help="timed steps per carrier")
    parser.add_argument("--warmup", type=int, default=20, help="untimed steps first (UniLab's compiled reset builds at first use; >= 1)")
    parser.add_argument("--carriers", nargs="+", default=["cuda", "cpu"], choices=["auto", "cuda", "cpu"])
    parser.add_argument("--threads", type=int, default=1, help="torch threads (UniLab gives its collector one at 16 CPUs)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--eager", action="store_true", help="torch.compile'd functions run eagerly (FLASHSAC_OPT_COLLECTOR_EAGER's stance)")
    parser.add_argument("--output", type=Path, required=True)
    args = parser.parse_args(argv)
    if args.warmup < 1 or args.steps < 2:
        parser.error("--warmup must be at least 1 and --steps at least 2")

    import torch

    torch.set_num_threads(args.threads)
    if args.eager:
        torch.compiler.set_stance("force_eager")
    if "cpu" in args.carriers and torch.cuda.is_available():
        os.environ["UNILAB_ALLOW_CUDA_LEARNER_CPU_CARRIER"] = "1"  # UniLab's own opt-in for this carrier
    carriers = [c for c in args.carriers if c != "cuda" or torch.cuda.is_available()]
    skipped = sorted(set(args.carriers) - set(carriers))
    result = {"experiment": "collector_step", "environment": run_environment("cuda" if torch.cuda.is_available() else "cpu"),
              "envs": args.envs, "steps": args.steps, "warmup": args.warmup, "torch_threads": args.threads, "eager": args.eager,
              "carriers": {}, "skipped_carriers": skipped}
    with tempfile.TemporaryDirectory(prefix="collector_step_") as tmp:
        work = Path(tmp)
        copy_installed_unilab(work)  # the training driver's copy, with the G1 placeholder meshes
        scene = work / "unilab" / "assets" / "robots" / "g1" / "scene_flat.xml"
        sys.path.insert(0, str(work))
        for name in [m for m in sys.modules if m == "unilab" or m.startswith("unilab.")]:
            del sys.modules[name]
        for carrier in carriers:
            started = time.perf_counter()
            env = make_env(args.envs, carrier, scene, work / "unilab" / "conf" / "flashsac")
            built_s = time.perf_counter() - started
            result["carriers"][carrier] = {"construct_s": built_s, **measure(env, args.steps, args.warmup, args.seed)}
            close = getattr(env, "close", None)
            if callable(close):
                close()
            phases = result["carriers"][carrier]["phases_ms"]
            print(f"{carrier}: " + ", ".join(f"{k} {v['median']:.2f}" for k, v in phases.items()))
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
