"""flashsac_opt vs UniLab 1.5.2's FlashSAC learner, update by update.

Builds UniLab's learner (compile and graphs off), copies its weights into flashsac_opt,
drives both with the same synthetic G1-shaped batches, reward statistics and RNG state,
and writes JSON with the relative difference of every per-update loss and of every final
tensor (weights, BN statistics, target critic, temperature, Adam moments, reward
normalizer), with pass/fail against the stated tolerances.

    python experiments/validate_numerics.py --device cpu --iterations 20 --output results/numerics/numerics_cpu_fp32.json

Without --output the JSON goes to the system temp directory (the path is printed), so a
trial run never replaces the committed results.
"""

from __future__ import annotations

import argparse
import platform
import sys
import tempfile
import time
from pathlib import Path

import torch
from common import run_environment, write_report

# fp32 differences must be at rounding level; bf16 autocast rounds activations to 8 bits of
# mantissa, and the two learners may round a few intermediate values differently.
# Relative tolerance per (device, dtype). CPU fp32 is bit-identical (0: the oracle tests assert
# it). On CUDA the C51 projection's scatter_add_ runs as atomic adds, whose order is not fixed,
# so fp32 gets a relative bound there; bf16 autocast rounds differently per kernel.
TOLERANCE = {("cpu", "fp32"): 0.0, ("cuda", "fp32"): 1e-5, ("cpu", "bf16"): 2e-2, ("cuda", "bf16"): 2e-2}


def environment(device: str) -> dict:
    env = {**run_environment(device, packages=("unilab",)), "cpu": platform.processor() or platform.machine()}
    if device == "cuda":
        env["cuda"] = torch.version.cuda
    return env


def finish(report: dict, output: Path, console) -> int:
    """Write the JSON and turn pass/fail into the exit status."""
    write_report(report, output)
    console.print(f"wrote {output}")
    return 0 if report["passed"] else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--iterations", type=int, default=20)
    parser.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--updates-per-step", type=int, nargs="+", default=[8, 2])
    parser.add_argument("--policy-frequency", type=int, default=2)
    parser.add_argument("--normalize-reward", choices=["on", "off", "both"], default="both")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--compare-modes", nargs="*", choices=["compile", "graph"], default=None,
                        help="instead of UniLab: compare these learner modes with eager (drift curves)")
    parser.add_argument("--compile-backend", default="inductor", help="torch.compile backend for --compare-modes")
    parser.add_argument("--output", type=Path, default=None,
                        help="JSON path (default: numerics[_modes]_<device>_<dtype>.json in the system temp directory, "
                             "so the committed results/numerics/ files change only when named here)")
    args = parser.parse_args(argv)
    if args.output is None:
        name = f"numerics{'_modes' if args.compare_modes is not None else ''}_{args.device}_{args.dtype}.json"
        args.output = Path(tempfile.gettempdir()) / name

    if args.iterations < 1:
        parser.error("--iterations must be >= 1")
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device is available")
    if args.dtype == "bf16" and args.device != "cuda":
        parser.error("--dtype bf16 needs --device cuda (UniLab disables autocast on CPU)")
    if "graph" in (args.compare_modes or []) and args.device != "cuda":
        parser.error("--compare-modes graph needs --device cuda")
    if args.compare_modes is not None:
        return compare_modes_main(args)
    try:
        import unilab.rl.algos.flash_sac.learner  # noqa: F401
    except ImportError:
        parser.error("UniLab 1.5.2 is not installed: pip install 'flashsac-opt[unilab]'")

    from rich.console import Console
    from rich.progress import Progress
    from rich.table import Table

    from flashsac_opt.config import FlashSACConfig
    from flashsac_opt.testing.oracle import G1_DIMS, compare_with_unilab

    if args.device == "cuda":
        # Exact fp32 on the GPU: no TF32 in either learner.
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    tolerance = TOLERANCE[args.device, args.dtype]
    norms = {"on": [True], "off": [False], "both": [True, False]}[args.normalize_reward]
    cases = []
    console = Console()
    with Progress(console=console) as progress:
        for u in args.updates_per_step:
            for norm in norms:
                cfg = FlashSACConfig(
                    batch_size=args.batch_size,
                    updates_per_step=u,
                    policy_frequency=args.policy_frequency,
                    gamma=0.97,
                    tau=0.05,
                    normalize_reward=norm,
                    use_amp=args.dtype == "bf16",
                    amp_dtype="bf16",
                )
                task = progress.add_task(f"updates_per_step={u} normalize_reward={norm}", total=args.iterations)
                start = time.perf_counter()
                result = compare_with_unilab(
                    cfg, args.iterations, G1_DIMS, args.device, args.seed, on_iteration=lambda _: progress.advance(task)
                )
                worst_loss, worst_state = result.worst_loss(), result.worst_state()
                cases.append(
                    {
                        "updates_per_step": u,
                        "policy_frequency": args.policy_frequency,
                        "batch_size": args.batch_size,
                        "normalize_reward": norm,
                        "iterations": args.iterations,
                        "seconds": round(time.perf_counter() - start, 2),
                        "per_update_loss_rel": result.loss_rel,
                        "per_tensor": {k: {"max_abs": a, "max_rel": r} for k, (a, r) in sorted(result.state_diffs.items())},
                        "worst_loss": {"where": worst_loss[0], "rel": worst_loss[1]},
                        "worst_tensor": {"name": worst_state[0], "rel": worst_state[1]},
                        "passed": worst_loss[1] <= tolerance and worst_state[1] <= tolerance
                        and (tolerance > 0 or not result.mismatches()),
                        "mismatches": result.mismatches()[:20],  # what is not bit-identical (first 20)
                    }
                )
    report = {
        "experiment": "validate_numerics",
        "reference": "unilab==1.5.2 FlashSACLearner, use_compile=False (per-update path)",
        "dims": G1_DIMS,
        "dtype": args.dtype,
        "tolerance_rel": tolerance,
        "relative_difference": "max|ours - unilab| / max|unilab| per tensor; |ours - unilab| / |unilab| per loss",
        "environment": environment(args.device),
        "cases": cases,
        "passed": all(c["passed"] for c in cases),
    }
    table = Table(title=f"flashsac_opt vs UniLab 1.5.2 ({args.device}, {args.dtype}, tolerance {tolerance:g})")
    for col in ("updates", "reward norm", "tensors", "worst loss rel", "worst tensor rel", "pass"):
        table.add_column(col)
    for c in cases:
        table.add_row(
            str(c["updates_per_step"]),
            str(c["normalize_reward"]),
            str(len(c["per_tensor"])),
            f"{c['worst_loss']['rel']:.2e}",
            f"{c['worst_tensor']['rel']:.2e} ({c['worst_tensor']['name']})",
            "yes" if c["passed"] else "NO",
        )
    console.print(table)
    return finish(report, args.output, console)


