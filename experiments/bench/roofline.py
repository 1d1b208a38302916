"""Roofline map of the learner iteration: where its GPU time goes, by kernel class, against the
H200's ceilings (issue "The learner at half of UniLab's best").

Classes come from the kernel names torch.profiler records (`classify`, first matching rule):
vendor GEMMs, BatchNorm statistics, BN apply (with the activations Inductor fused in),
activations, the weight renormalization, the Adam step, other. The ceilings per class:
- GEMM: its FLOPs per iteration, counted exactly on the CPU in eager mode (`work`), at the dense
  bf16 peak; or, tighter, the workload's GEMMs alone in a CUDA graph (`--gemm-ceiling`,
  gemm_ceiling.py);
- memory-bound classes: Inductor's own byte count per generated kernel (`kernel_num_gb`, present
  when compiled with `benchmark_kernel`: `benchmark_learner.py --kernel-bytes`; read by
  `inductor_kernel_gb`) at the HBM rate, and, tighter, each counted kernel (`counted_kernels`) at
  the time a plain copy of its bytes takes in a CUDA graph (`graph_copy_us`: a few-MB kernel pays
  the copy's fixed cost, not bytes / HBM): `ms_at_size_ceilings`;
- latency: a dependent kernel that does nearly nothing still takes `graph_kernel_us` in a CUDA
  graph (`launch_floor_us`, and the iteration's `chain_floor_us`: W1's bound).
The peaks are measured on the benchmark's GPU when it ran with --kernel-bytes (`measure_peaks`),
else the datasheet's. Vendor kernels other than GEMMs have no byte count.

    python experiments/bench/roofline.py --input results/learner_benchmark/benchmark_learner_side_by_side_W3_W4.json \\
        --variant ours_graph --output results/roofline/roofline_W3_W4.json --plot results/roofline/roofline_W3_W4.png

An older benchmark JSON (no `kernel_classes`) has its 40 longest kernels only: `coverage` says their share.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # experiments/: common, report.plotting

H200_PEAKS = {"bf16_dense_tflops": 989.0, "hbm_tb_per_s": 4.8}  # NVIDIA H200 SXM datasheet
CLASSES = ("GEMM", "BN statistics", "BN apply", "activations", "renormalization", "optimizer", "other")
_RULES = (  # (class, pattern over the kernel name): the first match wins
    # a sqrt that is not rsqrt: a BN statistics kernel carries lerp (its running mean) and rsqrt
    # gated_adam: fused_step's Triton kernel (Adam, renormalization, commit, Polyak)
    ("optimizer", r"^Optimizer\.step|lerp.*(addcmul|(?<!r)sqrt)|addcmul.*lerp|_fused_adam|multi_tensor_apply|^gated_adam"),
    ("renormalization", r"linalg_vector_norm|renorm"),
    ("GEMM", r"^(nvjet|sm\d+_xmma|cutlass|ampere_|volta_|turing_)|gemm|splitKreduce|\bbmm_|_bmm\b"),
    ("BN statistics", r"^triton_(red|per)_.*(var|mean|rsqrt)|WelfordOps|batch_norm_collect|batch_norm_backward_reduce"),
    ("BN apply", r"^triton_poi_.*rsqrt|batch_norm_elemt|batch_norm_backward_elemt"),
    ("activations", r"relu|threshold_backward|tanh|softplus|sigmoid|exp|log_softmax|silu|gelu"),
)


def classify(name: str) -> str:
    for cls, pattern in _RULES:
        if re.search(pattern, name):
            return cls
    return "other"


def kernel_classes(by_name: dict[str, tuple[float, float]], iterations: int,
                   gb_by_name: dict[str, float] | None = None) -> dict[str, dict[str, float]]:
    """{class: {kernels, us}} per iteration from {kernel name: (count, device us)} of a profile;
    with ``gb_by_name`` (`inductor_kernel_gb`) also the GB the class moves per iteration and
    the time of the kernels that count covers (``gb_us``)."""
    out = {c: {"kernels": 0.0, "us": 0.0} for c in CLASSES}
    for name, (count, us) in by_name.items():
        row = out[classify(name)]
        row["kernels"] += count / iterations
        row["us"] += us / iterations
        if gb_by_name is not None and name in gb_by_name:
            row["gb"] = row.get("gb", 0.0) + gb_by_name[name] * count / iterations
            row["gb_us"] = row.get("gb_us", 0.0) + us / iterations
    return out


def counted_kernels(by_name: dict[str, tuple[float, float]], iterations: int,
                    gb_by_name: dict[str, float]) -> dict[str, list[list[float]]]:
    """{class: [[GB a launch, launches an iteration, us an iteration], ...]}: every profiled
    kernel with a byte count, one entry a name, without the names (the JSON stays small). What
    the table needs to give each kernel its own size's ceiling (copy_us), not the class's."""
    out: dict[str, list[list[float]]] = {}
    for name, (count, us) in by_name.items():
        if name in gb_by_name:
            out.setdefault(classify(name), []).append([gb_by_name[name], count / iterations, us / iterations])
    return out


def inductor_kernel_gb() -> tuple[dict[str, float], list[str]]:
    """({kernel name: GB per launch}, [ambiguous names]) for the Triton kernels Inductor has
    loaded in this process, by its own count (`kernel_num_gb`: present only for kernels compiled
    with torch._inductor.config.benchmark_kernel on). A name two generated modules give
    different counts (kernel names are unique within one graph, not across graphs) is left out
    and listed as ambiguous rather than guessed."""
    from torch._inductor.codecache import PyCodeCache

    seen: dict[str, set[float]] = {}
    for module in list(PyCodeCache.modules) + list(PyCodeCache.modules_no_attr.values()):
        for value in list(vars(module).values()):
            meta = getattr(value, "inductor_meta", None)
            if isinstance(meta, dict) and meta.get("kernel_num_gb") is not None and meta.get("kernel_name"):
                seen.setdefault(meta["kernel_name"], set()).add(round(float(meta["kernel_num_gb"]), 12))
    gb = {name: values.pop() for name, values in seen.items() if len(values) == 1}
    return gb, sorted(name for name, values in seen.items() if len(values) > 1)


@contextlib.contextmanager
def unique_kernel_names():
    """Number Inductor's generated kernels across every graph this process compiles, not per graph.

    Inductor names a kernel by its category, its ops and a number that restarts in each graph's
    wrapper (`PythonWrapperCodegen.next_kernel_suffix`), so the critic's and the actor's graphs
    both hold a `triton_red_fused_5`, with different byte counts: torch.profiler keys kernels by
    name, so such a name could not be given its bytes (`inductor_kernel_gb`'s ambiguous list).
    With one counter for the process every generated kernel keeps a name of its own, and each
    profiled name has one count. Only the names change (the kernels' code and the graphs do not);
    kernels loaded from an Inductor cache keep the names of the process that compiled them, so
    the graphs of one map must be compiled in one process, from an empty cache."""
    from torch._inductor.codegen.wrapper import PythonWrapperCodegen

    original = PythonWrapperCodegen.__dict__.get("next_kernel_suffix")
    if original is None:
        raise RuntimeError("this torch's Inductor has no PythonWrapperCodegen.next_kernel_suffix: "
                           "kernel names cannot be made unique across graphs")
    numbers = itertools.count()
    PythonWrapperCodegen.next_kernel_suffix = lambda self: str(next(numbers))
    try:
        yield
    finally:
        PythonWrapperCodegen.next_kernel_suffix = original


def inductor_kernel_sources(names: list[str], limit: int = 8000) -> dict[str, list[str]]:
    """{kernel name: [its Triton source, one per distinct generated body]} for ``names`` among
    the kernels Inductor has loaded in this process: what a kernel named only by its number
    (`triton_poi_fused_3`, no op names) computes. Each source cut at ``limit`` characters."""
    from torch._inductor.codecache import PyCodeCache

    wanted, found = set(names), {}
    for module in list(PyCodeCache.modules) + list(PyCodeCache.modules_no_attr.values()):
        for value in list(vars(module).values()):
            meta = getattr(value, "inductor_meta", None)
            name = meta.get("kernel_name") if isinstance(meta, dict) else None
            src = getattr(getattr(value, "fn", None), "src", None)
            if name in wanted and isinstance(src, str) and src[:limit] not in found.get(name, []):
                found.setdefault(name, []).append(src[:limit])
    return found


def measure_peaks(device: str = "cuda") -> dict[str, float]:
    """The ceilings on this GPU (device events, median of 20 after warm-up): HBM TB/s of a
    1-GiB device-to-device copy (bytes read + written), TFLOP/s of an 8192^3 bf16 GEMM on
    random data (zeros run faster than real data), a dependent kernel's time in a CUDA graph and a
    copy kernel's there by size (graph_copy_us); with them the SM count, to read a small GEMM's
    grid against."""
    import torch

    from common import cuda_event_ms

    def median_ms(fn) -> float:
        times = sorted(cuda_event_ms(fn, warmup=3, repeat=20))
        return times[len(times) // 2]

    src = torch.randn(2**28, device=device)  # 1 GiB of fp32
    dst = torch.empty_like(src)
    copy_ms = median_ms(lambda: dst.copy_(src))
    n = 8192
    a, b = (torch.randn(n, n, device=device, dtype=torch.bfloat16) for _ in range(2))
    gemm_ms = median_ms(lambda: a @ b)
    del src, dst, a, b
    return {"hbm_tb_per_s": 2 * 2**30 / (copy_ms * 1e-3) / 1e12, "bf16_dense_tflops": 2 * n**3 / (gemm_ms * 1e-3) / 1e12,
            "graph_kernel_us": graph_kernel_us(device), "sm_count": torch.cuda.get_device_properties(device).multi_processor_count,
            "copy_us_by_bytes": graph_copy_us(device)}


def _captured_chain_us(step, kernels: int) -> float:
    """Microseconds per call of ``step`` (one kernel each, each depending on the one before)
    when ``kernels`` calls are captured in one CUDA graph and replayed, median of 20."""
    times = sorted(captured_replay_us(step, kernels))
    return times[len(times) // 2]


def captured_replay_us(step, calls: int = 1, repeat: int = 20) -> list[float]:
    """Microseconds per call of ``step`` in each of ``repeat`` replays (after 3 untimed) of one
    CUDA graph that captured ``calls`` calls of it back to back, warmed up once off the default
    stream first (cuBLAS's workspace and heuristics, the allocator, before capture)."""
    import torch

    from common import cuda_event_ms

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up off the default stream, as capture wants
        step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            step()
    return [ms * 1e3 / calls for ms in cuda_event_ms(graph.replay, warmup=3, repeat=repeat)]


def kernels_per_call(step) -> int:
    """CUDA kernels one call of ``step`` launches (torch.profiler)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    return sum(1 for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA)


def graph_kernel_us(device: str = "cuda", kernels: int = 1000) -> float:
    """Microseconds a dependent kernel takes in a CUDA graph when it does (almost) nothing: a
    captured chain of ``kernels`` in-place adds on one float, replayed, median of 20. The third
    ceiling, for W1's chain of small kernels: no iteration of n dependent kernels runs faster than
    n times this, whatever their bytes and FLOPs."""
    import torch

    x = torch.zeros(1, device=device)
    return _captured_chain_us(lambda: x.add_(1.0), kernels)


# Bytes moved (read + written, as Inductor's kernel_num_gb counts them) of the copies that
# graph_copy_us times: 4 KiB to 1 GiB, a factor of 4 apart.
COPY_BYTES = tuple(4**k * 4096 for k in range(10))


def graph_copy_us(device: str = "cuda", moved_bytes: tuple[int, ...] = COPY_BYTES, kernels: int = 50) -> list[list[float]]:
    """[[bytes moved, us], ...]: a plain copy kernel's time in a CUDA graph for each size, a
    chain of ``kernels`` dependent copies back and forth between two fp32 buffers. A
    memory-bound kernel moving that many bytes cannot beat the copy: at a few MB and below the
    copy itself is far from the HBM rate (ramp-up, tail, latency), which bytes / HBM ignores."""
    import torch

    out = []
    for moved in moved_bytes:
        a = torch.randn(moved // 8, device=device)  # read + written: twice the buffer's 4-byte elements
        b = torch.empty_like(a)
        flip = [a, b]

        def step() -> None:
            flip[1].copy_(flip[0])
            flip.reverse()

        out.append([float(moved), _captured_chain_us(step, kernels)])
        del a, b, flip
    return out


def copy_us(gb: float, curve: list[list[float]]) -> float:
    """A copy kernel's microseconds for ``gb`` moved, from graph_copy_us's curve: interpolated in
    log-log between measured sizes; below the smallest, the smallest's time (the fixed cost);
    above the largest, the largest's rate."""
    import math

    moved = gb * 1e9
    sizes, times = [c[0] for c in curve], [c[1] for c in curve]
    if moved <= sizes[0]:
        return times[0]
    if moved >= sizes[-1]:
        return times[-1] * moved / sizes[-1]
    i = next(k for k in range(1, len(sizes)) if sizes[k] >= moved)
    f = (math.log(moved) - math.log(sizes[i - 1])) / (math.log(sizes[i]) - math.log(sizes[i - 1]))
    return math.exp(math.log(times[i - 1]) + f * (math.log(times[i]) - math.log(times[i - 1])))


def work(workload: dict) -> dict[str, float]:
    """GEMM FLOPs of one learner iteration of ``workload`` (its batch size, updates per step,
    policy frequency and dims), counted on the CPU in eager mode."""
    import torch
    from torch.utils.flop_counter import FlopCounterMode

    from flashsac_opt.config import FlashSACConfig
    from flashsac_opt.learner import FlashSACLearner
    from flashsac_opt.testing.oracle import synthetic_batch

    cfg = FlashSACConfig(batch_size=workload["batch_size"], updates_per_step=workload["updates_per_step"],
                         policy_frequency=workload["policy_frequency"], learner_mode="eager")
    learner = FlashSACLearner(cfg, workload["obs_dim"], workload["critic_obs_dim"], workload["action_dim"], device="cpu")
    batch = synthetic_batch(cfg.batch_size * cfg.updates_per_step, learner.obs_dim, learner.critic_obs_dim, learner.action_dim,
                            torch.Generator().manual_seed(0))
    flops = FlopCounterMode(display=False)
    with flops:
        learner.update(batch)
    return {"gemm_flops": float(flops.get_total_flops())}


def table(cell: dict, counts: dict[str, float], peaks: dict[str, float] = H200_PEAKS, gemm_alone_us: float | None = None) -> dict:
    """The roofline rows of one benchmark cell (one variant at one workload); ``gemm_alone_us``:
    the workload's GEMMs alone (gemm_ceiling.py), the GEMM class's ceiling where measured."""
    classes = cell.get("kernel_classes")
    if classes is None:  # an older benchmark JSON: its 40 longest kernels only
        by_name = {k["name"]: (k["count_per_iteration"], k["us_per_iteration"]) for k in cell["top_kernels"]}
        classes = kernel_classes(by_name, 1)
        source = "top_kernels"
    else:
        source = "kernel_classes"
    covered = sum(c["us"] for c in classes.values())
    total = cell.get("kernel_us_per_iteration") or covered
    rows = []
    for name in CLASSES:
        us = classes[name]["us"]
        row = {"class": name, "kernels": classes[name]["kernels"], "us": us, "share_of_kernel_time": us / total if total else None}
        if classes[name].get("gb_us"):  # Inductor's byte count covers (part of) this class
            gb, gb_us = classes[name]["gb"], classes[name]["gb_us"]
            row.update(gb=gb, gb_covered_share=gb_us / us, gb_per_s_achieved=gb / (gb_us * 1e-6),
                       floor_us=gb / (peaks["hbm_tb_per_s"] * 1e3) * 1e6)  # of the counted kernels only
        rows.append(row)
    gemm = rows[0]
    gemm["tflops_achieved"] = counts["gemm_flops"] / (gemm["us"] * 1e-6) / 1e12 if gemm["us"] else None
    gemm["floor_us"] = counts["gemm_flops"] / (peaks["bf16_dense_tflops"] * 1e12) * 1e6
    if source == "top_kernels":  # GEMMs outside the top 40 are missing from its time
        gemm["tflops_achieved_is_upper_bound"] = True
    memory_floor = [r["floor_us"] for r in rows[1:] if "floor_us" in r]
    chain = {}
    if peaks.get("graph_kernel_us"):  # measured with the peaks: the launch floor of each class's kernels
        for r in rows:
            r["launch_floor_us"] = r["kernels"] * peaks["graph_kernel_us"]
        # no iteration of these kernels, run one after another, is shorter than their count's floor
        chain = {"chain_floor_us": sum(r["kernels"] for r in rows) * peaks["graph_kernel_us"]}
    # Every counted kernel at its class's ceiling (GEMMs at the bf16 peak, bytes at the HBM rate, none
    # under the graph-kernel latency), the rest as measured: what faster kernels alone can give.
    above_floor = {}  # class: its counted kernels' time above their ceiling
    for r in rows:
        counted = 1.0 if r is gemm else r.get("gb_covered_share", 0.0)
        if counted and r.get("floor_us") is not None:
            floor = max(r["floor_us"], r.get("launch_floor_us", 0.0) * counted)
            above_floor[r["class"]] = max(r["us"] * counted - floor, 0.0)
    above_floor_us = sum(above_floor.values())
    # Tighter, where the benchmark kept each counted kernel and the peaks hold the copy curve: each
    # memory-bound kernel at a plain copy of its bytes, the GEMMs alone where measured (else as above).
    sized = {}
    curve, per_kernel = peaks.get("copy_us_by_bytes"), cell.get("counted_kernels")
    if curve and per_kernel:
        above_size_us = 0.0
        for r in rows[1:]:
            entries = per_kernel.get(r["class"], [])
            if entries:
                floors = [n * copy_us(gb, curve) for gb, n, _ in entries]
                r["copy_floor_us"] = sum(floors)
                above_size_us += sum(max(us - floor, 0.0) for (_, _, us), floor in zip(entries, floors))
        if gemm_alone_us is not None:
            gemm["alone_us"] = gemm_alone_us
            above_size_us += max(gemm["us"] - gemm_alone_us, 0.0)
        else:
            above_size_us += above_floor[gemm["class"]]
        sized = {"ms_at_size_ceilings": cell["ms_median"] - above_size_us / 1e3,
                 "gemm_ceiling": "alone (gemm_ceiling.py)" if gemm_alone_us is not None else "bf16 peak / launch floor"}
    return {
        "variant": cell["variant"], "workload": cell["workload"], "ms_median": cell["ms_median"],
        "ms_at_class_floors": cell["ms_median"] - above_floor_us / 1e3, **sized,
        "kernel_us_per_iteration": total, "source": source, "coverage": covered / total if total else None,
        # the iteration's time with no kernel running: gaps between a graph's kernels, its launch, the metrics read
        "outside_kernels_us": cell["ms_median"] * 1e3 - total,
        "rows": rows, "work": counts, "peaks": peaks, "gemm_floor_us": gemm["floor_us"],
        # the GEMM FLOPs at peak plus every counted byte at HBM speed, one after the other
        "floor_us": gemm["floor_us"] + sum(memory_floor) if memory_floor else None,
        **chain,
    }


def gemm_ceiling_us(cell: dict) -> float:
    """A gemm_ceiling.py cell's GEMMs alone: the aligned replay where it ran (graph mode's GEMMs
    are padded by Inductor; eager's unaligned calls run cuBLAS's slower align1 kernels), else the plain one."""
    return cell["aligned"]["us_median"] if "aligned" in cell else cell["us_median"]


def against_unilab(cell: dict, unilab_ms: float) -> dict:
    """Add to a roofline cell its ratio to UniLab's default path (``unilab_ms``, measured in another
    process or call: a reading, not a side by side) and, per class, the ratio were that class's
    whole kernel time removed from the iteration: no remedy aimed at one class can do better."""
    cell["unilab_graph_ms"] = unilab_ms
    cell["ratio_to_unilab_graph"] = cell["ms_median"] / unilab_ms
    cell["ratio_at_class_floors"] = cell["ms_at_class_floors"] / unilab_ms
    if "ms_at_size_ceilings" in cell:
        cell["ratio_at_size_ceilings"] = cell["ms_at_size_ceilings"] / unilab_ms
    for r in cell["rows"]:
        r["ratio_without_class"] = max(cell["ms_median"] - r["us"] / 1e3, 0.0) / unilab_ms
    return cell


def plot(report: dict, path: Path) -> None:
    from report import plotting

    cells = report["cells"]
    fig, ax = plotting.subplots(figsize=(10, 1.2 + 0.9 * len(cells)))
    labels = [f"{c['workload']} {c['variant']}" for c in cells]
    left = [0.0] * len(cells)
    for name in CLASSES:
        widths = [next(r["us"] for r in c["rows"] if r["class"] == name) / 1e3 for c in cells]
        ax.barh(labels, widths, left=left, label=name)
        left = [a + b for a, b in zip(left, widths)]
    rest = [c["kernel_us_per_iteration"] / 1e3 - x for c, x in zip(cells, left)]
    if any(r > 1e-6 for r in rest):  # an older JSON: the kernels outside its top 40, unclassified
        ax.barh(labels, rest, left=left, label="not classified (outside the top 40)", color="lightgrey")
    for i, c in enumerate(cells):
        ax.plot([c["gemm_floor_us"] / 1e3] * 2, [i - 0.4, i + 0.4], color="black", linewidth=2)
        if c.get("floor_us"):
            ax.plot([c["floor_us"] / 1e3] * 2, [i - 0.4, i + 0.4], color="black", linewidth=2, linestyle=":")
    plotting.finish_axis(ax, "GPU kernel time per learner iteration (ms)\nblack tick: the GEMM FLOPs at the bf16 peak; "
                         "dotted: plus the counted bytes at HBM speed",
                         "", "Kernel time by class (H200)", legend=False)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))  # outside: the bars reach the right edge
    plotting.save(fig, path)


def main(argv: list[str] | None = None) -> int:
    from common import write_report
    from bench.workloads import WORKLOADS

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--input", type=Path, required=True, help="a benchmark_learner JSON (measured on the GPU)")
    parser.add_argument("--variant", action="append", help="cells of this variant (repeatable; default ours_graph and unilab_graph)")
    parser.add_argument("--output", type=Path, required=True)
    parser.add_argument("--plot", type=Path)
    parser.add_argument("--against", type=Path, help="a side-by-side benchmark JSON with unilab_graph cells (run on the same "
                        "GPU): each cell gets its ratio to UniLab's default path and, per class, the ratio were that class's "
                        "whole kernel time gone (the most any remedy of that class can give)")
    parser.add_argument("--gemm-ceiling", type=Path, help="a gemm_ceiling.py JSON (same GPU): each workload's GEMMs alone "
                        "become the GEMM class's ceiling in ms_at_size_ceilings")
    args = parser.parse_args(argv)
    bench = json.loads(args.input.read_text())
    gemm_alone = {c["workload"]: gemm_ceiling_us(c) for c in json.loads(args.gemm_ceiling.read_text())["cells"]} if args.gemm_ceiling else {}
    variants = args.variant or ["unilab_graph", "ours_graph"]
    cells = [c for c in bench["cells"] if c["variant"] in variants and ("top_kernels" in c or "kernel_classes" in c)]
    if not cells:
        parser.error(f"{args.input}: no profiled cell of {variants}")
    counted = {w: work(WORKLOADS[w]) for w in sorted({c["workload"] for c in cells})}
    measured = (bench.get("environment") or {}).get("measured_peaks")
    peaks = measured or H200_PEAKS
    report = {
        "experiment": "roofline",
        "what": "kernel time by class from the benchmark's profile (measured on the GPU it names), work per iteration counted on this machine's CPU",
        "input": str(args.input), "gpu_environment": bench.get("environment"), "peaks": peaks,
        "peaks_source": "measured on the benchmark's GPU (measure_peaks)" if measured else "NVIDIA H200 SXM datasheet",
        "cells": [table(c, counted[c["workload"]], peaks, gemm_alone.get(c["workload"])) for c in cells],
        **({"gemm_ceiling": str(args.gemm_ceiling)} if args.gemm_ceiling else {}),
        "command": " ".join(["python", *sys.argv]),
    }
    if args.against:
        unilab_ms = {c["workload"]: c["ms_median"] for c in json.loads(args.against.read_text())["cells"]
                     if c["variant"] == "unilab_graph" and "ms_median" in c}
        report["against"] = str(args.against)
        for c in report["cells"]:
            if c["workload"] in unilab_ms:
                against_unilab(c, unilab_ms[c["workload"]])
    write_report(report, args.output, plot if args.plot else None, args.plot)
    for c in report["cells"]:
        g = c["rows"][0]
        print(f"{c['workload']} {c['variant']}: {c['kernel_us_per_iteration']:.0f} us of kernels ({c['coverage']:.0%} classified); "
              f"GEMM {g['us']:.0f} us at {g['tflops_achieved'] or 0:.0f} TFLOP/s (floor {g['floor_us']:.0f} us); "
              + ", ".join(f"{r['class']} {r['us']:.0f}" + (f" ({r['gb_per_s_achieved']:.0f} GB/s)" if "gb_per_s_achieved" in r else "")
                          for r in c["rows"][1:] if r["us"])
              + (f"; floor {c['floor_us']:.0f} us" if c.get("floor_us") else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
