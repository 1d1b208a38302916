"""The offline sweep behind kernels.CONFIGS: the fused up projection + BatchNorm + ReLU
(flashsac_opt/kernels.py) at the critic's shapes, every launch configuration of a small grid,
against the composite layer it replaces (bmm + Inductor's statistics and apply kernels).

Each cell: one CUDA graph of `--calls` forward calls, replayed `--repeat` times (us per call, median
and p90), and the largest difference from the composite's output. Forward only (the configuration
changes only the forward kernel).

    python experiments/bench/fused_kernel_configs.py --output /tmp/fused_kernel_configs.json

On a CPU (Triton's interpreter: TRITON_INTERPRET=1) it checks every configuration on a small shape.
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # experiments/: common, bench

import torch

from flashsac_opt import kernels
from flashsac_opt.networks import BN_EPS, EXPANSION

MEMBERS = 2
# rows per update at B256 and the 512 rows of a critic pass over two batches; the critic's up
# projection (hidden 256 -> 1024) and its down projection with the skip connection (1024 -> 256)
SHAPES = [(rows, inputs, features) for rows in (256, 512) for inputs, features in ((256, 256 * EXPANSION), (256 * EXPANSION, 256))]
GRID = list(itertools.product((16, 32, 64), (32, 64), (4, 8)))  # BLOCK_N, BLOCK_K, num_warps


def composite(x, w, gamma, beta, residual):
    """The layer as the critic computes it without the kernel: the up projection's output rounded
    to the GEMM dtype, the down projection's float32 with the skip connection."""
    h = torch.bmm(x, w.transpose(1, 2)).float()
    mean, var = h.mean(1, keepdim=True), h.var(1, correction=0, keepdim=True)
    y = torch.relu((h - mean) * torch.rsqrt(var + BN_EPS) * gamma.unsqueeze(1) + beta.unsqueeze(1))
    return y.to(x.dtype) if residual is None else y + residual


def operands(rows, inputs, features, dtype, device):
    g = torch.Generator(device=device).manual_seed(rows + features)
    x = torch.randn(MEMBERS, rows, inputs, generator=g, device=device).to(dtype)
    w = (torch.randn(MEMBERS, features, inputs, generator=g, device=device) / inputs**0.5).to(dtype)
    gamma = torch.rand(MEMBERS, features, generator=g, device=device) + 0.5
    beta = torch.randn(MEMBERS, features, generator=g, device=device) * 0.1
    residual = torch.randn(MEMBERS, rows, features, generator=g, device=device) if inputs > features else None
    return x, w, gamma, beta, residual


def cell(step, calls, repeat, timed):
    if not timed:
        step()
        return {}
    from bench.roofline import captured_replay_us

    us = captured_replay_us(step, calls=calls, repeat=repeat)
    return {"us_median": statistics.median(us), "us_p90": statistics.quantiles(us, n=10)[-1]}


def sweep(device: str, calls: int, repeat: int) -> list[dict]:
    timed = device == "cuda"
    dtype = torch.bfloat16 if timed else torch.float16  # the interpreter misreads bfloat16
    shapes = SHAPES if timed else [(40, 16, 16 * EXPANSION), (40, 16 * EXPANSION, 16)]
    compiled = torch.compile(composite) if timed else composite
    cells = []
    for rows, inputs, features in shapes:
        x, w, gamma, beta, residual = operands(rows, inputs, features, dtype, device)
        want = composite(x, w, gamma, beta, residual).float()
        shape = {"members": MEMBERS, "rows": rows, "inputs": inputs, "features": features, "dtype": str(dtype),
                 "skip_connection": residual is not None}
        cells.append({**shape, "variant": "composite (bmm + Inductor)",
                      **cell(lambda: compiled(x, w, gamma, beta, residual), calls, repeat, timed)})
        cells.append({**shape, "variant": "bmm alone", **cell(lambda: torch.bmm(x, w.transpose(1, 2)), calls, repeat, timed)})
        for block_n, block_k, warps in GRID:
            config = (block_n, block_k, warps)

            def step(config=config):
                return kernels._launch(x, w, gamma, beta, residual, BN_EPS, residual is None, config)[0]

            error = (step().float() - want).abs().max().item()
            cells.append({**shape, "variant": "fused", "block_n": block_n, "block_k": block_k, "num_warps": warps,
                          "max_abs_error": error, **cell(step, calls, repeat, timed)})
    return cells


def best(cells: list[dict]) -> dict:
    """Per rows class, the configuration with the least total median time over that class's shapes."""
    out = {}
    for rows in sorted({c["rows"] for c in cells if "us_median" in c}):
        totals: dict[tuple, float] = {}
        for c in (c for c in cells if c["rows"] == rows and c["variant"] == "fused"):
            key = (c["block_n"], c["block_k"], c["num_warps"])
            totals[key] = totals.get(key, 0.0) + c["us_median"]
        key = min(totals, key=totals.get)
        composite = sum(c["us_median"] for c in cells if c["rows"] == rows and c["variant"].startswith("composite"))
        out[str(rows)] = {"block_n": key[0], "block_k": key[1], "num_warps": key[2], "us_total": totals[key], "composite_us_total": composite}
    return out


def main(argv: list[str] | None = None) -> int:
    from common import run_environment

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--calls", type=int, default=20, help="forward calls captured back to back in one graph")
    parser.add_argument("--repeat", type=int, default=30, help="timed replays (after 3 untimed)")
    parser.add_argument("--output", type=Path, required=True)
    args = parser.parse_args(argv)
    kernels.register()
    cells = sweep(args.device, args.calls, args.repeat)
    bad = [c for c in cells if c.get("max_abs_error", 0.0) > 0.1]
    result = {"experiment": "fused_kernel_configs", "environment": run_environment(args.device, ("triton",)),
              "grid": "BLOCK_N x BLOCK_K x num_warps", "table_in_use": {str(k): v for k, v in kernels.CONFIGS.items()},
              "cells": cells, "best": best(cells), "configs_over_error_bound": len(bad)}
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(result, indent=1) + "\n")
    for c in cells:
        label = f"{c['variant']} {c.get('block_n', '')}/{c.get('block_k', '')}/{c.get('num_warps', '')}"
        print(f"rows {c['rows']} {c['inputs']}->{c['features']} {label}: {c.get('us_median', 0):.2f} us, error {c.get('max_abs_error', 0):.2e}")
    print("best:", json.dumps(result["best"]))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
