"""Effect of bf16 observation storage in GPUReplay on the learner's numerics (real G1 rows).

Three eager learners start from the same weights and see the same sampled indices and RNG
state: `fp32` samples from a replay storing observations in fp32, `bf16_obs` from a replay
storing them in bf16 (what `GPUReplay(obs_dtype=torch.bfloat16)` does: half the bytes per
sampled row's observation columns), and `rounding_floor` from the fp32 replay with its
critic weights perturbed by 1e-7 relative once (how far two runs differing only by rounding
drift apart). Reported per iteration: norm-relative parameter drift from `fp32` and the
relative difference of the per-update losses; plus the storage's own rounding error.

    python experiments/validate/validate_bf16_obs_storage.py --iterations 300 \\
        --output results/bf16_obs_storage/bf16_obs_storage_cpu.json --plot results/bf16_obs_storage/bf16_obs_storage_cpu.png
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # experiments/: common, report.plotting
from common import load_replay_file, run_environment, write_report  # noqa: E402
from report import plotting  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
DEFAULT_REPLAY = REPO / "tests" / "data" / "replay_g1_cpu.pt"


def plot(report: dict, path: Path) -> None:
    fig, (ax1, ax2) = plotting.subplots(1, 2, figsize=(12, 4.5))
    runs = (("bf16_obs", "-"), ("rounding_floor", "--"))
    plotting.drift_panel(ax1, report["drift"], runs, "fp32 run", "parameter drift from the fp32-storage run")
    for name, style in runs:
        ax2.plot(report["drift"][name]["losses"], style, label=name)
    plotting.finish_axis(ax2, "iteration", "relative difference of per-update losses", "loss difference", log=True)
    cfg = report["training_config"]
    fig.suptitle(f"bf16 observation storage, real G1 replay, eager {report['environment']['device']}: "
                 f"B{cfg['batch_size']} x {cfg['updates_per_step']} updates, {report['iterations']} iterations")
    plotting.save(fig, path, dpi=120)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--replay", type=Path, default=DEFAULT_REPLAY)
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--iterations", type=int, default=300)
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--updates-per-step", type=int, default=2)
    parser.add_argument("--policy-frequency", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output", type=Path, required=True)
    parser.add_argument("--plot", type=Path)
    args = parser.parse_args(argv)
    if args.iterations < 1 or args.batch_size < 1 or args.updates_per_step < 1:
        parser.error("--iterations, --batch-size and --updates-per-step must be >= 1")
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device is available")
    recorded = load_replay_file(parser, args.replay)

    from flashsac_opt.config import FlashSACConfig
    from flashsac_opt.learner import COL, FlashSACLearner
    from flashsac_opt.testing.oracle import perturb_for_rounding_floor, relative_difference
    from flashsac_opt.replay import GPUReplay

    rows = {k: v.to(args.device) for k, v in recorded["rows"].items()}
    dims = {"obs_dim": rows["obs"].shape[1], "critic_obs_dim": rows["critic"].shape[1], "action_dim": rows["actions"].shape[1]}
    capacity = rows["actions"].shape[0]
    replays = {}
    for name, dtype in (("fp32", torch.float32), ("bf16_obs", torch.bfloat16)):
        replays[name] = GPUReplay(capacity, device=args.device, obs_dtype=dtype, seed=args.seed, **dims)
        replays[name].extend(rows)
    replays["rounding_floor"] = GPUReplay(capacity, device=args.device, seed=args.seed, **dims)
    replays["rounding_floor"].extend(rows)
    obs_error = {
        k: float(((v.float() - v.bfloat16().float()).abs() / v.abs().clamp_min(1e-12)).max())
        for k, v in rows.items() if k in ("obs", "next_obs", "critic", "next_critic")
    }

    cfg = FlashSACConfig(
        batch_size=args.batch_size, updates_per_step=args.updates_per_step, policy_frequency=args.policy_frequency,
        gamma=0.97, tau=0.05, use_amp=False, normalize_reward=False, learner_mode="eager",
    )
    learners = {}
    for name in replays:
        torch.manual_seed(args.seed)
        learners[name] = FlashSACLearner(cfg, device=args.device, **dims)
    perturb_for_rounding_floor(learners["rounding_floor"], args.seed)

    curves = {name: {"actor": [], "critic": [], "target_critic": [], "losses": []} for name in ("bf16_obs", "rounding_floor")}
    for it in range(args.iterations):
        tables = {}
        for name, learner in learners.items():
            torch.manual_seed(args.seed * 100_003 + it)
            learner.update_from_replay(replays[name])
            tables[name] = learner.update_metrics_table()[:-1, [COL["critic_loss"], COL["actor_loss"]]]
        ref = learners["fp32"]
        for name, curve in curves.items():
            for net in ("actor", "critic", "target_critic"):
                curve[net].append(relative_difference(getattr(learners[name], net).params.detach(), getattr(ref, net).params.detach()))
            curve["losses"].append(relative_difference(tables[name], tables["fp32"]))
        if it % 50 == 0:
            print(f"iteration {it}: bf16_obs critic drift {curves['bf16_obs']['critic'][-1]:.2e}, "
                  f"floor {curves['rounding_floor']['critic'][-1]:.2e}", flush=True)

    final = {name: {k: v[-1] for k, v in c.items()} for name, c in curves.items()}
    finite = all(bool(torch.isfinite(learner.critic.params).all()) for learner in learners.values())
    row_bytes = {name: r.obs.element_size() * r.layout.obs_width + r.rest.element_size() * r.layout.rest_width
                 for name, r in replays.items() if name != "rounding_floor"}
    report = {
        "experiment": "validate_bf16_obs_storage",
        "replay": {"file": str(args.replay.relative_to(REPO) if args.replay.is_relative_to(REPO) else args.replay),
                   "rows": capacity, "dims": dims},
        "iterations": args.iterations,
        "training_config": {"batch_size": args.batch_size, "updates_per_step": args.updates_per_step,
                            "policy_frequency": args.policy_frequency, "learner_mode": "eager", "dtype": "fp32"},
        "stored_row_bytes": row_bytes,
        "obs_storage_max_relative_error": obs_error,
        "drift": curves,
        "final_drift": final,
        "finite": finite,
        "ratio_to_rounding_floor": {k: final["bf16_obs"][k] / max(final["rounding_floor"][k], 1e-30) for k in final["bf16_obs"]},
        "environment": run_environment(args.device),
    }
    write_report(report, args.output, plot, args.plot)
    print(json.dumps({"final_drift": final, "obs_storage_max_relative_error": obs_error, "row_bytes": row_bytes}, indent=1))
    return 0 if finite else 1


if __name__ == "__main__":
    sys.exit(main())
