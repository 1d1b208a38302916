"""Why is compile mode slow (and at U8 crashing) inside UniLab's runner but not in the learner benchmark?

Inside UniLab's off-policy runner, flashsac_opt's compile mode ran 11.4 ms per U2 iteration
(the learner benchmark: ~2 ms) and at U8 crashed after 171 iterations in Inductor's
cudagraph trees (`assert storage_ptr is not None`, raised while checkpointing the
allocator for a *new recording* during execution). Both point at cudagraph trees
re-recording, which the benchmark never does. The runner does more around each
``update_cycle`` than the benchmark: ``prepare_for_collection`` (one warm-up iteration,
then the state is restored), ``update_reward_stats``, ``actor.explore`` for the collector,
``read_deferred_cycle_metrics`` and a checkpoint every --save-interval iterations.

This script drives the UniLab adapter the way the runner does, without UniLab or MuJoCo,
one variant per fresh process (fresh Dynamo caches and cudagraph trees), each adding one of
those runner actions to the benchmark's loop ("bare"), plus "runner" with all of them.
Per variant: ms per iteration after warm-up (median, p90), Dynamo graphs compiled after
warm-up, cudagraph-tree re-recordings and their reasons (the trees' own debug log),
recorded graphs, cudagraph skips, and whether the run raised.
On the H200 (results/diagnose_compile_rerecord/diagnose_compile_rerecord_2026-11-29.json): 0
re-records and 0 recompiles in every variant. The runner's slowness had another cause:
patch 0001 v2 did not pass the runner's batch size, so the learner chose the split update
path meant for its default batch 2048 (fixed in v3; FLASH_SAC_OPTIMIZATION.md).

    python experiments/archive/diagnose_compile_rerecord.py --output diagnose_rerecord.json
    (without CUDA: a CPU rehearsal; there are no cudagraph trees to count)
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import subprocess
import sys
import time
import traceback
from pathlib import Path
from types import SimpleNamespace

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # experiments/: common
from common import percentile, run_environment  # noqa: E402

ACTIONS = ("prepare", "reward_stats", "explore", "checkpoint")
VARIANTS = {"bare": (), **{a: (a,) for a in ACTIONS}, "runner": ACTIONS}
DIMS = dict(obs_dim=98, critic_obs_dim=101, action_dim=29)  # G1 flat walking
WARMUP = 3


class RerecordLog(logging.Handler):
    """Collects the cudagraph trees' "Re-recording ... reason=..." debug lines."""

    def __init__(self):
        super().__init__(logging.DEBUG)
        self.reasons: list[str] = []

    def emit(self, record):
        message = record.getMessage()
        if "Re-recording" in message or "skipping cudagraph" in message:
            self.reasons.append(message[:600])


def tree_state(device: torch.device) -> dict:
    """Recorded graphs and re-record counts of this thread's cudagraph tree (None off CUDA)."""
    if device.type != "cuda":
        return {"recorded_graphs": None, "rerecords": None, "checkpoints": None}
    from torch._inductor import cudagraph_trees

    manager = cudagraph_trees.get_manager(device.index or 0, create_if_none_exists=False)
    if manager is None:
        return {"recorded_graphs": 0, "rerecords": 0, "checkpoints": 0}
    nodes, stack = 0, [n for lst in manager.roots.values() for n in lst]
    while stack:
        node = stack.pop()
        nodes += 1
        stack += [c for lst in node.children.values() for c in lst]
    rerecords = sum(sum(per_fn.values()) for per_fn in getattr(manager, "num_rerecord", {}).values())
    return {"recorded_graphs": nodes, "rerecords": rerecords, "checkpoints": getattr(manager, "debug_checkpointing_counter", None)}


