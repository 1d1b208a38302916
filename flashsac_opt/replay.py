"""GPU-resident replay: packed ring storage, bulk append, sampling on the device.

Row layout (one row per transition; only the fields the learner reads), in this order:

    obs (O) | next_obs (O) | critic (C) | next_critic (C) | actions (A) | rewards | dones | truncated

G1 walk: O=98, C=101, A=29 -> 430 columns; motion tracking: O=160, C=289, A=29 -> 930.
Observations may be stored in bf16 (``obs_dtype``); actions and the scalar columns stay fp32
in a second packed tensor, so both gathers are one ``index_select`` each.

Sampling draws ``floor(u * size)`` with u ~ U[0, 1) from a dedicated generator and the valid
row count ``size`` read from a device tensor: no host value enters the sample, so it can sit
inside a captured CUDA graph (each replay draws new indices; the same seed gives the same
indices). Rows are appended in a ring: once full, the oldest rows are overwritten, and
only written rows are ever sampled.

``HostReplay`` is the host-authoritative alternative (pinned CPU ring, CPU sampling, one H2D
copy of the sampled batch) for comparison and for rings larger than GPU memory.
"""

from __future__ import annotations

import torch

from flashsac_opt.devices import resolve_device

OBS_FIELDS = ("obs", "next_obs", "critic", "next_critic")
SCALAR_FIELDS = ("rewards", "dones", "truncated")


