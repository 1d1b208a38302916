"""Replay placement microbenchmark (seed 003, Tier 1): host sample + H2D vs sampling on the GPU.

Workload (motion tracking): packed rows of 930 float32 (3,720 B; obs 160, action 29, critic 289),
32,768 rows sampled per learner iteration (batch 8,192 x 4 updates), ring capacities 2^20 ... 2^26
rows as memory allows (skipped sizes listed with the reason). Columns (median, p90, mean ms over
--repeat after --warmup): cpu_sample (randint + index_select into a pinned buffer, host clock),
h2d (CUDA events), cpu_sample_h2d (both, host clock), gpu_sample (indices and index_select on the
GPU, CUDA events), gpu_sample_graph (the same replayed from a CUDA graph), and the speedups.

    python experiments/bench/benchmark_replay_sampling.py --output results/replay_sampling/replay_sampling.json \\
        --plot results/replay_sampling/replay_sampling.png
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # experiments/: common, report.plotting
from common import add_output_arguments, cuda_event_ms, percentile, plot_only_or_require_cuda, run_environment, write_report  # noqa: E402
from report import plotting  # noqa: E402

COLUMNS = ("cpu_sample", "h2d", "cpu_sample_h2d", "gpu_sample", "gpu_sample_graph")


def stats(ms: list[float]) -> dict[str, float]:
    return {"median": statistics.median(ms), "p90": percentile(ms, 0.9), "mean": statistics.fmean(ms)}


def measure(capacity: int, width: int, rows: int, warmup: int, repeat: int) -> dict:
    import torch

    dev = torch.device("cuda")
    host = torch.empty(capacity, width, pin_memory=True)
    host.uniform_()  # never time on zeros
    ring = torch.empty(capacity, width, device=dev)
    ring.uniform_()
    staging = torch.empty(rows, width, pin_memory=True)
    dest = torch.empty(rows, width, device=dev)
    cpu_gen = torch.Generator().manual_seed(0)
    gpu_gen = torch.Generator(device=dev).manual_seed(0)
    size = torch.full((1,), float(capacity), device=dev, dtype=torch.float64)
    out = torch.empty(rows, width, device=dev)

    def cpu_sample():
        idx = torch.randint(0, capacity, (rows,), generator=cpu_gen)
        torch.index_select(host, 0, idx, out=staging)

    def gpu_sample():
        u = torch.rand(rows, device=dev, generator=gpu_gen, dtype=torch.float64)
        torch.index_select(ring, 0, (u * size).long(), out=out)

    def host_clock(fn) -> list[float]:
        times = []
        for i in range(warmup + repeat):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            fn()
            torch.cuda.synchronize()
            if i >= warmup:
                times.append((time.perf_counter() - t0) * 1e3)
        return times

    def events(fn) -> list[float]:
        return cuda_event_ms(fn, warmup, repeat)

    result = {
        "cpu_sample": host_clock(cpu_sample),
        "h2d": events(lambda: dest.copy_(staging, non_blocking=True)),
        "cpu_sample_h2d": host_clock(lambda: (cpu_sample(), dest.copy_(staging, non_blocking=True))),
        "gpu_sample": events(gpu_sample),
    }
    graph = torch.cuda.CUDAGraph()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        gpu_sample()
    torch.cuda.current_stream().wait_stream(side)
    graph.register_generator_state(gpu_gen)
    with torch.cuda.graph(graph):
        gpu_sample()
    result["gpu_sample_graph"] = events(graph.replay)
    return {k: stats(v) for k, v in result.items()}  # the rings are freed on return


LABELS = {"cpu_sample": "CPU random sample", "h2d": "H2D (pinned)", "cpu_sample_h2d": "CPU sample + H2D",
          "gpu_sample": "GPU sample", "gpu_sample_graph": "GPU sample in a CUDA graph"}
MARKERS = {"cpu_sample": "o", "h2d": "s", "cpu_sample_h2d": "D", "gpu_sample": "^", "gpu_sample_graph": "v"}


def plot(report: dict, path: Path) -> None:
    cells = [c for c in report["capacities"] if "results" in c]
    fig, ax = plotting.subplots(figsize=(11, 5.5))
    plotting.grouped_bars(
        ax, [f"2^{c['exponent']} rows\n{c['capacity_gib']:.1f} GiB\nCPU+H2D / GPU graph = {c['speedup_graph']:.0f}x" for c in cells],
        [{"label": LABELS[col], "marker": MARKERS[col], "values": [c["results"][col]["median"] for c in cells]} for col in COLUMNS],
        lambda y: f"{y:.3f}" if y < 1 else f"{y:.2f}")
    w = report["workload"]
    env = report["environment"]
    ax.set_title(
        f"Replay sample of {w['rows_per_iteration']:,} rows x {w['row_bytes']:,} B ({w['mib_per_iteration']:.1f} MiB) per iteration: "
        f"host vs GPU\n{env.get('gpu')}, torch {env.get('torch')}; median ms (log), {report['repeat']} repeats after {report['warmup']} warm-up"
    )
    plotting.log_value_axis(ax, "ms per iteration (median)")
    skipped = [f"2^{c['exponent']}: {c['skipped']}" for c in report["capacities"] if "skipped" in c]
    if skipped:
        fig.text(0.01, 0.01, "skipped: " + "; ".join(skipped), fontsize=7, ha="left", va="bottom", wrap=True)
    plotting.save(fig, path, rect=(0, 0.05 if skipped else 0, 1, 1))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--obs-dim", type=int, default=160)
    parser.add_argument("--critic-obs-dim", type=int, default=289)
    parser.add_argument("--action-dim", type=int, default=29)
    parser.add_argument("--batch-size", type=int, default=8192)
    parser.add_argument("--updates-per-step", type=int, default=4)
    parser.add_argument("--capacity-exponents", type=int, nargs="+", default=[20, 22, 24, 26])
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--repeat", type=int, default=20)
    parser.add_argument("--host-memory-gib", type=float, default=96.0, help="largest pinned host ring to try")
    add_output_arguments(parser)
    args = parser.parse_args(argv)
    if plot_only_or_require_cuda(parser, args, plot):
        return 0
    import torch

    from flashsac_opt.replay import ReplayLayout

    width = ReplayLayout(args.obs_dim, args.critic_obs_dim, args.action_dim).row_width
    rows = args.batch_size * args.updates_per_step
    free_gpu, _ = torch.cuda.mem_get_info()
    report = {
        "experiment": "benchmark_replay_sampling",
        "workload": {"row_width": width, "row_bytes": width * 4, "rows_per_iteration": rows,
                     "mib_per_iteration": rows * width * 4 / 2**20, "batch_size": args.batch_size, "updates_per_step": args.updates_per_step},
        "warmup": args.warmup,
        "repeat": args.repeat,
        "environment": run_environment("cuda"),
        "command": " ".join(["python", *sys.argv]),
        "capacities": [],
    }
    for exp in args.capacity_exponents:
        capacity = 2**exp
        gib = capacity * width * 4 / 2**30
        cell = {"exponent": exp, "capacity_rows": capacity, "capacity_gib": gib}
        if gib > args.host_memory_gib:
            cell["skipped"] = f"a {gib:.1f} GiB pinned host ring exceeds --host-memory-gib {args.host_memory_gib}"
        elif gib * 2**30 > 0.8 * free_gpu:
            cell["skipped"] = f"a {gib:.1f} GiB device ring exceeds 80% of free GPU memory ({free_gpu / 2**30:.1f} GiB)"
        else:
            try:
                print(f"capacity 2^{exp} ({gib:.1f} GiB)", flush=True)
                cell["results"] = measure(capacity, width, rows, args.warmup, args.repeat)
                r = cell["results"]
                cell["speedup"] = r["cpu_sample_h2d"]["median"] / r["gpu_sample"]["median"]
                cell["speedup_graph"] = r["cpu_sample_h2d"]["median"] / r["gpu_sample_graph"]["median"]
            except (RuntimeError, MemoryError) as exc:  # e.g. pinned allocation refused
                cell["skipped"] = f"{type(exc).__name__}: {str(exc)[:200]}"
            torch.cuda.empty_cache()
        report["capacities"].append(cell)
        if args.output:
            write_report(report, args.output)
    if args.plot:
        plot(report, args.plot)
    for c in report["capacities"]:
        if "results" in c:
            r = c["results"]
            print(f"2^{c['exponent']}: " + "  ".join(f"{k} {r[k]['median']:.3f}" for k in COLUMNS) + f"  speedup x{c['speedup']:.1f} / graph x{c['speedup_graph']:.1f}")
        else:
            print(f"2^{c['exponent']}: skipped: {c['skipped']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
