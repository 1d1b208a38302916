"""Data-parallel flashsac_opt: one learner per rank, one averaged bucket per network update.

Each rank samples its own batch from its own (rank-local) replay and runs the same update
schedule. Between the loss and the optimizer step, everything the step reads that depends
on the batch is averaged across ranks in **one** all-reduce per network update: the flat
gradient (the parameters are already one flat buffer, so the bucket is the gradient plus a
few hundred floats), the loss (so the finite guard decides the same on every rank: a
non-finite value on any rank makes the average non-finite and every rank skips), the new
BatchNorm running statistics and, for the actor, the entropy that drives the temperature.
Identical inputs to a deterministic step keep the parameters, Adam moments, BN statistics,
target network and temperature bit-identical on all ranks.

BatchNorm batch statistics stay rank-local inside the forward (as DDP without SyncBN); the
running statistics are averaged. Reward statistics are updated from the transitions of all
ranks (gathered), so the reward scale is global and identical everywhere.

The collective runs between the compiled loss and step functions (``fused_update`` is off
for a data-parallel learner: a collective inside the fused graph would need functional
collectives in Inductor). In ``graph`` mode the all-reduce is captured with the rest of the
iteration (NCCL collectives are capturable), so an iteration is still one graph launch.

gloo (CPU) has no AVG reduction: the bucket is summed and divided by the world size.

UniLab's ``training.dp_gradient_wire_dtype: bfloat16`` (opt-in; the adapter reads it from the
sync UniLab hands over) sends the gradient as bf16, as UniLab's own all-reduce does for fp32
groups of at least 1024 elements: rounded to bf16, summed, restored to fp32, multiplied by
1/world_size. The rest of the bucket (loss, BN statistics, entropy) stays fp32, in a second
all-reduce. Half the gradient bytes, for a transport-bound run (NCCL over TCP loopback).

``dp_broadcast_params`` (config; default: on in compiled modes on CUDA) adds one broadcast
of rank 0's parameters at the end of each iteration: a guarantee of bit-identical ranks that
does not depend on every rank's compiled optimizer step producing the same bits (on the
H200 Inductor's did not, by ~1 ulp, even on identical inputs: FLASH_SAC_OPTIMIZATION.md,
"Data parallel").
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from dataclasses import asdict

import torch
import torch.distributed as dist


def broadcasts_params(option: bool | None, compiled: bool, device: torch.device) -> bool:
    """Whether a data-parallel learner broadcasts rank 0's parameters every iteration.

    ``option`` is the config's ``dp_broadcast_params``; None means: where the compiled optimizer
    step was seen to round differently on two GPUs, i.e. compiled modes on CUDA (eager and CPU
    ranks stay bit-identical without it).
    """
    if option is None:
        return compiled and device.type == "cuda"
    return bool(option)


WIRE_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}  # UniLab's dp_gradient_wire_dtype
WIRE_MIN_NUMEL = 1024  # UniLab compresses no smaller group (e.g. the temperature's gradient)


class RankAverager:
    """Collectives of a data-parallel learner over one process group."""

    def __init__(self, group: dist.ProcessGroup | None = None, gradient_wire_dtype: str = "float32"):
        if gradient_wire_dtype not in WIRE_DTYPES:
            raise ValueError(f"gradient_wire_dtype must be one of {sorted(WIRE_DTYPES)} (UniLab's training.dp_gradient_wire_dtype), "
                             f"got {gradient_wire_dtype!r}")
        if not dist.is_available() or not dist.is_initialized():
            raise ValueError("data-parallel flashsac_opt needs torch.distributed.init_process_group() first")
        self.group = group
        self.world_size = dist.get_world_size(group)
        self.gradient_wire_dtype = gradient_wire_dtype

    def compresses(self, numel: int, dtype: torch.dtype = torch.float32) -> bool:
        """Whether a gradient of ``numel`` elements crosses the wire as bf16 (UniLab's rule)."""
        return self.gradient_wire_dtype == "bfloat16" and dtype == torch.float32 and numel >= WIRE_MIN_NUMEL

    def average(self, *tensors: torch.Tensor) -> list[torch.Tensor]:
        """Average ``tensors`` across ranks; returns new tensors (same shapes, dtypes). The first is
        the gradient (the engine's ``reduce(grad, *loss outputs)``): with a bf16 wire it goes in a
        bf16 all-reduce of its own, the rest in one fp32 bucket; else all in one bucket."""
        grad = tensors[0]
        if self.compresses(grad.numel(), grad.dtype):
            wire = grad.detach().reshape(-1).to(torch.bfloat16)
            dist.all_reduce(wire, op=dist.ReduceOp.SUM, group=self.group)
            averaged = (wire.float() * (1.0 / self.world_size)).view(grad.shape)  # UniLab's order: fp32 first, then 1/world
            return [averaged, *(self._bucket(*tensors[1:]) if len(tensors) > 1 else [])]
        return self._bucket(*tensors)

    def _bucket(self, *tensors: torch.Tensor) -> list[torch.Tensor]:
        """``tensors`` averaged in one fp32 all-reduce."""
        flat = torch.cat([t.detach().reshape(-1).float() for t in tensors])
        dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=self.group)
        flat = flat / self.world_size
        out, start = [], 0
        for t in tensors:
            out.append(flat[start : start + t.numel()].view(t.shape).to(t.dtype))
            start += t.numel()
        return out

    @torch.no_grad()
    def broadcast_(self, tensors: list[torch.Tensor], src: int = 0) -> None:
        """Overwrite ``tensors`` (all fp32) in place with rank ``src``'s values, in one broadcast."""
        flat = torch.cat([t.reshape(-1) for t in tensors])
        dist.broadcast(flat, src=src, group=self.group)
        start = 0
        for t in tensors:
            t.copy_(flat[start : start + t.numel()].view_as(t))
            start += t.numel()

    def gather(self, x: torch.Tensor) -> torch.Tensor:
        """All ranks' ``x`` (the same shape on every rank), stacked in rank order."""
        parts = [torch.empty_like(x) for _ in range(self.world_size)]
        dist.all_gather(parts, x.contiguous(), group=self.group)
        return torch.stack(parts)


