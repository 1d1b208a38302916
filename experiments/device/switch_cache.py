"""Why the background switch recompiles Triton kernels on a cold machine (issue 44).

In the cold protocol seed the compile-ahead child fills empty caches, then the training process
compiles from them at the switch: every FX-graph and AOTAutograd lookup hits, yet Triton compiles
kernels again in the training process for 26-31 s (switch_stacks of
results/time_to_reward/protocol_u64_mps_cold_s1_switch_stacks_2026-12-04/). This reproduces that
switch without UniLab: per variant, in a fresh process on empty caches, a learner is built with
its compile deferred, a CompileAhead child compiles it (as in training), then this process
compiles it on one Inductor worker (UniLab's budget at the switch). It records the switch's
seconds, the Triton cache entries the switch added (each one a Triton cache miss), how their
metadata differs from the child's entry for the same kernel, and the Triton toolchain variables.

Every variant first compiles a small CUDA function, as UniLab's training process compiles its
env reset before the learner exists (Triton reads its assembler's version once per process, at
the first code generation: flashsac_opt/toolchain.py). Variants: ``launch_aligned`` (TRITON_PTXAS_PATH
exported at the process's start, as the patched train script does), ``engine_aligned_late`` (only
the engine's alignment, after that first compile), ``unaligned`` (no alignment in this process;
the child aligns itself, as its workers always did).

    python3 experiments/device/switch_cache.py --output switch_cache.json [--variants NAME...]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "experiments"))
TOOLCHAIN_VARIABLES = ("TRITON_PTXAS_PATH", "TRITON_LIBDEVICE_PATH", "TRITON_CACHE_DIR", "TORCHINDUCTOR_CACHE_DIR",
                       "TORCHINDUCTOR_COMPILE_THREADS", "TRITON_CUOBJDUMP_PATH", "TRITON_NVDISASM_PATH")
VARIANTS = ("launch_aligned", "engine_aligned_late", "unaligned")


def triton_entries(folder: Path) -> dict[str, dict]:
    """Triton cache entries under ``folder``: hash directory -> kernel name and its metadata."""
    out = {}
    if not folder.is_dir():
        return out
    for meta in folder.glob("*/*.json"):
        if meta.name.startswith("__grp__"):
            continue
        try:
            data = json.loads(meta.read_text())
        except (OSError, ValueError):
            continue
        if isinstance(data, dict) and "name" in data:
            out[meta.parent.name] = {"name": data["name"], "metadata": data}
    return out


def metadata_difference(a: dict, b: dict) -> dict:
    return {k: [a.get(k), b.get(k)] for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k) and k not in ("hash",)}


def _version_of(ptxas: Path) -> str | None:
    if not ptxas.is_file():
        return None
    lines = subprocess.run([str(ptxas), "--version"], capture_output=True, text=True).stdout.strip().splitlines()
    return lines[-1] if lines else None


def key_ptxas_version() -> str | None:
    """The assembler version in this process's Triton kernel keys (cached at its first use)."""
    try:
        from triton.backends.nvidia.compiler import get_ptxas_version

        text = get_ptxas_version(90)
        return text.strip().splitlines()[-1] if text else None
    except Exception as exc:  # noqa: BLE001
        return repr(exc)


def first_compile() -> None:
    """A small Inductor compile on the GPU: what UniLab's env reset is in its training process."""
    import torch

    torch.compile(lambda x: (x * 2).sin() + 1)(torch.randn(1024, device="cuda"))
    torch.cuda.synchronize()


def toolchain() -> dict:
    """The Triton toolchain this process would use now, and the torch source that sets it."""
    import inspect

    info: dict = {"environ": {k: os.environ.get(k) for k in TOOLCHAIN_VARIABLES}}
    try:
        import torch

        ptxas = Path(torch.__file__).parent / "bin" / "ptxas"
        info["torch_bin_ptxas"] = {"path": str(ptxas), "exists": ptxas.is_file()}
        if ptxas.is_file():
            info["torch_bin_ptxas"]["version"] = _version_of(ptxas)
    except Exception as exc:  # noqa: BLE001
        info["torch_bin_ptxas"] = repr(exc)
    try:  # each assembler's version by running it: Triton's own cached query would fix this process's
        import triton

        bundled = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"
        info["triton_bundled_ptxas"] = {"path": str(bundled), "version": _version_of(bundled)}
    except Exception as exc:  # noqa: BLE001
        info["triton_bundled_ptxas"] = repr(exc)
    info["triton_cache_invalidating"] = None
    for module_name in ("triton.knobs", "triton.runtime.cache", "triton.compiler.compiler", "triton._utils"):
        try:
            module = __import__(module_name, fromlist=["get_cache_invalidating_env_vars"])
            info["triton_cache_invalidating"] = {"from": module_name, "values": module.get_cache_invalidating_env_vars()}
            break
        except Exception:  # noqa: BLE001 - the function moved between Triton versions
            continue
    try:
        from torch._inductor.async_compile import AsyncCompile

        info["async_compile_triton_sets"] = [line.strip() for line in inspect.getsource(AsyncCompile.triton).splitlines() if "_set_triton" in line]
    except Exception as exc:  # noqa: BLE001
        info["async_compile_triton_sets"] = repr(exc)
    return info


