"""The learner's update phase running ahead of UniLab's runner (patches/0007).

UniLab 1.5.2's off-policy runner synchronizes the device after every update phase and then reads
the phase's metrics, so everything its host does between two updates (the iteration's logging,
its bookkeeping, the wait for the collector's next request and the inference it then serves)
follows the update instead of overlapping it: at U64 on one GPU about 7 ms of a 41-ms iteration
besides the update's 34 ms (results/time_to_reward/protocol_u64_mps_short_h200_2026-12-06). With
``FLASHSAC_OPT_UPDATE_RUNS_AHEAD`` on (the default; ``0`` turns it off) the learner tells the patched runner
(``update_phase_runs_ahead``) to leave that synchronize out, and keeps every ordering the
synchronize gave on its own:

- the replay batch: UniLab's pipeline gathers the batch two ticks ahead into the slot this
  update read, on a stream of its own, without waiting for the learner's stream. An update cycle
  therefore returns only once the captured graph's copy of the batch has run (``Engine.run``'s
  event). The device has then also finished what was queued before it (the inference the runner
  just served, the previous update), which the collector's request already waited for, so the
  wait is short; an uncaptured iteration reads the batch throughout and is waited for whole;
- the actor the next inference uses, the reward statistics, checkpoints: all on the learner's
  stream, after the update, as before;
- metrics: each phase's buffer is copied to pinned host memory behind it; the runner gets the
  previous phase's (one iteration late; the first iteration logs none), which is complete once
  the current cycle returns;
- ``Perf/learning_time``: the previous phase's device time (CUDA events around it) instead of the
  host's time around a launch.

Only graph mode on CUDA gains: elsewhere the cycle reads its batch itself and is waited for
whole (as the runner's synchronize did), and on the CPU the work is done when it is queued (host
timestamps stand in for events), which lets a CPU training exercise the patched runner's path.
Never with data parallelism (the adapter decides). On an H100 a compiled U64 iteration took
35.6-35.9 ms of wall clock with it against 39.3-39.4 ms without, on another machine of that kind
the day before (results/time_to_reward/protocol_u64_mps_candidates_h100_2026-12-07/README.md).
"""

from __future__ import annotations

import time
from typing import Any, Callable

import torch

from flashsac_opt.compile_ahead import on_off_switch

SWITCH = "FLASHSAC_OPT_UPDATE_RUNS_AHEAD"


def wanted() -> bool:
    """The switch: on by default; 0/off or 1/on, anything else is refused."""
    return on_off_switch(SWITCH, "1")


class HostEvent:
    """A CUDA event's interface for CPU work, which is done when it is queued."""

    def __init__(self, enable_timing: bool = False):
        self.at: float | None = None

    def record(self) -> None:
        self.at = time.perf_counter()

    def synchronize(self) -> None:
        pass

    def elapsed_time(self, other: "HostEvent") -> float:  # milliseconds, as CUDA's
        return (other.at - self.at) * 1000.0


class RunAhead:
    """One update phase in flight: its metrics' host copies and device times, two deep."""

    def __init__(self, device: torch.device, event: Callable[..., Any] | None = None):
        self.device = torch.device(device)
        self._event = event or (torch.cuda.Event if self.device.type == "cuda" else HostEvent)
        self.phases = 0  # update phases ended so far
        self._host: list[torch.Tensor | None] = [None, None]  # pinned copies of the metrics buffer
        self._schedule: list[Any] = [None, None]
        self._times: list[tuple[Any, Any] | None] = [None, None]  # (start, end) events
        self._copied: list[Any] = [None, None]  # recorded after each host copy
        self._start: Any = None

    def begin(self) -> None:
        """Before the phase's work is queued."""
        self._start = self._event(enable_timing=True)
        self._start.record()

    def end(self, metrics: torch.Tensor, schedule: Any, inputs_read: Any) -> None:
        """After the phase's work is queued: queue the copy of ``metrics`` (the phase's buffer),
        then wait until the phase no longer reads its batch (``inputs_read``: the captured
        graph's copy; None: the whole phase)."""
        if self._start is None:
            raise RuntimeError("RunAhead.end() without begin()")
        finish = self._event(enable_timing=True)
        finish.record()
        slot = self.phases % 2
        host = self._host[slot]
        if host is None or host.shape != metrics.shape:
            host = torch.empty(metrics.shape, dtype=metrics.dtype, pin_memory=self.device.type == "cuda")
            self._host[slot] = host
        host.copy_(metrics, non_blocking=True)
        copied = self._event()
        copied.record()
        self._copied[slot] = copied
        self._schedule[slot] = schedule
        self._times[slot] = (self._start, finish)
        self._start = None
        self.phases += 1
        (inputs_read if inputs_read is not None else finish).synchronize()

    def _previous(self) -> int | None:
        return (self.phases - 2) % 2 if self.phases >= 2 else None

    def previous_metrics(self) -> tuple[list[list[float]], Any] | None:
        """The phase before the last one: its metrics rows and its schedule (None before the
        second phase). Complete: the last phase's wait in ``end`` came after it."""
        slot = self._previous()
        if slot is None:
            return None
        self._copied[slot].synchronize()  # done already: the last phase's wait in ``end`` came after it
        return self._host[slot].tolist(), self._schedule[slot]

    def previous_seconds(self) -> float | None:
        """The device time of the phase before the last one (None before the second phase)."""
        slot = self._previous()
        if slot is None:
            return None
        start, finish = self._times[slot]
        finish.synchronize()
        return start.elapsed_time(finish) / 1000.0
