"""Issue 45, item 1 as a measured study: a SimbaV2 block's training forward (up projection,
BatchNorm, ReLU, down projection, BatchNorm, ReLU, skip connection) for two critic members,

- composite: two bmm and Inductor's kernels for the rest (torch.compile of the block as the critic
  writes it: the up projection's ReLU rounded to the GEMM dtype);
- gemm_stats: flashsac_opt/gemm_stats.py, four launches: the up GEMM with the statistics in its
  epilogue, their finalize, the down GEMM with the up layer's BatchNorm + ReLU in its prologue and
  its own statistics in its epilogue, then the last BatchNorm, ReLU and the skip connection (with
  both layers' batch statistics, which the running statistics need);
- member_linear_bn_relu: kernels.py's kernel (every row in one program), two launches;
- bmm alone: the two GEMMs, the floor of any variant that keeps cuBLAS;
- "fwd+bwd": the composite and gemm_stats.block (its backward in PyTorch) compiled, forward and
  backward to every input (torch.autograd.grad), as a learner's critic runs them.

Each cell: one CUDA graph of `--calls` block forwards back to back, replayed `--repeat` times (us
per block, median and p90), kernels per block (torch.profiler on one eager call), and the largest
difference of the block's output from a float32 composite.

    python experiments/bench/gemm_stats_block.py --output /tmp/gemm_stats_block.json

With --sweep it times each of the two GEMMs alone (the down one with its prologue) in every launch
configuration of a small grid, for each TILE_M, and names the best per layer: the table behind
gemm_stats.CONFIGS.

On a CPU (Triton's interpreter: TRITON_INTERPRET=1) it checks the variants' outputs on a small shape.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # experiments/: common, bench

import torch

from flashsac_opt import gemm_stats, kernels
from flashsac_opt.networks import BN_EPS, EXPANSION

MEMBERS = 2
HIDDEN = 256  # the critic's width; 32 on the CPU, where the interpreter runs every program in Python


def hidden(device: str) -> int:
    return HIDDEN if device == "cuda" else 32


def bn_relu(h, gamma, beta):
    h = h.float()
    mean, var = h.mean(1, keepdim=True), h.var(1, correction=0, keepdim=True)
    return torch.relu((h - mean) * torch.rsqrt(var + BN_EPS) * gamma.unsqueeze(1) + beta.unsqueeze(1))


def composite(x, w_up, w_down, g_up, b_up, g_down, b_down):
    y = bn_relu(torch.bmm(x, w_up.transpose(1, 2)), g_up, b_up).to(x.dtype)
    return (bn_relu(torch.bmm(y, w_down.transpose(1, 2)), g_down, b_down) + x).to(x.dtype)


def with_gemm_stats(x, w_up, w_down, g_up, b_up, g_down, b_down):
    h_up, s_up, m2_up = gemm_stats.gemm_stats(x, w_up)
    _, _, scale, shift = gemm_stats.finalize(s_up, m2_up, g_up, b_up, x.shape[1], BN_EPS)
    h_down, s_down, m2_down = gemm_stats.gemm_stats(h_up, w_down, (scale, shift))
    return gemm_stats.bn_relu_apply(h_down, s_down, m2_down, g_down, b_down, residual=x, eps=BN_EPS)[0]


def with_member_linear_bn_relu(x, w_up, w_down, g_up, b_up, g_down, b_down):
    y, _, _ = kernels.member_linear_bn_relu(x, w_up, g_up, b_up, BN_EPS, y_in_input_dtype=True)
    y, _, _ = kernels.member_linear_bn_relu(y, w_down, g_down, b_down, BN_EPS, y_in_input_dtype=True, residual=x)
    return y


def operands(rows, dtype, device):
    g = torch.Generator(device=device).manual_seed(rows)
    width = hidden(device)
    wide = width * EXPANSION
    x = torch.randn(MEMBERS, rows, width, generator=g, device=device).to(dtype)
    w_up = (torch.randn(MEMBERS, wide, width, generator=g, device=device) / width**0.5).to(dtype)
    w_down = (torch.randn(MEMBERS, width, wide, generator=g, device=device) / wide**0.5).to(dtype)
    g_up, b_up = torch.rand(MEMBERS, wide, generator=g, device=device) + 0.5, torch.randn(MEMBERS, wide, generator=g, device=device) * 0.1
    g_down, b_down = torch.rand(MEMBERS, width, generator=g, device=device) + 0.5, torch.randn(MEMBERS, width, generator=g, device=device) * 0.1
    return x, w_up, w_down, g_up, b_up, g_down, b_down


def forward_backward(fn, leaves, grad):
    y = fn(*leaves)
    return torch.autograd.grad(y, leaves, grad.to(y.dtype))


def measure(device: str, calls: int, repeat: int, rows_list: list[int]) -> list[dict]:
    from common import percentile

    timed = device == "cuda"
    dtype = torch.bfloat16 if timed else torch.float16  # the interpreter misreads bfloat16
    compiled = torch.compile(composite) if timed else composite
    block_compiled = torch.compile(lambda *a: gemm_stats.block(*a, eps=BN_EPS)[0]) if timed else None
    cells = []
    for rows in rows_list:
        args = operands(rows, dtype, device)
        want = composite(args[0].float(), *(a.float() for a in args[1:]))
        variants = {
            "composite (bmm + Inductor)": lambda: compiled(*args),
            "gemm_stats": lambda: with_gemm_stats(*args),
            "member_linear_bn_relu": lambda: with_member_linear_bn_relu(*args),
            "bmm alone": lambda: torch.bmm(torch.bmm(args[0], args[1].transpose(1, 2)), args[2].transpose(1, 2)),
        }
        if timed:
            leaves = [a.detach().requires_grad_() for a in args]
            grad = torch.randn_like(want)
            for name, fn in (("composite fwd+bwd", compiled), ("gemm_stats fwd+bwd", block_compiled)):
                variants[name] = lambda fn=fn: forward_backward(fn, leaves, grad)
        for name, step in variants.items():
            out = step()
            cell = {"rows": rows, "members": MEMBERS, "hidden": hidden(device), "wide": hidden(device) * EXPANSION, "dtype": str(dtype),
                    "variant": name}
            if name in ("composite (bmm + Inductor)", "gemm_stats", "member_linear_bn_relu"):
                cell["max_abs_error"] = (out.float() - want).abs().max().item()
            if timed:
                from bench.roofline import captured_replay_us, kernels_per_call

                us = captured_replay_us(step, calls=calls, repeat=repeat)
                cell.update(us_median=percentile(us, 0.5), us_p90=percentile(us, 0.9), kernels=kernels_per_call(step))
            cells.append(cell)
    return cells


SWEEP = list(itertools.product((32, 64, 128), (32, 64, 128), (4, 8), (2, 3, 4)))  # BLOCK_N, BLOCK_K, warps, stages


def sweep(device: str, calls: int, repeat: int, rows: int, tile_ms: list[int]) -> tuple[list[dict], dict]:
    """Each GEMM of the block alone in every configuration, per TILE_M; the best per (TILE_M, layer)."""
    from common import percentile

    timed = device == "cuda"
    dtype = torch.bfloat16 if timed else torch.float16
    x, w_up, w_down, g_up, b_up, _, _ = operands(rows, dtype, device)
    configs = SWEEP if timed else SWEEP[:2]
    cells, best = [], {}
    default_tile_m = gemm_stats.TILE_M
    try:
        for tile_m in tile_ms:
            gemm_stats.TILE_M = tile_m
            h_up, s_up, m2_up = gemm_stats.gemm_stats(x, w_up)
            affine_in = gemm_stats.finalize(s_up, m2_up, g_up, b_up, rows, BN_EPS)[2:]
            want_down = torch.bmm(bn_relu(h_up, g_up, b_up).to(dtype), w_down.transpose(1, 2)).float()
            layers = {"up": (lambda c: gemm_stats.gemm_stats(x, w_up, config=c)[0], torch.bmm(x, w_up.transpose(1, 2)).float()),
                      "down": (lambda c: gemm_stats.gemm_stats(h_up, w_down, affine_in, config=c)[0], want_down)}
            for layer, (launch, want) in layers.items():
                for config in configs:
                    try:
                        error = (launch(config).float() - want).abs().max().item()
                    except Exception as exc:  # a configuration past the GPU's shared memory
                        cells.append({"tile_m": tile_m, "layer": layer, "config": list(config), "error": type(exc).__name__})
                        continue
                    cell = {"tile_m": tile_m, "layer": layer, "config": list(config), "max_abs_error": error}
                    if timed:
                        from bench.roofline import captured_replay_us

                        us = captured_replay_us(lambda config=config: launch(config), calls=calls, repeat=repeat)
                        cell.update(us_median=percentile(us, 0.5), us_p90=percentile(us, 0.9))
                    cells.append(cell)
                timed_cells = [c for c in cells if c.get("tile_m") == tile_m and c.get("layer") == layer and "us_median" in c]
                if timed_cells:
                    fastest = min(timed_cells, key=lambda c: c["us_median"])
                    best[f"tile_m {tile_m} {layer}"] = {"config": fastest["config"], "us_median": fastest["us_median"]}
    finally:
        gemm_stats.TILE_M = default_tile_m
    return cells, best


def main(argv: list[str] | None = None) -> int:
    from common import run_environment

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--rows", type=int, nargs="+", default=None, help="default: 256 512 on CUDA, 40 on the CPU")
    parser.add_argument("--calls", type=int, default=20, help="block forwards captured back to back in one graph")
    parser.add_argument("--repeat", type=int, default=30, help="timed replays (after 3 untimed)")
    parser.add_argument("--sweep", action="store_true", help="the launch configurations of each GEMM instead of the variants")
    parser.add_argument("--tile-m", type=int, nargs="+", default=None, help="the sweep's TILE_M values (default: gemm_stats.TILE_M)")
    parser.add_argument("--output", type=Path, required=True)
    args = parser.parse_args(argv)
    kernels.register()
    gemm_stats.register()
    if args.sweep:
        cells, best = sweep(args.device, args.calls, args.repeat, (args.rows or [256 if args.device == "cuda" else 40])[0],
                            args.tile_m or [gemm_stats.TILE_M])
        result = {"experiment": "gemm_stats_sweep", "environment": run_environment(args.device, ("triton",)),
                  "grid": "BLOCK_N x BLOCK_K x num_warps x num_stages", "cells": cells, "best": best}
        args.output.parent.mkdir(parents=True, exist_ok=True)
        args.output.write_text(json.dumps(result, indent=1) + "\n")
        print(json.dumps(best, indent=1))
        return 1 if any(c.get("max_abs_error", 0.0) > 0.1 for c in cells) else 0
    rows = args.rows or ([256, 512] if args.device == "cuda" else [40])
    cells = measure(args.device, args.calls, args.repeat, rows)
    bad = [c for c in cells if c.get("max_abs_error", 0.0) > 0.1]
    result = {"experiment": "gemm_stats_block", "environment": run_environment(args.device, ("triton",)),
              "config": {"tile_m": gemm_stats.TILE_M, "(BLOCK_N, BLOCK_K, num_warps, num_stages)": list(gemm_stats.DEFAULT_CONFIG)},
              "cells": cells, "outputs_over_error_bound": len(bad)}
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(result, indent=1) + "\n")
    for c in cells:
        print(f"rows {c['rows']} {c['variant']}: {c.get('us_median', 0):.2f} us (p90 {c.get('us_p90', 0):.2f}), "
              f"{c.get('kernels', '-')} kernels, error {c.get('max_abs_error', 0):.2e}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
