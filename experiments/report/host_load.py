"""Who used the host's CPUs while a training ran: the training's own processes, one by one, and
everything outside its process tree.

Why: UniLab's MuJoCo collector is CPU-bound, and on the H200 host of 2026-12-07 the same warm seed's
env step took 35.8 ms in the cold-first protocol and 26.6 ms alone minutes later
(results/time_to_reward/run_ahead_warm_seeds_h200_2026-12-07/README.md), with nothing recorded to
tell a busier host from a slower trajectory. The device machines have no profiler and no
network, so this reads /proc only (Linux), from a thread of the benchmark's own process, which
waits on the training anyway.

`HostLoad(root_pid).start()` samples every interval_s: per process, its CPU seconds
(/proc/PID/stat utime + stime) since the previous sample, so cores used; the 1-minute load
average; the host's busy share (/proc/stat). `stop(launched, since_s, until_s)` ends it and summarizes
the samples taken between since_s and until_s seconds after launch: per process of the training's tree (root and
descendants, by parent pid at each sample) its command, CPU seconds and cores (median, p90); the
cores used outside the tree (median, p90) and the five outside processes that used the most.
"""

from __future__ import annotations

import os
import statistics
import threading
import time
from pathlib import Path

PROC = Path("/proc")
TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def read_processes(proc: Path = PROC, commands: dict[int, str] | None = None) -> dict[int, tuple[int, float, str]]:
    """pid -> (parent pid, CPU seconds so far, command); processes that end while read are left out.
    ``commands``: the command lines already known by pid (not read again: half the cost of a sample)."""
    out = {}
    for entry in proc.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            cmd = (commands or {}).get(int(entry.name))
            if cmd is None:
                cmd = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
        except OSError:
            continue
        # the command name (field 2) is in parentheses and may hold spaces: split after its ")"
        name, fields = stat[stat.index("(") + 1 : stat.rindex(")")], stat[stat.rindex(")") + 2 :].split()
        out[int(entry.name)] = (int(fields[1]), (int(fields[11]) + int(fields[12])) / TICKS, cmd or f"[{name}]")
    return out


def host_busy_ticks(proc: Path = PROC) -> tuple[int, int]:
    """(busy, total) jiffies of all CPUs since boot, from /proc/stat's first line."""
    values = [int(v) for v in (proc / "stat").read_text().split("\n", 1)[0].split()[1:]]
    idle = values[3] + (values[4] if len(values) > 4 else 0)  # idle + iowait
    return sum(values) - idle, sum(values)


def tree(processes: dict[int, tuple[int, float, str]], root: int) -> set[int]:
    """root and its descendants among processes."""
    children: dict[int, list[int]] = {}
    for pid, (ppid, _, _) in processes.items():
        children.setdefault(ppid, []).append(pid)
    found, todo = set(), [root]
    while todo:
        pid = todo.pop()
        if pid in found:
            continue
        found.add(pid)
        todo.extend(children.get(pid, ()))
    return found & processes.keys()


def _quantiles(values: list[float]) -> dict:
    if not values:
        return {"median": None, "p90": None, "count": 0}
    ordered = sorted(values)
    return {"median": statistics.median(ordered), "p90": ordered[min(len(ordered) - 1, int(0.9 * len(ordered)))],
            "count": len(ordered)}


class HostLoad:
    def __init__(self, root_pid: int | None = None, interval_s: float = 1.0, proc: Path = PROC):
        self.root, self.interval, self.proc = root_pid, interval_s, proc
        self.samples: list[dict] = []  # {"t": wall time, "cores": {pid: cores}, "in_tree": set, "load1", "busy"}
        self.commands: dict[int, str] = {}
        self.cpu_s: dict[int, float] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="host_load_sampler", daemon=True)
        self._me = os.getpid()

    @staticmethod
    def available(proc: Path = PROC) -> bool:
        return (proc / "stat").is_file() and (proc / "self" / "stat").is_file()

    def start(self, root_pid: int | None = None) -> "HostLoad":
        """Sample from now on; root_pid: the training's process, if not given at construction."""
        if root_pid is not None:
            self.root = root_pid
        if self.root is None:
            raise ValueError("HostLoad needs the training's process id")
        self._thread.start()
        return self

    def _run(self) -> None:
        before, busy_before, t_before = read_processes(self.proc), host_busy_ticks(self.proc), time.time()
        while not self._stop.wait(self.interval):
            now, busy_now, t_now = read_processes(self.proc, self.commands), host_busy_ticks(self.proc), time.time()
            dt = max(t_now - t_before, 1e-6)
            cores = {}
            for pid, (_, cpu, cmd) in now.items():
                used = cpu - before[pid][1] if pid in before else cpu  # a new process: all its CPU time so far
                self.commands.setdefault(pid, cmd)
                if used > 0 and pid != self._me:
                    cores[pid] = used / dt
                    self.cpu_s[pid] = self.cpu_s.get(pid, 0.0) + used
            busy, total = busy_now[0] - busy_before[0], busy_now[1] - busy_before[1]
            try:
                load1 = float((self.proc / "loadavg").read_text().split()[0])
            except (OSError, ValueError, IndexError):
                load1 = None
            self.samples.append({"t": t_now, "cores": cores, "in_tree": tree(now, self.root), "load1": load1,
                                 "busy": busy / total if total > 0 else None})
            before, busy_before, t_before = now, busy_now, t_now

    def stop(self, launched: float, since_s: float = 0.0, until_s: float | None = None) -> dict:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()
        window = [s for s in self.samples if since_s <= s["t"] - launched <= (until_s if until_s is not None else float("inf"))]
        in_tree = set().union(*(s["in_tree"] for s in window)) if window else set()
        per_process = []
        for pid in sorted(in_tree, key=lambda p: -sum(s["cores"].get(p, 0.0) for s in window)):
            used = [s["cores"].get(pid, 0.0) for s in window if pid in s["in_tree"]]
            per_process.append({"pid": pid, "root": pid == self.root, "cmd": self.commands.get(pid, "?")[:200],
                                "cpu_s": round(sum(c * self.interval for c in used), 3),
                                "cores": _quantiles(used)})
        outside_cpu: dict[int, float] = {}
        outside = []
        for s in window:
            out = {pid: c for pid, c in s["cores"].items() if pid not in s["in_tree"]}
            outside.append(sum(out.values()))
            for pid, c in out.items():
                outside_cpu[pid] = outside_cpu.get(pid, 0.0) + c * self.interval
        top = sorted(outside_cpu.items(), key=lambda kv: -kv[1])[:5]
        return {
            "what": "CPU use while the training ran, from /proc, sampled by experiments/report/host_load.py",
            "interval_s": self.interval,
            "since_s": since_s,
            "until_s": until_s,
            "samples": len(window),
            "cpu_count": os.cpu_count(),
            "load1": _quantiles([s["load1"] for s in window if s["load1"] is not None]),
            "host_busy_share": _quantiles([s["busy"] for s in window if s["busy"] is not None]),
            "training_processes": [p for p in per_process if p["cpu_s"] > 0][:12],
            "outside_training_cores": _quantiles(outside),
            "outside_training_top": [{"pid": pid, "cmd": self.commands.get(pid, "?")[:200], "cpu_s": round(cpu, 3)}
                                     for pid, cpu in top],
        }