def compare_modes_main(args: argparse.Namespace) -> int:
    """learner_mode compile/graph against eager: drift curves next to the rounding floor."""
    from rich.console import Console
    from rich.progress import Progress
    from rich.table import Table

    from flashsac_opt.config import FlashSACConfig
    from flashsac_opt.testing.oracle import G1_DIMS, compare_modes

    if args.device == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    modes = args.compare_modes or ["compile"]
    cases = []
    console = Console()
    for u in args.updates_per_step:
        cfg = FlashSACConfig(
            batch_size=args.batch_size, updates_per_step=u, policy_frequency=args.policy_frequency, gamma=0.97,
            tau=0.05, use_amp=args.dtype == "bf16", amp_dtype="bf16", compile_backend=args.compile_backend,
        )
        with Progress(console=console) as progress:
            task = progress.add_task(f"modes {modes} updates_per_step={u}", total=args.iterations)
            curves = compare_modes(cfg, modes, args.iterations, G1_DIMS, args.device, args.seed, lambda *_: progress.advance(task))
        final = {name: {k: v[-1] for k, v in c.items()} for name, c in curves.items()}
        # A mode passes when it stays within 10x of the rounding floor (or 1e-6).
        passed = {
            m: all(final[m][k] <= 10 * final["rounding_floor"][k] + 1e-6 for k in ("actor", "critic", "target_critic"))
            for m in modes
        }
        cases.append({"updates_per_step": u, "batch_size": args.batch_size, "iterations": args.iterations,
                      "curves": curves, "final": final, "passed": passed})
    report = {
        "experiment": "validate_numerics --compare-modes",
        "reference": "flashsac_opt learner_mode=eager",
        "compile_backend": args.compile_backend,
        "dtype": args.dtype,
        "criterion": "final norm-relative parameter drift <= 10 x drift of an eager run perturbed by 1e-7 (rounding floor) + 1e-6",
        "environment": environment(args.device),
        "cases": cases,
        "passed": all(all(c["passed"].values()) for c in cases),
    }
    table = Table(title=f"learner modes vs eager after {args.iterations} iterations ({args.device}, {args.dtype}, {args.compile_backend})")
    for col in ("updates", "run", "actor", "critic", "target", "losses"):
        table.add_column(col)
    for c in cases:
        for name, f in c["final"].items():
            table.add_row(str(c["updates_per_step"]), name, *(f"{f[k]:.2e}" for k in ("actor", "critic", "target_critic", "losses")))
    console.print(table)
    return finish(report, args.output, console)


if __name__ == "__main__":
    sys.exit(main())
