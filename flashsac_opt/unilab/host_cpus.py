"""Sharing the host's CPUs between UniLab's learner process and its MuJoCo collector (both switches
off until measured on the GPU host).

On the H200 host of 2026-12-07 (16 CPUs) the recipe's collector was the bound of an iteration: its
env step took 34.6-36.7 ms in the cold-first protocol and 26.6-32.7 ms for the same warm seeds run
alone minutes later, with every part of it slower (MuJoCo's step, UniLab's single-threaded state
update and resets), results/time_to_reward/protocol_u64_mps_short_h200_2026-12-07/README.md. Two
ways the learner process can take CPU from it:

- MuJoCo's pool (unisim's BatchEnvPool) starts one worker per CPU the collector may use, 16 here,
  and each vectorized step waits for its slowest worker; a learner thread on one of those CPUs
  stretches every step. FLASHSAC_OPT_COLLECTOR_SPARE_CPUS=N takes N CPUs (whole physical cores,
  hyperthread siblings together) out of the forked collector's affinity before UniLab builds its
  envs, so the pool sizes itself to the rest (it reads sched_getaffinity) and the learner process
  has those CPUs to itself. Only a collector forked by patch 0005's server (the default) gets it.
- CUDA's default wait on a host with more CPUs than contexts spins: the learner thread that waits
  for an update phase or an inference copy keeps a core busy for the whole wait.
  FLASHSAC_OPT_BLOCKING_SYNC=1 sets the primary contexts' scheduling to blocking sync
  (cuDevicePrimaryCtxSetFlags, CU_CTX_SCHED_BLOCKING_SYNC) in the launch hook, before torch
  creates them: waits then sleep, at a wake-up latency of microseconds.
"""

from __future__ import annotations

import ctypes
import os
from pathlib import Path

SPARE_ENV = "FLASHSAC_OPT_COLLECTOR_SPARE_CPUS"
BLOCKING_SYNC_ENV = "FLASHSAC_OPT_BLOCKING_SYNC"
CU_CTX_SCHED_BLOCKING_SYNC = 0x04
CU_CTX_SCHED_MASK = 0x07
SYSFS_CPUS = Path("/sys/devices/system/cpu")


def _cpu_list(text: str) -> set[int]:
    """'0-3,8,10-11' -> {0, 1, 2, 3, 8, 10, 11}"""
    out: set[int] = set()
    for part in text.strip().split(","):
        if part:
            lo, _, hi = part.partition("-")
            out.update(range(int(lo), int(hi or lo) + 1))
    return out


def physical_cores(cpus: set[int], sysfs: Path = SYSFS_CPUS) -> list[set[int]]:
    """``cpus`` grouped by physical core (hyperthread siblings together), in CPU order; a CPU
    whose topology is not readable is a core of its own."""
    cores: list[set[int]] = []
    for cpu in sorted(cpus):
        if any(cpu in core for core in cores):
            continue
        try:
            siblings = _cpu_list((sysfs / f"cpu{cpu}" / "topology" / "thread_siblings_list").read_text())
        except (OSError, ValueError):
            siblings = {cpu}
        cores.append((siblings & cpus) | {cpu})
    return cores


def collector_cpus(allowed: set[int], spare: int, sysfs: Path = SYSFS_CPUS) -> tuple[set[int], set[int]]:
    """(the collector's CPUs, the spared ones): whole physical cores from the highest-numbered
    down until at least ``spare`` CPUs are spared, leaving the collector one core at least."""
    if spare < 0:
        raise ValueError(f"{SPARE_ENV} must be >= 0, got {spare}")
    cores = physical_cores(allowed, sysfs)
    spared: set[int] = set()
    while len(spared) < spare and len(cores) > 1:
        spared |= cores.pop()
    return allowed - spared, spared


def spare_cpus_from_env() -> int:
    value = os.environ.get(SPARE_ENV, "0").strip() or "0"
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"{SPARE_ENV} must be a whole number of CPUs, got {value!r}") from None


def confine_collector(sysfs: Path = SYSFS_CPUS) -> dict | None:
    """In the forked collector, before UniLab builds its envs: leave FLASHSAC_OPT_COLLECTOR_SPARE_CPUS
    CPUs to the other processes. None when the switch is off (or 0); else what was set."""
    spare = spare_cpus_from_env()
    if spare == 0 or not hasattr(os, "sched_setaffinity"):
        return None
    allowed = set(os.sched_getaffinity(0))
    mine, spared = collector_cpus(allowed, spare, sysfs)
    os.sched_setaffinity(0, mine)
    return {"collector_cpus": sorted(mine), "spared_cpus": sorted(spared)}


def _driver() -> ctypes.CDLL | None:
    try:
        return ctypes.CDLL("libcuda.so.1")
    except OSError:
        return None


def blocking_sync_wanted() -> bool:
    return os.environ.get(BLOCKING_SYNC_ENV, "0") == "1"


def set_blocking_sync(driver: ctypes.CDLL | None = None) -> str:
    """Set every visible device's primary-context scheduling to blocking sync, before any context
    exists. Returns what happened, in words (the training goes on in every case: a context that
    already exists keeps its flags, and CUDA reports it)."""
    driver = driver if driver is not None else _driver()
    if driver is None:
        return "no CUDA driver: nothing set"
    if driver.cuInit(0) != 0:
        return "cuInit failed: nothing set"
    count = ctypes.c_int(0)
    if driver.cuDeviceGetCount(ctypes.byref(count)) != 0:
        return "cuDeviceGetCount failed: nothing set"
    done = []
    for ordinal in range(count.value):
        device = ctypes.c_int(0)
        if driver.cuDeviceGet(ctypes.byref(device), ordinal) != 0:
            return f"cuDeviceGet({ordinal}) failed"
        flags, active = ctypes.c_uint(0), ctypes.c_int(0)
        driver.cuDevicePrimaryCtxGetState(device, ctypes.byref(flags), ctypes.byref(active))
        wanted = (flags.value & ~CU_CTX_SCHED_MASK) | CU_CTX_SCHED_BLOCKING_SYNC
        status = driver.cuDevicePrimaryCtxSetFlags(device, ctypes.c_uint(wanted))
        if status != 0:
            return f"cuDevicePrimaryCtxSetFlags on device {ordinal} returned {status} (context active: {bool(active.value)})"
        done.append(ordinal)
    return f"blocking sync set on device(s) {done}"


def primary_context_schedule(ordinal: int = 0, driver: ctypes.CDLL | None = None) -> int | None:
    """The scheduling bits of a device's primary context (CU_CTX_SCHED_*), None without a driver."""
    driver = driver if driver is not None else _driver()
    if driver is None or driver.cuInit(0) != 0:
        return None
    device, flags, active = ctypes.c_int(0), ctypes.c_uint(0), ctypes.c_int(0)
    if driver.cuDeviceGet(ctypes.byref(device), ordinal) != 0:
        return None
    driver.cuDevicePrimaryCtxGetState(device, ctypes.byref(flags), ctypes.byref(active))
    return flags.value & CU_CTX_SCHED_MASK