def run_variant(args, actions: tuple[str, ...]) -> dict:
    from torch._dynamo.utils import counters

    from flashsac_opt.testing.oracle import synthetic_batch
    from flashsac_opt.unilab.adapter import build_unilab_learner

    device = torch.device(args.device)
    handler = RerecordLog()
    if device.type == "cuda":
        from torch._inductor import cudagraph_trees, cudagraph_utils

        torch._logging.set_logs(cudagraphs=True)  # also to stderr (the parent keeps its tail)
        for log in (cudagraph_trees.log, cudagraph_utils.cudagraphs_log):
            log.setLevel(logging.DEBUG)  # the trees compute a re-record's reason only at DEBUG
            log.addHandler(handler)
            log.propagate = False
    u, bsz = args.updates_per_step, args.batch_size
    learner = build_unilab_learner(device=device, learner_mode=args.mode, batch_size=bsz, updates_per_step=u, **DIMS)
    g = torch.Generator().manual_seed(0)
    # The runner's large batch: views into persistent device buffers refilled in place
    # (two slots, like its double-buffered replay pipeline).
    slots = [synthetic_batch(u * bsz, *DIMS.values(), generator=g, device=device) for _ in range(2)]
    fresh = [synthetic_batch(u * bsz, *DIMS.values(), generator=g, device=device) for _ in range(4)]
    obs = torch.randn(args.num_envs, DIMS["obs_dim"], generator=g).to(device)
    if "prepare" in actions:
        context = SimpleNamespace(replay_batch=slots[1], updates_per_step=u, policy_frequency=2, target_frequency=1, policy_before_critic=False)
        learner.prepare_for_collection(context)
    times, error, after_warmup = [], None, None
    try:
        for it in range(args.iterations):
            if it == WARMUP:
                if device.type == "cuda":
                    torch.cuda.synchronize()
                after_warmup = (counters["stats"]["unique_graphs"], tree_state(device))
            start = time.perf_counter()
            if "reward_stats" in actions:
                learner.update_reward_stats(torch.randn(1, args.num_envs).to(device), torch.zeros(1, args.num_envs, device=device))
            if "explore" in actions:
                with torch.no_grad():
                    learner.actor.explore(obs, dones=torch.zeros(args.num_envs, device=device), deterministic=False)
            slot = slots[it % 2]
            for key, value in fresh[it % 4].items():
                slot[key].copy_(value)
            learner.update_cycle(slot, updates_per_step=u, policy_frequency=2, target_frequency=1, policy_before_critic=False)
            learner.read_deferred_cycle_metrics()  # the one device-to-host read
            if "checkpoint" in actions and (it + 1) % args.save_interval == 0:
                learner.update_count = it + 1
                learner.get_state_dict()
            times.append((time.perf_counter() - start) * 1e3)
    except Exception as exc:  # the U8 crash is what we look for: record it, do not lose the rest
        error = "".join(traceback.format_exception_only(type(exc), exc)).strip()[-2000:]
    end_graphs, end_tree = counters["stats"]["unique_graphs"], tree_state(device)
    steady = times[WARMUP:]
    out = {
        "actions": list(actions),
        "iterations_done": len(times),
        "error": error,
        "ms_median": statistics.median(steady) if steady else None,
        "ms_p90": percentile(steady, 0.9) if steady else None,
        "warmup_s": sum(times[:WARMUP]) / 1e3,
        "graphs_compiled_total": end_graphs,
        "graphs_compiled_after_warmup": end_graphs - after_warmup[0] if after_warmup else None,
        "cudagraph_skips": counters["inductor"]["cudagraph_skips"],
        **{f"{k}_total": v for k, v in end_tree.items()},
        **{f"{k}_after_warmup": (v - after_warmup[1][k] if after_warmup and v is not None else None) for k, v in end_tree.items()},
        "rerecord_reasons_first": handler.reasons[:8],
        "rerecord_log_lines": len(handler.reasons),
    }
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    parser.add_argument("--mode", default="compile", choices=["eager", "compile", "graph"])
    parser.add_argument("--updates-per-step", type=int, default=8)
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--num-envs", type=int, default=256)
    parser.add_argument("--iterations", type=int, default=60)
    parser.add_argument("--save-interval", type=int, default=20)
    parser.add_argument("--variant-timeout", type=float, default=240.0, help="seconds per variant process")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--output", type=Path, required=True)
    parser.add_argument("--one", help=argparse.SUPPRESS)  # internal: run one variant, print its JSON
    args = parser.parse_args()
    if args.iterations <= WARMUP:
        parser.error(f"--iterations must be more than the {WARMUP} warm-up iterations")
    if args.one:
        print("RESULT " + json.dumps(run_variant(args, VARIANTS[args.one])), flush=True)
        return 0
    results = {}
    report = {
        "what": "flashsac_opt through the UniLab adapter, driven as UniLab's runner drives it, one runner action added per variant",
        "mode": args.mode,
        "workload": {"updates_per_step": args.updates_per_step, "batch_size": args.batch_size, "num_envs": args.num_envs, "policy_frequency": 2, **DIMS},
        "iterations": args.iterations,
        "warmup_iterations": WARMUP,
        "variants": results,
        "environment": run_environment(args.device),
        "command": " ".join([Path(sys.executable).name] + sys.argv),
    }
    args.output.parent.mkdir(parents=True, exist_ok=True)
    for name in args.variants:
        cmd = [sys.executable, __file__, "--one", name] + [a for a in sys.argv[1:] if a not in args.variants and a != "--variants"]
        start = time.time()
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.variant_timeout, env=os.environ)
            lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
            result = json.loads(lines[-1][7:]) if lines else {"error": f"exit {proc.returncode}"}
            result["stderr_tail"] = proc.stderr[-3000:]
        except subprocess.TimeoutExpired:
            result = {"error": f"timed out after {args.variant_timeout:.0f} s"}
        result["wall_s"] = round(time.time() - start, 1)
        results[name] = result
        print(f"{name:13s} " + json.dumps({k: result.get(k) for k in ("ms_median", "rerecords_after_warmup", "graphs_compiled_after_warmup", "cudagraph_skips", "error")}), flush=True)
        args.output.write_text(json.dumps(report, indent=2) + "\n")  # after every variant: a timeout loses little
    return 0


if __name__ == "__main__":
    sys.exit(main())
