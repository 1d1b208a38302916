"""Manual CUDA-graph capture of a whole learner iteration (``learner_mode=graph``).

One ``torch.cuda.CUDAGraph`` holds every critic, actor and temperature update of an
iteration, their optimizer steps, renormalizations, BN-statistics commits, Polyak updates,
noise draws and metric writes. A replay is one launch from the host.

Lifetime rules (what keeps a captured graph valid):
- It reads and writes tensors by address: parameters, BN statistics, Adam state, reward
  statistics, the metrics buffer and its own static batch buffers. All of these are only
  ever updated in place (``copy_``), including by ``load_state_dict``, so the graph
  survives checkpoint loads and reward-statistics updates.
- The capture key is (updates_per_step, policy_frequency, target_frequency,
  policy_before_critic, every batch field's shape and dtype). A different key recaptures
  (and the old graph is released); the compiled functions are reused.
- Inductor's own CUDA graphs are off in this mode: a capture cannot contain another.
- Noise comes from the default CUDA generator, which is graph-safe: each replay draws new
  values, in the same sequence eager execution would.
- A data-parallel learner's graph holds its NCCL all-reduces: NCCL keeps a reference on
  the communicator for every live graph that captured one, so ``destroy_process_group``
  waits forever while such a graph exists (pytorch/pytorch#115388). Call
  ``learner.release_graphs()`` before tearing the process group down.
- ``run_sampled`` captures the replay sampling too (``GPUReplay``: indices from its own
  registered generator, the valid-row count read from a device tensor): the key then holds
  the replay's identity and capacity; appends between replays need no recapture.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from flashsac_opt.learner import FlashSACLearner

WARMUP_ITERATIONS = 2


class WholeCycleGraph:
    def __init__(self, learner: "FlashSACLearner"):
        if learner.device.type != "cuda":
            raise ValueError(f"learner_mode=graph needs a CUDA device, got {learner.device}")
        self.learner = learner
        self.graph: torch.cuda.CUDAGraph | None = None
        self.key: tuple | None = None
        self.static_batch: dict[str, torch.Tensor] = {}
        self.captures = 0
        self.last_warmup_seconds = 0.0
        self.last_capture_seconds = 0.0

    def _key(self, batch: dict[str, torch.Tensor], u_count: int, pf: int) -> tuple:
        cfg = self.learner.cfg
        fields = tuple((k, tuple(v.shape), v.dtype) for k, v in sorted(batch.items()))
        return (u_count, pf, cfg.target_frequency, cfg.policy_before_critic, fields)

    def release(self) -> None:
        """Free the captured graph (the next iteration recaptures)."""
        if self.graph is not None:
            torch.cuda.synchronize(self.learner.device)  # no replay may still be running
            self.graph.reset()
        self.graph, self.key, self.static_batch = None, None, {}

    def run(self, batch: dict[str, torch.Tensor], u_count: int, pf: int, bsz: int) -> None:
        key = self._key(batch, u_count, pf)
        if key != self.key:
            self._capture(batch, key, u_count, pf, bsz)
        for name, tensor in batch.items():
            self.static_batch[name].copy_(tensor)
        assert self.graph is not None
        self.graph.replay()

    def run_sampled(self, replay, u_count: int, pf: int, bsz: int) -> None:
        """Replay the iteration with the batch sampled from `replay` inside the graph."""
        cfg = self.learner.cfg
        key = ("replay", id(replay), replay.capacity, u_count, pf, bsz, cfg.target_frequency, cfg.policy_before_critic)
        if key != self.key:
            self._capture(None, key, u_count, pf, bsz, replay=replay)
        assert self.graph is not None
        self.graph.replay()

    def _capture(self, batch: dict[str, torch.Tensor] | None, key: tuple, u_count: int, pf: int, bsz: int, replay=None) -> None:
        learner = self.learner
        self.graph = None
        if replay is None:
            assert batch is not None
            self.static_batch = {k: v.detach().clone() for k, v in batch.items()}

            def body() -> None:
                learner._run_updates(self.static_batch, u_count, pf, bsz)
        else:
            self.static_batch = {}

            def body() -> None:  # sampling (indices, gather) is part of the captured iteration
                learner._run_updates(replay.sample(u_count * bsz), u_count, pf, bsz)

        sampler_state = replay.generator.get_state() if replay is not None else None
        saved = learner.snapshot()
        rng = torch.cuda.get_rng_state(learner.device)
        start = time.perf_counter()
        # Warm-up on a side stream compiles every function and lets the allocator and
        # cuBLAS settle; its effects on the learner state are undone below.
        side = torch.cuda.Stream(learner.device)
        side.wait_stream(torch.cuda.current_stream(learner.device))
        with torch.cuda.stream(side):
            for _ in range(WARMUP_ITERATIONS):
                body()
        torch.cuda.current_stream(learner.device).wait_stream(side)
        learner.restore(saved)
        torch.cuda.set_rng_state(rng, learner.device)
        if replay is not None:
            replay.generator.set_state(sampler_state)
        torch.cuda.synchronize(learner.device)
        self.last_warmup_seconds = time.perf_counter() - start
        start = time.perf_counter()
        graph = torch.cuda.CUDAGraph()
        if replay is not None:
            # A generator other than the default CUDA one must be registered with the graph
            # so that each replay advances it (new indices) instead of repeating one draw.
            graph.register_generator_state(replay.generator)
        with torch.cuda.graph(graph, capture_error_mode="thread_local"):
            body()
        torch.cuda.synchronize(learner.device)
        self.last_capture_seconds = time.perf_counter() - start
        self.graph, self.key = graph, key
        self.captures += 1
