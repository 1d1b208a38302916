"""Issue 45, item 3 as a measured study: a network's post-backward step alone (the finite guard, Adam,
the unit renormalization, the guarded commit and, for the critic, the Polyak update of its target),

- composite: optim.GatedStep as graph mode compiles it (Inductor's kernels over the flat buffers);
- fused_step: the same GatedStep with FlashSACConfig.fused_gated_step (fused_step.py: the guard's
  reduction and the scalars by Inductor, the rest in one Triton launch);
- copy of its bytes: one copy moving as many bytes as the step must (each flat array read once and
  the written ones written once), the floor of any form of it.

for the recipe's critic (2 members, hidden 256: 2.2 M parameters, with its target) and actor (hidden
128: 0.29 M). Each cell: one CUDA graph of `--calls` steps back to back, replayed `--repeat` times (us
per step, median and p90), and kernels per step (torch.profiler on one call). The two forms run the
same steps from the same state; their parameters' largest difference after the warm-up is reported.

    python experiments/bench/gated_step.py --output /tmp/gated_step.json

On a CPU (Triton's interpreter: TRITON_INTERPRET=1) it checks the two forms agree on small networks.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # experiments/: common, bench

import torch

from flashsac_opt import fused_step
from flashsac_opt.networks import FlashSACActor, FlashSACCritic
from flashsac_opt.optim import FlatAdam, GatedStep

TAU = 0.005


def networks(device: str) -> dict[str, torch.nn.Module]:
    """The recipe's critic and actor on CUDA; small ones on the CPU, where the interpreter runs every
    program in Python."""
    wide = device == "cuda"
    return {"critic": FlashSACCritic(101, 29, 256 if wide else 16, 2 if wide else 1, 101 if wide else 11, -5.0, 5.0),
            "actor": FlashSACActor(98, 29, 128 if wide else 16, 2 if wide else 1)}


def step_of(net, fused: bool, polyak: bool, device: str):
    """A compiled step closure over its own copies of the network's buffers, and its parameters."""
    params = net.params.detach().clone().to(device)
    target = params.clone() if polyak else None
    adam = FlatAdam(params.numel(), torch.device(device))
    units = fused_step.renorm_units(net.layout, net.renorm_groups).to(device) if fused else None
    gated = GatedStep(params, None, adam, net.renormalized, lambda s: torch.full_like(s, 3e-4), units)
    grad = torch.randn(params.numel(), generator=torch.Generator().manual_seed(0)).to(device) * 1e-2
    loss = torch.ones((), device=device)

    # Inductor on CUDA; on the CPU aot_eager (the check is of the values; Inductor's C++ build is slow there)
    @torch.compile(backend="inductor" if device == "cuda" else "aot_eager")
    def step():
        with torch.no_grad():
            return gated(grad, loss, polyak=(target, TAU) if polyak else None)

    return step, params


def measure(device: str, calls: int, repeat: int) -> list[dict]:
    from common import percentile

    timed = device == "cuda"
    cells = []
    for name, net in networks(device).items():
        polyak = name == "critic"
        numel = net.layout.numel
        # reads: param, grad, both moments (+ target); writes: param, both moments (+ target)
        moved = (4 + 3 + (2 if polyak else 0)) * numel * 4
        forms = {form: step_of(net, form == "fused_step", polyak, device) for form in ("composite", "fused_step")}
        for _ in range(2):
            for step, _params in forms.values():
                step()
        difference = (forms["fused_step"][1] - forms["composite"][1]).abs().max().item()
        src = torch.empty(moved // 8, device=device)
        dst = torch.empty_like(src)
        variants = {**{form: step for form, (step, _params) in forms.items()}, "copy of its bytes": lambda: dst.copy_(src)}
        for form, step in variants.items():
            cell = {"network": name, "parameters": numel, "bytes": moved, "variant": form}
            if form == "fused_step":
                cell["max_abs_difference_from_composite"] = difference
            if timed:
                from bench.roofline import captured_replay_us, kernels_per_call

                us = captured_replay_us(step, calls=calls, repeat=repeat)
                cell.update(us_median=percentile(us, 0.5), us_p90=percentile(us, 0.9), kernels=kernels_per_call(step),
                            tb_per_s=moved / percentile(us, 0.5) / 1e6)
            cells.append(cell)
    return cells


def main(argv: list[str] | None = None) -> int:
    from common import run_environment

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--calls", type=int, default=20, help="steps captured back to back in one graph")
    parser.add_argument("--repeat", type=int, default=30, help="timed replays (after 3 untimed)")
    parser.add_argument("--output", type=Path, required=True)
    args = parser.parse_args(argv)
    fused_step.register()
    cells = measure(args.device, args.calls, args.repeat)
    bad = [c for c in cells if c.get("max_abs_difference_from_composite", 0.0) > 1e-4]
    result = {"experiment": "gated_step", "environment": run_environment(args.device, ("triton",)),
              "config": {"chunk": fused_step.CHUNK, "num_warps": fused_step.NUM_WARPS}, "cells": cells,
              "forms_over_difference_bound": len(bad)}
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(result, indent=1) + "\n")
    for c in cells:
        timing = f": {c['us_median']:.2f} us (p90 {c['us_p90']:.2f}), {c['kernels']} kernels" if "us_median" in c else ""
        difference = f", difference {c['max_abs_difference_from_composite']:.2e}" if "max_abs_difference_from_composite" in c else ""
        print(f"{c['network']} {c['variant']}{timing}{difference}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
