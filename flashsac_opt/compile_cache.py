"""torch.compile's portable cache artifacts in one file, and the default keyed location.

``torch.compiler.save_cache_artifacts`` / ``load_cache_artifacts`` carry Inductor's generated
code, Triton kernels and autotuning results between processes and machines. A loaded file
only pre-populates torch's own caches, whose entries are keyed by torch's hashes of the graph,
its inputs and the Inductor configuration: an entry that does not match is never used, so a
file from another configuration costs a cold compile, never wrong code. ``cache_key`` picks the
file that will match: one digest over everything that decides the compiled code.

Default location (``compile_cache_file="auto"``): ``$FLASHSAC_OPT_CACHE_DIR/<key>.bin``, or
``~/.cache/flashsac_opt/<key>.bin`` when that variable is unset.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import os
import platform
import warnings
from pathlib import Path
from typing import Any, Mapping

import torch

from flashsac_opt import toolchain

AUTO = "auto"  # compile_cache_file value: the keyed file in default_dir()
ENV_DIR = "FLASHSAC_OPT_CACHE_DIR"
KEY_FORMAT = "flashsac_opt.compile_cache/1"
# Config fields left out of the key: the cache location itself and how compiled steps are kept
# (precompiled.py files sit beside it under the same key), and fields that never reach
# a compiled graph: the runtime's (collector, replay, run length), UniLab's actor_lr /
# critic_lr (its adapter drops them; the learning rate is a device tensor, not a constant),
# and the schedule, whose values the key takes from the iteration that actually runs
# (UniLab hands policy_frequency to each call, not to the learner's config). Every other
# field (all engine options, every hyperparameter) is in the key: a field that does not
# change the code only costs a cache miss, a missing one could make two configurations
# share a file that then hits for neither.
NOT_IN_KEY = frozenset({
    "compile_cache_file", "precompiled_steps",
    "num_envs", "replay_buffer_n", "learning_starts", "max_iterations",
    "actor_lr", "critic_lr",
    "batch_size", "updates_per_step", "policy_frequency", "target_frequency", "policy_before_critic",
})


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def environment(device: torch.device) -> dict[str, Any]:
    """What outside the configuration decides the compiled code: GPU kind and software versions."""
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else device.type
    return {
        "gpu": gpu,
        "torch": torch.__version__,  # includes the CUDA build (+cuXYZ)
        "triton": _version("triton"),
        "python": platform.python_version(),
        "flashsac_opt": _version("flashsac-opt"),
        # Triton's kernel keys hold the assembler's version: a file of kernels built with
        # another one would load and then miss (toolchain.py)
        "triton_ptxas": os.environ.get(toolchain.PTXAS_VARIABLE),
    }


def cache_key(environment: Mapping[str, Any], *, rows: int, dims: Mapping[str, int], config: Mapping[str, Any], **compiled: Any) -> str:
    """Hex digest of the environment, the learner's dims, the per-update rows, the config
    (less ``NOT_IN_KEY``) and ``compiled``: what the engine adds (mode, backend, the resolved
    Inductor options, the schedule, data parallel)."""
    material = {
        "format": KEY_FORMAT,
        "environment": dict(environment),
        "rows": int(rows),
        "dims": dict(dims),
        "config": {k: v for k, v in config.items() if k not in NOT_IN_KEY},
        "compiled": compiled,
    }
    text = json.dumps(material, sort_keys=True, default=repr)
    return hashlib.sha256(text.encode()).hexdigest()[:32]


def default_dir() -> Path:
    """``$FLASHSAC_OPT_CACHE_DIR``, else ``~/.cache/flashsac_opt``."""
    configured = os.environ.get(ENV_DIR)
    return Path(configured).expanduser() if configured else Path.home() / ".cache" / "flashsac_opt"


def default_file(key: str) -> Path:
    return default_dir() / f"{key}.bin"


def load(path: str | Path) -> bool:
    """Pre-populate torch.compile's caches from a saved artifact file; False if there is none
    or it cannot be read (then one warning: a corrupt or foreign file must not stop training)."""
    file = Path(path)
    if not file.is_file():
        return False
    try:
        info = torch.compiler.load_cache_artifacts(file.read_bytes())
        problem = None if info is not None else "torch rejected it (see its log)"
    except Exception as exc:  # noqa: BLE001
        problem = f"{type(exc).__name__}: {exc}"
    if problem is not None:
        warnings.warn(
            f"compile cache {file} could not be loaded ({problem}); compiling from scratch and "
            "rewriting it if the backend leaves artifacts",
            stacklevel=3,
        )
        return False
    return True


def save(path: str | Path) -> bool:
    """Write every cache artifact this process's compilations produced (atomically); False
    when there are none (e.g. the aot_eager backend), and then no file is written."""
    saved = torch.compiler.save_cache_artifacts()
    if saved is None:
        return False
    file = Path(path)
    file.parent.mkdir(parents=True, exist_ok=True)
    tmp = file.with_name(f"{file.name}.{os.getpid()}.tmp")
    tmp.write_bytes(saved[0])
    os.replace(tmp, file)
    return True