def check_same_config(averager: RankAverager, description: dict) -> None:
    """Raise ValueError on every rank when the ranks' ``description`` ({section: {field: value}},
    JSON-able: the config and dims) differ; the message names the fields that differ from rank 0's."""
    import json

    text = json.dumps(description, sort_keys=True, default=repr)
    gathered: list = [None] * averager.world_size
    dist.all_gather_object(gathered, text, group=averager.group)
    if all(g == text for g in gathered):
        return

    def fields(json_text: str) -> dict:
        return {f"{section}.{key}": value for section, values in json.loads(json_text).items() for key, value in values.items()}

    reference = fields(gathered[0])
    differing: dict[str, dict[int, object]] = {}
    for rank, other in enumerate(gathered[1:], start=1):
        theirs = fields(other)
        for key in sorted(reference.keys() | theirs.keys()):
            if reference.get(key) != theirs.get(key):
                differing.setdefault(key, {})[rank] = theirs.get(key)
    raise ValueError(
        "data-parallel ranks must run the same learner configuration; differing from rank 0: "
        + "; ".join(f"{key} (rank 0: {reference.get(key)!r}, " + ", ".join(f"rank {r}: {v!r}" for r, v in ranks.items()) + ")"
                    for key, ranks in sorted(differing.items()))
    )


def join(learner, process_group: "dist.ProcessGroup | bool" = True,
         averager: "RankAverager | None" = None, gradient_wire_dtype: str = "float32") -> None:
    """Make ``learner`` one rank of a data-parallel learner over ``process_group`` (True: the
    default group), before its first update: rank 0's networks are broadcast to every rank and
    the engine is rebuilt with the all-reduce between loss and step. The state (a loaded
    checkpoint included) is kept. Every rank must run the same configuration: a mismatch raises
    ValueError on every rank (one all-gather of the config as JSON)."""
    if learner.averager is not None:
        raise ValueError("this learner is data parallel already")
    if learner.engine.fused_update is not None:
        raise ValueError("enable_data_parallel() must come before the first update (the update functions are built)")
    # ``averager``: other collectives with RankAverager's interface (benchmark_multigpu's
    # comparison with UniLab's gradient all-reduce); by default RankAverager's bucket, the
    # gradient at ``gradient_wire_dtype`` (UniLab's training.dp_gradient_wire_dtype)
    averager = averager or RankAverager(None if process_group is True else process_group, gradient_wire_dtype)
    # the compile-cache file may be a per-rank path; everything else must agree
    config = {k: v for k, v in asdict(learner.cfg).items() if k != "compile_cache_file"}
    check_same_config(averager, {"config": config, "dims": learner.dims})
    learner.averager = averager
    # Every rank starts from rank 0's networks, whatever its seed.
    averager.broadcast_(list(learner.network_tensors().values()))
    learner.engine = learner.build_engine()
    learner.broadcast_params = broadcasts_params(learner.cfg.dp_broadcast_params, learner.engine.compiled, learner.device)


def collective_bytes_per_iteration(learner, updates_per_step: int, policy_frequency: int) -> int:
    """Bytes each rank all-reduces per iteration, from the learner's layout (the gradients at the
    averager's wire dtype, everything else fp32)."""
    averager = learner.averager
    grad_bytes = lambda numel: (2 if averager is not None and averager.compresses(numel) else 4) * numel  # noqa: E731
    critic = grad_bytes(learner.critic.layout.numel) + 4 * (1 + 2 * learner.critic.stats_layout.numel)
    actor = grad_bytes(learner.actor.layout.numel) + 4 * (2 + learner.actor.stats_layout.numel)
    actor_updates = len(range(0, updates_per_step, policy_frequency))
    broadcast = 0
    if learner.broadcast_params:  # actor, critic and target parameters, once per iteration
        broadcast = 4 * (learner.actor.layout.numel + 2 * learner.critic.layout.numel)
    return updates_per_step * critic + actor_updates * actor + broadcast


def named_tensors(state: dict, prefix: str = "") -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor of a nested state dict (e.g. ``learner.state_dict()``), as (dotted name, tensor)."""
    for key, value in state.items():
        if isinstance(value, torch.Tensor):
            yield f"{prefix}{key}", value
        elif isinstance(value, dict):
            yield from named_tensors(value, f"{prefix}{key}.")


# State that is each rank's own by design: the running discounted return of the rank's own
# envs (the reward statistics built from them are global).
RANK_LOCAL_STATE = ("reward_normalizer.returns",)


def state_digest(state: dict) -> str:
    """SHA-256 of every tensor's name and bytes but RANK_LOCAL_STATE: equal digests =
    bit-identical ranks."""
    digest = hashlib.sha256()
    shared = (item for item in named_tensors(state) if item[0] not in RANK_LOCAL_STATE)
    for name, t in sorted(shared, key=lambda item: item[0]):
        digest.update(name.encode())
        digest.update(t.detach().cpu().reshape(-1).contiguous().view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()
