"""Data-parallel flashsac_opt on 1/2/4/8 GPUs: ms per iteration, scaling, replay traffic.

Each world size N runs as N spawned processes (NCCL on CUDA, gloo on CPU), each rank with its
own GPUReplay of synthetic G1-shaped rows, the learner in graph mode by default sampling inside
the captured iteration and averaging the gradient buckets across ranks inside the same graph
(flashsac_opt/data_parallel.py). Weak scaling: each rank keeps the workload's batch.
  scaling_efficiency = t(1) / t(N);  collective_share = (t(N) - t(1')) / t(N)
t(1): the best single-GPU learner (fused loss, backward and step); t(1'): one GPU on the
data-parallel code path without the collective (``fused_update=False``, world 1: the all-reduce
sits between backward and step); without that cell (eager, --no-unfused-baseline) t(1') = t(1).
Replay traffic per iteration: rows and bytes each rank samples (on its own GPU: no H2D), the bytes
it all-reduces, and the global sample:new ratio against one collector writing --new-rows rows.
--grad-sync unilab|both (issue 19): the multi-rank cells average the gradient with UniLab 1.5.2's
DpParameterSync.allreduce_gradients, and the loss, BN statistics and entropy in a second
all-reduce; the default is flashsac_opt's one bucket per update. U64: the G1 training's shape.

    python experiments/bench/benchmark_multigpu.py --nproc 1 2 4 8 --workloads W3 W4 \\
        --output results/multigpu/benchmark_multigpu.json --plot results/multigpu/benchmark_multigpu.png
    python experiments/bench/benchmark_multigpu.py --device cpu --nproc 1 2 --workloads T --iters 3   # CPU smoke (gloo, eager)

NVLink multicast stays off (NCCL_NVLS_ENABLE=0), as the device notes require.
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import os
import statistics
import sys
import tempfile
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # experiments/: common, report.plotting
from common import add_output_arguments, percentile, plot_only, run_environment, write_report  # noqa: E402
from report import plotting  # noqa: E402
from bench.workloads import U64, WORKLOADS as LEARNER_WORKLOADS  # noqa: E402

WORKLOADS = {
    "W3": LEARNER_WORKLOADS["W3"], "U64": U64, "W4": LEARNER_WORKLOADS["W4"],
    # tiny, for the CPU smoke run in CI
    "T": dict(batch_size=16, updates_per_step=4, policy_frequency=2, obs_dim=12, critic_obs_dim=15, action_dim=4,
              actor_hidden_dim=16, critic_hidden_dim=32, num_atoms=21),
}
DIM_KEYS = ("obs_dim", "critic_obs_dim", "action_dim")
TEARDOWN_GRACE_S = 30.0  # how long ranks that wrote their results may take to exit


def unilab_gradient_averager(world: int, rank: int, backend: str, wire: str = "float32"):
    """A RankAverager whose gradient goes through UniLab's own all-reduce (the callable UniLab's
    runner hands to ``set_gradient_sync``); the rest of the bucket through a second all-reduce."""
    import torch
    from unilab.rl.runtime.distributed.sync import DpParameterSync

    from flashsac_opt.data_parallel import RankAverager

    class UniLabGradientAverager(RankAverager):
        def __init__(self) -> None:
            super().__init__(gradient_wire_dtype=wire)  # (its own bucket stays fp32: the loss and statistics)
            # the process group is up already (the worker's): start() is never called, and
            # allreduce_gradients uses the default group
            self.sync = DpParameterSync(world_size=world, rank=rank, rendezvous_path="unused", backend=backend, gradient_wire_dtype=wire)
            self.holders: dict[int, torch.nn.Parameter] = {}  # one per flat gradient size: a stable packing buffer

        def average(self, grad, *rest):
            holder = self.holders.get(grad.numel())
            if holder is None:
                holder = self.holders[grad.numel()] = torch.nn.Parameter(torch.empty_like(grad))
            holder.grad = grad  # averaged in place
            self.sync.allreduce_gradients([holder])
            return [grad, *(self._bucket(*rest) if rest else [])]

    return UniLabGradientAverager()


def _worker(rank: int, world: int, store: str, spec: dict, result_path: str) -> None:
    import torch
    import torch.distributed as dist

    from flashsac_opt.config import FlashSACConfig
    from flashsac_opt.data_parallel import collective_bytes_per_iteration, state_digest
    from flashsac_opt.learner import FlashSACLearner
    from flashsac_opt.testing.oracle import synthetic_batch
    from flashsac_opt.replay import GPUReplay

    os.environ.update(NCCL_NVLS_ENABLE="0")
    # Should the cell hang, every thread's Python stack goes to stderr before the parent kills it.
    faulthandler.dump_traceback_later(spec["stack_dump_after"], exit=False)
    cuda = spec["device"] == "cuda"
    if cuda:
        torch.cuda.set_device(rank)
    device = torch.device("cuda", rank) if cuda else torch.device("cpu")
    if world > 1:  # one rank needs no process group (and gloo's 1-rank teardown can abort)
        # rendezvous through a file of the cell's temporary directory: no TCP port to race for
        dist.init_process_group("nccl" if cuda else "gloo", init_method=f"file://{store}", rank=rank, world_size=world,
                                device_id=device if cuda else None)
    try:
        w = dict(spec["workload"])
        dims = {k: w.pop(k) for k in DIM_KEYS}
        fused = None if spec["fused"] else False  # None: the learner's own choice
        cfg = FlashSACConfig(**w, learner_mode=spec["mode"], use_amp=cuda, amp_dtype="bf16", gamma=0.97, tau=0.05,
                             fused_update=fused, dp_broadcast_params=spec["broadcast_params"])
        torch.manual_seed(rank)
        start = time.perf_counter()
        learner = FlashSACLearner(cfg, device=device, **dims)
        if world > 1:
            from flashsac_opt.data_parallel import RankAverager

            wire = spec["gradient_wire_dtype"]
            learner.enable_data_parallel(True, unilab_gradient_averager(world, rank, "nccl" if cuda else "gloo", wire)
                                         if spec["grad_sync"] == "unilab" else RankAverager(gradient_wire_dtype=wire))
        replay = GPUReplay(spec["capacity"], device=device, seed=1000 + rank, **dims)
        replay.extend(synthetic_batch(spec["capacity"], generator=torch.Generator().manual_seed(rank), device=device, **dims))
        u, pf, bsz = cfg.updates_per_step, cfg.policy_frequency, cfg.batch_size

        def iteration() -> None:
            learner.update_from_replay(replay)
            learner.read_metrics()  # the one D2H copy; it also waits for the iteration
            if cuda:
                torch.cuda.current_stream().synchronize()

        iteration()
        cold = time.perf_counter() - start
        for _ in range(spec["warmup"]):
            iteration()
        if world > 1:
            dist.barrier()
        times = []
        for _ in range(spec["iters"]):
            t0 = time.perf_counter()
            iteration()
            times.append((time.perf_counter() - t0) * 1e3)
        finite = bool(torch.isfinite(learner.critic.params).all()) and bool(torch.isfinite(learner.actor.params).all())
        row_bytes = replay.obs.element_size() * replay.layout.obs_width + replay.rest.element_size() * replay.layout.rest_width
        mine = {
            # state_sha256: the whole learner state (networks, targets, Adam moments, BN and
            # reward statistics, temperature) must be bit-identical on every rank
            "rank": rank, "ms": times, "state_sha256": state_digest(learner.state_dict()), "cold_start_s": cold, "finite": finite, "fused_update": learner.fused_update,
            "broadcast_params": learner.broadcast_params,
            "peak_memory_mib": torch.cuda.max_memory_allocated(device) / 2**20 if cuda else None,
            "rows_sampled": u * bsz, "bytes_sampled": u * bsz * row_bytes,
            "collective_bytes": collective_bytes_per_iteration(learner, u, pf) if world > 1 else 0,
        }
        gathered = [mine]
        if world > 1:
            gathered = [None] * world
            dist.all_gather_object(gathered, mine)
        if rank == 0:  # written whole (rename), so a file that exists is a complete measurement
            tmp_path = Path(result_path + ".tmp")
            tmp_path.write_text(json.dumps(gathered))
            os.replace(tmp_path, result_path)
        # A live graph that captured NCCL calls makes destroy_process_group hang
        # (pytorch/pytorch#115388): the first H200 x2 run lost its 2-rank cells to that.
        learner.release_graphs()
    finally:
        if world > 1:
            dist.destroy_process_group()


def wait_for_ranks(ctx, path: str, world: int, cell_timeout: float) -> tuple[bool, str | None]:
    """Wait for a cell's ranks; returns (teardown_hung, teardown_error).

    Once rank 0 has written the results file the measurement is complete and only the process
    group's teardown is left: a rank that then hangs past the grace period, or dies (gloo can
    abort there when a peer's socket closes under a pending read), is killed and reported, and
    the measurement stands. Before that, a hang or a dead rank fails the cell.
    """
    import torch.multiprocessing as mp

    deadline = time.monotonic() + cell_timeout
    while True:
        try:
            if ctx.join(timeout=5):  # raises if a rank failed
                return False, None
        except mp.ProcessExitedException as exc:
            if not os.path.exists(path):
                raise
            for proc in ctx.processes:
                proc.kill()
            return False, f"{type(exc).__name__}: {exc}"
        if os.path.exists(path):  # measured: the ranks only have to tear down now
            deadline = min(deadline, time.monotonic() + TEARDOWN_GRACE_S)
        if time.monotonic() > deadline:  # a hung collective must not take the other cells with it
            for proc in ctx.processes:
                proc.kill()
            if not os.path.exists(path):
                raise TimeoutError(f"{world} ranks did not finish within --cell-timeout {cell_timeout} s")
            return True, None  # measured, then stuck tearing the process group down


def run_world(world: int, wname: str, args, fused: bool = True, grad_sync: str = "flashsac_opt") -> dict:
    import torch.multiprocessing as mp

    spec = {"device": args.device, "mode": args.mode, "workload": WORKLOADS[wname], "capacity": args.capacity,
            "iters": args.iters, "warmup": args.warmup, "fused": fused, "broadcast_params": {"auto": None, "on": True, "off": False}[args.broadcast_params], "grad_sync": grad_sync, "gradient_wire_dtype": args.gradient_wire_dtype, "stack_dump_after": max(1.0, args.cell_timeout - 15)}
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "ranks.json")
        store = os.path.join(tmp, "rendezvous")
        ctx = mp.start_processes(_worker, args=(world, store, spec, path), nprocs=world, start_method="spawn", join=False)
        teardown_hung, teardown_error = wait_for_ranks(ctx, path, world, args.cell_timeout)
        ranks = json.loads(Path(path).read_text())
    w = WORKLOADS[wname]
    r0 = ranks[0]
    return {
        "workload": wname, "world_size": world, "fused_update": r0["fused_update"], "broadcast_params": r0["broadcast_params"],
        "baseline_of_collectives": world == 1 and not fused, "grad_sync": grad_sync if world > 1 else None, **{k: w[k] for k in ("batch_size", "updates_per_step", "policy_frequency")},
        "ms_median": statistics.median(r0["ms"]), "ms_p90": percentile(r0["ms"], 0.9),
        "ms_median_slowest_rank": max(statistics.median(r["ms"]) for r in ranks),
        "global_updates_per_s": world * w["updates_per_step"] / (statistics.median(r0["ms"]) / 1e3),
        "cold_start_s_max": max(r["cold_start_s"] for r in ranks),
        "peak_memory_mib_max": max((r["peak_memory_mib"] or 0.0) for r in ranks) or None,
        "finite": all(r["finite"] for r in ranks),
        "ranks_bit_identical": len({r["state_sha256"] for r in ranks}) == 1,
        "state_sha256_rank0": r0["state_sha256"],  # the same synthetic data and seeds: cells comparable
        "rows_sampled_per_rank": r0["rows_sampled"], "bytes_sampled_per_rank": r0["bytes_sampled"],
        "bytes_sampled_global": sum(r["bytes_sampled"] for r in ranks),
        "h2d_bytes_per_rank": 0,  # rank-local GPU replay: sampled on the device
        "collective_bytes_per_rank": r0["collective_bytes"],
        "sample_new_ratio_global": world * r0["rows_sampled"] / args.new_rows,
        "ranks_ms_median": [statistics.median(r["ms"]) for r in ranks],
        "teardown_hung": teardown_hung,
        "teardown_error": teardown_error,
    }


def add_scaling(cells: list[dict]) -> None:
    def single(wname: str, collective_baseline: bool) -> dict | None:
        return next((b for b in cells if b["workload"] == wname and b["world_size"] == 1 and "ms_median" in b
                     and b.get("baseline_of_collectives", False) == collective_baseline), None)

    for c in cells:
        if "ms_median" not in c or c.get("baseline_of_collectives"):
            continue
        best = single(c["workload"], False)
        same_path = single(c["workload"], True) or best
        if best:
            c["scaling_efficiency"] = best["ms_median"] / c["ms_median"]
        if c["world_size"] == 1:  # no collectives at all
            c["collective_ms_per_iteration"] = c["collective_share"] = 0.0
        elif same_path:
            # Inside one captured graph the all-reduces cannot be timed apart: their cost is
            # what the iteration gained over one GPU on the same (unfused) code path.
            c["collective_ms_per_iteration"] = max(0.0, c["ms_median"] - same_path["ms_median"])
            c["collective_share"] = c["collective_ms_per_iteration"] / c["ms_median"]


def environment(args) -> dict:
    import torch

    return {
        **run_environment(args.device),
        "gpus_visible": torch.cuda.device_count() if torch.cuda.is_available() else 0,
        "NCCL_NVLS_ENABLE": "0",
    }


def plot(report: dict, path: Path) -> None:
    cells = [c for c in report["cells"] if "ms_median" in c]
    workloads = sorted({c["workload"] for c in cells})
    fig, axes = plotting.subplots(1, max(len(workloads), 1), figsize=(5.5 * max(len(workloads), 1), 4.5), squeeze=False)
    for ax, wname in zip(axes[0], workloads):
        rows = sorted((c for c in cells if c["workload"] == wname),
                      key=lambda c: (c["world_size"], not c.get("baseline_of_collectives", False), c.get("grad_sync") == "unilab"))

        def label(c: dict) -> str:
            text = ("UniLab's gradient all-reduce\n" if c.get("grad_sync") == "unilab" else "") + f"{c['ms_median']:.2f} ms\n" + ("no all-reduce" if c.get("baseline_of_collectives") else f"{c.get('scaling_efficiency', 1.0):.0%}")
            return text + ("\nranks not bit-identical" if c["world_size"] > 1 and c.get("ranks_bit_identical") is False else "")

        plotting.bars(ax, [f"{c['world_size']}\n(unfused)" if c.get("baseline_of_collectives") else
                           f"{c['world_size']}\n(UniLab sync)" if c.get("grad_sync") == "unilab" else str(c["world_size"]) for c in rows],
                      [c["ms_median"] for c in rows], [label(c) for c in rows],
                      upper=[c["ms_p90"] - c["ms_median"] for c in rows],
                      color=["#9ecae1" if c.get("baseline_of_collectives") else "#08519c" for c in rows])
        ax.set_ylim(top=1.25 * max(c["ms_p90"] for c in rows))  # room for the labels under the title
        plotting.finish_axis(ax, "GPUs (ranks)", "ms per iteration (median; whisker p90)",
                             f"{wname}: B{rows[0]['batch_size']} x {rows[0]['updates_per_step']} per rank (label: efficiency)", legend=False,
                             grid_axis="y")
    env = report["environment"]
    fig.suptitle(f"Data-parallel flashsac_opt ({report['mode']} mode, {env.get('gpu') or env.get('device')}, torch {env.get('torch')})")
    plotting.save(fig, path)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nproc", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--workloads", nargs="+", default=["W3", "W4"], choices=list(WORKLOADS))
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--mode", choices=("eager", "compile", "graph"), help="learner_mode (default: graph on cuda, eager on cpu)")
    parser.add_argument("--capacity", type=int, default=1 << 18, help="replay rows per rank")
    parser.add_argument("--new-rows", type=int, default=2048, help="rows one collector writes per iteration (sample:new ratio)")
    parser.add_argument("--no-unfused-baseline", dest="unfused_baseline", action="store_false",
                        help="skip the 1-GPU cell on the data-parallel (unfused) code path")
    parser.add_argument("--broadcast-params", choices=("auto", "on", "off"), default="auto",
                        help="dp_broadcast_params: rank 0's parameters broadcast once per iteration (bit-identical ranks by "
                             "construction); auto = the learner's default (on in compiled modes on CUDA)")
    parser.add_argument("--grad-sync", choices=("flashsac_opt", "unilab", "both"), default="flashsac_opt",
                        help="the multi-rank cells' gradient all-reduce: flashsac_opt's one bucket, UniLab's callable, or each in turn")
    parser.add_argument("--gradient-wire-dtype", choices=("float32", "bfloat16"), default="float32",
                        help="the gradient's dtype on the wire (UniLab's training.dp_gradient_wire_dtype), both --grad-sync forms")
    parser.add_argument("--cell-timeout", type=float, default=300.0, help="seconds one world size may take (compile included)")
    parser.add_argument("--iters", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=5)
    add_output_arguments(parser)
    args = parser.parse_args(argv)
    if plot_only(parser, args, plot):
        return 0
    import torch

    if args.device == "cuda":
        if not torch.cuda.is_available():
            parser.error("--device cuda needs a CUDA device (use --device cpu for the gloo smoke run)")
        skipped = [n for n in args.nproc if n > torch.cuda.device_count()]
        args.nproc = [n for n in args.nproc if n <= torch.cuda.device_count()]
    else:
        skipped = []
    if any(n < 1 for n in args.nproc):
        parser.error("--nproc values must be >= 1")
    args.mode = args.mode or ("graph" if args.device == "cuda" else "eager")
    if args.mode == "graph" and args.device != "cuda":
        parser.error("--mode graph needs --device cuda")
    report = {
        "experiment": "benchmark_multigpu",
        "timed": "per rank, host clock around update_from_replay (sampling inside the iteration) + metrics read + stream sync; ranks start together after a barrier",
        "scaling": "weak: the per-rank batch is fixed, so the global batch grows with the world size",
        "mode": args.mode, "capacity_per_rank": args.capacity, "new_rows_per_iteration": args.new_rows,
        "dp_broadcast_params": args.broadcast_params, "gradient_wire_dtype": args.gradient_wire_dtype,
        "world_sizes_skipped": {str(n): "more ranks than visible GPUs" for n in skipped},
        "environment": environment(args), "command": " ".join(["python", *sys.argv]), "cells": [],
    }
    for wname in args.workloads:
        syncs = ["flashsac_opt", "unilab"] if args.grad_sync == "both" else [args.grad_sync]
        worlds = [(n, True, sync) for n in sorted(set(args.nproc)) for sync in (syncs if n > 1 else ["flashsac_opt"])]
        if args.mode != "eager" and args.unfused_baseline and 1 in args.nproc and any(n > 1 for n in args.nproc):
            worlds.insert(1, (1, False, "flashsac_opt"))  # before the multi-rank runs: they reuse its compiled code
        for world, fused, sync in worlds:
            print(f"== {wname} x {world} ranks{'' if fused else ' (unfused: the data-parallel code path)'}"
                  f"{' (UniLab gradient all-reduce)' if world > 1 and sync == 'unilab' else ''}", flush=True)
            try:
                cell = run_world(world, wname, args, fused, sync)
            except Exception as exc:  # keep measuring the other cells  # noqa: BLE001
                cell = {"workload": wname, "world_size": world, "baseline_of_collectives": not fused, "grad_sync": sync if world > 1 else None,
                        "error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()[-3000:]}
            report["cells"].append(cell)
            add_scaling(report["cells"])
            print("   " + json.dumps({k: (round(v, 3) if isinstance(v, float) else v) for k, v in cell.items()
                                      if k in ("ms_median", "ms_p90", "scaling_efficiency", "collective_share", "error")}), flush=True)
            if args.output:
                write_report(report, args.output)
    if args.plot:
        plot(report, args.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
