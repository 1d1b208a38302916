"""The GEMM class's own ceiling: one learner iteration's GEMMs alone, back to back in a CUDA graph.

The learner's GEMMs are far smaller than the 8192^3 one of the bf16 peak, and cuBLAS does not reach
that peak on them whatever runs around them. This records every GEMM one eager iteration dispatches
(`RecordGemms`: aten mm / addmm / bmm / baddbmm with their operands' shapes, strides and dtypes,
autocast applied, backward included), replays exactly those calls on fresh operands of the same
layout captured in one CUDA graph, and times the replay: the ceiling of any remedy that keeps these
GEMMs (roofline.py's --gemm-ceiling). Inductor's graphs call the same ATen GEMMs but may fold a
transpose into the call and pad unaligned dims (--align 8 replays that too).

    python experiments/bench/gemm_ceiling.py --workloads W1 W2 W3 W4 --output /tmp/gemm_ceiling.json
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # experiments/: common, bench

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import FlopCounterMode

GEMM_OPS = ("mm", "addmm", "bmm", "baddbmm")


class RecordGemms(TorchDispatchMode):
    """Records every GEMM dispatched under it: (op name, [operand spec or scalar], kwargs)."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[str, list, dict]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func.overloadpacket.__name__
        if name in GEMM_OPS:
            spec = [(tuple(a.shape), tuple(a.stride()), a.dtype) if isinstance(a, torch.Tensor) else a for a in args]
            self.calls.append((name, spec, {k: v for k, v in kwargs.items() if not isinstance(v, torch.Tensor)}))
        return func(*args, **kwargs)


def is_operand(item) -> bool:
    """A recorded tensor operand (shape, stride, dtype), not a scalar argument."""
    return isinstance(item, tuple) and len(item) == 3 and isinstance(item[2], torch.dtype)


def gemm_flops(name: str, spec: list) -> int:
    """FLOPs of one recorded call (2 per multiply-add), as torch's flop counter counts them."""
    shapes = [s[0] for s in spec if is_operand(s)]
    a, b = shapes[-2], shapes[-1]  # addmm / baddbmm: (bias, a, b)
    if name in ("mm", "addmm"):
        return 2 * a[0] * a[1] * b[1]
    return 2 * a[0] * a[1] * a[2] * b[2]


