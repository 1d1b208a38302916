"""Would Dynamo's AOT precompile take the warm start's compile off the training process?

A warm start re-traces the fused objectives with every cache hit (Dynamo's bytecode tracing: 4.9 s
of the cold switch's 9.9 s, results/time_to_reward/protocol_u64_mps_split_h100_2026-12-05). This
compiles the engine's fused critic and actor steps four ways, each in a fresh process on one
private Inductor cache: torch.compile on the empty cache (normal_cold), again (normal_warm),
``aot_compile`` + ``save_compiled_function`` (save), ``torch.compiler.load_compiled_function`` (load);
two updates each on one synthetic batch: first-call seconds with torch's compile timers, load
seconds, and bit-identity with normal_cold. Loading needs a throw-away TracingContext (unpickled
guard sources install a guard into it; torch 2.11 and 2.13); a loaded function raises on a guard
miss instead of recompiling.

    python experiments/bench/aot_precompile.py --size real --output results/startup/aot_precompile_cpu.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # experiments/: common
from common import run_environment, write_report  # noqa: E402

STAGES = ("normal_cold", "normal_warm", "save", "load")
SIZES = {  # (config overrides, obs_dim, critic_obs_dim, action_dim)
    "small": ({"batch_size": 16, "actor_hidden_dim": 16, "critic_hidden_dim": 16, "num_atoms": 11,
               "actor_num_blocks": 1, "critic_num_blocks": 1}, 6, 7, 3),
    "real": ({"batch_size": 256}, 98, 101, 29),  # W1's shapes
}


def child(stage: str, size: str, backend: str, mode: str, device: str, folder: Path) -> dict:
    """One stage in this (fresh) process; returns its record and saves outputs and state."""
    start = time.perf_counter()
    import torch

    from flashsac_opt import precompiled
    from flashsac_opt.compile_ahead import compile_time_totals
    from flashsac_opt.config import FlashSACConfig
    from flashsac_opt.learner import FlashSACLearner
    from flashsac_opt.testing.oracle import synthetic_batch

    record = {"stage": stage, "imports_s": round(time.perf_counter() - start, 3)}
    overrides, *dims = SIZES[size]
    cfg = FlashSACConfig(updates_per_step=2, learner_mode=mode, compile_backend=backend, **overrides)
    torch.manual_seed(0)
    learner = FlashSACLearner(cfg, *dims, device=device)
    engine, fns, rows = learner.engine, learner.update_functions, cfg.batch_size
    batch = fns.prepare_batch({k: v.to(device) for k, v in synthetic_batch(rows * 2, *dims, torch.Generator().manual_seed(0)).items()})
    slices = [{k: v[u * rows:(u + 1) * rows] for k, v in batch.items()} for u in range(2)]
    gen = torch.Generator().manual_seed(1)
    noise = [(torch.randn(rows, dims[2], generator=gen).to(device), torch.randn(2 * rows, dims[2], generator=gen).to(device)) for _ in slices]
    options, settings = engine._inductor_options(rows), dict(engine._functorch_config or {})
    compiled = {}

    def calls(fn):  # as the engine's fused wrapper calls a step: no outer autograd, its AOTAutograd settings
        def call(*args):
            with torch.no_grad(), torch._functorch.config.patch(**settings):
                return fn(*args)
        return call

    def timed(name: str, thunk):
        before, t = compile_time_totals(), time.perf_counter()
        out = thunk()
        if device == "cuda":
            torch.cuda.synchronize()
        record[f"{name}_s"] = round(time.perf_counter() - t, 4)
        after = compile_time_totals()
        record[f"{name}_phases_s"] = {k: round(after[k] - before.get(k, 0.0), 3) for k in after if after[k] - before.get(k, 0.0) > 1e-4}
        return out

    if stage.startswith("normal"):
        for name in ("critic", "actor"):
            step = getattr(fns, f"_{name}_step")
            compiled[name] = calls(torch.compile(step, fullgraph=True, dynamic=False, backend=backend, options=options))
    elif stage == "save":
        for name in ("critic", "actor"):
            step = getattr(fns, f"_{name}_step")
            example = (slices[0], noise[0][0], True) if name == "critic" else (slices[0], noise[0][1])
            with precompiled.aot_enabled():  # off by default on torch 2.11
                aot = timed(f"aot_compile_{name}", lambda: calls(torch.compile(step, fullgraph=True, dynamic=False, backend=backend,
                                                                              options=options).aot_compile)((example, {})))
                aot.save_compiled_function(str(folder / f"{name}.aot"))
            record[f"{name}_file_bytes"] = (folder / f"{name}.aot").stat().st_size
            compiled[name] = calls(lambda *a, f=aot: f(fns, *a))  # traced unbound: self is the first argument
    else:
        for name in ("critic", "actor"):
            loaded = timed(f"load_{name}", lambda: precompiled.load(folder / f"{name}.aot"))
            compiled[name] = calls(lambda *a, f=loaded: f(fns, *a))
    outs = {}
    for u, b in enumerate(slices):
        first = "first_" if u == 0 else ""
        outs[f"critic{u}"] = timed(f"{first}critic{u}", lambda: compiled["critic"](b, noise[u][0], True)).clone()
        outs[f"actor{u}"] = timed(f"{first}actor{u}", lambda: compiled["actor"](b, noise[u][1])).clone()
    torch.save({"outs": {k: v.cpu() for k, v in outs.items()}, "state": [t.detach().cpu().clone() for t in learner._state_tensors()]},
               folder / f"{stage}.pt")
    from torch._dynamo.utils import counters

    record["caches"] = {k: dict(counters[k]) for k in ("inductor", "aot_autograd") if counters[k]}
    record["process_s"] = round(time.perf_counter() - start, 3)
    return record


def compare(folder: Path, stage: str) -> dict:
    import torch

    ref, other = torch.load(folder / "normal_cold.pt"), torch.load(folder / f"{stage}.pt")
    outs = all(torch.equal(ref["outs"][k], other["outs"][k]) for k in ref["outs"])
    state = [torch.equal(a, b) for a, b in zip(ref["state"], other["state"])]
    return {"outputs_equal": outs, "state_tensors_equal": f"{sum(state)} of {len(state)}", "bit_identical": outs and all(state)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", choices=sorted(SIZES), default="real")
    parser.add_argument("--backend", default="inductor")
    parser.add_argument("--mode", choices=("compile", "graph"), help="whose Inductor options (default: graph on CUDA, Inductor's CUDA graphs off; compile on the CPU)")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda", help="cuda falls back to cpu where there is none")
    parser.add_argument("--work", type=Path, default=Path("/tmp/flashsac_aot_precompile"))
    parser.add_argument("--output", type=Path, required=True)
    parser.add_argument("--child", choices=STAGES, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        print("RECORD " + json.dumps(child(args.child, args.size, args.backend, args.mode, args.device, args.work)))
        return 0
    import shutil

    import torch

    device = args.device if torch.cuda.is_available() or args.device == "cpu" else "cpu"
    args.mode = args.mode or ("graph" if device == "cuda" else "compile")
    shutil.rmtree(args.work, ignore_errors=True)
    args.work.mkdir(parents=True)
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(args.work / "inductor"), "TRITON_CACHE_DIR": str(args.work / "inductor" / "triton")}
    stages, failed = [], None
    for stage in STAGES:
        cmd = [sys.executable, __file__, "--child", stage, "--size", args.size, "--backend", args.backend, "--mode", args.mode,
               "--device", device, "--work", str(args.work), "--output", str(args.output)]
        start = time.perf_counter()
        done = subprocess.run(cmd, env=env, capture_output=True, text=True)
        lines = [line[7:] for line in done.stdout.splitlines() if line.startswith("RECORD ")]
        if done.returncode or not lines:
            failed = {"stage": stage, "returncode": done.returncode, "stderr_tail": done.stderr[-3000:]}
            print(done.stderr[-3000:], file=sys.stderr)
            break
        record = {**json.loads(lines[-1]), "wall_s": round(time.perf_counter() - start, 3)}
        if stage != "normal_cold":
            record["against_normal_cold"] = compare(args.work, stage)
        stages.append(record)
        print(f"{stage}: process {record['wall_s']:.1f} s", {k: v for k, v in record.items() if k.endswith("_s") and not k.endswith("phases_s")})
    by = {r["stage"]: r for r in stages}
    summary = {}
    if {"normal_warm", "load"} <= by.keys():
        first = lambda r: r["first_critic0_s"] + r["first_actor0_s"]  # noqa: E731
        summary = {"warm_first_calls_s": round(first(by["normal_warm"]), 3),
                   "load_and_first_calls_s": round(by["load"]["load_critic_s"] + by["load"]["load_actor_s"] + first(by["load"]), 3),
                   "load_bit_identical": by["load"]["against_normal_cold"]["bit_identical"]}
    report = {"experiment": "aot_precompile", "what": __doc__.split("\n\n")[0],
              "configuration": {"size": args.size, "backend": args.backend, "mode": args.mode, "device": device, "updates": 2},
              "environment": run_environment(device), "stages": stages, "summary": summary, "failed": failed}
    write_report(report, args.output)
    print(json.dumps(summary))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
