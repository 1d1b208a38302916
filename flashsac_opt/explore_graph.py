"""The collection forward (the actor's ``explore``) captured into one CUDA graph per input shape.

UniLab's runner serves the collector's actions from the learner process: once per collection
step it calls ``actor.explore(obs, dones)`` on the learner's thread, between learner
iterations, so every millisecond it takes is added to the iteration. Eager, that is ~40 small
kernels and their Python (BatchNorm, GEMMs, RMSNorm, heads, the held-noise update): 2.1 ms of
GPU-timer time per call at 64 updates per iteration on the H200, 3.2 ms with the publication
(results/contention/mps_2026-12-01/), most of the 4.9 ms left between iteration and learner
time once the collector no longer waits for GPU time-slices. One replay of a captured graph
launches it all at once.

What keeps the graph valid: it reads the actor's flat ``params`` and ``bn_stats`` by address,
and the learner only ever updates them in place (see engine.py); the held-noise state is
updated in place inside the graph; the noise comes from the default CUDA generator, which is
graph-safe, so each replay draws the values eager execution would have drawn. The graph is
captured per (obs shape/dtype, dones shape/dtype or none, autocast dtype); anything else
(CPU, deterministic actions, a new shape past ``MAX_GRAPHS``) runs eagerly.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, NamedTuple

import torch

from flashsac_opt.networks import autocast_dtype

if TYPE_CHECKING:
    from flashsac_opt.networks import FlashSACActor

MAX_GRAPHS = 4  # distinct collection shapes captured; more run eagerly (a run has one or two)
ENV_SWITCH = "FLASHSAC_OPT_CAPTURE_EXPLORE"


def wanted() -> bool:
    """FLASHSAC_OPT_CAPTURE_EXPLORE: on by default (1/true/yes/on); 0/false/no/off keeps the eager
    forward (graph mode only captures it; for A/B runs and as an escape hatch). Anything else is refused."""
    value = os.environ.get(ENV_SWITCH, "1").strip().lower()
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"{ENV_SWITCH}={value!r}: expected 1/on or 0/off")


class _Captured(NamedTuple):
    graph: torch.cuda.CUDAGraph
    obs: torch.Tensor
    dones: torch.Tensor | None
    actions: torch.Tensor
    state: tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # the held-noise state it reads and writes


def _key(obs: torch.Tensor, dones: torch.Tensor | None) -> tuple:
    autocast = autocast_dtype(obs.device.type)
    done_key = None if dones is None else (tuple(dones.shape), dones.dtype, dones.device)
    return (tuple(obs.shape), obs.dtype, obs.device, done_key, autocast)


class CapturedExplore:
    """Replays the actor's stochastic ``explore`` from a CUDA graph (see the module docstring)."""

    def __init__(self, actor: "FlashSACActor"):
        self.actor = actor
        self.graphs: dict[tuple, _Captured] = {}

    def usable(self, obs: torch.Tensor, dones: torch.Tensor | None) -> bool:
        if not obs.is_cuda or (dones is not None and dones.device != obs.device):
            return False
        return _key(obs, dones) in self.graphs or len(self.graphs) < MAX_GRAPHS

    def __call__(self, obs: torch.Tensor, dones: torch.Tensor | None) -> torch.Tensor:
        key = _key(obs, dones)
        captured = self.graphs.get(key)
        if captured is None:
            captured = self.graphs[key] = self._capture(obs, dones)
        current = self.actor.exploration_state()
        if current is None or any(a is not b for a, b in zip(current, captured.state)):
            # another shape ran in between: as eager does on a shape change, every env redraws
            for tensor in captured.state:
                tensor.zero_()
            self.actor.use_exploration_state(captured.state)
        captured.obs.copy_(obs)
        if dones is not None:
            assert captured.dones is not None
            captured.dones.copy_(dones)
        captured.graph.replay()
        # the caller may hold the actions past the next call (UniLab copies them into its ring
        # at once, a test may not): hand out a copy, not the graph's output buffer
        return captured.actions.clone()

    def _capture(self, obs: torch.Tensor, dones: torch.Tensor | None) -> _Captured:
        actor = self.actor
        static_obs = torch.empty_like(obs, memory_format=torch.contiguous_format).copy_(obs)
        static_dones = None if dones is None else dones.detach().clone()
        # the state's dtype is the actions' mean's: the autocast dtype when autocast is on
        autocast = _key(obs, dones)[-1]
        state = actor.ensure_exploration_state(obs.shape[0], obs.device, autocast or actor.params.dtype)
        # One eager call on a side stream first (cuBLAS handles and workspaces, the allocator),
        # its effects undone: the held-noise state and the generator's position are restored,
        # so the first replay returns what the first eager call would have.
        saved = [tensor.clone() for tensor in state]
        generator_state = torch.cuda.get_rng_state(obs.device)
        side = torch.cuda.Stream(obs.device)
        side.wait_stream(torch.cuda.current_stream(obs.device))
        with torch.cuda.stream(side):
            actor.explore_step(static_obs, static_dones)
        torch.cuda.current_stream(obs.device).wait_stream(side)
        for tensor, before in zip(state, saved):
            tensor.copy_(before)
        torch.cuda.set_rng_state(generator_state, obs.device)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, capture_error_mode="thread_local"):
            actions = actor.explore_step(static_obs, static_dones)
        return _Captured(graph, static_obs, static_dones, actions, state)
