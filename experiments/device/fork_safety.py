"""Which of the collector preload's imports (flashsac_opt.unilab.collector_start) makes a forked
child unable to use CUDA: imports PRELOAD_MODULES and UniLab's env registry one by one, records the
stack of every CUDA device-count query (torch marks the process so that a forked child refuses
CUDA), and after each step forks a child that creates a CUDA tensor. JSON to --output."""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
import traceback

import torch

sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parents[1]))  # experiments/: common
from common import run_environment  # noqa: E402

from flashsac_opt.unilab.collector_start import PRELOAD_MODULES  # noqa: E402

queries: list[dict] = []
_real = getattr(torch._C, "_cuda_getDeviceCount", None)  # absent from CPU builds (the dry run there)


def _recording(*args, **kwargs):
    queries.append({"stack": traceback.format_stack(limit=12)[:-1]})
    return _real(*args, **kwargs)


def child_can_use_cuda() -> dict:
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(r)
        try:
            torch.zeros(1, device="cuda").add_(1)
            msg = "ok"
        except Exception as exc:  # noqa: BLE001
            msg = repr(exc)[:300]
        os.write(w, msg.encode())
        os._exit(0)
    os.close(w)
    out = os.read(r, 1000).decode()
    os.waitpid(pid, 0)
    return {"child": out}


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--output", required=True)
    parser.add_argument("--dry-run", action="store_true", help="print the imports it would test, run nothing")
    args = parser.parse_args()
    if args.dry_run:
        print("imports one by one, a forked child creating a CUDA tensor after each: " + " ".join((*PRELOAD_MODULES, "ensure_registries")))
        return 0
    torch._C._cuda_getDeviceCount = _recording
    steps = []
    for name in (*PRELOAD_MODULES, "ensure_registries"):
        before = len(queries)
        if name == "ensure_registries":
            from unilab.training.common import ensure_registries
            ensure_registries()
        else:
            importlib.import_module(name)
        steps.append({"step": name, "new_queries": queries[before:], "cuda_initialized": torch.cuda.is_initialized(), **child_can_use_cuda()})
        print(name, steps[-1]["child"], len(queries) - before, flush=True)
    json.dump({"experiment": "fork_safety", "command": " ".join(sys.argv), "environment": run_environment("cuda", ("triton",)),
               "steps": steps, "torch": torch.__version__}, open(args.output, "w"), indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
