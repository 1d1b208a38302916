"""Does a process compile from what the compile-ahead child left in Inductor's cache?

In real UniLab trainings (results/startup/startup_summary.json) the training process, after
waiting for the child, still compiled for long: it did not reuse the child's FX graphs. This
fills one fresh Inductor cache with the child (compile_ahead.CompileAhead), then starts fresh
processes that each compile the same learner a different way and counts Inductor's FX-graph
and AOTAutograd cache hits and misses:

- learner: FlashSACLearner + one update on the same synthetic batch (what the child does);
- adapter: UniLab's adapter built as patch 0001 builds it (batch_size, updates_per_step,
  compile_cache_file auto), then the first update_cycle, as when prepare_for_collection
  left the compile to the first update;
- adapter_after_collection: the same after what UniLab does before the first update:
  reward statistics folded in and the actor serving inference (actor.explore);
- adapter_rewards_column: the first update_cycle with rewards/dones/truncated shaped
  (rows, 1), a layout the learner boundary also accepts.

A variant with misses where ``learner`` has none names what makes the graphs differ.

    python experiments/archive/diagnose_compile_ahead_cache.py --device cpu --output /tmp/diag.json
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from flashsac_opt.testing.oracle import G1_DIMS as DIMS, unilab_learner_kwargs

REPO = Path(__file__).resolve().parents[2]
VARIANTS = ("learner", "adapter", "adapter_after_collection", "adapter_rewards_column")
SIZES = dict(batch_size=64, updates_per_step=2, actor_hidden_dim=32, critic_hidden_dim=32, num_atoms=21)


def unilab_kwargs(**sizes) -> dict:
    """UniLab's learner kwargs (what patch 0001 forwards), G1's tau, these networks and batch."""
    return unilab_learner_kwargs(tau=0.01, **sizes)


def config(mode: str):
    """The adapter's config, which the compile-ahead child gets in a real run."""
    from flashsac_opt.unilab.adapter import build_unilab_learner

    return build_unilab_learner(device="cpu", learner_mode=mode, **unilab_kwargs(**SIZES)).cfg


def run_child(args) -> dict:
    from flashsac_opt.compile_ahead import CompileAhead

    ahead = CompileAhead(config(args.mode), DIMS, args.device)
    ok = ahead.wait()
    return {"ok": ok, "report": ahead.report, "log": None if ok else str(ahead.log)}


def run_variant(args) -> dict:
    import torch
    from torch._dynamo.utils import counters

    from flashsac_opt.testing.oracle import synthetic_batch

    rows = SIZES["batch_size"] * SIZES["updates_per_step"]
    batch = synthetic_batch(rows, DIMS["obs_dim"], DIMS["critic_obs_dim"], DIMS["action_dim"],
                            torch.Generator().manual_seed(0), device=args.device)
    start = time.perf_counter()
    if args.variant == "learner":
        from flashsac_opt.compile_ahead import precompile
        from flashsac_opt.learner import FlashSACLearner

        precompile(FlashSACLearner(config(args.mode), DIMS["obs_dim"], DIMS["critic_obs_dim"], DIMS["action_dim"], device=args.device))
    else:
        from flashsac_opt.unilab.adapter import build_unilab_learner

        learner = build_unilab_learner(device=args.device, learner_mode=args.mode, **unilab_kwargs(**SIZES))
        if args.variant == "adapter_after_collection":
            g = torch.Generator().manual_seed(1)
            for _ in range(8):  # learning_starts' worth of collection, 16 envs
                learner.update_reward_stats(torch.randn(1, 16, generator=g), torch.zeros(1, 16))
                learner.actor.explore(torch.randn(16, DIMS["obs_dim"], generator=g), dones=torch.zeros(16))
        if args.variant == "adapter_rewards_column":
            batch = {k: (v[:, None] if v.ndim == 1 else v) for k, v in batch.items()}
        learner.update_cycle(batch, updates_per_step=SIZES["updates_per_step"], policy_frequency=2, target_frequency=1,
                             policy_before_critic=False)
    seconds = time.perf_counter() - start
    return {
        "seconds": seconds,
        "fxgraph_cache_hit": counters["inductor"]["fxgraph_cache_hit"],
        "fxgraph_cache_miss": counters["inductor"]["fxgraph_cache_miss"],
        "aot_autograd_cache_hit": counters["aot_autograd"]["autograd_cache_hit"],
        "aot_autograd_cache_miss": counters["aot_autograd"]["autograd_cache_miss"],
        "dynamo_frames_compiled": counters["stats"]["unique_graphs"],
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--mode", default=None, help="learner_mode (default: graph on CUDA, compile on CPU)")
    parser.add_argument("--variant", choices=("child", *VARIANTS), help=argparse.SUPPRESS)
    parser.add_argument("--output", type=Path)
    args = parser.parse_args(argv)
    args.mode = args.mode or ("graph" if args.device.startswith("cuda") else "compile")
    if args.variant:  # one process of the diagnosis
        result = run_child(args) if args.variant == "child" else run_variant(args)
        print("RESULT " + json.dumps(result), flush=True)
        return 0
    root = Path(tempfile.mkdtemp(prefix="diagnose_compile_ahead_"))

    def env_for(cache: Path) -> dict:
        return {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(cache / "inductor"), "TRITON_CACHE_DIR": str(cache / "inductor" / "triton"),
                "FLASHSAC_OPT_CACHE_DIR": str(cache / "flashsac_opt"),
                "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}

    results = {}
    for variant in ("child", *VARIANTS):
        # every variant starts from a copy of what the child left, nothing another variant added
        cache = root / variant
        if variant != "child":
            shutil.copytree(root / "child", cache)
        done = subprocess.run([sys.executable, __file__, "--device", args.device, "--mode", args.mode, "--variant", variant],
                              env=env_for(cache), capture_output=True, text=True)
        line = next((ln for ln in done.stdout.splitlines() if ln.startswith("RESULT ")), None)
        results[variant] = json.loads(line[7:]) if line else {"error": done.stderr[-2000:]}
        print(variant, results[variant], flush=True)
    report = {"experiment": "diagnose_compile_ahead_cache", "device": args.device, "mode": args.mode, "sizes": SIZES,
              "caches": str(root), "results": results}
    if args.output:
        args.output.write_text(json.dumps(report, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
