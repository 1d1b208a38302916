"""Long learner run on real G1 replay data: finite, no recompiles/recaptures, flat memory, tracks eager.

The replay file holds rows UniLab's own G1 training sampled from its replay buffer (record
one with FLASHSAC_OPT_RECORD_REPLAY=PATH:N and benchmark_flashsac_training.py; the committed
tests/data/replay_g1_cpu.pt came from a CPU run, see FLASH_SAC_OPTIMIZATION.md). Each iteration
draws a fresh large batch from those rows (seeded), and the learner under test (default
`graph`), an eager learner and an eager "rounding floor" learner (critic weights perturbed
by 1e-7 once) all take the same batches and RNG state.

Checks, written to JSON (+ a figure of the drift and memory curves):
- every parameter, BN statistic and Adam moment stays finite (checked every --check-every);
- no Dynamo recompiles and no graph recaptures after warm-up;
- device memory after warm-up stays flat (max - min allocated <= 1 MiB; CUDA only);
- the mode tracks eager: final norm-relative parameter drift <= 10x the rounding floor's.

    python experiments/validate_replay_stability.py --device cuda --iterations 1000 \\
        --output results/replay_stability/replay_stability.json --plot results/replay_stability/replay_stability.png
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
from common import load_replay_file, run_environment, write_report
from report import plotting

REPO = Path(__file__).resolve().parents[1]
DEFAULT_REPLAY = REPO / "tests" / "data" / "replay_g1_cpu.pt"
WARMUP = 5


def finite_state(learner) -> bool:
    tensors = [learner.actor.params, learner.critic.params, learner.target_critic.params, learner.temperature.log_temp,
               learner.actor.bn_stats, learner.critic.bn_stats, learner.critic_adam.exp_avg_sq, learner.actor_adam.exp_avg_sq]
    return bool(torch.stack([torch.isfinite(t).all() for t in tensors]).all())


def plot(report: dict, path: Path) -> None:
    fig, (ax1, ax2) = plotting.subplots(1, 2, figsize=(12, 4.5))
    mode = report["mode"]
    plotting.drift_panel(ax1, report["drift"], ((mode, "-"), ("rounding_floor", "--")), "eager params",
                         f"{mode} vs eager on real G1 replay")
    memory = report["memory_mib"]
    if not memory:
        ax2.text(0.5, 0.5, "not measured on CPU", ha="center", va="center", transform=ax2.transAxes)
    ax2.plot(memory, marker=".", markersize=2)
    ax2.axvline(WARMUP, color="grey", linestyle=":", label="end of warm-up")
    plotting.finish_axis(ax2, "iteration", "allocated MiB (all learners)", f"device memory ({report['environment']['device']})")
    fig.suptitle(f"validate_replay_stability: {report['iterations']} iterations, {'PASS' if report['passed'] else 'FAIL'}")
    plotting.save(fig, path, dpi=120)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--replay", type=Path, default=DEFAULT_REPLAY)
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--mode", choices=["compile", "graph"], default="graph")
    parser.add_argument("--compile-backend", default="inductor")
    parser.add_argument("--iterations", type=int, default=1000)
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--updates-per-step", type=int, default=8)
    parser.add_argument("--policy-frequency", type=int, default=2)
    parser.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32")
    parser.add_argument("--check-every", type=int, default=10, help="finite check (a host read) every N iterations")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--time-limit", type=float, metavar="SECONDS",
                        help="stop after this many seconds (the checks then cover the iterations run; the JSON says so)")
    parser.add_argument("--output", type=Path, required=True)
    parser.add_argument("--plot", type=Path)
    args = parser.parse_args(argv)
    if args.iterations <= WARMUP:
        parser.error(f"--iterations must be > {WARMUP} (the warm-up)")
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device is available")
    if args.mode == "graph" and args.device != "cuda":
        parser.error("--mode graph needs --device cuda")
    replay = load_replay_file(parser, args.replay)

    from torch._dynamo.utils import counters

    from flashsac_opt.config import FlashSACConfig
    from flashsac_opt.testing.oracle import compare_modes

    if args.device == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    pool = {k: v.to(args.device) for k, v in replay["rows"].items()}
    pool_rows = pool["actions"].shape[0]
    dims = {"obs_dim": pool["obs"].shape[1], "critic_obs_dim": pool["critic"].shape[1], "action_dim": pool["actions"].shape[1]}
    rows = args.batch_size * args.updates_per_step
    sampler = torch.Generator(device=args.device).manual_seed(args.seed)

    def batch_source(_iteration: int) -> dict[str, torch.Tensor]:
        idx = torch.randint(0, pool_rows, (rows,), device=args.device, generator=sampler)
        return {k: v.index_select(0, idx) for k, v in pool.items()}

    cfg = FlashSACConfig(
        batch_size=args.batch_size, updates_per_step=args.updates_per_step, policy_frequency=args.policy_frequency,
        gamma=0.97, tau=0.05, use_amp=args.dtype == "bf16", amp_dtype="bf16", compile_backend=args.compile_backend,
        normalize_reward=False,  # the recorded rows carry no per-env reward streams
    )
    memory: list[float] = []
    nonfinite: list[int] = []
    baseline: dict = {}

    def on_iteration(it: int, learners: dict) -> None:
        if args.device == "cuda":
            memory.append(torch.cuda.memory_allocated() / 2**20)
        if it == WARMUP - 1:
            baseline["graphs"] = counters["stats"].get("unique_graphs", 0)
            graph = learners[args.mode].engine.graph  # None in compile mode: nothing to recapture
            baseline["captures"] = graph.captures if graph is not None else 0
        if it % args.check_every == 0 or it == args.iterations - 1:
            if not all(finite_state(learner) for learner in learners.values()):
                nonfinite.append(it)
        if it % 100 == 0:
            print(f"iteration {it}", flush=True)

    learners_holder: dict = {}

    def remember(it: int, learners: dict) -> None:
        learners_holder.update(learners)
        on_iteration(it, learners)

    start = time.monotonic()

    def out_of_time(it: int) -> bool:
        return args.time_limit is not None and time.monotonic() - start > args.time_limit and it >= WARMUP

    curves = compare_modes(cfg, [args.mode], args.iterations, dims, args.device, args.seed, remember, batch_source, out_of_time)
    iterations_run = len(curves[args.mode]["critic"])  # one point per iteration run
    stopped_early = iterations_run < args.iterations
    if stopped_early and not all(finite_state(learner) for learner in learners_holder.values()):
        nonfinite.append(iterations_run - 1)  # the last iteration run is checked as a full run's last is
    tested = learners_holder[args.mode]
    graph = tested.engine.graph
    recompiles = counters["stats"].get("unique_graphs", 0) - baseline.get("graphs", 0)
    recaptures = (graph.captures if graph is not None else 0) - baseline.get("captures", 0)
    steady = memory[WARMUP:]
    memory_spread = max(steady) - min(steady) if steady else None  # not measured on CPU
    final = {name: {k: v[-1] for k, v in c.items()} for name, c in curves.items()}
    tracks = all(final[args.mode][k] <= 10 * final["rounding_floor"][k] + 1e-6 for k in ("actor", "critic", "target_critic"))
    checks = {
        "finite": not nonfinite,
        "no_recompiles_after_warmup": recompiles == 0,
        "no_recaptures_after_warmup": recaptures == 0,
        "memory_flat": None if memory_spread is None else memory_spread <= 1.0,
        "tracks_eager": tracks,
    }
    report = {
        "experiment": "validate_replay_stability",
        "replay": {"file": str(args.replay.relative_to(REPO) if args.replay.is_relative_to(REPO) else args.replay), "rows": pool_rows, "dims": dims},
        "mode": args.mode,
        "compile_backend": args.compile_backend,
        "dtype": args.dtype,
        "iterations": args.iterations,
        "iterations_run": iterations_run,
        "stopped_by_time_limit": stopped_early,
        "time_limit_s": args.time_limit,
        "wall_s": time.monotonic() - start,
        "warmup_iterations": WARMUP,
        "training_config": {"batch_size": args.batch_size, "updates_per_step": args.updates_per_step, "policy_frequency": args.policy_frequency},
        "nonfinite_at_iterations": nonfinite,
        "recompiles_after_warmup": recompiles,
        "recaptures_after_warmup": recaptures,
        "memory_mib": memory,
        "memory_spread_after_warmup_mib": memory_spread,
        "drift": curves,
        "final_drift": final,
        "criterion": "tracks_eager: final norm-relative drift of each network <= 10 x the rounding floor's + 1e-6",
        "checks": checks,
        "passed": all(v is not False for v in checks.values()),
        "environment": run_environment(args.device),
    }
    write_report(report, args.output, plot, args.plot)
    print(json.dumps({"checks": checks, "final_drift": final}, indent=1))
    return 0 if report["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
