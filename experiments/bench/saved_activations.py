"""What the split-form backward keeps from the forward: the saved activations' bytes by dtype.

Without a GPU: the learner's split form (W3/W4, above ``FUSED_UPDATE_MAX_BATCH`` rows) goes
through AOTAutograd, whose min-cut partitioner (Inductor's) decides what the forward saves. A
recording backend (flashsac_opt/testing/saved_tensors.py) runs that partitioner on the learner's
compiled losses under bf16 autocast (on the CPU; this model's ops fall in the same autocast
classes on CUDA) and lists every saved tensor of each backward graph (shape, dtype, bytes) and
the GEMMs in forward and backward (a backward with more recomputes some). Each workload runs with
torch's default partition, the learner's ``activation_memory_budget`` (knapsack recomputation) and
``relu_in_autocast_dtype``. Bytes are per update and network loss: what the backward reads back,
which bounds what recomputation could save. Nothing is timed.

    python experiments/bench/saved_activations.py --workloads W3 W4 --output results/roofline/saved_activations_W3_W4_cpu.json
"""

from __future__ import annotations

import argparse
import sys
from collections import defaultdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # experiments/: common
from common import run_environment, write_report  # noqa: E402
from bench.workloads import WORKLOADS  # noqa: E402

# The settings compared: engine options over the default (torch's min-cut partition, as Inductor
# runs it). activation_memory_budget below ~0.5 starts recomputing GEMMs (W3, 0.2: 16 backward
# GEMMs in the critic loss instead of 12), which costs FLOPs, not bytes.
SETTINGS = {
    "default": {},
    "budget_0.9": {"activation_memory_budget": 0.9},
    "budget_0.7": {"activation_memory_budget": 0.7},
    "budget_0.5": {"activation_memory_budget": 0.5},
    "relu_in_autocast_dtype": {"relu_in_autocast_dtype": True},
}


def measure(workload: str, setting: str, seed: int = 0) -> dict:
    """One learner iteration (split form, bf16 autocast, CPU) with the recording backend."""
    from flashsac_opt.config import FlashSACConfig
    from flashsac_opt.learner import FlashSACLearner
    from flashsac_opt.testing.oracle import synthetic_batch
    from flashsac_opt.testing.saved_tensors import recording_backend, saved_bytes

    w = WORKLOADS[workload]
    dims = {k: w[k] for k in ("obs_dim", "critic_obs_dim", "action_dim")}
    graphs: list[dict] = []
    torch._dynamo.reset()
    torch.manual_seed(seed)
    cfg = FlashSACConfig(
        batch_size=w["batch_size"], updates_per_step=w["updates_per_step"], policy_frequency=w["policy_frequency"],
        learner_mode="compile", fused_update=False, **SETTINGS[setting],
    )
    learner = FlashSACLearner(cfg, device="cpu", **dims)
    learner.engine._backend = recording_backend(graphs)  # the engine's compile boundaries, this backend
    learner.amp_dtype = torch.bfloat16  # the CUDA learner's autocast, here on CPU
    rows = w["batch_size"] * w["updates_per_step"]
    batch = synthetic_batch(rows, generator=torch.Generator().manual_seed(seed), **dims)
    learner.update(batch)
    if not graphs:
        raise RuntimeError(f"{workload}: no backward graph was compiled (is the split form in use?)")
    losses = []
    for g in graphs:
        by_dtype: dict[str, int] = defaultdict(int)
        for t in g["saved"]:
            by_dtype[t["dtype"]] += t["bytes"]
        losses.append({
            "saved_tensors": len(g["saved"]), "saved_bytes": saved_bytes(g), "bytes_by_dtype": dict(by_dtype),
            "forward_gemms": g["forward_gemms"], "backward_gemms": g["backward_gemms"], "tensors": g["saved"],
        })
    total = sum(g["saved_bytes"] for g in losses)
    bf16 = sum(g["bytes_by_dtype"].get("bfloat16", 0) for g in losses)
    return {
        "workload": workload, "setting": setting, "options": SETTINGS[setting],
        "rows_per_update": w["batch_size"], "backward_graphs": len(losses), "saved_bytes": total,
        "saved_mb": total / 1e6, "bf16_share": bf16 / total if total else 0.0,
        "backward_gemms": sum(g["backward_gemms"] for g in losses), "losses": losses,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--workloads", nargs="+", default=["W3", "W4"], choices=sorted(WORKLOADS))
    p.add_argument("--settings", nargs="+", default=list(SETTINGS), choices=list(SETTINGS))
    p.add_argument("--output", required=True)
    args = p.parse_args()
    rows = []
    for wl in args.workloads:
        for s in args.settings:
            r = measure(wl, s)
            rows.append(r)
            print(f"{wl} {s:32s} graphs {r['backward_graphs']}  saved {r['saved_mb']:8.2f} MB  bf16 {r['bf16_share']:.3f}  backward GEMMs {r['backward_gemms']}", flush=True)
    write_report({"experiment": "saved_activations", "environment": run_environment("cpu"), "rows": rows}, Path(args.output))


if __name__ == "__main__":
    main()
