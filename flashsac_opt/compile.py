"""Compile boundaries of the learner.

Each compiled function has ``fullgraph=True`` (a graph break is an error, not a silent
slowdown) and ``dynamic=False`` (batch shapes are fixed per run).

``fused_update`` on (the default up to batch 1024, see config.py): two functions, one per network update.
- ``critic_step``: the critic objective, its gradient through ``torch.func.grad_and_value``
  (traced by Dynamo, so forward, backward and the step below are one graph), finite guard,
  Adam, renormalization, BN-statistics commit, Polyak, metric values.
- ``actor_step``: the actor objective (frozen critic), its gradient w.r.t. the actor's
  parameters only, the guarded actor step and the closed-form temperature step.
One graph lets Inductor fuse the gradient assembly (the flat gradient buffer) into Adam and
the renormalization, and saves a compile boundary per update.

``fused_update`` off: four functions, autograd between loss and step:
- ``critic_loss``: actor(s') in eval BN, target and online critic on the joint 2B batch,
  min-Q member, C51 projection, cross-entropy. Its backward is compiled by AOTAutograd.
- ``critic_apply``: finite guard, Adam, renormalization, BN-statistics commit, Polyak.
- ``actor_loss``: actor on the joint batch, frozen critic (detached parameters) in eval BN.
- ``actor_apply``: finite guard, Adam, renormalization, BN commit, closed-form temperature step.

``learner_mode=compile`` turns Inductor's CUDA graphs (cudagraph trees) on for them;
``learner_mode=graph`` turns them off because the whole iteration is captured into one
manual ``torch.cuda.CUDAGraph`` (graph.py) and capture cannot nest.
"""

from __future__ import annotations

import os
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

import torch

if TYPE_CHECKING:
    from flashsac_opt.learner import FlashSACLearner

FUSED_FUNCTIONS = ("critic_step", "actor_step")
SPLIT_FUNCTIONS = ("critic_loss", "critic_apply", "actor_loss", "actor_apply")


def mark_static(*tensors: torch.Tensor) -> None:
    """Declare persistent state as fixed-address graph inputs.

    Cudagraph trees then neither copy these tensors into graph-owned placeholders nor
    refuse to graph a function that updates them in place.
    """
    for tensor in tensors:
        torch._dynamo.mark_static_address(tensor)


def persistent_state(learner: "FlashSACLearner") -> list[torch.Tensor]:
    """Every tensor an iteration reads or writes in place (all with fixed addresses)."""
    tensors = [
        learner.actor.bn_stats,
        learner.critic.bn_stats,
        learner.target_critic.params,
        learner.target_critic.bn_stats,
        learner.totals,
        learner.tau,
    ]
    for adam in (learner.actor_adam, learner.critic_adam, learner.temperature_adam):
        tensors += list(adam.tensors().values())
    if learner.reward_normalizer is not None:
        rn = learner.reward_normalizer
        tensors += [rn.mean, rn.var, rn.count, rn.abs_max]
    return tensors


def inductor_options(cfg, device: torch.device) -> dict[str, Any]:
    """Inductor options of the compiled modes: flashsac_opt's defaults, then ``cfg.inductor_options``."""
    cuda = device.type == "cuda"
    mode = cfg.learner_mode
    options = {
        # Inductor's CUDA graphs in compile mode only: graph mode captures the whole
        # iteration itself, and a capture cannot contain another.
        "triton.cudagraphs": mode == "compile" and cuda,
        # Pad GEMM operands whose rows are not 16-byte aligned (101 atoms, 29 actions,
        # 130-wide critic input) instead of letting cuBLAS fall back to align-1 kernels.
        "force_shape_pad": cuda,
        # Horizontal fusion of independent small kernels (per-layer BN statistics,
        # renormalization groups, Adam/Polyak pieces) in graph mode, where an iteration
        # is a chain of hundreds of small kernels: 0.89x (B256 x 2) and 0.98x (B2048 x 8)
        # of graph mode's time, 0.71x / 0.72x of its kernels, side by side on the H200
        # (results/benchmark_learner_side_by_side_W1_W3.json; numerics GPU-tested). It costs
        # ~25% more peak memory there; inductor_options={"combo_kernels": False} opts out.
        "combo_kernels": cuda and mode == "graph",
    }
    options.update(cfg.inductor_options or {})
    return options


def build_update_functions(learner: "FlashSACLearner") -> dict[str, Callable[..., Any]]:
    names = FUSED_FUNCTIONS if learner.fused_update else SPLIT_FUNCTIONS
    functions = {name: getattr(learner, f"_{name}") for name in names}
    mode = learner.cfg.learner_mode
    if mode == "eager":
        return functions
    backend = learner.cfg.compile_backend
    mark_static(*persistent_state(learner))
    options = inductor_options(learner.cfg, learner.device) if backend == "inductor" else None
    return {
        name: torch.compile(fn, fullgraph=True, dynamic=False, backend=backend, options=options)
        for name, fn in functions.items()
    }


def load_compile_cache(path: str) -> bool:
    """Pre-populate torch.compile's caches from a saved artifact file; False if there is none."""
    file = Path(path)
    if not file.is_file():
        return False
    try:
        info = torch.compiler.load_cache_artifacts(file.read_bytes())
        problem = None if info is not None else "torch rejected it (see its log)"
    except Exception as exc:  # a corrupt or foreign file must not stop training  # noqa: BLE001
        problem = f"{type(exc).__name__}: {exc}"
    if problem is not None:
        warnings.warn(f"compile cache {file} could not be loaded ({problem}); compiling from scratch and rewriting it", stacklevel=2)
        return False
    return True


def save_compile_cache(path: str) -> bool:
    """Write every cache artifact this process's compilations produced (atomically)."""
    saved = torch.compiler.save_cache_artifacts()
    if saved is None:  # nothing cacheable (e.g. the aot_eager backend)
        return False
    file = Path(path)
    file.parent.mkdir(parents=True, exist_ok=True)
    tmp = file.with_name(file.name + ".tmp")
    tmp.write_bytes(saved[0])
    os.replace(tmp, file)
    return True
