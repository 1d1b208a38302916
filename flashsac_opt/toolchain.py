"""One Triton assembler (``ptxas``) for a training and every process it starts.

Triton keys its kernel cache by, among others, the assembler's version string
(``CUDABackend.hash``), which it reads once per process (``get_ptxas_version`` is cached).
Inductor's compile workers export TRITON_PTXAS_PATH as torch's own ``ptxas`` (``torch/bin``,
present in the CUDA wheels) when they start. A process that compiles on one worker (UniLab's
budget) sets it only before its first kernel build, after its first code generation has read
the version of Triton's bundled ``ptxas`` (``triton_hash_with_backend``, torch 2.11). The same
kernel then has two keys on one machine: a compile-ahead child's workers build it under torch's
assembler, the training process looks it up under Triton's, misses and builds it again.
Inductor's bundle of statically launchable cubins, which would skip the lookup, leaves out
every PDL kernel (``static launch does not support launch attributes``), i.e. most of graph
mode's. That fits the cold start of 2026-12-04: every FX-graph and AOTAutograd lookup hit at the
background switch, yet Triton built kernels for 26-31 s
(results/time_to_reward/protocol_u64_mps_cold_s1_switch_stacks_2026-12-04/, switch_stacks);
experiments/device/switch_cache.py measures the switch with and without the alignment.

``align_triton_toolchain`` exports the workers' choice in this process before anything compiles,
so that processes started later (the collector, the compile-ahead child and their workers)
inherit it. It must run before the process's first Triton code generation: the patched UniLab
train script calls it at launch (through collector_start.start_preload), the engine again for
processes without that launch hook. It imports nothing heavy (not even torch).
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

PTXAS_VARIABLE = "TRITON_PTXAS_PATH"


def torch_ptxas() -> Path | None:
    """torch's bundled ``ptxas`` (an executable file), None when this torch has none."""
    spec = importlib.util.find_spec("torch")
    if spec is None or spec.origin is None:
        return None
    ptxas = Path(spec.origin).parent / "bin" / "ptxas"
    return ptxas if ptxas.is_file() and os.access(ptxas, os.X_OK) else None


def align_triton_toolchain() -> str | None:
    """Export TRITON_PTXAS_PATH as Inductor's compile workers do (torch's ``ptxas``) unless it is
    set already (an explicit choice is kept). Returns the assembler in force, None for Triton's own."""
    if os.environ.get(PTXAS_VARIABLE):
        return os.environ[PTXAS_VARIABLE]
    ptxas = torch_ptxas()
    if ptxas is None:
        return None
    os.environ[PTXAS_VARIABLE] = str(ptxas)
    return str(ptxas)