def aligned(spec: list, multiple: int = 8) -> list:
    """``spec`` with every operand's matrix dims (the last two; a bias's one) rounded up to
    ``multiple`` elements and dense strides in the recorded dim order: the padding Inductor's
    pad_mm gives a GEMM whose leading dimension is not 16-byte aligned (obs 98, critic obs 101,
    action 29), which eager's calls keep and cuBLAS then serves with align1 kernels. A GEMM
    dim is shared by two operands, so both round it alike and the calls stay valid."""
    out = []
    for s in spec:
        if not is_operand(s):
            out.append(s)
            continue
        shape, stride, dtype = s
        lead = len(shape) - min(len(shape), 2)
        padded = tuple(n if i < lead else -(-n // multiple) * multiple for i, n in enumerate(shape))
        new_stride, step = [0] * len(shape), 1
        for i in sorted((i for i in range(len(shape)) if stride[i]), key=lambda i: (stride[i], i)):  # innermost first
            new_stride[i], step = step, step * padded[i]  # a broadcast (stride-0) dim stays 0
        out.append((padded, tuple(new_stride), dtype))
    return out


def operands(spec: list, device: str, generator: torch.Generator) -> list:
    """Fresh operands of the recorded shapes, strides and dtypes (random values: zeros run
    faster): each a view of the span its strides reach, as a transposed operand is."""
    out = []
    for s in spec:
        if is_operand(s):
            shape, stride, dtype = s
            span = 1 + sum((n - 1) * st for n, st in zip(shape, stride))
            base = torch.randn(span, generator=generator, device=device).to(dtype)
            out.append(base.as_strided(shape, stride))
        else:
            out.append(s)
    return out


def record(workload: dict, device: str) -> tuple[list, float]:
    """The GEMM calls of one eager learner iteration of ``workload`` (after one warm-up
    iteration, so lazy set-up is not recorded) and the iteration's FLOPs by torch's counter."""
    from flashsac_opt.config import FlashSACConfig
    from flashsac_opt.learner import FlashSACLearner
    from flashsac_opt.testing.oracle import synthetic_batch

    cfg = FlashSACConfig(batch_size=workload["batch_size"], updates_per_step=workload["updates_per_step"],
                         policy_frequency=workload["policy_frequency"], learner_mode="eager")
    learner = FlashSACLearner(cfg, workload["obs_dim"], workload["critic_obs_dim"], workload["action_dim"], device=device)
    g = torch.Generator().manual_seed(0)  # synthetic_batch draws on the CPU
    batch = lambda: synthetic_batch(cfg.batch_size * cfg.updates_per_step, learner.obs_dim, learner.critic_obs_dim,  # noqa: E731
                                    learner.action_dim, g, device=device)
    learner.update(batch())
    recorder, flops = RecordGemms(), FlopCounterMode(display=False)
    with flops, recorder:
        learner.update(batch())
    return recorder.calls, float(flops.get_total_flops())


def prepare(calls: list, device: str) -> list:
    """(ATen op, fresh operands, kwargs) for each recorded call, operands drawn from one seeded generator."""
    g = torch.Generator(device=device).manual_seed(1)
    return [(getattr(torch.ops.aten, name).default, operands(spec, device, g), kw) for name, spec, kw in calls]


def replay_us(calls: list, device: str = "cuda", repeat: int = 20) -> list[float]:
    """Microseconds of each of ``repeat`` replays of ``calls`` captured back to back in one CUDA graph."""
    from bench.roofline import captured_replay_us

    prepared = prepare(calls, device)

    def all_gemms() -> None:
        for op, args, kw in prepared:
            op(*args, **kw)

    return captured_replay_us(all_gemms, calls=1, repeat=repeat)


def operand_dtypes(calls: list) -> dict[str, int]:
    """How many recorded calls run on each (op, operand dtypes): whether autocast reached them all."""
    from collections import Counter

    return dict(Counter(f"{name}:" + ",".join(str(s[2]).removeprefix("torch.") for s in spec if is_operand(s))
                        for name, spec, _ in calls))


def profiled_kernels(calls: list, device: str = "cuda", passes: int = 3) -> dict:
    """The replayed calls run eagerly under torch.profiler: their kernels' summed device time
    per pass, their count and the five longest by name. Against the captured replay's wall time
    it splits "slow GEMM kernels" from "time between them"; against graph mode's GEMM class
    (roofline.py) it says whether eager's layouts run the same GEMMs slower."""
    from collections import defaultdict

    from torch.profiler import ProfilerActivity, profile

    prepared = prepare(calls, device)
    for op, args, kw in prepared:  # cuBLAS heuristics and workspace outside the profile
        op(*args, **kw)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(passes):
            for op, args, kw in prepared:
                op(*args, **kw)
        torch.cuda.synchronize()
    by_name: dict[str, list[float]] = defaultdict(list)
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            by_name[e.name].append(e.device_time)
    total = sum(sum(v) for v in by_name.values()) / passes
    longest = sorted(by_name.items(), key=lambda kv: -sum(kv[1]))[:5]
    return {"kernel_us_per_pass": total, "kernels_per_pass": sum(len(v) for v in by_name.values()) / passes,
            "longest": [{"name": n[:120], "launches_per_pass": len(v) / passes, "us_per_pass": sum(v) / passes} for n, v in longest]}


def main(argv: list[str] | None = None) -> int:
    from collections import Counter

    from common import percentile, run_environment, write_report
    from bench.workloads import WORKLOADS

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workloads", nargs="+", default=list(WORKLOADS), choices=list(WORKLOADS))
    parser.add_argument("--repeat", type=int, default=20)
    parser.add_argument("--align", type=int, default=0, metavar="N",
                        help="also replay every call with its matrix dims rounded up to N elements (aligned; Inductor pads to 8 for bf16)")
    parser.add_argument("--profile", action="store_true",
                        help="also the calls' kernel time under torch.profiler, run eagerly (profiled_kernels)")
    parser.add_argument("--output", type=Path, required=True)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        parser.error("this benchmark needs a CUDA device")
    report = {"experiment": "gemm_ceiling", "environment": run_environment("cuda"),
              "what": "one eager iteration's GEMMs (bf16 autocast, forward and backward) alone, captured back to back in one "
                      "CUDA graph on fresh operands of the same layouts: median and p90 us per replay",
              "command": " ".join(["python", *sys.argv]), "cells": []}
    recorded_calls = {}
    for name in args.workloads:
        calls, flops = record(WORKLOADS[name], "cuda")
        times = replay_us(calls, repeat=args.repeat)
        recorded = sum(gemm_flops(n, s) for n, s, _ in calls)
        by_op = dict(Counter(n for n, _, _ in calls))
        median = statistics.median(times)
        cell = {"workload": name, "gemms": len(calls), "gemms_by_op": by_op, "gemm_flops": recorded,
                "iteration_flops_torch_counter": flops, "us_median": median, "us_p90": percentile(times, 0.9),
                "tflops_alone": recorded / (median * 1e-6) / 1e12, "operand_dtypes": operand_dtypes(calls)}
        padded = None
        if args.align:  # the same calls padded as Inductor pads them: graph mode's GEMMs
            padded = [(n, aligned(s, args.align), kw) for n, s, kw in calls]
            padded_times = replay_us(padded, repeat=args.repeat)
            cell["aligned"] = {"multiple": args.align, "us_median": statistics.median(padded_times),
                               "us_p90": percentile(padded_times, 0.9),
                               "gemm_flops_padded": sum(gemm_flops(n, s) for n, s, _ in padded)}
        report["cells"].append(cell)
        recorded_calls[name] = (calls, padded)
        print(f"{name}: {len(calls)} GEMMs ({by_op}), {recorded / 1e9:.1f} GFLOP, alone {cell['us_median']:.0f} us "
              f"(p90 {cell['us_p90']:.0f}), {cell['tflops_alone']:.0f} TFLOP/s {cell['operand_dtypes']}", flush=True)
        write_report(report, args.output)
    # Profiled only after every cell was timed: CUPTI stays attached once the profiler ran.
    for cell in report["cells"] if args.profile else []:
        calls, padded = recorded_calls[cell["workload"]]
        cell["profiled"] = profiled_kernels(calls)
        if padded is not None:
            cell["aligned"]["profiled"] = profiled_kernels(padded)
        print(f"{cell['workload']}: kernels {cell['profiled']['kernel_us_per_pass']:.0f} us a pass "
              f"({cell['profiled']['kernels_per_pass']:.0f} launches)", flush=True)
        write_report(report, args.output)
    return 0


if __name__ == "__main__":
    sys.exit(main())