class ReplayLayout:
    def __init__(self, obs_dim: int, critic_obs_dim: int, action_dim: int):
        self.obs_dim, self.critic_obs_dim, self.action_dim = obs_dim, critic_obs_dim, action_dim
        widths = {"obs": obs_dim, "next_obs": obs_dim, "critic": critic_obs_dim, "next_critic": critic_obs_dim}
        self.obs_slices, start = {}, 0
        for name in OBS_FIELDS:
            self.obs_slices[name] = slice(start, start + widths[name])
            start += widths[name]
        self.obs_width = start
        self.rest_slices = {"actions": slice(0, action_dim)}
        for i, name in enumerate(SCALAR_FIELDS):
            self.rest_slices[name] = slice(action_dim + i, action_dim + i + 1)
        self.rest_width = action_dim + len(SCALAR_FIELDS)

    @property
    def row_width(self) -> int:
        return self.obs_width + self.rest_width

    def pack(self, batch: dict[str, torch.Tensor], obs_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        n = batch["actions"].shape[0]
        obs = torch.cat([batch[k].reshape(n, -1) for k in OBS_FIELDS], dim=1).to(obs_dtype)
        rest = torch.cat([batch["actions"].reshape(n, -1)] + [batch[k].reshape(n, 1).float() for k in SCALAR_FIELDS], dim=1)
        if obs.shape[1] != self.obs_width or rest.shape[1] != self.rest_width:
            raise ValueError(f"transition widths {obs.shape[1]}+{rest.shape[1]} do not match the layout {self.obs_width}+{self.rest_width}")
        return obs, rest

    def views(self, obs: torch.Tensor, rest: torch.Tensor) -> dict[str, torch.Tensor]:
        """The learner's batch dict as column views of the packed sample (no copies)."""
        out = {k: obs[:, s] for k, s in self.obs_slices.items()}
        out["actions"] = rest[:, self.rest_slices["actions"]]
        for name in SCALAR_FIELDS:
            out[name] = rest[:, self.rest_slices[name].start]
        return out


class GPUReplay:
    """Packed ring on the learner's device; ``sample`` is graph-safe."""

    def __init__(
        self,
        capacity: int,
        obs_dim: int,
        critic_obs_dim: int,
        action_dim: int,
        device: str | torch.device = "cuda",
        obs_dtype: torch.dtype = torch.float32,
        seed: int = 0,
    ):
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        self.capacity = int(capacity)
        self.device = resolve_device(device)
        self.layout = ReplayLayout(obs_dim, critic_obs_dim, action_dim)
        self.obs_dtype = obs_dtype
        self.obs = torch.zeros(self.capacity, self.layout.obs_width, device=self.device, dtype=obs_dtype)
        self.rest = torch.zeros(self.capacity, self.layout.rest_width, device=self.device)
        self.head = 0  # next row to write (host: the writer knows how much it wrote)
        self.count = 0  # valid rows (host copy)
        self.size = torch.zeros(1, device=self.device, dtype=torch.float64)  # valid rows (device copy)
        self.generator = torch.Generator(device=self.device)
        self.generator.manual_seed(seed)

    def extend(self, batch: dict[str, torch.Tensor]) -> None:
        """Append transitions (UniLab field names, any leading row count) at the ring head."""
        obs, rest = self.layout.pack({k: v.to(self.device) for k, v in batch.items()}, self.obs_dtype)
        n = obs.shape[0]
        if n > self.capacity:  # only the newest `capacity` rows can survive
            obs, rest, n = obs[-self.capacity :], rest[-self.capacity :], self.capacity
        first = min(n, self.capacity - self.head)
        self.obs[self.head : self.head + first].copy_(obs[:first])
        self.rest[self.head : self.head + first].copy_(rest[:first])
        if first < n:  # wrap around
            self.obs[: n - first].copy_(obs[first:])
            self.rest[: n - first].copy_(rest[first:])
        self.head = (self.head + n) % self.capacity
        self.count = min(self.count + n, self.capacity)
        self.size.fill_(float(self.count))  # a host scalar into a kernel argument: no sync

    def sample_indices(self, n: int) -> torch.Tensor:
        u = torch.rand(n, device=self.device, generator=self.generator, dtype=torch.float64)
        # floor(u * size) < size for u < 1: never an unwritten row.
        return (u * self.size).long().clamp_(max=self.capacity - 1)

    def sample(self, n: int) -> dict[str, torch.Tensor]:
        """n uniform rows among the written ones, as the learner's batch dict."""
        idx = self.sample_indices(n)
        return self.layout.views(self.obs.index_select(0, idx).float(), self.rest.index_select(0, idx))


class HostReplay:
    """Host-authoritative ring: CPU storage, CPU sampling, one pinned H2D copy per sample."""

    def __init__(self, capacity: int, obs_dim: int, critic_obs_dim: int, action_dim: int, device: str | torch.device = "cuda", seed: int = 0):
        self.capacity = int(capacity)
        self.device = resolve_device(device)
        self.layout = ReplayLayout(obs_dim, critic_obs_dim, action_dim)
        pin = self.device.type == "cuda"
        self.storage = torch.zeros(self.capacity, self.layout.row_width, pin_memory=pin)
        self.head = self.count = 0
        self.generator = torch.Generator().manual_seed(seed)
        # Two pinned staging buffers, alternated: a buffer is refilled only after the H2D
        # copy that last read it has completed (its event), never while it is in flight.
        self._staging: list[torch.Tensor] = []
        self._copied: list[torch.cuda.Event | None] = [None, None]
        self._turn = 0
        self._pin = pin

    def extend(self, batch: dict[str, torch.Tensor]) -> None:
        obs, rest = self.layout.pack({k: v.cpu() for k, v in batch.items()}, torch.float32)
        rows = torch.cat([obs, rest], dim=1)[-self.capacity :]
        n = rows.shape[0]
        first = min(n, self.capacity - self.head)
        self.storage[self.head : self.head + first].copy_(rows[:first])
        if first < n:
            self.storage[: n - first].copy_(rows[first:])
        self.head = (self.head + n) % self.capacity
        self.count = min(self.count + n, self.capacity)

    def sample(self, n: int) -> dict[str, torch.Tensor]:
        if self.count == 0:
            raise ValueError("cannot sample from an empty replay")
        if not self._staging or self._staging[0].shape[0] != n:
            self._staging = [torch.empty(n, self.layout.row_width, pin_memory=self._pin) for _ in range(2)]
            self._copied = [None, None]
        turn, self._turn = self._turn, 1 - self._turn
        if self._copied[turn] is not None:
            self._copied[turn].synchronize()
        idx = torch.randint(0, self.count, (n,), generator=self.generator)
        torch.index_select(self.storage, 0, idx, out=self._staging[turn])
        rows = self._staging[turn].to(self.device, non_blocking=True)
        if self._pin:
            self._copied[turn] = torch.cuda.Event()
            self._copied[turn].record()
        w = self.layout.obs_width
        return self.layout.views(rows[:, :w], rows[:, w:])