def variant(name: str, report: Path) -> int:
    """One variant in this (fresh) process: empty caches are in the environment already."""
    import torch
    from torch._inductor import config as inductor_config

    from flashsac_opt import compile_ahead
    from flashsac_opt import toolchain as flashsac_toolchain
    from flashsac_opt.config import FlashSACConfig
    from flashsac_opt.learner import FlashSACLearner
    from flashsac_opt.testing.oracle import synthetic_batch
    from flashsac_opt.unilab.adapter import compile_cache_counters

    if name == "launch_aligned":
        flashsac_toolchain.align_triton_toolchain()  # what the patched train script's launch hook does
    elif name == "unaligned":
        flashsac_toolchain.align_triton_toolchain = lambda: None  # the engine calls it through the module
    first_compile()
    dims = {"obs_dim": 98, "critic_obs_dim": 101, "action_dim": 29}  # G1's
    cfg = FlashSACConfig(learner_mode="graph", batch_size=256, updates_per_step=64, compile_cache_file=None)
    triton_dir = Path(os.environ["TRITON_CACHE_DIR"])
    out: dict = {"variant": name, "toolchain_at_start": toolchain()}
    t0 = time.perf_counter()
    learner = FlashSACLearner(cfg, dims["obs_dim"], dims["critic_obs_dim"], dims["action_dim"], device="cuda")
    learner.engine.defer_compile()
    ahead = compile_ahead.CompileAhead(cfg, dims, learner.device)
    ok = ahead.wait()
    out["child"] = {"ok": ok, "seconds": time.perf_counter() - t0, "report": ahead.report}
    child_entries = triton_entries(triton_dir)
    out["child_triton_entries"] = len(child_entries)
    out["toolchain_before_switch"] = toolchain()
    inductor_config.compile_threads = 1  # UniLab's budget at the switch (the adapter's _compile_workers)
    batch = synthetic_batch(cfg.batch_size * cfg.updates_per_step, dims["obs_dim"], dims["critic_obs_dim"], dims["action_dim"],
                            torch.Generator().manual_seed(1), device="cuda")
    counters = compile_cache_counters()
    start = time.perf_counter()
    learner.engine.compile_now()
    learner.update(batch)
    torch.cuda.synchronize()
    out["switch_s"] = time.perf_counter() - start
    out["switch_caches"] = compile_cache_counters(since=counters)
    after = triton_entries(triton_dir)
    added = {k: v for k, v in after.items() if k not in child_entries}
    by_name: dict[str, list[dict]] = {}
    for entry in child_entries.values():
        by_name.setdefault(entry["name"], []).append(entry["metadata"])
    out["switch_triton_entries_added"] = len(added)
    out["added_names"] = sorted(v["name"] for v in added.values())[:200]
    diffs = []
    for entry in list(added.values())[:20]:
        for theirs in by_name.get(entry["name"], [])[:1]:
            diffs.append({"name": entry["name"], "switch_vs_child": metadata_difference(entry["metadata"], theirs)})
    out["metadata_differences"] = diffs
    out["added_without_child_namesake"] = sum(1 for v in added.values() if v["name"] not in by_name)
    out["toolchain_after_switch"] = toolchain()
    out["key_ptxas_version"] = key_ptxas_version()  # this process's, fixed at its first compile
    report.write_text(json.dumps(out, indent=1, default=str))
    print(json.dumps({k: out[k] for k in ("variant", "switch_s", "switch_caches", "child_triton_entries", "switch_triton_entries_added")}), flush=True)
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output", required=True)
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS)
    parser.add_argument("--dry-run", action="store_true", help="print the variant processes, run nothing")
    parser.add_argument("--variant", help=argparse.SUPPRESS)  # internal: run one variant in this process
    parser.add_argument("--report", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.variant:
        return variant(args.variant, Path(args.report))
    import torch
    from common import run_environment

    # The environment first and the JSON rewritten after every variant: a failure later (the
    # 2026-12-05 call lost its JSON to one at the very end) keeps what the earlier variants measured.
    record = {"experiment": "switch_cache", "environment": run_environment("cuda" if torch.cuda.is_available() else "cpu"),
              "command": " ".join(sys.argv), "variants": []}
    for name in args.variants:
        with tempfile.TemporaryDirectory(prefix=f"switch_cache_{name}_") as folder:
            cache = Path(folder) / "cache"
            env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(cache), "TRITON_CACHE_DIR": str(cache / "triton"),
                   "FLASHSAC_OPT_CACHE_DIR": str(cache / "flashsac_opt"), "TORCHINDUCTOR_COMPILE_THREADS": "1"}
            for key in ("TRITON_PTXAS_PATH", "TRITON_LIBDEVICE_PATH"):
                env.pop(key, None)  # as a fresh shell has them
            report = Path(folder) / "report.json"
            command = [sys.executable, __file__, "--output", args.output, "--variant", name, "--report", str(report)]
            if args.dry_run:
                print(f"{name}: empty caches under {cache}; " + " ".join(command))
                continue
            rc = subprocess.run(command, env=env).returncode
            record["variants"].append(json.loads(report.read_text()) if report.is_file() else {"variant": name, "exit_status": rc})
        Path(args.output).write_text(json.dumps(record, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
