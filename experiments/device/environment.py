"""Where a device call ran: GPUs, driver, GPU topology, CPU cores and hyperthread siblings,
Python packages, date. Writes JSON and prints a short summary.

    python3 experiments/device/environment.py --output $OUT/env.json
"""

from __future__ import annotations

import argparse
import datetime
import importlib.metadata as md
import json
import os
import platform
import subprocess
import sys
from pathlib import Path

GPU_FIELDS = ("index", "name", "driver_version", "memory.total", "pci.bus_id", "clocks.sm", "clocks.max.sm", "temperature.gpu", "power.draw")
PACKAGES = ("torch", "triton", "numpy", "unilab", "mujoco")


def _run(cmd: list[str]) -> str | None:
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return done.stdout if done.returncode == 0 else None


def gpus() -> list[dict]:
    text = _run(["nvidia-smi", f"--query-gpu={','.join(GPU_FIELDS)}", "--format=csv,noheader,nounits"]) or ""
    return [dict(zip(GPU_FIELDS, (v.strip() for v in line.split(",")))) for line in text.splitlines() if line.strip()]


def cpu_siblings(sysfs: Path = Path("/sys/devices/system/cpu")) -> list[str]:
    """Each physical core's logical CPUs (the kernel's thread_siblings_list), one entry per core."""
    seen = []
    for topo in sorted(sysfs.glob("cpu[0-9]*/topology/thread_siblings_list"), key=lambda p: int(p.parts[-3][3:])):
        text = topo.read_text().strip()
        if text not in seen:
            seen.append(text)
    return seen


def version(name: str) -> str | None:
    try:
        return md.version(name)
    except md.PackageNotFoundError:
        return None


def collect() -> dict:
    env = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "python": platform.python_version(),
        "python_executable": sys.executable,
        "kernel": platform.release(),
        "gpus": gpus(),
        "gpu_topology": _run(["nvidia-smi", "topo", "-m"]),
        "cpu_count": os.cpu_count(),
        "cpus_usable": len(os.sched_getaffinity(0)),
        "cpu_model": next((line.split(":", 1)[1].strip() for line in (_run(["lscpu"]) or "").splitlines() if line.startswith("Model name")), None),
        "cpu_siblings": cpu_siblings(),
        "packages": {name: version(name) for name in PACKAGES},
        "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
    }
    try:
        import torch

        env["torch_cuda"] = torch.version.cuda
        env["cuda_devices"] = torch.cuda.device_count() if torch.cuda.is_available() else 0
    except ImportError:
        env["torch_cuda"] = None
    return env


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--output", type=Path, required=True)
    parser.add_argument("--dry-run", action="store_true", help="print what would be written, write nothing")
    args = parser.parse_args(argv)
    if args.dry_run:
        print(f"would write {args.output}: {', '.join(GPU_FIELDS[:3])} per GPU, topology, CPU siblings, {', '.join(PACKAGES)}, date")
        return 0
    env = collect()
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(env, indent=1))
    for gpu in env["gpus"]:
        print(f"GPU {gpu['index']}: {gpu['name']}, driver {gpu['driver_version']}, {gpu['memory.total']} MiB, SM {gpu['clocks.sm']} MHz")
    print(f"torch {env['packages']['torch']} (CUDA {env['torch_cuda']}), triton {env['packages']['triton']}, python {env['python']}, "
          f"{env['cpu_count']} logical CPUs in {len(env['cpu_siblings'])} cores, {env['date']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
